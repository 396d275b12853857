"""Calibration: one layer's attention inputs on the calibration text, and their statistics.

The conversion runs the calibration blocks through the model one layer at a time (the hidden states
of all blocks kept, one layer's weights and statistics at a time); for each layer it receives:

    cov     E[x xᵀ]  of the attention input x (after the layer's input RMSNorm), float64, [D, D]
    mean    E[x], [D]
    q_norm  mean over tokens of ‖q_{h,k}‖, the pre-RoPE norm of query head h's frequency pair k
            (dims k and k + d_h/2), [n_heads, d_h/2]
    k_norm  the same for each KV head, [n_kv, d_h/2]
    inputs  the attention inputs themselves, one [b, T, D] tensor per batch of blocks (for the
            output refit, which needs the source's attention on them; one layer's worth)
    hidden  the layer's input hidden states (before the norm), one [b, T, D] tensor per batch

A converted attention is compared with the source's on these inputs by its relative output error
(`attention_error`),  e = Σ ‖o_MLA − o_src‖² / Σ ‖o_src‖².
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Calibration:
    """One layer's calibration: its attention inputs and hidden states, and their statistics (above)."""
    cov: torch.Tensor
    mean: torch.Tensor
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    inputs: list[torch.Tensor]
    hidden: list[torch.Tensor]


def pair_norms(states: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Σ over tokens of the norm of every frequency pair: states [N, n_heads·d_h] → [n_heads, d_h/2]."""
    per_head = states.double().view(states.shape[0], n_heads, 2, -1)  # [N, heads, (re, im), d_h/2]
    return per_head.pow(2).sum(2).sqrt().sum(0)


def accumulate(attn, x: torch.Tensor, stats: dict) -> None:
    """Add one batch of attention inputs x [N, D] to the running sums."""
    config = attn.config
    stats["xx"] += (x.T @ x).double()  # per-batch product in the model dtype, running sum in float64
    stats["x"] += x.double().sum(0)
    stats["q"] += pair_norms(attn.q_proj(x), config.num_attention_heads)
    stats["k"] += pair_norms(attn.k_proj(x), config.num_key_value_heads)
    stats["n"] += x.shape[0]


@torch.no_grad()
def calibrate(layer, hidden: list[torch.Tensor], config) -> Calibration:
    """Statistics of one decoder layer's attention inputs for its input hidden states (one [b, T, D]
    tensor per batch of calibration blocks)."""
    hidden_size = config.hidden_size
    head_dim = layer.self_attn.head_dim
    stats = {"xx": torch.zeros(hidden_size, hidden_size, dtype=torch.float64),
             "x": torch.zeros(hidden_size, dtype=torch.float64),
             "q": torch.zeros(config.num_attention_heads, head_dim // 2, dtype=torch.float64),
             "k": torch.zeros(config.num_key_value_heads, head_dim // 2, dtype=torch.float64), "n": 0}
    inputs = [layer.input_layernorm(h) for h in hidden]
    for x in inputs:
        accumulate(layer.self_attn, x.reshape(-1, hidden_size), stats)
    n = stats["n"]
    return Calibration(cov=stats["xx"] / n, mean=stats["x"] / n, q_norm=stats["q"] / n, k_norm=stats["k"] / n,
                      inputs=inputs, hidden=hidden)


@torch.no_grad()
def attention_error(mla_attn, inputs: list[torch.Tensor], targets: list[torch.Tensor], causal: torch.Tensor,
                    position_ids: torch.Tensor) -> float:
    """Relative squared error of an MLA attention's output against the source's (`targets`) on a layer's
    calibration inputs."""
    err = total = 0.0
    for x, target in zip(inputs, targets):
        got = mla_attn(x, position_ids.expand(x.shape[0], -1), causal)
        err += (got - target).double().pow(2).sum().item()
        total += target.double().pow(2).sum().item()
    return err / total
