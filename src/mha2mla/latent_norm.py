"""A latent RMSNorm given to a converted MLA attention layer without changing what it computes.

DeepSeek's MLA normalises the cached latent, c ↦ w ⊙ c / sqrt(ms(c) + ε) with ms(c) = mean(c²)
(`kv_a_layernorm`); an MHA2MLA layer caches c = kv_down x as it is. Two ways to give it that norm:

* "near_linear": shrink the latent by α so that α²·ms(c) ≪ ε, where the norm is nearly linear.
  With kv_down' = α·kv_down and w = sqrt(ε)/α,
      w · αc / sqrt(α² ms(c) + ε) = c / sqrt(1 + α² ms(c)/ε) ≈ c · (1 − α² ms(c) / (2ε)),
  a relative error of α² ms(c)/(2ε) on the latent. α is set from calibration inputs so that this
  error is `tolerance` at the largest ms(c) among them (a token with a larger latent gets
  proportionally more). The cached latent is then of size ~sqrt(2ε·tolerance): fine in float32 and
  bfloat16 (8 exponent bits), below float16's normal range.
* "rms": the norm in its ordinary regime, w = the median over calibration tokens of RMS(c): exact
  for a token whose latent has the median RMS; a token with RMS ρ has its latent scaled by median/ρ.

Both keep kv_down's other uses (refit reads kv_down x directly) consistent only before the norm is
added, so it is added last, after a layer's refit.
"""

from __future__ import annotations

import torch

from .modeling.modeling_mla import MLARMSNorm

METHODS = ("near_linear", "rms")
TOLERANCE = 1e-6   # near_linear: relative latent error at the largest calibration latent (measured: SmolLM2
                   # logits within 2e-4 of the MLA model at 1e-6, 4e-3 at 1e-4, 4e-2 at 1e-3)
EPS = 1e-6         # transformers' DeepseekV3 kv_a_layernorm has this eps (not the config's rms_norm_eps)


@torch.no_grad()
def latent_mean_squares(kv_down_weight: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
    """ms(c) = mean(c²) per token for c = kv_down x over inputs [..., hidden] → [N] float64."""
    c = inputs.reshape(-1, inputs.shape[-1]).double() @ kv_down_weight.double().T
    return c.pow(2).mean(-1)


def norm_parameters(ms: torch.Tensor, method: str, eps: float = EPS, tolerance: float = TOLERANCE
                    ) -> tuple[float, float]:
    """(α, w): kv_down is scaled by α and the norm's weight is w in every channel."""
    if method == "near_linear":
        alpha = (2 * eps * tolerance / float(ms.max())) ** 0.5
        return alpha, eps**0.5 / alpha
    if method == "rms":
        return 1.0, float(ms.sqrt().median())
    raise ValueError(f"unknown latent norm method {method!r} (one of {', '.join(METHODS)})")


@torch.no_grad()
def add_latent_norm(attn, inputs: torch.Tensor, method: str = "near_linear", eps: float = EPS,
                    tolerance: float = TOLERANCE) -> None:
    """Give a converted MLAAttention `attn` a latent norm `kv_norm` by `method`, from its calibration
    inputs [..., hidden] (what enters the layer's attention); kv_down is rescaled in place. The model's
    config must then say latent_norm=True, latent_norm_eps=eps (so a reloaded model builds kv_norm)."""
    alpha, weight = norm_parameters(latent_mean_squares(attn.kv_down.weight, inputs), method, eps, tolerance)
    attn.kv_down.weight.mul_(alpha)
    norm = MLARMSNorm(attn.kv_down.out_features, eps).to(attn.kv_down.weight.device)
    norm.weight.fill_(weight)
    attn.kv_norm = norm.to(attn.kv_down.weight.dtype)
