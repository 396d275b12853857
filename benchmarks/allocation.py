"""Quality at a fixed KV budget, round 2: global latent allocation and query-aware keys (prints; never asserts).

For each model and budget (values per token per layer), zero-shot WikiText-2 perplexity (8 × 1024
tokens), the held-out loss the budget search saw (when it compared several splits) and the conversion
time, for the default recipe (RoPE concentration, query-aware joint SVD, refit vo, the split searched
by `kv_budget`) with
    uniform            every layer the same split (the default)
    global             the same total spread over the layers, RoPE dims and latent width per layer, by
                       their measured attention-output error curves (Recipe.allocate="global")
    activation         activation-aware key factorisation (Recipe.weighting="activation": the previous
                       default, `--init activation` before issue 32), uniform
    global+activation  both
and for the paper's per-head partial RoPE (2-norm, r = d_h/16, refit vo) with the error weightings
given by `--per-head` (Recipe.weighting values, e.g. `--per-head activation,query`, at the first budget).

    python benchmarks/allocation.py [--model smollm2-135m] [--budgets 48,72,120] [--rows uniform,global]
                                    [--per-head activation,query]
"""

from __future__ import annotations

import argparse
import time

import torch

from mha2mla import convert, load_source
from mha2mla.evaluate.perplexity import perplexity
from mha2mla.modeling.configuration_mla import head_dim_of, paper_rope_pairs

ROWS = {  # row → changes to the default Recipe
    "uniform": {}, "global": dict(allocate="global"), "activation": dict(weighting="activation"),
    "global+activation": dict(allocate="global", weighting="activation"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--budgets", default="48,72,120")
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--per-head", default="", help="error weightings (Recipe.weighting) to run with per-head "
                        "partial RoPE, e.g. activation,query")
    parser.add_argument("--windows", type=int, default=8)
    args = parser.parse_args()
    print(f"torch threads: {torch.get_num_threads()}; model {args.model}", flush=True)
    model, tok = load_source(args.model)
    print(f"source ppl {perplexity(model, tok, windows=args.windows, progress=False)['ppl']:.2f}", flush=True)
    table = []

    def run(label, budget, size=None, **changes):
        start = time.perf_counter()
        mla, _ = convert((model, tok), progress=False, **(size or dict(kv_budget=budget)), **changes)
        seconds = time.perf_counter() - start
        conv = mla.config.conversion
        held = min((t["held_out_loss"] for t in conv["budget_candidates"]), default=None)
        widths = [mla.config.latent_dim_at(i) for i in range(mla.config.num_hidden_layers)]
        rope = sorted({mla.config.rope_pairs_at(i) for i in range(mla.config.num_hidden_layers)})
        ppl = perplexity(mla, tok, windows=args.windows, progress=False)["ppl"]
        table.append((label, budget, ppl, held, seconds, f"{min(widths)}–{max(widths)}"))
        print(f"{label:>20} budget {budget:>4}: ppl {ppl:9.2f}  held-out {held if held is None else round(held, 4)}  "
              f"{seconds:6.1f} s  latent {table[-1][5]}  rope pairs {rope}", flush=True)
        del mla

    budgets = [int(b) for b in args.budgets.split(",")]
    for budget in budgets:
        for row in args.rows.split(","):
            run(row, budget, **ROWS[row])
    if args.per_head:
        config = model.config
        pairs = paper_rope_pairs(head_dim_of(config))
        size = dict(d_kv=budgets[0] // config.num_key_value_heads - 2 * pairs, rope_pairs=pairs)
        for weighting in args.per_head.split(","):
            run(f"2-norm r={pairs}, {weighting}", budgets[0], size, rope="2-norm", weighting=weighting)
    print("\n| conversion | budget | ppl | held-out loss | conversion s | latent widths |\n|---|---|---|---|---|---|")
    for label, budget, ppl, held, seconds, widths in table:
        print(f"| {label} | {budget} | {ppl:,.1f} | {'–' if held is None else f'{held:.4f}'} | {seconds:.0f} | "
              f"{widths} |")


if __name__ == "__main__":
    main()
