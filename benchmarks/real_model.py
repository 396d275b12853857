"""A real source model measured end to end through the CLI (prints a table; asserts nothing).

    python benchmarks/real_model.py [--model qwen2.5-0.5b] [--budgets 48,80] [--windows 8]
                                    [--tasks arc_easy,arc_challenge,piqa,hellaswag,openbookqa,winogrande]
                                    [--limit 200] [--out DIR]

For each budget (cached values per token per layer) two conversions, each a `mha2mla convert`
process of its own (its time and peak resident memory come from its --json report):
  default  the default recipe with the budget (`--kv-budget N`: RoPE/latent split searched on
           held-out text)
  paper    the MHA2MLA paper's recipe: 2-norm partial RoPE with r = d_h/16 pairs per KV head,
           weight-only joint SVD, no refit, the rest of the budget as the latent
Then the WikiText-2 test perplexity (`--windows` × 1024 tokens) of the source and of each
conversion, and, with `--tasks`, the zero-shot tasks (`--limit` items each) for the source and the
default conversions.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path


def cli(*args) -> dict:
    """Run `mha2mla ARGS --json` → its JSON report (a failure prints the error and returns {})."""
    run = subprocess.run([sys.executable, "-m", "mha2mla.cli", *map(str, args), "--json"], capture_output=True,
                         text=True)
    if run.returncode != 0:
        print(f"  failed: mha2mla {' '.join(map(str, args))}: {run.stderr.strip().splitlines()[-1:]}", flush=True)
        return {}
    return json.loads(run.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-0.5b")
    parser.add_argument("--budgets", default="48,80")
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--tasks", default="")
    parser.add_argument("--limit", type=int, default=200)
    parser.add_argument("--out", default=None, help="where the converted checkpoints go (default: a temp dir)")
    args = parser.parse_args()

    from mha2mla.io.sources import open_source
    from mha2mla.modeling.configuration_mla import head_dim_of, paper_rope_pairs, source_kv_values

    config = open_source(args.model).config
    n_kv, r = config.num_key_value_heads, paper_rope_pairs(head_dim_of(config))
    source_values = source_kv_values(config)
    out = Path(args.out or tempfile.mkdtemp(prefix="real-model-"))
    ppl = cli("eval", "ppl", args.model, "--windows", args.windows).get("ppl")
    print(f"{args.model}: source caches {source_values} values per token per layer; WikiText-2 ppl "
          f"({args.windows} × 1024) {ppl:.2f}\n", flush=True)
    print("| budget | reduction | recipe | split (RoPE dims + latent) | WikiText ppl | conversion (s) | peak RSS (GB) |")
    print("|---|---|---|---|---|---|---|")
    converted = []
    for budget in (int(b) for b in args.budgets.split(",")):
        latent = budget - 2 * r * n_kv
        recipes = {"default": ["--kv-budget", budget],
                   "paper": ["--recipe", "paper", "--rope-pairs", r, "--d-kv", latent // n_kv]}
        for name, options in recipes.items():
            path = out / f"{name}-{budget}"
            report = cli("convert", args.model, path, *options, "--overwrite")
            if not report:
                continue
            mla_ppl = cli("eval", "ppl", path, "--windows", args.windows).get("ppl", float("nan"))
            with open(path / "config.json") as f:
                c = json.load(f)
            rope_dims = (1 if c["rope_layout"] == "shared" else n_kv) * 2 * c["rope_pairs"]
            print(f"| {budget} | −{100 * (1 - budget / source_values):.2f} % | {name} | {rope_dims} + "
                  f"{c['latent_dim']} | {mla_ppl:.1f} | {report['seconds']:.0f} | "
                  f"{report['process_peak_rss_mb'] / 1024:.2f} |", flush=True)
            if name == "default":
                converted.append((f"default at {budget}", path))
    if args.tasks:
        print(f"\nZero-shot tasks (lm-eval, --limit {args.limit}; acc_norm where reported, else acc):\n")
        for name, model in [("source", args.model)] + converted:
            result = cli("eval", "tasks", model, "--tasks", args.tasks, "--limit", args.limit)
            scores = ", ".join(f"{t} {m['acc_norm'] if m['acc_norm'] is not None else m['acc']:.3f}"
                               for t, m in result.get("results", {}).items())
            print(f"{name}: average {result.get('average', float('nan')):.3f} ({scores})", flush=True)


if __name__ == "__main__":
    main()
