"""Part 6 of the GPU check: the DeepSeek-V3 export served — transformers always, vLLM when it is installed.

1. The MLA model (SmolLM2's conversion from the conversion part, else a small random source converted
   here at d_kv 8) exported with `mha2mla.export(..., format="deepseek-v3", pad_for="vllm")` (vLLM's MLA
   kernels take kv_lora_rank 512 + qk_rope_head_dim 64): time and the export's own logits gap.
2. Greedy tokens of the export in stock transformers (DeepseekV3ForCausalLM, bf16, on the device)
   against the MLA model's own (bf16, LatentCache), from the same prompt: how many agree.
3. vLLM, if importable: the export served with the TRITON_MLA attention backend
   (VLLM_ATTENTION_BACKEND; enforce_eager), greedy, against transformers' tokens of step 2. No machine
   this project has seen has vLLM, so this step has never run: its line is a skip until one does.
Counts are measurements, not pass/fail: bf16 greedy paths may part after a near tie.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import time

import torch
from transformers import AutoModelForCausalLM

from mha2mla import convert, export, load_model

from .conversion import smollm2_pair
from .models import byte_tokenizer, random_source, toy_eval_text, train_text
from .record import Context, Skip, release

PROMPT_TOKENS = 32
NEW_TOKENS = {"gpu": 32, "dry": 8}


def run(ctx: Context) -> None:
    state = {}
    ctx.step("MLA model to export", lambda: pick_model(ctx, state), needs=ctx.size(15, 1))
    ctx.step("export to DeepSeek-V3, padded for vLLM",
             lambda: do_export(ctx, state) if "mla" in state else skip("no MLA model"), needs=ctx.size(20, 1))
    ctx.step("greedy tokens: export in transformers vs the MLA model",
             lambda: transformers_tokens(ctx, state) if "export" in state else skip("no export"),
             needs=ctx.size(15, 1))
    ctx.step("vLLM (TRITON_MLA) greedy tokens vs transformers", lambda: vllm_check(ctx, state),
             needs=ctx.size(60, 1))


def skip(reason: str):
    raise Skip(reason)


def pick_model(ctx: Context, state: dict) -> dict:
    pair = smollm2_pair(ctx)
    if pair is not None:
        state["mla"] = pair[1]
        return {"model": "SmolLM2-135M's conversion from the conversion part"}
    path = ctx.scratch / "serve-mla"
    shutil.rmtree(path, ignore_errors=True)
    convert((random_source("exactness", ctx.dry), byte_tokenizer()), path, d_kv=8, calib_data=train_text(),
            calib_samples=2, calib_seq_len=64, device=ctx.device, progress=False)
    state["mla"] = path
    return {"model": "a small random Llama converted here at d_kv 8"}


def do_export(ctx: Context, state: dict) -> dict:
    out = ctx.scratch / "serve-ds"
    shutil.rmtree(out, ignore_errors=True)
    start = time.perf_counter()
    report = export(state["mla"], out, format="deepseek-v3", pad_for="vllm", calib_data=train_text(),
                    calib_samples=ctx.size(4, 2), calib_seq_len=ctx.size(256, 64))
    state["export"] = out
    gap = report["logits_gap"]
    return {"seconds": round(time.perf_counter() - start, 1), "kv_lora_rank": report["kv_lora_rank"],
            "qk_rope_head_dim": report["qk_rope_head_dim"], "gap_max_abs": gap["max_abs"],
            "gap_top1_agreement": gap["top1_agreement"]}


def prompt_ids(ctx: Context, tokenizer) -> torch.Tensor:
    text = toy_eval_text().read_text(encoding="utf-8", errors="replace")[:2000]
    return tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"][:, :PROMPT_TOKENS]


@torch.no_grad()
def greedy(model, ids: torch.Tensor, new_tokens: int) -> list[int]:
    out = model.generate(ids.to(model.device), attention_mask=torch.ones_like(ids, device=model.device),
                         max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    return out[0, ids.shape[1]:].tolist()


def transformers_tokens(ctx: Context, state: dict) -> dict:
    new_tokens = NEW_TOKENS["dry" if ctx.dry else "gpu"]
    mla, tokenizer = load_model(state["mla"], dtype=torch.bfloat16)
    ids = prompt_ids(ctx, tokenizer)
    mla_tokens = greedy(mla.to(ctx.device), ids, new_tokens)
    del mla
    exported = AutoModelForCausalLM.from_pretrained(state["export"], dtype=torch.bfloat16).to(ctx.device).eval()
    state["prompt"], state["tokens"] = ids[0].tolist(), greedy(exported, ids, new_tokens)
    del exported
    release(ctx.device)
    agree = sum(a == b for a, b in zip(mla_tokens, state["tokens"]))
    return {"agree": agree, "of": new_tokens, "architecture": "DeepseekV3ForCausalLM"}


def vllm_check(ctx: Context, state: dict) -> dict:
    if importlib.util.find_spec("vllm") is None:
        raise Skip("vLLM is not installed on this machine")
    if ctx.dry or not ctx.device.startswith("cuda"):
        raise Skip("vLLM's MLA backends need a GPU")
    if "tokens" not in state:
        raise Skip("no transformers tokens to compare with")
    os.environ["VLLM_ATTENTION_BACKEND"] = "TRITON_MLA"
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(state["export"]), dtype="bfloat16", enforce_eager=True, gpu_memory_utilization=0.4,
              max_model_len=1024)
    params = SamplingParams(temperature=0.0, max_tokens=len(state["tokens"]), min_tokens=len(state["tokens"]))
    output = llm.generate([{"prompt_token_ids": state["prompt"]}], params)[0].outputs[0]
    tokens = list(output.token_ids)
    agree = sum(a == b for a, b in zip(tokens, state["tokens"]))
    return {"agree": agree, "of": len(state["tokens"]), "backend": os.environ["VLLM_ATTENTION_BACKEND"]}
