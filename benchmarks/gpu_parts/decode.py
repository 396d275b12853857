"""Part 4 of the GPU check: decode on the device — a source with transformers' cache against its MLA model
with LatentCache, bf16, at 4K and 16K context, batch 1 and 32.

`mha2mla bench decode` loads both models on the CPU (mha2mla.evaluate.speed), so this part runs its
loop on the device instead, with the same prompt (random tokens, prefilled in chunks asking for the
last position's logits only), one untimed warm-up step, then timed greedy steps — each step
synchronised, decode tok/s = batch / median step time — and reports its rows through the project's
`speed.compare` (DESIGN.md's `bench decode` keys). Peak memory is the GPU allocator's peak (weights
included), reset before each measurement; on the CPU (dry run) the process's peak resident memory.
A measurement whose estimated peak (speed.estimated_peak_bytes) exceeds the free memory is not
started: its row says how much it needed; an out-of-memory error is recorded as such.

Models: SmolLM2-135M and its conversion at 72 values from the conversion part (context 8192 at most, so
its 16K rows are skip lines), and a random model of SmolLM2-1.7B's shape (MHA, 32 heads of 64) against a
random MLA model of its shape at d_kv 16 (the default recipe's widths: 768 of 4096 values), both built
on the device. Dry run: toy stand-ins, contexts 64/128, batch 1/2.
"""

from __future__ import annotations

import statistics
import time

import torch

from mha2mla import LatentCache, load_model
from mha2mla.evaluate import speed
from mha2mla.evaluate.inputs import is_mla
from mha2mla.modeling.modeling_mla import CACHE_NAME

from .conversion import smollm2_pair
from .models import describe, random_mla, random_source
from .record import Context, Skip, free_memory, peaks, release, reset_peaks, sync

CONTEXTS = {"gpu": (4096, 16384), "dry": (64, 128)}
BATCHES = {"gpu": (1, 32), "dry": (1, 2)}
NEW_TOKENS = {"gpu": 32, "dry": 4}
CHUNK = {"gpu": 1024, "dry": 32}


def run(ctx: Context) -> None:
    for label, load in (("SmolLM2-135M vs MLA (72 values)", smollm2_models),
                        ("random 1.7B (SmolLM2-1.7B shape) vs MLA d_kv 16", random_models)):
        loaded = {}
        if ctx.step(f"load {label}", lambda f=load: f(ctx, loaded), needs=ctx.size(10, 1)) is None:
            continue
        pair = loaded.pop("pair")
        for context in CONTEXTS[mode(ctx)]:
            for batch in BATCHES[mode(ctx)]:
                ctx.step(f"{label}: context {context}, batch {batch}",
                         lambda c=context, b=batch, p=pair: row(ctx, *p, c, b), needs=ctx.size(8, 0.5))
        del pair
        release(ctx.device)


def mode(ctx: Context) -> str:
    return "dry" if ctx.dry else "gpu"


def smollm2_models(ctx: Context, loaded: dict) -> dict:
    pair = smollm2_pair(ctx)
    if pair is None:
        raise Skip("the conversion part left no SmolLM2 conversion (see its lines)")
    source, mla = (load_model(path, dtype=torch.bfloat16)[0].to(ctx.device) for path in pair)
    return described(loaded, source, mla, "SmolLM2-135M" if not ctx.dry else describe("SmolLM2-135M", True))


def random_models(ctx: Context, loaded: dict) -> dict:
    context = max(CONTEXTS[mode(ctx)]) + NEW_TOKENS[mode(ctx)] + 1
    source = random_source("SmolLM2-1.7B", ctx.dry, ctx.device, torch.bfloat16, context=context)
    mla = random_mla(source.config, ctx.device, torch.bfloat16, d_kv=16)
    return described(loaded, source, mla, describe("SmolLM2-1.7B", ctx.dry))


def described(loaded: dict, source, mla, what: str) -> dict:
    """Keep the pair in `loaded` and describe it."""
    loaded["pair"] = (source, mla)
    params = sum(p.numel() for p in source.parameters())
    return {"model": what, "params_m": round(params / 1e6, 1),
            "source_kv_values": 2 * source.config.num_key_value_heads * source.config.head_dim,
            "mla_kv_values": mla.config.kv_elements_per_token_per_layer}


def row(ctx: Context, source, mla, context: int, batch: int) -> dict:
    """Both models at one (context, batch): speed.compare's row, or what each one could not do."""
    results = {}
    for name, model in (("source", source), ("mla", mla)):
        results[name] = measure_or_reason(ctx, model, context, batch)
    if all(isinstance(r, dict) for r in results.values()):
        return {k: round(v, 4) if isinstance(v, float) else v
                for k, v in speed.compare(context, batch, results["source"], results["mla"]).items()}
    if not any(isinstance(r, dict) for r in results.values()):
        raise Skip(f"source: {results['source']}; MLA: {results['mla']}")
    return {f"{name}_{k}": v for name, r in results.items()
            for k, v in (r.items() if isinstance(r, dict) else [("not_run", r)])}


def measure_or_reason(ctx: Context, model, context: int, batch: int):
    """measure()'s dict, or a one-line reason it was not measured (too long, too big, out of memory)."""
    new_tokens, chunk = NEW_TOKENS[mode(ctx)], CHUNK[mode(ctx)]
    if context + new_tokens + 1 > model.config.max_position_embeddings:
        return f"context {context} is beyond the model's {model.config.max_position_embeddings}"
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    need = speed.estimated_peak_bytes(model, context, batch, new_tokens, 16, chunk) - weights
    free = free_memory(ctx.device)
    if need > 0.9 * free:
        return f"needs about {need / 2**30:.2f} GiB beside its weights, {free / 2**30:.2f} GiB free"
    try:
        return measure(ctx.device, model, context, batch, new_tokens, chunk)
    except torch.OutOfMemoryError as e:
        return f"out of memory: {str(e).splitlines()[0][:120]}"
    finally:
        release(ctx.device)


def step(model, ids, cache):
    """One cached forward asking for the last position's logits → (next greedy token [B, 1], cache)."""
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1, **{CACHE_NAME: cache})
    return out.logits[:, -1].argmax(-1, keepdim=True), getattr(out, CACHE_NAME)


@torch.inference_mode()
def measure(device: str, model, context: int, batch: int, new_tokens: int, chunk: int) -> dict:
    """Prefill in chunks, one warm-up step, `new_tokens` timed steps → speed.compare's inputs."""
    torch.manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (batch, context), device=device)
    cache = LatentCache(model.config) if is_mla(model) else None
    reset_peaks(device)
    start = time.perf_counter()
    for i in range(0, context, chunk):
        token, cache = step(model, prompt[:, i:i + chunk], cache)
    sync(device)
    prefill_s = time.perf_counter() - start
    token, cache = step(model, token, cache)
    times = []
    for _ in range(new_tokens):
        sync(device)
        start = time.perf_counter()
        token, cache = step(model, token, cache)
        sync(device)
        times.append(time.perf_counter() - start)
    peak = peaks(device)
    return {"prefill_s": prefill_s, "decode_tok_s": batch / statistics.median(times),
            "peak_mb": peak.get("peak_gpu_mb", peak["peak_rss_mb"]), "kv_bytes": speed.cache_bytes(cache)}
