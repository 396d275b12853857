"""What DeepSeek's latent RMSNorm costs an MHA2MLA model, before and after a short fine-tune.

The MLA model (SmolLM2-135M, default recipe at 72 values, `--mla`) is given a latent norm by
`mha2mla.conversion.stages.latent_norm.add_latent_norm` on each layer, from its attention inputs over
4 × 256 calibration tokens: "near_linear" (an eps large enough that the norm is near-linear at the
latent's natural scale) and "rms" (eps 1e-6, weight = the median latent RMS), against the model
without one. Each variant is perplexity-scored (WikiText-2 raw test, `--windows` × 1024), fine-tuned
`--steps` steps by mha2mla.apps.train (2 × 256 tokens per step, lr 1e-4, the Wikipedia shards) and
scored again; then exported to DeepSeek-V3 (a variant with a norm exactly; the one without by the
near-linear method), with the logits gap `export` measures. Prints, never asserts.

    python benchmarks/latent_norm_finetune.py [--mla out/smollm2-b72] [--out out/latent-norm] [--steps 50]
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

import torch

from mha2mla import load_model
from mha2mla.apps.train import train
from mha2mla.conversion.stages.latent_norm import add_latent_norm
from mha2mla.evaluate.perplexity import perplexity
from mha2mla.exports.deepseek_v3 import export_checkpoint
from mha2mla.io.text import calibration_blocks, default_eval_text, default_train_text

VARIANTS = ("near_linear", "rms", "none")  # "none" last: it fine-tunes the loaded model itself


@torch.no_grad()
def attention_inputs(model, blocks: torch.Tensor) -> list[torch.Tensor]:
    """What enters every layer's attention (after its input norm) over `blocks` [N, T] → per layer [N·T, hidden]."""
    seen = [[] for _ in model.model.layers]
    hooks = [layer.self_attn.register_forward_pre_hook(
        lambda module, args, i=i: seen[i].append(args[0].reshape(-1, args[0].shape[-1]).float()))
        for i, layer in enumerate(model.model.layers)]
    try:
        for block in blocks:
            model(block[None].to(model.device), use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    return [torch.cat(x) for x in seen]


def with_latent_norm(model, inputs, method: str):
    """A copy of the MLA model with a latent norm added by `method` to every layer."""
    model = copy.deepcopy(model)
    eps = [add_latent_norm(layer.self_attn, x, method=method) for layer, x in zip(model.model.layers, inputs)]
    model.config.latent_norm, model.config.latent_norm_eps = True, eps
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mla", default="out/smollm2-b72")
    parser.add_argument("--out", default="out/latent-norm")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--windows", type=int, default=8)
    args = parser.parse_args()
    out, text = Path(args.out), default_eval_text()
    mla, tokenizer = load_model(args.mla)
    calib, _ = calibration_blocks(tokenizer, [default_train_text()], 256, 4, 0)
    inputs = attention_inputs(mla, calib)

    rows = []
    for variant in VARIANTS:
        model = mla if variant == "none" else with_latent_norm(mla, inputs, variant)
        before = perplexity(model, tokenizer, text, 1024, args.windows, progress=False)["ppl"]
        run = train((model, tokenizer), out / variant / "run", steps=args.steps, seq_len=256, batch_size=2,
                    save_every=0)
        model.eval()
        after = perplexity(model, tokenizer, text, 1024, args.windows, progress=False)["ppl"]
        report = export_checkpoint((model, tokenizer), out / variant / "deepseek-v3", overwrite=True)
        gap = report["logits_gap"]
        rows.append((variant, before, after, run["final_loss"], report["latent_norm"], gap["max_abs"],
                     gap["top1_agreement"]))
        print(rows[-1], flush=True)

    print(f"MLA model {args.mla}; WikiText-2 raw test, {args.windows} × 1024 tokens; fine-tune {args.steps} steps "
          f"of 2 × 256 tokens (lr 1e-4, Wikipedia shards)")
    print("| latent norm | ppl before | ppl after fine-tune | final loss | export's latent norm "
          "| export max logits gap | export top-1 agreement |")
    print("|---|---:|---:|---:|---|---:|---:|")
    for variant, before, after, loss, norm, worst, agree in rows:
        print(f"| {variant} | {before:.3f} | {after:.3f} | {loss:.4f} | {norm} | {worst:.2e} | {100 * agree:.2f} % |")


if __name__ == "__main__":
    main()
