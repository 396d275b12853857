"""Part 2 of the GPU check: the equivalences the MLA model rests on, measured on the device in fp32 and bf16.

On a random Llama source (GQA; wide initial weights, so attention is far from uniform and a wrong key
or position shows in the logits), converted on the device by mha2mla.convert:

* full rank keeps the logits: every frequency pair kept with RoPE and a latent as wide as the values
  (per-head RoPE layout; the paper recipe, and the default recipe's stages with 2-norm RoPE), converted
  on the device (fp32 forward passes, the default) and run in the checked dtype, against the source;
  beside it, measured and not judged, the same conversion with bf16 forward passes (`--dtype
  bfloat16`), whose refit solves its least squares on bf16 activations;
* absorbed = expanded: a chunked prefill and decode steps through LatentCache, every cached attention
  forced absorbed (queries against the latent) and then forced expanded (K and V rebuilt);
* cached decoding = full forward: the same tokens fed one at a time through LatentCache against one
  forward over the whole sequence;
* eager = sdpa (= flash_attention_2 where it loads): full forward and cached steps;

the last three on two compressed conversions (d_kv 8: the default recipe's shared RoPE key, and the
paper's per-head partial RoPE). Tokens are fixed (no greedy choice), so every dtype sees the same ones.

Pass rule. fp32: relative gap max|a − b| / max|b| ≤ 1e-4. bf16: both sides in bf16 and the gap taken
to the reference computed in fp32; it passes when it is at most 3 × the reference's own bf16 rounding
(the reference in bf16 against itself in fp32), i.e. the MLA path costs no more precision than bf16 does.
"""

from __future__ import annotations

import copy
import importlib.util
from functools import lru_cache

import torch

from mha2mla import LatentCache, Recipe, convert
from mha2mla.modeling.modeling_mla import CACHE_NAME

from .models import byte_tokenizer, describe, random_source, train_text
from .record import Context, Skip, relative_gap

FP32_BOUND = 1e-4
BF16_FACTOR = 3.0
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
FULL_RANK_RECIPES = {"paper recipe": "paper", "default stages, per-head 2-norm RoPE": Recipe(rope="2-norm")}
COMPRESSED = {"default recipe d_kv 8 (shared RoPE key)": dict(d_kv=8),
              "paper recipe d_kv 8 (per-head RoPE)": dict(d_kv=8, recipe="paper")}
PREFILL = (8, 16)   # two prefill chunks end at these positions, then one token per step
LENGTH = 32


def run(ctx: Context) -> None:
    sources = Sources(ctx)
    ctx.step("source", lambda: {"model": describe("exactness", ctx.dry), "device": ctx.device})
    for label, recipe in FULL_RANK_RECIPES.items():
        for name, dtype in DTYPES.items():
            ctx.step(f"full rank keeps the logits, {label}, {name}",
                     lambda r=recipe, d=dtype: judge(lambda dt: sources.full_rank_pair(r, dt), d), needs=2)
        ctx.step(f"full rank converted with bf16 forward passes, {label}, bf16 (measured, not judged)",
                 lambda r=recipe: unjudged(judge(lambda dt: sources.full_rank_pair(r, dt, dt), torch.bfloat16)),
                 needs=2)
    for label, settings in COMPRESSED.items():
        model = ctx.step(f"convert ({label})", lambda s=settings: sources.compressed(label, s), needs=2)
        if model is None:
            continue
        base = sources.models[label]
        for name, dtype in DTYPES.items():
            for check, pair in path_checks(ctx, base).items():
                ctx.step(f"{check}, {label}, {name}", lambda p=pair, d=dtype: judge(p, d), needs=1)


class Sources:
    """The random source, its conversions (memoized), and fixed token ids on the device."""

    def __init__(self, ctx: Context):
        self.ctx, self.tokenizer = ctx, byte_tokenizer()
        self.source = random_source("exactness", ctx.dry, init_range=0.1)
        self.head_dim = self.source.config.head_dim
        self.models = {}
        generator = torch.Generator().manual_seed(1)
        self.ids = torch.randint(3, len(self.tokenizer), (2, LENGTH), generator=generator).to(ctx.device)

    def convert(self, recipe, dtype: torch.dtype, **size):
        return convert((self.source, self.tokenizer), recipe=recipe, device=self.ctx.device,
                       dtype=str(dtype).removeprefix("torch."), calib_data=train_text(), calib_samples=2,
                       calib_seq_len=64, progress=False, **size)[0]

    @lru_cache(maxsize=None)
    def full_rank(self, recipe, dtype: torch.dtype):
        return self.convert(recipe, dtype, rope_pairs=self.head_dim // 2, d_kv=self.head_dim)

    @torch.no_grad()
    def full_rank_pair(self, recipe, dtype: torch.dtype, conversion_dtype: torch.dtype = torch.float32):
        mla = on(self.full_rank(recipe, conversion_dtype), self.ctx.device, dtype)
        source = on(self.source, self.ctx.device, dtype)
        return mla(self.ids).logits, source(self.ids).logits

    def compressed(self, label: str, settings: dict) -> dict:
        settings = dict(settings)
        model = self.convert(settings.pop("recipe", "default"), torch.float32, **settings)
        self.models[label] = (model, self.ids)
        c = model.config
        return {"latent": c.latent_dim, "rope_dims": c.n_rope_heads * 2 * c.rope_pairs, "layout": c.rope_layout}


def on(model, device: str, dtype: torch.dtype):
    return copy.deepcopy(model).to(device, dtype).eval()


def judge(run_pair, dtype: torch.dtype) -> dict:
    """run_pair(dtype) → (candidate logits, reference logits); the pass rule of the module docstring."""
    candidate, reference = run_pair(dtype)
    if dtype == torch.float32:
        gap = relative_gap(candidate, reference)
        return {"gap": gap, "bound": FP32_BOUND, "passed": gap <= FP32_BOUND}
    _, exact = run_pair(torch.float32)
    gap, rounding = relative_gap(candidate, exact), relative_gap(reference, exact)
    bound = max(BF16_FACTOR * rounding, FP32_BOUND)
    return {"gap_to_fp32_reference": gap, "reference_bf16_rounding": rounding, "bound": bound,
            "gap_to_bf16_reference": relative_gap(candidate, reference), "passed": gap <= bound}


def unjudged(values: dict) -> dict:
    """A judged comparison as a measurement: the gap in units of the reference's bf16 rounding."""
    values.pop("passed"), values.pop("bound")
    values["gap_over_rounding"] = values["gap_to_fp32_reference"] / values["reference_bf16_rounding"]
    return values


# ---- the model paths ------------------------------------------------------------------------------

def path_checks(ctx: Context, base) -> dict:
    """check name → run_pair(dtype) for one converted model."""
    model, ids = base

    def variant(dtype, implementation="sdpa"):
        m = on(model, ctx.device, dtype)
        m.set_attn_implementation(implementation)
        return m

    def eager_pair(other):
        def pair(dtype):
            if other.startswith("flash") and not flash_loads(ctx.device):
                raise Skip("flash-attn is not installed here or the device is not CUDA")
            both = [variant(dtype, i) for i in (other, "eager")]
            return tuple(torch.cat([full_run(m, ids), cached_run(m, ids)], dim=1) for m in both)
        return pair

    return {
        "absorbed = expanded": lambda dtype: (cached_run(variant(dtype), ids, absorbed=True),
                                              cached_run(variant(dtype), ids, absorbed=False)),
        "cached decoding = full forward": lambda dtype: (cached_run(variant(dtype), ids),
                                                         full_run(variant(dtype), ids)),
        "eager = sdpa": eager_pair("sdpa"),
        "eager = flash_attention_2": eager_pair("flash_attention_2"),
    }


def flash_loads(device: str) -> bool:
    return device.startswith("cuda") and importlib.util.find_spec("flash_attn") is not None


def force_path(model, absorbed: bool | None) -> None:
    """Make every cached attention take the absorbed (True) or expanded (False) form; None: the cost rule."""
    for layer in model.model.layers:
        if absorbed is None:
            layer.self_attn.__dict__.pop("absorbed_is_cheaper", None)
        else:
            layer.self_attn.absorbed_is_cheaper = lambda queries, keys, a=absorbed: a


@torch.no_grad()
def cached_run(model, ids: torch.Tensor, absorbed: bool | None = None) -> torch.Tensor:
    """Last-position logits of each cached forward: two prefill chunks, then one token at a time → [B, n, V]."""
    force_path(model, absorbed)
    cache, logits, start = LatentCache(model.config), [], 0
    for end in (*PREFILL, *range(PREFILL[-1] + 1, ids.shape[1] + 1)):
        out = model(ids[:, start:end], use_cache=True, **{CACHE_NAME: cache})
        logits.append(out.logits[:, -1])
        start = end
    force_path(model, None)
    return torch.stack(logits, dim=1)


@torch.no_grad()
def full_run(model, ids: torch.Tensor) -> torch.Tensor:
    """One forward over the whole sequence, its logits at the positions cached_run reports → [B, n, V]."""
    positions = [p - 1 for p in (*PREFILL, *range(PREFILL[-1] + 1, ids.shape[1] + 1))]
    return model(ids).logits[:, positions]
