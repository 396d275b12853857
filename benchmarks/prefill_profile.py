"""Where a prefill chunk's time goes: one chunk of --chunk tokens over a cached past of --past tokens,
source (transformers' cache) against the MLA checkpoint (LatentCache), with torch's profiler.

Prints, per model, the chunk's wall time and the operators that take the most CPU time. The past is
built first with the model's own chunked prefill (untimed). Measures and prints; asserts nothing.

    python benchmarks/prefill_profile.py MLA_DIR [--source smollm2-135m] [--past 3584] [--chunk 512] [--batch 2]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from mha2mla.evaluate.inputs import is_mla
from mha2mla.io.sources import load_model
from mha2mla.modeling import LatentCache
from mha2mla.modeling.modeling_mla import CACHE_NAME


@torch.inference_mode()
def profile_chunk(name: str, past: int, chunk: int, batch: int, rows: int) -> None:
    model, _ = load_model(name)
    ids = torch.randint(0, model.config.vocab_size, (batch, past + chunk), generator=torch.Generator().manual_seed(0))
    cache = LatentCache(model.config) if is_mla(model) else None
    for start in range(0, past, chunk):
        out = model(input_ids=ids[:, start:start + chunk], use_cache=True, logits_to_keep=1, **{CACHE_NAME: cache})
        cache = getattr(out, CACHE_NAME)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        model(input_ids=ids[:, past:], use_cache=True, logits_to_keep=1, **{CACHE_NAME: cache})
        seconds = time.perf_counter() - start
    print(f"\n{name}: {chunk} tokens over a past of {past}, batch {batch}: {seconds:.2f} s "
          f"(attention implementation {model.config._attn_implementation})")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mla")
    parser.add_argument("--source", default="smollm2-135m")
    parser.add_argument("--past", type=int, default=3584)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--rows", type=int, default=12)
    args = parser.parse_args()
    for name in (args.source, args.mla):
        profile_chunk(name, args.past, args.chunk, args.batch, args.rows)


if __name__ == "__main__":
    main()
