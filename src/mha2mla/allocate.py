"""Global allocation: one total cache budget, each layer its own RoPE dims and latent width.

The uniform conversion gives every layer the same split (r RoPE pairs, latent ℓ). Layers differ in
what a split costs them, so the same total can be spent better. The criterion is measured: layer i
converted at split (r, ℓ) (RoPE layout and factorisation, as the conversion does them, before any
refit) attends on the source's own calibration hidden states, and its attention output misses the
source's by the relative error

    e_i(r, ℓ) = Σ ‖o_MLA − o_src‖² / Σ ‖o_src‖²,

the per-layer split's objective (attention_error), so every layer counts alike, as a relative
error; measured against the residual stream instead (Σ ‖h_i‖² below the line), layers whose attention
adds little were starved (docs/experiments.md). Each layer's
curve is measured for every r the budget offers, at widths GRID × that r's uniform latent (within
[1, the layout's largest]), and taken linear between them. The allocation minimises Σ_i e_i(r_i, ℓ_i)
subject to Σ_i (RoPE values(r_i) + ℓ_i) = n_layers × budget exactly, by dynamic programming over the
total: the global optimum of the interpolated curves, so the mean cache per layer is exactly the
budget. Greedy marginal gain per value would equal it only for convex curves, which RoPE steps are not.

The curves come from one streaming pass over the source (`error_curves`: one source layer at a time,
each split converted by the caller's `build`), before the conversion proper.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .calibration import layer_stats, source_layer_step, source_pass
from .weights import load_module

GRID = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0)  # widths measured, as multiples of the uniform latent


def width_grid(uniform: int, cap: int) -> list[int]:
    """The latent widths measured around a uniform width: GRID × uniform, within [1, cap]."""
    return sorted({min(cap, max(1, round(uniform * f))) for f in GRID})


def interpolate(points: dict[int, float]) -> dict[int, float]:
    """Every integer width from the smallest measured to the largest, linear between measured ones."""
    widths = sorted(points)
    curve = {widths[0]: points[widths[0]]}
    for a, b in zip(widths, widths[1:]):
        for w in range(a + 1, b + 1):
            curve[w] = points[a] + (points[b] - points[a]) * (w - a) / (b - a)
    return curve


def allocate(curves: list[dict[tuple[int, int], float]], rope_values: dict[int, int], total: int
             ) -> list[tuple[int, int]]:
    """Per layer the split (r, ℓ) minimising the summed error with Σ (rope_values[r] + ℓ) = total.

    `curves[i]`: layer i's error at measured splits; between the measured widths of one r it is
    interpolated. Dynamic programming over the values spent so far: best[c] is the least error of
    the layers so far at exactly c values."""
    inf = float("inf")
    best = torch.full((total + 1,), inf, dtype=torch.float64)
    best[0] = 0.0
    choices = []
    for curve in curves:
        options = []
        for r in sorted({r for r, _ in curve}):
            for width, error in interpolate({w: e for (s, w), e in curve.items() if s == r}).items():
                options.append((r, width, rope_values[r] + width, error))
        step = torch.full_like(best, inf)
        pick = torch.full((total + 1,), -1, dtype=torch.long)
        for k, (_, _, cost, error) in enumerate(options):
            if cost > total:
                continue
            candidate = best[:total + 1 - cost] + error
            better = candidate < step[cost:]
            step[cost:] = torch.where(better, candidate, step[cost:])
            pick[cost:][better] = k
        best = step
        choices.append((options, pick))
    if best[total] == inf:
        raise ValueError(f"no per-layer splits reach exactly {total} values")
    splits, spent = [], total
    for options, pick in reversed(choices):
        r, width, cost, _ = options[int(pick[spent])]
        splits.append((r, width))
        spent -= cost
    return splits[::-1]


@torch.no_grad()
def attention_error(mla_attn, inputs: list[torch.Tensor], targets: list[torch.Tensor], causal: torch.Tensor,
                    position_ids: torch.Tensor) -> float:
    """Relative squared error Σ‖o_mla − o_src‖² / Σ‖o_src‖² of the MLA attention block's output against
    the source's (`targets`) on the layer's calibration inputs: the per-layer split's objective."""
    err = total = 0.0
    for x, target in zip(inputs, targets):
        got = mla_attn(x, position_ids.expand(x.shape[0], -1), causal)
        err += (got - target).double().pow(2).sum().item()
        total += target.double().pow(2).sum().item()
    return err / total


@torch.no_grad()
def error_curves(src, blocks: torch.Tensor, layout, splits: list[tuple[int, int]], build: Callable,
                 dtype: torch.dtype, batch: int) -> list[dict[tuple[int, int], float]]:
    """Each layer's e_i(r, ℓ) for every r of `splits` (the budget's (r, uniform latent) splits) at the
    widths of width_grid, measured on the source's own hidden states (streaming: one source layer at a
    time, `batch` blocks per pass). `build(idx, src_attn, stats, measured, (r, ℓ))` → the layer's MLA
    attention converted at that split."""
    config, reader = src.config, src.reader
    blocks = blocks.to(torch.get_default_device())
    run = source_pass(config, blocks.shape[1], dtype)
    embed = load_module(reader, run.skeleton.model.embed_tokens, "model.embed_tokens.", reader.dtype)
    hidden = [embed(blocks[i:i + batch]).to(dtype) for i in range(0, len(blocks), batch)]
    del embed
    curves = []
    for idx in range(config.num_hidden_layers):
        layer = load_module(reader, run.skeleton.model.layers[idx], f"model.layers.{idx}.", dtype)
        stats = layer_stats(layer, hidden, config)
        measured = layout.measure(layer.self_attn, stats)
        targets = [layer.self_attn(x, position_embeddings=run.rope, attention_mask=run.causal)[0]
                   for x in stats.inputs]
        curve = {}
        for r, uniform in splits:
            for width in width_grid(uniform, layout.max_latent(r)):
                attn = build(idx, layer.self_attn, stats, measured, (r, width))
                curve[r, width] = attention_error(attn, stats.inputs, targets, run.causal, run.position_ids)
        curves.append(curve)
        step = source_layer_step(layer, run.causal, run.position_ids, run.rope)
        hidden = [step(h) for h in hidden]
    return curves
