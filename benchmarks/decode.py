"""Decode benchmark: SmolLM2-135M with transformers' default cache against its MLA conversions (default
recipe at given KV budgets) with LatentCache — prefill time, decode tok/s, peak memory and its parts.

Each (model, context, batch) runs in its own subprocess (mha2mla.evaluate.speed); the source is
measured once per (context, batch) and compared with every conversion and cache precision. Prints the
`bench decode` table per conversion, the peak-memory breakdown (resident after loading = weights and
runtime, cache, transients = the rest of the peak) and the ratios the inference issue aims at. Never
asserts: timings on a shared CPU are noisy. Conversions are kept in --out and reused.

    python benchmarks/decode.py [--contexts 1024,4096] [--batches 1,8] [--budgets 72] [--kv-bits 16 4]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from mha2mla.evaluate.speed import compare, format_rows, measure_in_subprocess, peak_saved_over_kv_saved

SOURCE = "smollm2-135m"


def converted(budget: int, out: Path) -> Path:
    """The default-recipe MLA checkpoint of SOURCE at `budget` cached values per token and layer."""
    from mha2mla.conversion.pipeline import convert_checkpoint

    path = out / f"smollm2-135m-mla-b{budget}"
    if not (path / "config.json").exists():
        print(f"converting {SOURCE} at {budget} values → {path}", file=sys.stderr)
        convert_checkpoint(SOURCE, path, kv_budget=budget, overwrite=True)
    return path


def breakdown(name: str, m: dict) -> str:
    cache = m["kv_bytes"] / 2**20
    return (f"  {name:<6} peak {m['peak_mb']:>6.0f} MiB = loaded {m['loaded_mb']:>5.0f} (weights {m['weights_mb']:.0f}) "
            f"+ cache {cache:>6.1f} + transients {m['peak_mb'] - m['loaded_mb'] - cache:>6.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="1024,4096", help="comma-separated (7680 at most for SmolLM2)")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--budgets", type=int, nargs="+", default=[72], help="cached values per token per layer")
    parser.add_argument("--kv-bits", type=int, nargs="+", default=[16], help="latent cache precisions")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, default=Path("out/bench-decode"), help="where conversions are kept")
    args = parser.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    models = {(budget, bits): converted(budget, args.out) for budget in args.budgets for bits in args.kv_bits}
    start = time.perf_counter()
    rows = {key: [] for key in models}
    parts = []
    for context in contexts:
        for batch in batches:
            print(f"context {context}, batch {batch}: source", file=sys.stderr, flush=True)
            source = measure_in_subprocess(SOURCE, context, batch, args.new_tokens)
            parts.append(f"{context}×{batch}\n{breakdown('source', source)}")
            for (budget, bits), path in models.items():
                print(f"context {context}, batch {batch}: {budget} values, int{bits}", file=sys.stderr, flush=True)
                mla = measure_in_subprocess(path, context, batch, args.new_tokens, kv_bits=bits)
                rows[budget, bits].append(compare(context, batch, source, mla))
                parts.append(breakdown(f"b{budget}/{bits}", mla))
    print(f"{SOURCE}, {args.new_tokens} decode steps, fp32 weights, measured in {time.perf_counter() - start:.0f} s")
    for (budget, bits), table in rows.items():
        print(f"\nMLA, default recipe at {budget} values per token per layer, latent cache {bits}-bit\n"
              f"{format_rows(table)}")
        for r in table:
            print(f"{r['context']}×{r['batch']}: prefill MLA/source {r['mla_prefill_s'] / r['source_prefill_s']:.2f}×, "
                  f"decode {r['decode_tok_s_ratio']:.2f}×, peak saved / KV saved {peak_saved_over_kv_saved(r):.2f}")
    print("\npeak memory breakdown (MiB)\n" + "\n".join(parts))


if __name__ == "__main__":
    main()
