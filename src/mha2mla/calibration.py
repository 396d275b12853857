"""One pass over calibration text → per-layer statistics of the attention inputs.

The model runs layer by layer on the calibration blocks (hidden states of all blocks kept,
statistics of one layer at a time); for each layer the conversion receives:

    cov     E[x xᵀ]  of the attention input x (after the layer's input RMSNorm), float64, [D, D]
    mean    E[x], [D]
    q_norm  mean over tokens of ‖q_{h,k}‖, the pre-RoPE norm of query head h's frequency pair k
            (dims k and k + d_h/2), [n_heads, d_h/2]
    k_norm  the same for each KV head, [n_kv, d_h/2]
    inputs  the attention inputs themselves, one [b, T, D] tensor per batch of blocks (for the
            output refit, which needs the source's attention on them; one layer's worth)
    hidden  the layer's input hidden states (before the norm), one [b, T, D] tensor per batch
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from tqdm.auto import tqdm


@dataclass
class LayerStats:
    cov: torch.Tensor
    mean: torch.Tensor
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    tokens: int
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


def source_layer_step(layer, causal: torch.Tensor, position_ids: torch.Tensor, rope):
    """hidden → hidden through one source decoder layer (additive causal mask, positions [1, T])."""

    def step(h: torch.Tensor) -> torch.Tensor:
        out = layer(h, attention_mask=causal, position_ids=position_ids.expand(h.shape[0], -1),
                    position_embeddings=rope)
        return out[0] if isinstance(out, tuple) else out  # older transformers return a tuple

    return step


@torch.no_grad()
def calibrate(model, blocks: torch.Tensor, on_layer: Callable, batch_size: int = 4, progress: bool = True) -> None:
    """Run the calibration blocks through the model one layer at a time.

    For layer i, `on_layer(i, stats)` receives the LayerStats of that layer's inputs and returns the
    next layer's input hidden states (one tensor per batch) — those of the converted layer, so every
    later layer is calibrated on the activations it will really see (errors of earlier layers
    included), or of the source layer (`source_layer_step`) to follow the source model.
    """
    inner = model.model
    config = model.config
    hidden_size = config.hidden_size
    head_dim = getattr(config, "head_dim", None) or hidden_size // config.num_attention_heads
    hidden = [inner.embed_tokens(blocks[i:i + batch_size]) for i in range(0, len(blocks), batch_size)]
    layers = tqdm(inner.layers, desc="calibrating + converting layers", disable=not progress)
    for idx, layer in enumerate(layers):
        stats = {"xx": torch.zeros(hidden_size, hidden_size, dtype=torch.float64),
                 "x": torch.zeros(hidden_size, dtype=torch.float64),
                 "q": torch.zeros(config.num_attention_heads, head_dim // 2, dtype=torch.float64),
                 "k": torch.zeros(config.num_key_value_heads, head_dim // 2, dtype=torch.float64), "n": 0}
        inputs = [layer.input_layernorm(h) for h in hidden]
        for x in inputs:
            accumulate(layer.self_attn, x.reshape(-1, hidden_size), stats)
        n = stats["n"]
        hidden = on_layer(idx, LayerStats(cov=stats["xx"] / n, mean=stats["x"] / n, q_norm=stats["q"] / n,
                                          k_norm=stats["k"] / n, tokens=n, inputs=inputs, hidden=hidden))
