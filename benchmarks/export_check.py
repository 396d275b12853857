"""The DeepSeek-V3 export of SmolLM2-135M at 72 cached values: perplexity and logits gap of the exports
against the MLA model and the source.

The MLA model is the default recipe at d_kv 16 (72 values per token per layer), read from `--mla`
(converted there first when absent). Its exports (`mha2mla export --format deepseek-v3`): the
near-linear latent norm (the default), the median-RMS norm, and the near-linear one padded for vLLM
(`--pad-for vllm`). Each export is loaded with stock `AutoModelForCausalLM` (DeepseekV3ForCausalLM).
Reported per model: WikiText-2 raw test perplexity over `--windows` windows of 1024 tokens, the
largest and mean absolute logit difference to the float32 MLA model and the top-1 agreement on the
first window (float32; for the default export also loaded in bfloat16, beside the MLA model's own
bfloat16 difference), how many of 32 greedy `generate()` tokens after the window's first 64 equal the
MLA model's, and the cache per token per layer. Prints, never asserts.

    python benchmarks/export_check.py [--mla out/smollm2-b72] [--out out/export-check] [--windows 8]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from mha2mla import load_model
from mha2mla.conversion.pipeline import convert_checkpoint
from mha2mla.evaluate.perplexity import eval_windows, perplexity
from mha2mla.exports.deepseek_v3 import export_checkpoint
from mha2mla.io.text import default_eval_text
from mha2mla.modeling.configuration_mla import kv_values

SOURCE = "smollm2-135m"
EXPORTS = {  # directory under --out → (row name, export_checkpoint settings)
    "near_linear": ("DeepSeek-V3, near-linear latent norm (default)", dict(latent_norm="near_linear")),
    "rms": ("DeepSeek-V3, median-RMS latent norm", dict(latent_norm="rms")),
    "vllm": ("DeepSeek-V3, near-linear, --pad-for vllm", dict(latent_norm="near_linear", pad_for="vllm")),
}


@torch.no_grad()
def same_greedy(reference, model, prompt: torch.Tensor, new_tokens: int = 32) -> str:
    """Whether greedy generate() gives the same tokens as the MLA model's (its LatentCache against the export's cache)."""
    a = reference.generate(prompt[None], max_new_tokens=new_tokens, do_sample=False)[0, len(prompt):]
    b = model.generate(prompt[None], max_new_tokens=new_tokens, do_sample=False)[0, len(prompt):]
    agree = int((a == b).sum())
    return f"{agree}/{new_tokens} greedy tokens the MLA model's" + (" (all)" if agree == new_tokens else "")


@torch.no_grad()
def gap(reference, model, ids: torch.Tensor) -> str:
    a = reference(ids[None], use_cache=False).logits[0].double()
    b = model(ids[None], use_cache=False).logits[0].double()
    agree = float((a.argmax(-1) == b.argmax(-1)).double().mean())
    return f"max {float((a - b).abs().max()):.2e}, mean {float((a - b).abs().mean()):.2e}, top-1 {100 * agree:.2f} %"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mla", default="out/smollm2-b72")
    parser.add_argument("--out", default="out/export-check")
    parser.add_argument("--windows", type=int, default=8)
    args = parser.parse_args()
    mla_path, out = Path(args.mla), Path(args.out)
    if not (mla_path / "config.json").is_file():
        convert_checkpoint(SOURCE, mla_path, d_kv=16)
    text = default_eval_text()
    mla, tokenizer = load_model(mla_path)
    first = eval_windows(tokenizer, text, 1024, 1)[0]

    rows = []
    source, _ = load_model(SOURCE)
    rows.append(("SmolLM2-135M (source)", kv_values(source.config),
                 perplexity(source, tokenizer, text, 1024, args.windows, progress=False)["ppl"], "", ""))
    del source
    rows.append(("MLA model (default recipe, 72 values)", mla.config.kv_elements_per_token_per_layer,
                 perplexity(mla, tokenizer, text, 1024, args.windows, progress=False)["ppl"], "", ""))
    for directory, (name, settings) in EXPORTS.items():
        start = time.perf_counter()
        path = out / directory
        report = export_checkpoint(mla_path, path, overwrite=True, **settings)
        seconds = time.perf_counter() - start
        model = AutoModelForCausalLM.from_pretrained(path).eval()
        ppl = perplexity(model, tokenizer, text, 1024, args.windows, progress=False)["ppl"]
        calib = report["logits_gap"]
        rows.append((f"{name} [{type(model).__name__}, kv_lora_rank {report['kv_lora_rank']}, "
                     f"qk_rope_head_dim {report['qk_rope_head_dim']}; export {seconds:.0f} s]",
                     report["kv_values_per_token_per_layer"], ppl,
                     f"{gap(mla, model, first)}; {same_greedy(mla, model, first[:64])}",
                     f"max {calib['max_abs']:.2e}, top-1 {100 * calib['top1_agreement']:.2f} %"))
        if directory == "near_linear":  # bfloat16 against the float32 MLA model, and bfloat16's own noise
            bf16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
            rows.append(("  the same in bfloat16", report["kv_values_per_token_per_layer"], float("nan"),
                         gap(mla, bf16, first), ""))
            del bf16
            mla_bf16, _ = load_model(mla_path, dtype=torch.bfloat16)
            rows.append(("  the MLA model in bfloat16 (bfloat16's own noise)", mla.config.kv_elements_per_token_per_layer,
                         float("nan"), gap(mla, mla_bf16, first), ""))
            del mla_bf16

    print(f"SmolLM2-135M-Instruct, MLA model {mla_path}; WikiText-2 raw test, {args.windows} windows of 1024 "
          f"tokens; logits gap to the MLA model on the first window (float32 unless stated) and, as `export` "
          f"prints it, on its held-out calibration text")
    print("| model | KV values/token/layer | ppl | gap on WikiText window 1 | gap printed by export |")
    print("|---|---:|---:|---|---|")
    for name, values, ppl, window_gap, export_gap in rows:
        print(f"| {name} | {values} | {'' if ppl != ppl else f'{ppl:.3f}'} | {window_gap} | {export_gap} |")


if __name__ == "__main__":
    main()
