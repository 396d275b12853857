"""Low-rank factorisation of the position-free keys and the values into a shared latent.

Stack the NoPE rows of W_k over all KV heads with W_v: M = [W_k_nope; W_v] ∈ R^{R×D}. A rank-ℓ
factorisation M ≈ U·W_down (ℓ = n_kv·d_kv) gives c_kv = W_down x, k_nope = U_k c_kv, v = U_v c_kv.

* weight (the paper's):   M = P Σ Qᵀ,  W_down = Q_ℓᵀ,  U = P_ℓ Σ_ℓ.
* activation-aware:       with C = E[x xᵀ] = L Lᵀ (Cholesky, damped), factor M L = P Σ Qᵀ and take
                          W_down = Q_ℓᵀ L⁻¹, U = P_ℓ Σ_ℓ. Then ‖(M − U W_down) L‖_F, i.e. the
                          error on real activations E‖(M − U W_down) x‖², is minimal for rank ℓ.

* output-aware ("output"): also weight the rows by what their error costs downstream. A key error
  Δk reaches the scores as q·Δk/√d_h, so the NoPE key rows of group g are weighted by
  S_k = chol(Σ_{h∈g} E[q_h q_hᵀ]/d_h)ᵀ (query second moments on the NoPE dims, from C); a value
  error reaches the output through o_proj, so value rows are weighted by S_v = chol(Σ_{h∈g}
  W_o,hᵀ W_o,h)ᵀ · √β, β balancing the two. Then minimise ‖S (M − U W_down) L‖_F.

* query-aware ("query"): the key rows weighted by S_k as above (the closed-form best rank-ℓ
  approximation of the scores q·k on the calibration inputs, KQ-SVD's criterion), the value rows as
  activation-aware, and S_k scaled so that ‖S_k M_k L‖_F = ‖M_k L‖_F: the keys keep the share of the
  joint factorisation they have in the activation-aware one (S_k's own scale, set by the queries,
  would otherwise decide how much of the latent goes to keys rather than values).

`joint` factors M at rank ℓ; `split` factors W_k_nope and W_v separately at ℓ/2 each (their
latents concatenated). All algebra in float64.
"""

from __future__ import annotations

import torch

from ...errors import UserError

DAMPING = 1e-4
MAX_DAMPING = 1e-1  # cholesky_factor raises the damping tenfold at a time up to this before giving up


def cholesky_factor(cov: torch.Tensor, damping: float = DAMPING) -> torch.Tensor:
    """Lower-triangular L with L Lᵀ = cov + λ·mean(diag)·I, λ = damping, or tenfold more (up to
    MAX_DAMPING) where rounding leaves the damped matrix not positive-definite (a second moment of
    fewer tokens than dimensions is singular; the damping alone makes it definite in exact arithmetic)."""
    cov = cov.double()
    if not torch.isfinite(cov).all():
        raise UserError("the calibration statistics are not finite (the forward pass overflowed): convert with "
                        "--dtype float32")
    eye = torch.eye(cov.shape[0], dtype=torch.float64)
    scale = cov.diagonal().mean()
    while True:
        chol, info = torch.linalg.cholesky_ex(cov + damping * scale * eye)
        if info == 0:
            return chol
        if damping * 10 > MAX_DAMPING:
            raise UserError(f"the calibration statistics are not positive-definite even with damping {damping:g}: "
                            f"add calibration text (--calib-size)")
        damping *= 10


def factorize(weight: torch.Tensor, rank: int, chol: torch.Tensor | None = None,
              row_chol: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(up [R, rank], down [rank, D]) with up @ down ≈ weight.

    Activation-aware when `chol` (L) is given; with `row_chol` (S, upper-triangular) the error is
    also weighted on the output side: minimise ‖S (W − up·down) L‖_F via the SVD of S W L.
    """
    w = weight.double()
    target = w @ chol if chol is not None else w
    if row_chol is not None:
        target = row_chol @ target
    u, s, vh = torch.linalg.svd(target, full_matrices=False)
    up = u[:, :rank] * s[:rank]
    if row_chol is not None:
        up = torch.linalg.solve_triangular(row_chol, up, upper=True)
    down = vh[:rank]
    if chol is not None:
        down = torch.linalg.solve_triangular(chol, down, upper=False, left=False)  # Q_ℓᵀ L⁻¹
    return up, down


def joint_factors(k_nope: torch.Tensor, v: torch.Tensor, rank: int, svd: str, chol: torch.Tensor | None,
                  k_weight: torch.Tensor | None = None, v_weight: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(kv_down [rank, D], k_up [R_k, ·], v_up [R_v, ·]) for `joint` or `split` factorisation.

    `k_weight` / `v_weight`: optional upper-triangular output-side weights of the key / value rows.
    """
    if svd == "joint":
        row = torch.block_diag(k_weight, v_weight) if k_weight is not None else None
        up, down = factorize(torch.cat([k_nope, v]), rank, chol, row)
        return down, up[: k_nope.shape[0]], up[k_nope.shape[0]:]
    k_up, k_down = factorize(k_nope, rank // 2, chol, k_weight)
    v_up, v_down = factorize(v, rank - rank // 2, chol, v_weight)
    return torch.cat([k_down, v_down]), k_up, v_up


def upper_factor(gram: torch.Tensor, damping: float = DAMPING) -> torch.Tensor:
    """Upper-triangular S with SᵀS = gram + damping·mean(diag)·I."""
    return cholesky_factor(gram, damping).T


def second_moment(weight: torch.Tensor, bias: torch.Tensor | None, cov: torch.Tensor, mean: torch.Tensor):
    """E[y yᵀ] for y = W x + b given E[x xᵀ] = cov and E[x] = mean (float64)."""
    w = weight.double()
    out = w @ cov @ w.T
    if bias is not None:
        wm, b = w @ mean, bias.double()
        out = out + torch.outer(wm, b) + torch.outer(b, wm) + torch.outer(b, b)
    return out


def key_row_weight(w_q_nope: list[torch.Tensor], b_q_nope: list[torch.Tensor | None], cov: torch.Tensor,
                   mean: torch.Tensor, head_dim: int) -> torch.Tensor:
    """S_k for one KV group from its query heads' NoPE rows: Σ_h E[q_h q_hᵀ] / d_h."""
    gram = sum(second_moment(w, b, cov, mean) for w, b in zip(w_q_nope, b_q_nope))
    return upper_factor(gram / head_dim)


def same_energy(row_weight: torch.Tensor, rows: torch.Tensor, chol: torch.Tensor) -> float:
    """The scale c with ‖c·S W L‖_F = ‖W L‖_F."""
    plain = rows.double() @ chol
    return float(plain.norm() / (row_weight @ plain).norm())


def value_row_weight(w_o_heads: list[torch.Tensor]) -> torch.Tensor:
    """S_v for one KV group from the o_proj columns of its query heads: Σ_h W_o,hᵀ W_o,h."""
    return upper_factor(sum(w.double().T @ w.double() for w in w_o_heads))


def output_weights(src_attn, nope, stats, groups: int, d_h: int, kv_balance: float):
    """Block-diagonal output-side weights (S_k, S_v) of the key rows (per KV group, at the head dims
    `nope`) and the value rows of a source attention layer, from its calibration statistics."""
    w_q = src_attn.q_proj.weight.view(-1, d_h, src_attn.q_proj.weight.shape[-1])
    b_q = src_attn.q_proj.bias.view(-1, d_h) if src_attn.q_proj.bias is not None else None
    w_o = src_attn.o_proj.weight.view(src_attn.o_proj.weight.shape[0], -1, d_h)
    s_k, s_v = [], []
    for g, dims in enumerate(nope):
        heads = range(g * groups, (g + 1) * groups)
        s_k.append(key_row_weight([w_q[h, dims] for h in heads],
                                  [b_q[h, dims] if b_q is not None else None for h in heads],
                                  stats.cov, stats.mean, d_h))
        s_v.append(value_row_weight([w_o[:, h] for h in heads]) * kv_balance**0.5)
    return torch.block_diag(*s_k), torch.block_diag(*s_v)


def row_weights(src_attn, position_free, stats, chol, weighting: str, kv_balance: float, groups: int,
                d_h: int):
    """Output-side weights (S_k, S_v) of the key and value rows for `weighting` ("output", "query", or
    the identity with the values weighted √β), or (None, None) where both are the identity.
    `position_free`: the key rows (rope.layout.PositionFree: weight and, per KV group, its head dims)."""
    n_k, n_v = position_free.weight.shape[0], src_attn.v_proj.weight.shape[0]
    if weighting == "output":
        return output_weights(src_attn, position_free.dims, stats, groups, d_h, kv_balance)
    values = torch.eye(n_v, dtype=torch.float64) * kv_balance**0.5  # √β against the keys
    if weighting == "query":
        s_k = output_weights(src_attn, position_free.dims, stats, groups, d_h, kv_balance)[0]
        return s_k * same_energy(s_k, position_free.weight, chol), values
    return (torch.eye(n_k, dtype=torch.float64), values) if kv_balance != 1.0 else (None, None)


@torch.no_grad()
def fill_kv_factors(src, dst, position_free, stats, latent: int, svd: str, weighting: str, kv_balance: float) -> None:
    """The low-rank stage of a layer: the position-free key rows and W_v factored into dst's kv_down,
    k_up and v_up (weighted by the calibration activations unless `weighting` is "weight"); o_proj and
    the biases copied from the source attention `src`."""
    w_k_nope, b_k_nope, _ = position_free
    chol = cholesky_factor(stats.cov) if weighting != "weight" else None
    k_weight, v_weight = row_weights(src, position_free, stats, chol, weighting, kv_balance, dst.n_heads // dst.n_kv,
                                     dst.head_dim)
    down, k_up, v_up = joint_factors(w_k_nope, src.v_proj.weight, latent, svd, chol, k_weight, v_weight)
    dst.kv_down.weight.copy_(down)
    dst.k_up.weight.copy_(k_up)
    dst.v_up.weight.copy_(v_up)
    dst.o_proj.weight.copy_(src.o_proj.weight)
    if b_k_nope is not None:
        dst.k_up.bias.copy_(b_k_nope)
        dst.v_up.bias.copy_(src.v_proj.bias)
    if src.o_proj.bias is not None:
        dst.o_proj.bias.copy_(src.o_proj.bias)
