"""A latent RMSNorm given to a converted MLA attention layer without changing what it computes.

DeepSeek's MLA normalises the cached latent, c ↦ w ⊙ c / sqrt(ms(c) + ε) with ms(c) = mean(c²)
(`kv_a_layernorm`); an MHA2MLA layer caches c = kv_down x as it is. Two ways to give it that norm:

* "near_linear": a large ε, so that ms(c) ≪ ε where the norm is nearly linear, and w = sqrt(ε):
      sqrt(ε) · c / sqrt(ms(c) + ε) = c / sqrt(1 + ms(c)/ε) ≈ c · (1 − ms(c) / (2ε)),
  a relative error of ms(c)/(2ε) on the latent. ε is set from calibration inputs so that this error is
  `tolerance` at the largest ms(c) among them (a token with a larger latent gets proportionally more).
  Weights and latent keep their natural scale, so the layer fine-tunes as before (it may leave the
  near-linear range if that helps). An engine's fixed eps ε₀ (DeepSeek: 1e-6) takes the same
  function on α·kv_down with α = sqrt(ε₀/ε), since αc / sqrt(α² ms(c) + ε₀) = c / sqrt(ms(c) + ε);
  that cached latent is small, RMS ≤ sqrt(2 ε₀ tolerance) = 1.4e-6 at the default: fine in float32
  and bfloat16 (8 exponent bits), below float16's normal range (6e-5).
* "rms": ε = ε₀ and w = the median over calibration tokens of RMS(c): the norm in its ordinary regime,
  exact for a token whose latent has the median RMS; a token with RMS ρ has its latent scaled by median/ρ.

(Measured on SmolLM2 at 72 values, benchmarks/results/: near_linear keeps the logits within 1.4e-4 and
the perplexity to the third decimal; rms raises WikiText perplexity from 267 to 4214. Shrinking kv_down
by α instead of raising ε computes the same, but fine-tuning then diverged: AdamW's steps are ~lr in
size, far larger than weights of size α.)

The conversion's refit reads kv_down x as the latent, so a layer gets its norm after its refit.
"""

from __future__ import annotations

import torch

from ...modeling.modeling_mla import MLARMSNorm
from ...recipes import LATENT_NORMS

TOLERANCE = 1e-6   # near_linear: relative latent error at the largest calibration latent (measured: SmolLM2
                   # logits within 2e-4 of the MLA model at 1e-6, 4e-3 at 1e-4, 4e-2 at 1e-3)
EPS = 1e-6         # transformers' DeepseekV3 kv_a_layernorm has this eps (not the config's rms_norm_eps)


@torch.no_grad()
def latent_mean_squares(kv_down_weight: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
    """ms(c) = mean(c²) per token for c = kv_down x over inputs [..., hidden] → [N] float64."""
    c = inputs.reshape(-1, inputs.shape[-1]).double() @ kv_down_weight.double().T
    return c.pow(2).mean(-1)


def norm_parameters(ms: torch.Tensor, method: str, tolerance: float = TOLERANCE) -> tuple[float, float]:
    """(ε, w): the norm's eps and its weight in every channel, from the latents' mean squares `ms`."""
    if method == "near_linear":
        eps = float(ms.max()) / (2 * tolerance)
        return eps, eps**0.5
    if method == "rms":
        return EPS, float(ms.sqrt().median())
    raise ValueError(f"unknown latent norm method {method!r} (one of {', '.join(LATENT_NORMS)})")


@torch.no_grad()
def add_latent_norm(attn, inputs: torch.Tensor, method: str = "near_linear", tolerance: float = TOLERANCE) -> float:
    """Give a converted MLAAttention `attn` a latent norm `kv_norm` by `method`, from its calibration
    inputs [..., hidden] (what enters the layer's attention) → the norm's eps, which the model's config
    must then hold for this layer (latent_norm=True, latent_norm_eps[layer] = eps) so a reload builds it."""
    eps, weight = norm_parameters(latent_mean_squares(attn.kv_down.weight, inputs), method, tolerance)
    norm = MLARMSNorm(attn.kv_down.out_features, eps).to(attn.kv_down.weight.device)
    norm.weight.fill_(weight)
    attn.kv_norm = norm.to(attn.kv_down.weight.dtype)
    return eps
