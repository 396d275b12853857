"""The MHA2MLA paper's Table 1 for SmolLM2-135M: the source against its MLA conversions, zero-shot.

Rows: SmolLM2-135M, then `mha2mla.convert("smollm2-135m", d_kv=d)` for d in 8, 16, 32: the default
recipe at the paper's cache sizes n_kv·(d + 2·d_h/16) = 48 / 72 / 120 values, with its default RoPE
split (no fine-tuning, so these are the conversions' starting points, not the paper's fine-tuned
numbers). Columns: the seven
lm-eval tasks on the first `--limit` documents each (stated in the output), their average, KV bytes
per token per layer and the KV reduction; then the wall time of each model. Prints, never asserts.

    python benchmarks/eval_table.py [--limit 100] [--d-kv 8 16 32] [--tasks arc_easy,...] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import sys
import time

from mha2mla import convert, load_model
from mha2mla.evaluate.tasks import TASKS, compare_models, markdown_table

SOURCE = "smollm2-135m"


def models(d_kvs: list[int]) -> tuple[list, dict[str, float]]:
    """[(model, tokenizer)] of the source and its conversions, and each conversion's wall seconds."""
    source = load_model(SOURCE)
    source[0].config._name_or_path = f"{SOURCE} (source)"
    pairs, convert_seconds = [source], {}
    for d_kv in d_kvs:
        start = time.perf_counter()
        model, tokenizer = convert(SOURCE, d_kv=d_kv)
        name = f"MLA d_kv={d_kv}"
        model.config._name_or_path = name
        convert_seconds[name] = time.perf_counter() - start
        print(f"converted {name} in {convert_seconds[name]:.1f} s", file=sys.stderr)
        pairs.append((model, tokenizer))
    return pairs, convert_seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=100, help="documents per task (default 100)")
    parser.add_argument("--d-kv", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument("--dtype", default="bfloat16", help="evaluation dtype (default bfloat16)")
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()

    pairs, convert_seconds = models(args.d_kv)
    table = compare_models(pairs, args.tasks.split(","), limit=args.limit, batch_size=args.batch_size,
                           dtype=args.dtype)
    print(f"SmolLM2-135M vs MLA conversions (no fine-tuning), zero-shot, first {args.limit} documents per task, "
          f"{args.dtype}; scores in %, acc_norm where lm-eval reports it, else acc\n")
    print(markdown_table(table))
    print("\n| Model | convert s | eval s |\n|---|---:|---:|")
    for row in table["rows"]:
        convert = convert_seconds.get(row["model"])
        print(f"| {row['model']} | {'-' if convert is None else f'{convert:.1f}'} | {row['seconds']:.1f} |")


if __name__ == "__main__":
    main()
