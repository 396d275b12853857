"""Decode benchmark: SmolLM2-135M with transformers' default cache against its MLA conversions
(d_kv 8, 16, 32) with LatentCache — prefill time, decode tok/s, peak memory, KV bytes.

Each (model, context, batch) runs in its own subprocess (mha2mla.evaluate.speed); the source is
measured once per (context, batch) and compared with every conversion. Prints tables and the two
figures issue 3 aims at — decode tok/s ratio at the longest context × largest batch (target ≥ 2.5)
and peak memory saved / KV bytes saved (target ≥ 0.8) — and never asserts: timings on a shared CPU
are noisy. Conversions are kept in --out and reused.

    python benchmarks/decode.py [--contexts 1024,4096] [--batches 1,8] [--d-kv 8 16 32] [--new-tokens 32]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from mha2mla.evaluate.speed import compare, format_rows, measure_in_subprocess, peak_saved_over_kv_saved

SOURCE = "smollm2-135m"


def converted(d_kv: int, out: Path) -> Path:
    """The MLA checkpoint of SOURCE at `d_kv` under `out`, converted on first use."""
    from mha2mla.convert import convert_model

    path = out / f"smollm2-135m-mla-d{d_kv}"
    if not (path / "config.json").exists():
        print(f"converting {SOURCE} at d_kv={d_kv} → {path}", file=sys.stderr)
        convert_model(SOURCE, out=path, d_kv=d_kv, overwrite=True)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="1024,4096", help="comma-separated (7680 at most for SmolLM2)")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--d-kv", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, default=Path("out/bench-decode"), help="where conversions are kept")
    args = parser.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    models = {d_kv: converted(d_kv, args.out) for d_kv in args.d_kv}
    start = time.perf_counter()
    rows = {d_kv: [] for d_kv in models}
    for context in contexts:
        for batch in batches:
            print(f"context {context}, batch {batch}: source", file=sys.stderr, flush=True)
            source = measure_in_subprocess(SOURCE, context, batch, args.new_tokens)
            for d_kv, path in models.items():
                print(f"context {context}, batch {batch}: d_kv={d_kv}", file=sys.stderr, flush=True)
                rows[d_kv].append(compare(context, batch, source, measure_in_subprocess(path, context, batch,
                                                                                        args.new_tokens)))
    print(f"{SOURCE}, {args.new_tokens} decode steps, fp32, measured in {time.perf_counter() - start:.0f} s "
          f"on a CPU shared with other jobs")
    for d_kv, table in rows.items():
        longest = max(table, key=lambda r: (r["context"], r["batch"]))
        print(f"\nMLA d_kv={d_kv}\n{format_rows(table)}")
        print(f"context {longest['context']} × batch {longest['batch']}: decode tok/s ratio "
              f"{longest['decode_tok_s_ratio']:.2f} (target ≥ 2.5); peak saved / KV saved "
              f"{peak_saved_over_kv_saved(longest):.2f} (target ≥ 0.8)")


if __name__ == "__main__":
    main()
