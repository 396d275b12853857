"""Recovery that pays (issue 33): layer-wise reconstruction at conversion, distillation in fine-tuning.

Prints tables as rows complete (never asserts); WikiText-2 raw test perplexity over `--windows` × 1024
tokens and the zero-shot task average (`mha2mla eval tasks`, `--limit` items per task, bfloat16).

  zero-shot   per budget: the default recipe, and the default + `--reconstruct STEPS` (each converted
              attention trained to reproduce the source's output on the calibration inputs); the
              conversion's wall time beside each
  recovery    at one budget: one fine-tuning run per row (batch 4 × 256 tokens of the Wikipedia shards,
              the paper's optimizer and WSD schedule, the same data in the same order), perplexity
              before it and after each listed step; rows: lm (LM loss), distill (distillation from the
              source, apps/distill.py), reconstruct+distill (the reconstructed conversion, distilled); the task
              average before the run and after its last step

    python benchmarks/recovery.py zero-shot [--model smollm2-135m] [--budgets 48,72,120] [--reconstruct 100]
    python benchmarks/recovery.py recovery [--model smollm2-135m] [--budget 72] [--steps 50,200]
                                           [--rows lm distill reconstruct+distill] [--lr 1e-4]
                                           [--alpha A] [--temperature T]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
from transformers import TrainerCallback

from mha2mla import convert, load_source
from mha2mla.apps.distill import ALPHA, TEMPERATURE, Distillation
from mha2mla.apps.train import train
from mha2mla.evaluate.perplexity import perplexity
from mha2mla.evaluate.tasks import evaluate_tasks

ROWS = ("lm", "distill", "reconstruct+distill")


class EvalAt(TrainerCallback):
    """Perplexity of the model under training after the given optimizer steps, with the tokens and time so far."""

    def __init__(self, steps, tokenizer, windows: int, name: str):
        self.steps, self.tokenizer, self.windows, self.name = set(steps), tokenizer, windows, name
        self.ppl, self.start = {}, time.perf_counter()

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step in self.steps:
            model.eval()
            ppl = perplexity(model, self.tokenizer, windows=self.windows, progress=False)["ppl"]
            model.train()
            self.ppl[state.global_step] = ppl
            print(f"recovery {self.name:>20} after {state.global_step:>3} steps: ppl {ppl:8.1f}  "
                  f"({state.num_input_tokens_seen:,} tokens, {time.perf_counter() - self.start:.0f} s)", flush=True)


def converted(source, tok, budget: int, reconstruct: int):
    start = time.perf_counter()
    mla, _ = convert((source, tok), kv_budget=budget, reconstruct=reconstruct, progress=False)
    return mla, time.perf_counter() - start


def scores(mla, tok, args) -> tuple[float, float]:
    ppl = perplexity(mla, tok, windows=args.windows, progress=False)["ppl"]
    average = evaluate_tasks((mla, tok), limit=args.limit, dtype="bfloat16")["average"] if args.limit else float("nan")
    return ppl, average


def zero_shot(source, tok, args) -> None:
    rows = []
    for budget in map(int, args.budgets.split(",")):
        for reconstruct in (0, args.reconstruct):
            mla, seconds = converted(source, tok, budget, reconstruct)
            ppl, average = scores(mla, tok, args)
            name = "default" + (f" + reconstruct {reconstruct}" if reconstruct else "")
            rows.append((budget, name, ppl, average, seconds))
            print(f"zero-shot {budget:>4} {name:>26}: ppl {ppl:8.1f}  tasks {average:.4f}  conversion {seconds:.0f} s",
                  flush=True)
    print(f"\n| {args.model} | values | ppl | task average | conversion s |\n|---|---:|---:|---:|---:|")
    for budget, name, ppl, average, seconds in rows:
        print(f"| {name} | {budget} | {ppl:,.1f} | {average:.4f} | {seconds:.0f} |")


def recovery(source, tok, args) -> None:
    steps = sorted(map(int, args.steps.split(",")))
    curves = {}
    for row in args.rows:
        mla, seconds = converted(source, tok, args.budget, args.reconstruct if row.startswith("reconstruct") else 0)
        ppl0, tasks0 = scores(mla, tok, args)
        print(f"recovery {row:>20} zero-shot: ppl {ppl0:8.1f}  tasks {tasks0:.4f}  (conversion {seconds:.0f} s)",
              flush=True)
        evals = EvalAt(steps, tok, args.windows, row)
        distill = (Distillation(teacher=source, alpha=args.alpha, temperature=args.temperature)
                   if "distill" in row else None)
        with tempfile.TemporaryDirectory() as out:
            result = train((mla, tok), out, steps=max(steps), seq_len=256, batch_size=4, lr=args.lr, save_every=0,
                           callbacks=[evals], distill=distill)
        mla.eval()
        tasks = evaluate_tasks((mla, tok), limit=args.limit, dtype="bfloat16")["average"] if args.limit else float("nan")
        print(f"recovery {row:>20} after {max(steps):>3} steps: tasks {tasks:.4f}", flush=True)
        curves[row] = ({0: ppl0, **evals.ppl}, (tasks0, tasks), result)
    print(f"\n| {args.model}, {args.budget} values: steps | 0 | " + " | ".join(map(str, steps))
          + " | task average: 0 → last | tokens | train s | peak RSS MB |\n|---|---:|" + "---:|" * (len(steps) + 4))
    for row, (ppl, (tasks0, tasks), result) in curves.items():
        print(f"| {row} | " + " | ".join(f"{ppl[s]:,.1f}" for s in [0, *steps])
              + f" | {tasks0:.4f} → {tasks:.4f} | {result['tokens']:,} | {result['seconds']:.0f} | "
                f"{result['peak_rss_mb']:.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=["zero-shot", "recovery"])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--budgets", default="48,72,120")
    parser.add_argument("--budget", type=int, default=72)
    parser.add_argument("--reconstruct", type=int, default=100, help="reconstruction steps per layer")
    parser.add_argument("--steps", default="50,200")
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=ROWS)
    parser.add_argument("--alpha", type=float, default=ALPHA, help="distillation: weight of the KL")
    parser.add_argument("--temperature", type=float, default=TEMPERATURE, help="distillation: temperature")
    parser.add_argument("--lr", type=float, default=1e-4, help="peak learning rate of the fine-tune")
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--limit", type=int, default=200, help="items per task (0: no task evaluation)")
    args = parser.parse_args()
    print(f"torch threads: {torch.get_num_threads()}; lr {args.lr}; distillation alpha {args.alpha}, "
          f"T {args.temperature}", flush=True)
    source, tok = load_source(args.model)
    print(f"source ppl {perplexity(source, tok, windows=args.windows, progress=False)['ppl']:.2f}", flush=True)
    (zero_shot if args.part == "zero-shot" else recovery)(source, tok, args)


if __name__ == "__main__":
    main()
