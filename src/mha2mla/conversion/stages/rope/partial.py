"""Partial RoPE: which r of the d_h/2 frequency pairs of each head keep their rotary embedding.

Pair k is dims (k, k + d_h/2) (rotate_half layout) with frequency inv_freq[k], decreasing in k.
Strategies (the MHA2MLA paper's), each returning kept pair indices [n_kv, r], sorted:

    high      the r highest frequencies: 0 … r−1
    low       the r lowest frequencies: d_h/2 − r … d_h/2 − 1
    uniform   every (d_h/2)/r-th pair, starting at 0 (r must divide d_h/2)
    2-norm    per KV head g, the r pairs with the largest Σ_{h ∈ g} mean‖q_{h,k}‖ · mean‖k_{g,k}‖,
              measured before RoPE on calibration text (query heads share their group's choice)

The other pairs become position-free ("NoPE") and join the low-rank latent.
"""

from __future__ import annotations

import torch

from ....errors import UserError
from ....recipes import PER_HEAD_STRATEGIES


def check_rope_pairs(rope_pairs: int, head_dim: int, strategy: str) -> None:
    half = head_dim // 2
    if not 1 <= rope_pairs <= half:
        raise UserError(f"--rope-pairs {rope_pairs} is out of range: use 1 … {half} (d_h/2 for d_h={head_dim})")
    if strategy == "uniform" and half % rope_pairs:
        raise UserError(f"the uniform rope strategy needs --rope-pairs dividing {half}; {rope_pairs} does not")
    if strategy not in PER_HEAD_STRATEGIES:
        raise UserError(f"unknown rope strategy {strategy}: use one of {', '.join(PER_HEAD_STRATEGIES)}")


def two_norm_scores(q_norm: torch.Tensor, k_norm: torch.Tensor) -> torch.Tensor:
    """[n_heads, d_h/2] and [n_kv, d_h/2] → per-group score [n_kv, d_h/2]."""
    n_kv = k_norm.shape[0]
    q_group = q_norm.view(n_kv, -1, q_norm.shape[-1]).sum(1)
    return q_group * k_norm


def select_pairs(strategy: str, rope_pairs: int, head_dim: int, n_kv: int,
                 q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None) -> list[list[int]]:
    """Kept pair indices per KV head, [n_kv][rope_pairs], each list sorted ascending."""
    half = head_dim // 2
    if strategy == "high":
        kept = [list(range(rope_pairs))] * n_kv
    elif strategy == "low":
        kept = [list(range(half - rope_pairs, half))] * n_kv
    elif strategy == "uniform":
        kept = [list(range(0, half, half // rope_pairs))] * n_kv
    else:
        scores = two_norm_scores(q_norm, k_norm)
        kept = [sorted(scores[g].topk(rope_pairs).indices.tolist()) for g in range(n_kv)]
    return [list(k) for k in kept]


def split_dims(kept: list[int], head_dim: int) -> tuple[list[int], list[int]]:
    """(nope dims, rope dims) of one head: rope = kept pairs' (re…, im…), nope = the others'."""
    half = head_dim // 2
    dropped = [k for k in range(half) if k not in set(kept)]
    return dropped + [k + half for k in dropped], list(kept) + [k + half for k in kept]
