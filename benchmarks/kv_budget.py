"""Quality at a fixed KV budget on SmolLM2-135M (prints tables; never asserts).

Budgets 48 / 72 / 120 cached values per token per layer (−87.5 / −81.25 / −68.75 % of the source's
384). Zero-shot WikiText-2 raw test perplexity (8 × 1024 tokens) and conversion wall time for:
  paper    2-norm r=4, weight-only joint SVD, d_kv = budget/3 − 8 (the MHA2MLA recipe)
  default  2-norm r=4, activation-aware joint SVD (the conversion issue's default)
  best     RoPE concentration (pca, --freq-fold 2) + activation-aware SVD (the default recipe); at
           the --search budgets the RoPE/latent split is chosen by the budget search on held-in
           text (candidates logged on stderr), elsewhere a third of the budget goes to RoPE
Then the recovery curve at budget 72: perplexity after 0, 10, 25 and 50 fine-tuning steps (batch
4 × 256, the paper's optimizer and schedule; each step count is its own run) for paper vs best.

    python benchmarks/kv_budget.py [--budgets 48,72,120] [--fold 2] [--recovery-steps 10,25,50]
"""

from __future__ import annotations

import argparse
import copy
import tempfile
import time

from mha2mla import load_source
from mha2mla.convert import convert_model
from mha2mla.evaluate.perplexity import perplexity
from mha2mla.train import train

N_KV, ROPE_PAIRS = 3, 4


def configs(budget: int, fold: int, search: bool) -> dict:
    paper_d_kv = budget // N_KV - 2 * ROPE_PAIRS
    best = dict(kv_budget=budget) if search else dict(d_kv=paper_d_kv)  # search, or the default 1/3 RoPE share
    return {
        "paper": dict(d_kv=paper_d_kv, rope_pairs=ROPE_PAIRS, rope_strategy="2-norm", init="weight", sequential=False),
        "default": dict(d_kv=paper_d_kv, rope_pairs=ROPE_PAIRS, rope_strategy="2-norm", init="activation"),
        "best": dict(rope_strategy="pca", freq_fold=fold, init="activation", **best),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", default="48,72,120")
    parser.add_argument("--fold", type=int, default=2)
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--recovery-steps", default="10,25,50")
    parser.add_argument("--recovery-budget", type=int, default=72)
    parser.add_argument("--search", default="72", help="budgets where `best` runs the split search "
                        "(elsewhere it uses the default recipe's RoPE share)")
    args = parser.parse_args()
    source, tok = load_source("smollm2-135m")
    base = perplexity(source, tok, windows=args.windows, progress=False)["ppl"]
    print(f"source ppl {base:.1f}")
    table, models = {}, {}
    for budget in map(int, args.budgets.split(",")):
        for name, kw in configs(budget, args.fold, str(budget) in args.search.split(",")).items():
            start = time.perf_counter()
            mla, _ = convert_model((source, tok), progress=False, **kw)
            seconds = time.perf_counter() - start
            ppl = perplexity(mla, tok, windows=args.windows, progress=False)["ppl"]
            c = mla.config
            table[(name, budget)] = (ppl, seconds, f"{c.kv_elements_per_token_per_layer} values: {c.rope_layout} "
                                                   f"r={c.rope_pairs} latent={c.latent_dim}")
            print(f"budget {budget:>3} {name:>8}: ppl {ppl:10.1f}  {seconds:6.1f} s  ({table[(name, budget)][2]})",
                  flush=True)
            if budget == args.recovery_budget and name in ("paper", "best"):
                models[name] = mla
    budgets = list(map(int, args.budgets.split(",")))
    print("\n| conversion | " + " | ".join(f"{b} (−{100 * (1 - b / 384):.2f} %)" for b in budgets) + " |")
    print("|---|" + "---|" * len(budgets))
    for name in ("paper", "default", "best"):
        cells = [f"{table[(name, b)][0]:,.1f} ({table[(name, b)][1]:.0f} s)" for b in budgets]
        print(f"| {name} | " + " | ".join(cells) + " |")
    steps_list = [0] + list(map(int, args.recovery_steps.split(",")))
    curve = {}
    for name, converted in models.items():
        for steps in steps_list:
            mla = copy.deepcopy(converted)
            if steps:
                with tempfile.TemporaryDirectory() as out:
                    train((mla, tok), out, steps=steps, seq_len=256, batch_size=4, save_every=0)
            curve[(name, steps)] = perplexity(mla, tok, windows=args.windows, progress=False)["ppl"]
            print(f"recovery {name:>6} after {steps:>3} steps: ppl {curve[(name, steps)]:.1f}", flush=True)
    print(f"\n| budget {args.recovery_budget}: steps | " + " | ".join(map(str, steps_list)) + " |")
    print("|---|" + "---|" * len(steps_list))
    for name in models:
        print(f"| {name} | " + " | ".join(f"{curve[(name, s)]:,.1f}" for s in steps_list) + " |")


if __name__ == "__main__":
    main()
