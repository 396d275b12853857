"""Quality at a fixed KV budget on SmolLM2-135M (prints tables; never asserts).

Budgets 48 / 72 / 120 cached values per token per layer (−87.5 / −81.25 / −68.75 % of the source's
384). Zero-shot WikiText-2 raw test perplexity (8 × 1024 tokens) and conversion wall time for
(`mha2mla.convert` with a recipe and Recipe fields changed; before issue 32 these were CLI flags:
`--refit` → refit, `--init` → weighting, `--kv-balance` → kv_balance, `--per-layer-split` →
allocate="per-layer"):
  paper    2-norm r=4, weight-only joint SVD, d_kv = budget/3 − 8 (the MHA2MLA recipe, recipe="paper")
  2-norm   2-norm r=4, activation-aware joint SVD (the conversion issue's default), without a refit,
           with the value refit (refit="v") and with the value and o_proj refit (refit="vo", the default)
  best     the default recipe: RoPE concentration (rope="pca", freq_fold=4), query-aware SVD, v_up and
           o_proj refit; at the --search budgets the RoPE/latent split is chosen by the budget search
           on held-out text (candidates logged on stderr), elsewhere a quarter of the budget goes to RoPE
  best, per-layer split   the same with allocate="per-layer" (each layer picks its own split by its
           attention-output error), at the --per-layer budgets
Then the K/V balance at budget 72: the value rows weighted √β against the NoPE key rows in the
joint activation-aware factorisation, β = 0.25 / 1 / 4, for the default recipe (16 RoPE dims + a
56-wide latent; 24 + 48 before the round-by-round RoPE allocation) and for 2-norm r=4 (no refit,
so the factorisation is seen alone), and β chosen by held-out loss (kv_balance="auto") for the
default recipe.
  best, activation keys   the previous default (until 2026-12-05): activation-aware keys
           (weighting="activation")
Then the recovery curve at budget 72 (--recovery-rows, default paper, best and best with activation keys):
one fine-tuning run of the largest step count (batch 4 × 256, the paper's optimizer and schedule) per
recipe, perplexity measured before it and after each listed step.

    python benchmarks/kv_budget.py [--budgets 48,72,120] [--search 48,72,120] [--per-layer 72,120]
                                   [--recovery-steps 10,25,50] [--recovery-rows NAME ...]
                                   [--part all|budgets|balance|recovery]
                                   [--rows NAME ...]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
from transformers import TrainerCallback

from mha2mla import convert, load_source
from mha2mla.apps.train import train
from mha2mla.conversion.plan import AUTO_BALANCES
from mha2mla.evaluate.perplexity import perplexity

N_KV, ROPE_PAIRS = 3, 4


def configs(budget: int, search: bool, per_layer: bool) -> dict:
    """The conversions compared at one budget: mha2mla.convert's keywords, a size and a recipe or
    changes to the default one (None: not run at this budget)."""
    d_kv = budget // N_KV - 2 * ROPE_PAIRS
    two_norm = dict(d_kv=d_kv, rope_pairs=ROPE_PAIRS, rope="2-norm", weighting="activation")
    return {
        "paper": dict(d_kv=d_kv, rope_pairs=ROPE_PAIRS, recipe="paper"),
        "2-norm": dict(two_norm, refit="none"),
        "2-norm + v refit": dict(two_norm, refit="v"),
        "2-norm + vo refit": dict(two_norm, refit="vo"),
        "best": dict(kv_budget=budget) if search else dict(d_kv=d_kv),  # the default recipe
        "best, per-layer split": dict(kv_budget=budget, allocate="per-layer") if per_layer else None,
        "best, activation keys": (dict(kv_budget=budget, weighting="activation") if search
                                  else dict(d_kv=d_kv, weighting="activation")),
    }


class EvalAt(TrainerCallback):
    """Perplexity of the model under training after the given optimizer steps."""

    def __init__(self, steps, tokenizer, windows: int, name: str):
        self.steps, self.tokenizer, self.windows, self.name, self.ppl = set(steps), tokenizer, windows, name, {}

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step in self.steps:
            model.eval()
            self.ppl[state.global_step] = perplexity(model, self.tokenizer, windows=self.windows, progress=False)["ppl"]
            model.train()
            print(f"recovery {self.name:>6} after {state.global_step:>3} steps: ppl "
                  f"{self.ppl[state.global_step]:.1f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", default="48,72,120")
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--recovery-steps", default="10,25,50")
    parser.add_argument("--recovery-budget", type=int, default=72)
    parser.add_argument("--recovery-rows", nargs="*", default=["paper", "best", "best, activation keys"],
                        help="conversions of the budget table to fine-tune (names as printed)")
    parser.add_argument("--search", default="48,72,120", help="budgets where `best` runs the split search "
                        "(elsewhere it uses the default recipe's RoPE share)")
    parser.add_argument("--per-layer", default="120", help="budgets with a per-layer-split row")
    parser.add_argument("--balance-budget", type=int, default=72)
    parser.add_argument("--part", default="all", choices=["all", "budgets", "balance", "recovery"])
    parser.add_argument("--rows", nargs="*", help="budgets part: only these rows (names as printed)")
    args = parser.parse_args()
    print(f"torch threads: {torch.get_num_threads()}")
    source, tok = load_source("smollm2-135m")
    print(f"source ppl {perplexity(source, tok, windows=args.windows, progress=False)['ppl']:.1f}", flush=True)

    def convert_one(name, kw):
        start = time.perf_counter()
        mla, _ = convert((source, tok), progress=False, **kw)
        seconds = time.perf_counter() - start
        ppl = perplexity(mla, tok, windows=args.windows, progress=False)["ppl"]
        c = mla.config
        rope_dims = [c.n_rope_heads * 2 * r for r in c.layer_rope_pairs or [c.rope_pairs]]
        print(f"{name:>21}: ppl {ppl:10.1f}  {seconds:6.1f} s  ({c.kv_elements_per_token_per_layer} values: "
              f"{c.rope_layout} rope dims {'/'.join(map(str, rope_dims))}, latent "
              f"{'/'.join(map(str, c.layer_latent_dims or [c.latent_dim]))})", flush=True)
        return mla, ppl, seconds

    if args.part in ("all", "budgets"):
        budgets = list(map(int, args.budgets.split(",")))
        table = {}
        for budget in budgets:
            print(f"budget {budget}:", flush=True)
            listed = configs(budget, str(budget) in args.search.split(","), str(budget) in args.per_layer.split(","))
            for name, kw in listed.items():
                if kw is not None and (not args.rows or name in args.rows):
                    table[(name, budget)] = convert_one(name, kw)[1:]
        print("\n| conversion | " + " | ".join(f"{b} (−{100 * (1 - b / 384):.2f} %)" for b in budgets) + " |")
        print("|---|" + "---|" * len(budgets))
        for name in configs(budgets[0], False, False):
            cells = [f"{table[(name, b)][0]:,.1f} ({table[(name, b)][1]:.0f} s)" if (name, b) in table else "–"
                     for b in budgets]
            if any(cell != "–" for cell in cells):
                print(f"| {name} | " + " | ".join(cells) + " |")

    if args.part in ("all", "balance"):
        listed = configs(args.balance_budget, False, False)
        rows = {"best": listed["best"], "2-norm": listed["2-norm"]}
        table = {}
        for name, kw in rows.items():
            for beta in AUTO_BALANCES:
                table[(name, beta)] = convert_one(f"{name}, β={beta:g}", dict(kw, kv_balance=beta))[1]
        mla, ppl, _ = convert_one("best, β auto", dict(rows["best"], kv_balance="auto"))
        conversion = mla.config.conversion
        chosen = conversion["kv_balance"]
        losses = ", ".join(f"β={t['kv_balance']:g}: {t['held_out_loss']:.4f}" for t in conversion["budget_candidates"])
        print(f"\n| budget {args.balance_budget}: K/V balance β | " + " | ".join(f"{b:g}" for b in AUTO_BALANCES)
              + " | auto |\n|---|" + "---|" * (len(AUTO_BALANCES) + 1))
        for name in rows:
            auto = f"{ppl:,.1f} (β={chosen:g}; held-out {losses})" if name == "best" else "–"
            print(f"| {name} | " + " | ".join(f"{table[(name, b)]:,.1f}" for b in AUTO_BALANCES) + f" | {auto} |")

    if args.part in ("all", "recovery"):
        steps = list(map(int, args.recovery_steps.split(",")))
        curve = {}
        listed = configs(args.recovery_budget, False, False)
        for name in (n for n in listed if n in args.recovery_rows):
            kw = listed[name]
            mla, ppl, _ = convert_one(name, kw)
            evals = EvalAt(steps, tok, args.windows, name)
            with tempfile.TemporaryDirectory() as out:
                train((mla, tok), out, steps=max(steps), seq_len=256, batch_size=4, save_every=0, callbacks=[evals])
            curve[name] = {0: ppl, **evals.ppl}
        print(f"\n| budget {args.recovery_budget}: steps | 0 | " + " | ".join(map(str, steps)) + " |")
        print("|---|---|" + "---|" * len(steps))
        for name, ppl in curve.items():
            print(f"| {name} | " + " | ".join(f"{ppl[s]:,.1f}" for s in [0, *steps]) + " |")


if __name__ == "__main__":
    main()
