"""Global latent allocation: one total cache budget, latent widths that differ by layer.

The uniform conversion gives every layer the same latent width ℓ. Layers differ in how much of their
keys and values a rank-ℓ latent keeps, so the same total can be spent better. The factorisation
(lowrank) of layer i's M_i = [W_k_nope; W_v] at rank ℓ leaves the error

    e_i(ℓ) = Σ_{j > ℓ} σ_ij² / Σ_j σ_ij²,     σ_ij the singular values of S_i M_i L_i (C_i = L_i L_iᵀ),

the share of the layer's key and value energy on its calibration activations that the latent drops,
weighted as the factorisation weights it (S_i: the query-aware or output-aware row weights, or none).
Each e_i is convex and decreasing in ℓ, so the greedy allocation of one latent dim at a time to the
layer whose error drops most — the largest remaining normalised σ_ij² — is the global top-(n·ℓ) of
all layers' normalised squared singular values (CARE's global criterion on this error), with every
layer kept within [1, its available rank]. The total, and so the mean cache per layer, is exactly
the uniform one's; the RoPE part (r pairs) stays the same in every layer.

The spectra come from one streaming pass over the source (`layer_spectra`: each layer's statistics on
the source's own hidden states, the RoPE layout's position-free rows at r, one SVD), before the
conversion proper.
"""

from __future__ import annotations

import torch

from .calibration import layer_stats, source_layer_step, source_pass
from .lowrank import cholesky_factor, row_weights
from .weights import load_module


def normalised_spectrum(position_free_rows: torch.Tensor, values: torch.Tensor, chol: torch.Tensor | None,
                        k_weight: torch.Tensor | None = None, v_weight: torch.Tensor | None = None) -> torch.Tensor:
    """σ_j² / Σ σ² of S [W_k_nope; W_v] L (the matrix the factorisation truncates), descending."""
    target = torch.cat([position_free_rows.double(), values.double()])
    if chol is not None:
        target = target @ chol
    if k_weight is not None:
        target = torch.block_diag(k_weight, v_weight) @ target
    s = torch.linalg.svdvals(target)
    energy = s.pow(2)
    return energy / energy.sum()


def allocate_widths(spectra: list[torch.Tensor], total: int, caps: list[int]) -> list[int]:
    """Latent width per layer: the `total` largest normalised squared singular values over all layers,
    at least 1 and at most caps[i] in layer i."""
    n = len(spectra)
    if not n <= total <= sum(caps):
        raise ValueError(f"cannot spread {total} latent dims over {n} layers of at most {caps}")
    widths = [1] * n
    gains = torch.cat([s[1:cap] for s, cap in zip(spectra, caps)])
    owner = torch.cat([torch.full((max(cap - 1, 0),), i) for i, cap in enumerate(caps)])
    for i in owner[gains.argsort(descending=True)[: total - n]].tolist():
        widths[i] += 1
    return widths


@torch.no_grad()
def layer_spectra(src, blocks: torch.Tensor, layout, rope_pairs: int, init: str, kv_balance: float,
                  dtype: torch.dtype, batch: int) -> list[torch.Tensor]:
    """Each layer's normalised spectrum for a latent after the RoPE layout at `rope_pairs`, weighted as
    the factorisation `init` weights it (lowrank), measured on the source's own hidden states
    (streaming: one source layer at a time, `batch` blocks per pass)."""
    config, reader = src.config, src.reader
    blocks = blocks.to(torch.get_default_device())
    seq = blocks.shape[1]
    run = source_pass(config, seq, dtype)
    skeleton, inv_freq = run.skeleton, run.inv_freq
    embed = load_module(reader, skeleton.model.embed_tokens, "model.embed_tokens.", reader.dtype)
    hidden = [embed(blocks[i:i + batch]).to(dtype) for i in range(0, len(blocks), batch)]
    del embed
    spectra = []
    for idx in range(config.num_hidden_layers):
        layer = load_module(reader, skeleton.model.layers[idx], f"model.layers.{idx}.", dtype)
        stats = layer_stats(layer, hidden, config)
        choice = layout.choose(layout.measure(layer.self_attn, stats), rope_pairs, inv_freq, seq)
        attn = layer.self_attn
        position_free = layout.position_free(attn, choice)
        chol = cholesky_factor(stats.cov) if init != "weight" else None
        weights = row_weights(attn, position_free, stats, chol, init, kv_balance, config.num_attention_heads //
                              config.num_key_value_heads, attn.head_dim)
        spectra.append(normalised_spectrum(position_free.weight, attn.v_proj.weight, chol, *weights))
        step = source_layer_step(layer, run.causal, run.position_ids, run.rope)
        hidden = [step(h) for h in hidden]
    return spectra
