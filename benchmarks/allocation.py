"""Quality at a fixed KV budget, round 2: global latent allocation and query-aware keys (prints; never asserts).

For each model and budget (values per token per layer), zero-shot WikiText-2 perplexity (8 × 1024
tokens), the held-in loss the budget search saw (when it compared several splits) and the conversion
time, for the default recipe (RoPE concentration, query-aware joint SVD, refit vo, the split searched
by `--kv-budget`) with
    uniform            every layer the same split (the default)
    global             the same total spread over the layers, RoPE dims and latent width per layer, by
                       their measured attention-output error curves (--allocate global)
    activation         activation-aware key factorisation (--init activation: the previous default), uniform
    global+activation  both
and for the paper's per-head partial RoPE (2-norm, r = d_h/16, refit vo) with activation-aware and
query-aware keys (`--per-head activation,query`, at the first budget).

    python benchmarks/allocation.py [--model smollm2-135m] [--budgets 48,72,120] [--rows uniform,global]
                                    [--per-head activation,query]
"""

from __future__ import annotations

import argparse
import time

import torch

from mha2mla import load_source
from mha2mla.convert import convert_model
from mha2mla.evaluate.perplexity import perplexity

ROWS = {"uniform": {}, "global": dict(allocate="global"), "activation": dict(init="activation"),
        "global+activation": dict(allocate="global", init="activation")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--budgets", default="48,72,120")
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--per-head", default="", help="inits to run with per-head partial RoPE, e.g. activation,query")
    parser.add_argument("--windows", type=int, default=8)
    args = parser.parse_args()
    print(f"torch threads: {torch.get_num_threads()}; model {args.model}", flush=True)
    model, tok = load_source(args.model)
    print(f"source ppl {perplexity(model, tok, windows=args.windows, progress=False)['ppl']:.2f}", flush=True)
    table = []

    def run(label, budget, **kw):
        start = time.perf_counter()
        size = kw.pop("size", dict(kv_budget=budget))
        mla, _ = convert_model((model, tok), progress=False, **size, **kw)
        seconds = time.perf_counter() - start
        conv = mla.config.conversion
        held = min((t["held_in_loss"] for t in conv["budget_candidates"]), default=None)
        widths = [mla.config.latent_dim_at(i) for i in range(mla.config.num_hidden_layers)]
        rope = sorted({mla.config.rope_pairs_at(i) for i in range(mla.config.num_hidden_layers)})
        ppl = perplexity(mla, tok, windows=args.windows, progress=False)["ppl"]
        table.append((label, budget, ppl, held, seconds, f"{min(widths)}–{max(widths)}"))
        print(f"{label:>20} budget {budget:>4}: ppl {ppl:9.2f}  held-in {held if held is None else round(held, 4)}  "
              f"{seconds:6.1f} s  latent {table[-1][5]}  rope pairs {rope}", flush=True)
        del mla

    budgets = [int(b) for b in args.budgets.split(",")]
    for budget in budgets:
        for row in args.rows.split(","):
            run(row, budget, **ROWS[row])
    if args.per_head:
        config = model.config
        pairs = max(1, (getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads) // 16)
        size = dict(d_kv=budgets[0] // config.num_key_value_heads - 2 * pairs, rope_pairs=pairs)
        for init in args.per_head.split(","):
            run(f"2-norm r={pairs}, {init}", budgets[0], rope_strategy="2-norm", init=init, size=size)
    print("\n| conversion | budget | ppl | held-in loss | conversion s | latent widths |\n|---|---|---|---|---|---|")
    for label, budget, ppl, held, seconds, widths in table:
        print(f"| {label} | {budget} | {ppl:,.1f} | {'–' if held is None else f'{held:.4f}'} | {seconds:.0f} | "
              f"{widths} |")


if __name__ == "__main__":
    main()
