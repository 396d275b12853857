"""One source attention layer converted to MLA at one split: the RoPE layout, then the low-rank stage.

    1. RoPE layout (stages/rope/layout): which part of the keys keeps RoPE — the paper's partial RoPE
       (r pairs per KV head) or RoPE concentration (one shared RoPE key) — fills q_proj and k_rope_proj
       and leaves the position-free key rows;
    2. low rank (stages/lowrank): those rows and W_v factored into kv_down, k_up, v_up, weighted as
       the recipe says.

The conversion calls it once per layer (or once per split a layer may choose among), the allocation
once per measured point of a layer's error curve; both compare the result with the source's attention
outputs (`source_outputs`) by calibration.attention_error.
"""

from __future__ import annotations

import torch

from ..modeling.modeling_mla import MLAAttention
from .plan import Plan, Split
from .stages.lowrank import fill_kv_factors


def convert_attention(plan: Plan, idx: int, src_attn, calibration, measured, split: Split, kv_balance: float,
                      dtype: torch.dtype) -> tuple[MLAAttention, list[list[int]]]:
    """Layer idx's attention at `split` → (MLA attention, the RoPE frequencies it kept per RoPE head).
    `measured`: what the layout measured in the calibration (layout.measure)."""
    layout, recipe = plan.layout, plan.recipe
    attn = MLAAttention(plan.layer_config(split), idx).to(dtype)
    inv_freq = plan.fields["rope_inv_freq"]
    choice = layout.choose(measured, split[0], inv_freq, calibration.inputs[0].shape[1])
    kept = layout.frequencies(choice)
    attn.set_rope_pairs(kept, inv_freq)
    layout.fill(src_attn, attn, choice)
    fill_kv_factors(src_attn, attn, layout.position_free(src_attn, choice), calibration, split[1], recipe.svd,
                    recipe.weighting, kv_balance)
    return attn, kept


@torch.no_grad()
def source_outputs(src_attn, calibration, rope, causal: torch.Tensor) -> list[torch.Tensor]:
    """The source attention's outputs on the layer's calibration inputs."""
    return [src_attn(x, position_embeddings=rope, attention_mask=causal)[0] for x in calibration.inputs]
