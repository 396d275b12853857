"""RoPE concentration: a cross-head PCA per frequency (group), keeping RoPE on the top components.

For one frequency pair k, an orthogonal mix U of the n_kv heads' pairs commutes with RoPE (RoPE
rotates each (re, im) plane by the same angle; U acts across heads). So the keys can be rotated per
frequency, k'_c = Σ_g U[c, g] k_{g,k}, and the queries by the same coefficients, without changing any
score:  q_h · k_g = Σ_c (U[c, g(h)] q_{h,k}) · k'_c.  PCA of the keys (re and im parts as samples)
concentrates positional energy in few components; RoPE is kept on the top ones, as one RoPE key shared
by all query heads (DeepSeek's k_pe), and the rest of each key, (I − P) k with P the projection on
the kept components, becomes position-free and joins the low-rank latent. That split is exact.

Frequency folding (F > 1) treats F adjacent frequencies as one: the PCA runs over n_kv·F pair
vectors, concentrating further. The kept components are spread over all frequency groups, rank by
rank: every group's top component (largest key eigenvalue) first, then every group's second, and
so on, so each group's strongest directions keep RoPE and leave the position-free remainder that
the latent has to compress. Within a group, the ρ-th of its q kept components rotates with the
group's frequency ρ·⌊F/q⌋ (the first, the highest, for the top one) — an approximation, exact for
F = 1. This is TransMLA's RoRoPE + FreqFold allocation.

Within a rank, groups are ordered by the score change that dropping their RoPE would cause: a pair
rotated by θ·Δ between positions s and t = s + Δ contributes q'ᵀ R(θΔ) k', and without RoPE q'ᵀ k';
with |R(θΔ) − I|² = 2(1 − cos θΔ), the expected change scales as
    w(θ) · Σ_h RMS(q'_{h,c}) · RMS(k'_c),   w(θ) = sqrt(mean_{Δ=1…L} 2(1 − cos θΔ)),
the q·k energy of the component weighted by how much its frequency actually rotates over the
calibration length L (a slow frequency barely rotates, so it loses little by becoming position-free).
Energies come from the calibration covariance C (q, k linear in x: E[q qᵀ] = W C Wᵀ + bias terms).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch


@dataclass
class RopeBasis:
    """The kept components: rows of R_re / R_im map a full key (n_kv·d_h, pre-RoPE) to its RoPE part."""
    r_re: torch.Tensor      # [p, n_kv·d_h]
    r_im: torch.Tensor      # [p, n_kv·d_h]
    freq_index: list[int]   # frequency (pair index) each kept component rotates with

    def projection(self) -> torch.Tensor:
        """P = R_reᵀ R_re + R_imᵀ R_im, the orthogonal projection on the kept components."""
        return self.r_re.T @ self.r_re + self.r_im.T @ self.r_im


def group_dims(group: list[int], heads: list[int], head_dim: int) -> tuple[list[int], list[int]]:
    """(re dims, im dims) of the pairs in `group` for the given heads, head-major: index (head, pair)."""
    half = head_dim // 2
    re = [h * head_dim + k for h in heads for k in group]
    return re, [d + half for d in re]


def rotation_weight(theta: float, max_distance: int) -> float:
    """w(θ) = sqrt(mean over Δ = 1 … L of 2(1 − cos θΔ))."""
    deltas = torch.arange(1, max_distance + 1, dtype=torch.float64)
    return float((2 * (1 - torch.cos(theta * deltas))).mean().sqrt())


def pca_basis(e_kk: torch.Tensor, e_qq: torch.Tensor, n_heads: int, n_kv: int, head_dim: int,
              n_pairs: int, fold: int, inv_freq: list[float], max_distance: int) -> RopeBasis:
    """Kept RoPE components of one layer from key and query second moments (pre-RoPE)."""
    half = head_dim // 2
    kv_heads, groups = list(range(n_kv)), n_heads // n_kv
    candidates = []  # (rank in its group, −score, fold group, component vector over (g, k) pairs)
    for start in range(0, half, fold):
        group = list(range(start, min(start + fold, half)))
        re, im = group_dims(group, kv_heads, head_dim)
        sigma = e_kk[re][:, re] + e_kk[im][:, im]
        eigvals, eigvecs = torch.linalg.eigh(sigma)  # ascending
        weight = rotation_weight(inv_freq[group[len(group) // 2]], max_distance)
        for rank, c in enumerate(reversed(range(len(re)))):
            u = eigvecs[:, c].view(n_kv, len(group))
            q_energy = 0.0
            for h in range(n_heads):
                q_re, q_im = group_dims(group, [h], head_dim)
                s_q = e_qq[q_re][:, q_re] + e_qq[q_im][:, q_im]
                ug = u[h // groups]
                q_energy += float(ug @ s_q @ ug).__abs__() ** 0.5
            candidates.append((rank, -weight * q_energy * float(eigvals[c].clamp_min(0)) ** 0.5, group, u))
    candidates.sort(key=lambda t: t[:2])
    kept = candidates[:n_pairs]
    per_group = Counter(group[0] for _, _, group, _ in kept)
    r_re = torch.zeros(n_pairs, n_kv * head_dim, dtype=torch.float64)
    r_im = torch.zeros_like(r_re)
    freq_index = []
    for j, (rank, _, group, u) in enumerate(kept):
        re, im = group_dims(group, kv_heads, head_dim)
        r_re[j, re] = u.reshape(-1)
        r_im[j, im] = u.reshape(-1)
        freq_index.append(group[rank * (len(group) // per_group[group[0]])])
    return RopeBasis(r_re, r_im, freq_index)


def query_rows(basis: RopeBasis, w_q_head: torch.Tensor, kv_head: int, head_dim: int) -> torch.Tensor:
    """RoPE rows [2p, ·] of one query head (in KV group `kv_head`): [R_re,g W_q,h ; R_im,g W_q,h]."""
    cols = slice(kv_head * head_dim, (kv_head + 1) * head_dim)
    w = w_q_head.double()
    return torch.cat([basis.r_re[:, cols] @ w, basis.r_im[:, cols] @ w])
