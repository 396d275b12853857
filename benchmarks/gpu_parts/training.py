"""Part 5 of the GPU check: fine-tuning on the device — tok/s and peak memory of the MLA model against its
source, 20 steps of Trainer's bf16 mixed precision (fp32 weights, bf16 autocast), and of the MLA model
distilled from the source (apps/distill.py: the frozen teacher beside the student).

Each run is mha2mla.apps.train.train on the Wikipedia shards, batch 8 × 512 tokens, no intermediate
checkpoints; tok/s = the tokens Trainer counted / the wall time of train() (the first, slower steps
included), peak memory = the GPU allocator's peak during the run (the CPU's peak resident memory in
the dry run). Models: SmolLM2-135M and its conversion from the conversion part, else a random model of
SmolLM2-135M's shape and a random MLA model of its shape at d_kv 16. Dry run: toy models, 3 steps of
2 × 32 tokens.
"""

from __future__ import annotations

import shutil

import torch

from mha2mla import load_model
from mha2mla.apps.distill import Distillation
from mha2mla.apps.train import train

from .conversion import smollm2_pair
from .models import byte_tokenizer, describe, random_mla, save_model, source_config, train_text, write_random_source
from .record import Context, peaks, release, reset_peaks

STEPS = {"gpu": 20, "dry": 3}
SEQ_LEN = {"gpu": 512, "dry": 32}
BATCH = {"gpu": 8, "dry": 2}


def run(ctx: Context) -> None:
    models = {}
    if ctx.step("models", lambda: pick_models(ctx, models), needs=ctx.size(20, 1)) is None:
        return
    source, mla = models["source"], models["mla"]
    steps = STEPS["dry" if ctx.dry else "gpu"]
    for label, path, teacher in (("source", source, None), ("MLA", mla, None),
                                 ("MLA distilled from the source", mla, source)):
        ctx.step(f"{label}: {steps} steps, bf16", lambda p=path, t=teacher, n=label: train_run(ctx, p, t, n),
                 needs=ctx.size(20, 2))


def pick_models(ctx: Context, models: dict) -> dict:
    """SmolLM2 and its conversion when the conversion part made them, else random models of its shape."""
    pair = smollm2_pair(ctx)
    if pair is not None:
        models["source"], models["mla"] = pair
        return {"models": "SmolLM2-135M and its MLA conversion at 72 values" if not ctx.dry
                else describe("SmolLM2-135M", True) + ", and its conversion"}
    source = ctx.scratch / "train-source"
    shutil.rmtree(source, ignore_errors=True)
    write_random_source(source, "SmolLM2-135M", ctx.dry)
    mla = random_mla(source_config("SmolLM2-135M", ctx.dry), d_kv=16)
    models["source"], models["mla"] = str(source), save_model(mla, byte_tokenizer(), ctx.scratch / "train-mla")
    return {"models": describe("SmolLM2-135M", ctx.dry) + ", and a random MLA model of its shape at d_kv 16"}


def train_run(ctx: Context, path, teacher, label: str) -> dict:
    model, tokenizer = load_model(path)
    out = ctx.scratch / f"train-{label.replace(' ', '-')}"
    shutil.rmtree(out, ignore_errors=True)
    mode = "dry" if ctx.dry else "gpu"
    reset_peaks(ctx.device)
    try:
        result = train((model.to(torch.float32), tokenizer), out, data=train_text(), steps=STEPS[mode],
                       seq_len=SEQ_LEN[mode], batch_size=BATCH[mode], bf16=True, save_every=0,
                       distill=Distillation(teacher=str(teacher)) if teacher else None)
        measured = peaks(ctx.device)
    finally:
        shutil.rmtree(out, ignore_errors=True)
        del model
        release(ctx.device)
    return {"tok_s": round(result["tokens"] / result["seconds"], 1), "tokens": result["tokens"],
            "seconds": round(result["seconds"], 2), "final_loss": round(result["final_loss"], 4), **measured,
            "teacher_mb": round(result["teacher_bytes"] / 2**20, 1)}
