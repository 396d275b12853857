"""Decode speed and memory: a source model with transformers' default cache against its MLA conversion
with LatentCache, at given context lengths and batch sizes.

One measurement is one model at one (context, batch), run in a fresh subprocess, because a process's
peak memory never falls:
  1. prefill: `batch` rows of `context` random tokens go through the model in chunks of `chunk`
     tokens, asking for the last position's logits only (logits_to_keep=1), so prefill memory is
     the cache plus one chunk's activations, not [batch, context, vocab] logits;
  2. decode: one untimed warm-up step, then `new_tokens` timed greedy steps;
     decode tok/s = batch / median step time (the median shrugs off stalls caused by other jobs);
  3. peak_mb = the process's peak resident memory from after loading to the end (weights, cache,
     transients; MiB; the load's own transients excluded by resetting the count after it);
     kv_bytes = the bytes the cache holds after the last step; loaded_mb = resident memory once the
     model is loaded (weights and the runtime), weights_mb = the parameters' bytes, so that
     peak = loaded + cache + transients.
The MLA model's KV bytes per token and layer are its latent width plus its RoPE key dims times the
element size, the source's 2·n_kv·d_h·bytes; the saved memory shows in peak_mb.
"""

from __future__ import annotations

import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

from ..errors import UserError
from ..io.sources import load_model
from ..modeling import LatentCache
from ..modeling.configuration_mla import kv_values
from ..modeling.modeling_mla import CACHE_NAME
from .inputs import check_fits_context, check_kv_bits, is_mla


def cache_bytes(cache) -> int:
    """Bytes held by a LatentCache or by a transformers cache of K/V layers."""
    if isinstance(cache, LatentCache):
        return cache.nbytes()
    return sum(t.numel() * t.element_size() for layer in cache.layers if layer.is_initialized
               for t in (layer.keys, layer.values))


def reset_peak() -> None:
    """Restart this process's peak-RSS count (Linux: 5 → /proc/self/clear_refs); elsewhere a no-op."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def resident_mb(field: str = "VmRSS") -> float:
    """A memory field of /proc/self/status in MiB (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024
    except (OSError, StopIteration):
        return 0.0


def peak_mb() -> float:
    """Peak resident memory of this process since `reset_peak`, in MiB: VmHWM of /proc/self/status.

    Not ru_maxrss: on Linux a child inherits its parent's maxrss through fork and exec, so a small
    worker would report the peak of the process that started it.
    """
    return resident_mb("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20   # macOS: bytes


def _step(model, ids, cache):
    """One cached forward of `ids`; returns (next greedy token [B, 1], cache)."""
    kwargs = {CACHE_NAME: cache} if cache is not None else {}
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1, **kwargs)
    return out.logits[:, -1].argmax(-1, keepdim=True), getattr(out, CACHE_NAME)


@torch.inference_mode()
def measure(model: str, context: int, batch: int, new_tokens: int = 32, kv_bits: int = 16,
            chunk: int = 512, seed: int = 0) -> dict:
    """Prefill and decode one model in this process: {prefill_s, decode_tok_s, peak_mb, kv_bytes, loaded_mb,
    weights_mb}."""
    net, _ = load_model(model)
    for p in net.parameters():   # page in weights that loading left memory-mapped, so loaded_mb holds them
        p.sum()
    gc.collect()
    reset_peak()
    loaded_mb = resident_mb()
    torch.manual_seed(seed)
    prompt = torch.randint(0, net.config.vocab_size, (batch, context))
    cache = LatentCache(net.config, kv_bits=kv_bits) if is_mla(net) else None
    start = time.perf_counter()
    for i in range(0, context, chunk):
        token, cache = _step(net, prompt[:, i:i + chunk], cache)
    prefill_s = time.perf_counter() - start
    token, cache = _step(net, token, cache)
    step_s = []
    for _ in range(new_tokens):
        start = time.perf_counter()
        token, cache = _step(net, token, cache)
        step_s.append(time.perf_counter() - start)
    return {"prefill_s": prefill_s, "decode_tok_s": batch / statistics.median(step_s), "peak_mb": peak_mb(),
            "kv_bytes": cache_bytes(cache), "loaded_mb": loaded_mb,
            "weights_mb": sum(p.numel() * p.element_size() for p in net.parameters()) / 2**20}


def measure_in_subprocess(model: str, context: int, batch: int, new_tokens: int = 32, kv_bits: int = 16,
                          chunk: int = 512) -> dict:
    """`measure` in a fresh Python process, so that its peak memory is this model's alone."""
    args = dict(model=str(model), context=context, batch=batch, new_tokens=new_tokens, kv_bits=kv_bits, chunk=chunk)
    proc = subprocess.run([sys.executable, "-m", "mha2mla.evaluate.speed", json.dumps(args)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"decode measurement {args} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def compare(context: int, batch: int, source: dict, mla: dict) -> dict:
    """One `bench decode` row (DESIGN.md contract) from the two measurements."""
    return {
        "context": context, "batch": batch,
        "source_prefill_s": source["prefill_s"], "mla_prefill_s": mla["prefill_s"],
        "source_decode_tok_s": source["decode_tok_s"], "mla_decode_tok_s": mla["decode_tok_s"],
        "decode_tok_s_ratio": mla["decode_tok_s"] / source["decode_tok_s"],
        "source_peak_mb": source["peak_mb"], "mla_peak_mb": mla["peak_mb"],
        "source_kv_bytes": source["kv_bytes"], "mla_kv_bytes": mla["kv_bytes"],
    }


def peak_saved_over_kv_saved(row: dict) -> float:
    """(source peak − MLA peak) / (source KV bytes − MLA KV bytes): how much of the KV saving the process
    keeps (1 = all of it; weights and transients make up the rest of a peak)."""
    return (row["source_peak_mb"] - row["mla_peak_mb"]) * 2**20 / (row["source_kv_bytes"] - row["mla_kv_bytes"])


def format_rows(rows: list[dict]) -> str:
    """The human table of `bench decode`: source/MLA pairs and their ratios."""
    lines = [f"{'context':>7} {'batch':>5} | {'prefill s src/mla':>17} | {'decode tok/s src/mla':>20} {'ratio':>6} | "
             f"{'peak MiB src/mla':>17} | {'KV MiB src/mla':>15} {'ratio':>6} | peak saved/KV saved"]
    for r in rows:
        lines.append(
            f"{r['context']:>7} {r['batch']:>5} | {r['source_prefill_s']:>8.2f}/{r['mla_prefill_s']:<8.2f} | "
            f"{r['source_decode_tok_s']:>9.1f}/{r['mla_decode_tok_s']:<10.1f} {r['decode_tok_s_ratio']:>5.2f}x | "
            f"{r['source_peak_mb']:>8.0f}/{r['mla_peak_mb']:<8.0f} | "
            f"{r['source_kv_bytes'] / 2**20:>7.1f}/{r['mla_kv_bytes'] / 2**20:<7.1f} "
            f"{r['mla_kv_bytes'] / r['source_kv_bytes']:>5.3f}x | {peak_saved_over_kv_saved(r):>6.2f}")
    return "\n".join(lines)


def available_bytes() -> int:
    """Memory a new process can take without swapping: MemAvailable of /proc/meminfo (Linux), else all
    physical memory."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:")) * 1024
    except (OSError, StopIteration):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def estimated_peak_bytes(model, context: int, batch: int, new_tokens: int, kv_bits: int, chunk: int) -> int:
    """An upper estimate of one measurement's peak: the weights, the cache at its longest, and one prefill
    chunk's transients (MLP activations, and scores and K/V copies as a non-fused attention makes them)."""
    c = model.config
    width = next(model.parameters()).element_size()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    tokens = batch * (context + new_tokens + 1)
    if is_mla(model):
        per_token = c.kv_bytes_per_token_per_layer(kv_bits, width) * c.num_hidden_layers
    else:
        per_token = kv_values(c) * width * c.num_hidden_layers
    rows = batch * min(chunk, context)
    mlp = rows * (3 * c.intermediate_size + 4 * c.hidden_size) * width
    attention = batch * c.num_attention_heads * context * (2 * min(chunk, context) + 4 * c.hidden_size
                                                           // c.num_attention_heads) * width
    return int(weights + tokens * per_token + mlp + attention)


def check_batch_fits(model, what: str, context: int, batches: list[int], new_tokens: int, kv_bits: int,
                     chunk: int) -> None:
    """A UserError naming the largest batch that fits when a measurement of `model` would not fit in memory."""
    free = available_bytes()
    for batch in batches:
        need = estimated_peak_bytes(model, context, batch, new_tokens, kv_bits, chunk)
        if need > free:
            largest = largest_batch(model, context, new_tokens, kv_bits, chunk, free)
            hint = f"the largest that fits is --batch {largest}" if largest else "no batch fits: shorten --context"
            raise UserError(f"--batch {batch} at --context {context} needs about {need / 2**30:.1f} GiB for {what}, "
                            f"more than the {free / 2**30:.1f} GiB available: {hint}")


def largest_batch(model, context: int, new_tokens: int, kv_bits: int, chunk: int, free: int) -> int:
    """The largest batch whose estimated peak fits in `free` bytes (0 if none), by bisection."""
    lo, hi = 0, 1
    while estimated_peak_bytes(model, context, hi, new_tokens, kv_bits, chunk) <= free:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if estimated_peak_bytes(model, context, mid, new_tokens, kv_bits, chunk) <= free else (lo, mid)
    return lo


def check_bench_inputs(model, source, contexts: list[int], batches: list[int], new_tokens: int, kv_bits: int,
                       chunk: int) -> None:
    """UserErrors for anything a measurement subprocess would fail on, named as the CLI spells it."""
    check_kv_bits(kv_bits)
    if not is_mla(model):
        raise UserError(f"MODEL must be an MLA checkpoint (this is a '{model.config.model_type}' model): "
                        f"convert it with `mha2mla convert` and give the original as --source")
    for name, values in (("--context", contexts), ("--batch", batches), ("--new-tokens", [new_tokens]),
                         ("--chunk", [chunk])):
        if not values or min(values) < 1:
            raise UserError(f"{name} needs positive integers, got {values}")
    for m, what in ((model, "MODEL"), (source, "SOURCE")):
        check_fits_context(m, max(contexts) + new_tokens + 1,
                           f"--context {max(contexts)} plus {new_tokens + 1} decode steps on {what}")
        check_batch_fits(m, what, max(contexts), batches, new_tokens, kv_bits if m is model else 16, chunk)


def bench_decode(model: str, source: str, contexts: list[int], batches: list[int], new_tokens: int = 32,
                 kv_bits: int = 16, chunk: int = 512, log=None) -> dict:
    """{"rows": [compare(...) for each context × batch]}: `source` with its default cache against the MLA
    `model` with LatentCache(kv_bits). `log(msg)` reports progress."""
    check_kv_bits(kv_bits)
    mla, _ = load_model(model)
    src, _ = load_model(source)
    check_bench_inputs(mla, src, contexts, batches, new_tokens, kv_bits, chunk)
    del mla, src
    rows = []
    for context in contexts:
        for batch in batches:
            results = {}
            for name, path, bits in (("source", source, 16), ("mla", model, kv_bits)):
                if log:
                    log(f"measuring {name} at context {context}, batch {batch}")
                results[name] = measure_in_subprocess(path, context, batch, new_tokens, bits, chunk)
            rows.append(compare(context, batch, results["source"], results["mla"]))
    return {"rows": rows}


if __name__ == "__main__":  # the worker of measure_in_subprocess: one JSON object on the last line
    print(json.dumps(measure(**json.loads(sys.argv[1]))))
