"""Fine-tuning throughput: tokens/s of the MLA model against its source, same settings.

SmolLM2-135M (GQA, fp32) and its MLA conversion at d_kv=16 (r = 4 kept frequency pairs) take
training steps of the recipe in mha2mla.apps.train (forward, backward, clip to norm 1.0, AdamW
β = (0.9, 0.95)) on the same packed Wikipedia blocks. The two models alternate step by step in one
process, so load from other processes on a shared machine hits both alike; the first step of each is
a warm-up and not counted. Reported: tokens per wall second and per CPU second of this process.
Prints a table, never asserts (the target is MLA ≥ 0.95 × source).

    python benchmarks/train_throughput.py [--steps 6] [--seq-len 256] [--batch-size 2] [--d-kv 16]
"""

from __future__ import annotations

import argparse
import time

import torch

from mha2mla import convert, load_source
from mha2mla.io.text import default_train_text, pack_blocks


def train_step(model, optimizer, batch: torch.Tensor) -> tuple[float, float]:
    """One optimizer step; (wall seconds, CPU seconds)."""
    wall, cpu = time.perf_counter(), time.process_time()
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="timed steps per model (after one warm-up step)")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--d-kv", type=int, default=16)
    args = parser.parse_args()

    source, tokenizer = load_source("smollm2-135m")
    mla, _ = convert((source, tokenizer), d_kv=args.d_kv, calib_samples=4, calib_seq_len=256)
    blocks = pack_blocks(tokenizer, [default_train_text()], args.seq_len, (args.steps + 1) * args.batch_size)
    models = {"source (GQA)": source.train(), f"MLA d_kv={args.d_kv}": mla.train()}
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
                  for name, m in models.items()}
    totals = {name: [0.0, 0.0] for name in models}
    for step in range(args.steps + 1):
        batch = blocks[step * args.batch_size:(step + 1) * args.batch_size]
        for name, model in models.items():
            wall, cpu = train_step(model, optimizers[name], batch)
            if step > 0:
                totals[name][0] += wall
                totals[name][1] += cpu
    tokens = args.steps * args.batch_size * args.seq_len

    print(f"\nfine-tuning throughput, SmolLM2-135M fp32, {args.steps} steps × {args.batch_size} × {args.seq_len} "
          f"tokens, {torch.get_num_threads()} threads")
    print(f"{'model':<18}{'tokens/s':>10}{'tokens/CPU-s':>14}")
    for name, (wall, cpu) in totals.items():
        print(f"{name:<18}{tokens / wall:>10.1f}{tokens / cpu:>14.1f}")
    (src_wall, src_cpu), (mla_wall, mla_cpu) = totals.values()
    print(f"{'MLA / source':<18}{src_wall / mla_wall:>10.3f}{src_cpu / mla_cpu:>14.3f}   (target ≥ 0.95)")


if __name__ == "__main__":
    main()
