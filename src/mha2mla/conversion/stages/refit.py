"""Output refit: after a layer's K/V are factored, re-fit v_up and o_proj to the source's attention output.

The low-rank step minimises the error of every key and value on its own; what the model needs is
the attention output. With the calibration inputs x of a layer, p_h the source's attention
probabilities of query head h, and D = kv_down (c_kv = D x), two least-squares problems have
closed forms:

* values: head h outputs Σ_j p_hij v_j. With v ≈ U_g c the attended latent is D z_hi, z_hi =
  Σ_j p_hij x_j, so for KV group g
      U_g = argmin Σ_{h∈g, i} ‖U D z_hi − W_v,g z_hi‖² = W_v,g C_g Dᵀ (D C_g Dᵀ)⁻¹,
      C_g = Σ_{h∈g, i} z_hi z_hiᵀ
  — values weighted by how much they are attended, not one token one vote (v_up's bias passes
  through unchanged: the probabilities sum to one);
* o_proj: with ô the MLA layer's head outputs (its own attention, the refit values) and o the
  source's on the same inputs, W_o' = argmin Σ_i ‖W_o' ô_i − W_o o_i‖² = W_o E[o ôᵀ] E[ô ôᵀ]⁻¹,
  which also absorbs part of the score error the partial RoPE and the key truncation leave.

Both are solved as ridge regressions towards the weights they replace, (A + λW)(G + λI)⁻¹ for
W A G⁻¹, λ = damping·mean diag(G): well-posed with few calibration tokens, and exact wherever the
factorisation already is (nothing dropped → the refit changes nothing). All sums in float64. The
o_proj fit (H·d_h inputs, one calibration text) needs a strong pull towards W_o, O_PROJ_DAMPING,
or it follows the calibration text and does not transfer to other text.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv

from .lowrank import DAMPING

O_PROJ_DAMPING = 0.1  # ridge strength of the o_proj fit


def ridge_fit(cross: torch.Tensor, gram: torch.Tensor, prior: torch.Tensor, damping: float = DAMPING) -> torch.Tensor:
    """argmin_W ‖W F − Y‖² + λ‖W − prior‖² = (cross + λ prior)(gram + λI)⁻¹, cross = Y Fᵀ, gram = F Fᵀ."""
    lam = damping * gram.diagonal().mean().clamp_min(1e-30)
    eye = torch.eye(gram.shape[0], dtype=gram.dtype)
    return torch.linalg.solve(gram + lam * eye, (cross + lam * prior).T).T  # gram is symmetric


def source_attention(attn, x: torch.Tensor, rope, causal: torch.Tensor, n_heads: int, n_kv: int,
                     head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The source layer's (probabilities [B, H, T, T], head outputs [B, T, H·d_h]) for inputs x [B, T, D]."""
    B, T, _ = x.shape
    q = attn.q_proj(x).view(B, T, n_heads, head_dim).transpose(1, 2)
    k = attn.k_proj(x).view(B, T, n_kv, head_dim).transpose(1, 2)
    v = attn.v_proj(x).view(B, T, n_kv, head_dim).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, *rope)
    groups = n_heads // n_kv
    scores = (q * head_dim**-0.5) @ repeat_kv(k, groups).transpose(-1, -2)  # scaled before: fewer passes
    probs = scores.add_(causal).softmax(-1)
    out = probs @ repeat_kv(v, groups)
    return probs, out.transpose(1, 2).reshape(B, T, -1)


def mla_head_outputs(mla_attn, x: torch.Tensor, position_ids: torch.Tensor, causal: torch.Tensor) -> torch.Tensor:
    """The MLA layer's head outputs (o_proj's input) [B, T, H·d_h], read with a forward pre-hook."""
    seen = {}
    hook = mla_attn.o_proj.register_forward_pre_hook(lambda module, args: seen.update(out=args[0]))
    try:
        mla_attn(x, position_ids.expand(x.shape[0], -1), causal)
    finally:
        hook.remove()
    return seen["out"]


@torch.no_grad()
def refit_outputs(src_attn, mla_attn, inputs: list[torch.Tensor], rope, causal: torch.Tensor,
                  position_ids: torch.Tensor, o_proj: bool = True) -> list[torch.Tensor]:
    """Re-fit mla_attn's v_up, then (`o_proj`) its o_proj, on this layer's calibration inputs (in place);
    return the re-fit attention's outputs on those inputs (the calibration's next step, computed once).

    The value sums are taken in the latent and value spaces (D z and W_v z, not z itself): the same
    W_v C_g Dᵀ and D C_g Dᵀ at a fraction of the cost. Attention in the model dtype, the sums in
    float64 (so a refit with nothing dropped stays exact).
    """
    n_heads, n_kv, d_h = mla_attn.n_heads, mla_attn.n_kv, mla_attn.head_dim
    groups = n_heads // n_kv
    width = len(range(mla_attn.kv_down.out_features)[mla_attn.v_latent])
    cross = torch.zeros(n_kv, d_h, width, dtype=torch.float64)
    gram = torch.zeros(n_kv, width, width, dtype=torch.float64)
    targets = []  # the source's head outputs, kept for the o_proj fit
    for x in inputs:
        B, T, _ = x.shape
        probs, target = source_attention(src_attn, x, rope, causal, n_heads, n_kv, d_h)
        targets.append(target)
        probs = probs.view(B, n_kv, groups, T, T)
        latent = mla_attn.kv_down(x)[..., mla_attn.v_latent]                        # c_kv, [B, T, L_v]
        values = F.linear(x, src_attn.v_proj.weight).view(B, T, n_kv, d_h).transpose(1, 2)  # W_v x
        attended_latent = (probs @ latent[:, None, None]).double()                   # D z, [B, n_kv, G, T, L_v]
        attended_values = (probs @ values[:, :, None]).double()                      # W_v z
        cross += torch.einsum("bgitd,bgitl->gdl", attended_values, attended_latent)
        gram += torch.einsum("bgitl,bgitm->glm", attended_latent, attended_latent)
    prior = mla_attn.v_up.weight.double().view(n_kv, d_h, -1)
    mla_attn.v_up.weight.copy_(torch.cat([ridge_fit(cross[g], gram[g], prior[g]) for g in range(n_kv)]))

    heads = [mla_head_outputs(mla_attn, x, position_ids, causal) for x in inputs]
    if o_proj:
        width = n_heads * d_h
        cross = torch.zeros(width, width, dtype=torch.float64)
        gram = torch.zeros_like(cross)
        for got, target in zip(heads, targets):
            target, got = target.reshape(-1, width).double(), got.reshape(-1, width).double()
            cross += target.T @ got
            gram += got.T @ got
        w_o = src_attn.o_proj.weight.double()
        mla_attn.o_proj.weight.copy_(ridge_fit(w_o @ cross, gram, w_o, O_PROJ_DAMPING))
    return [mla_attn.o_proj(h) for h in heads]
