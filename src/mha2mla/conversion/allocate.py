"""Global allocation: one total cache budget, each layer its own RoPE dims and latent width.

The uniform conversion gives every layer the same split (r RoPE pairs, latent ℓ). Layers differ in
what a split costs them, so the same total can be spent better. The criterion is measured: layer i
converted at split (r, ℓ) (RoPE layout and factorisation, as the conversion does them, before any
refit) attends on the source's own calibration hidden states, and its attention output misses the
source's by the relative error

    e_i(r, ℓ) = Σ ‖o_MLA − o_src‖² / Σ ‖o_src‖²,

the per-layer split's objective (calibration.attention_error), so every layer counts alike, as a relative
error; measured against the residual stream instead (Σ ‖h_i‖² below the line), layers whose attention
adds little were starved (docs/experiments.md). Each layer's
curve is measured for every r the budget offers, at widths GRID × that r's uniform latent (within
[1, the layout's largest]), and taken linear between them. The allocation minimises Σ_i e_i(r_i, ℓ_i)
subject to Σ_i (RoPE values(r_i) + ℓ_i) = n_layers × budget exactly, by dynamic programming over the
total: the global optimum of the interpolated curves, so the mean cache per layer is exactly the
budget. Greedy marginal gain per value would equal it only for convex curves, which RoPE steps are not.

The curves come from one streaming pass over the source per K/V balance (`error_curves`: one source
layer at a time, each split converted as the conversion converts it), before the conversion proper.
"""

from __future__ import annotations

import torch

from .attention import convert_attention, source_outputs
from .plan import CALIB_BATCH, Candidate, Plan, Split
from .stages.calibration import attention_error, calibrate
from .stream import LayerStream

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
def error_curves(src, plan: Plan, calib: torch.Tensor, splits: list[Split], kv_balance: float,
                 dtype: torch.dtype) -> list[dict[Split, float]]:
    """Each layer's e_i(r, ℓ) for every r of `splits` (the budget's (r, uniform latent) splits) at the
    widths of width_grid, measured on the source's own hidden states, streaming one source layer at a
    time."""
    stream = LayerStream.open(src.reader, calib.shape[1], dtype)
    rope = stream.source_rope()
    hidden = stream.embed(stream.load("model.embed_tokens", src.reader.dtype), calib.to(torch.get_default_device()),
                          CALIB_BATCH)
    curves = []
    for idx, layer in stream.layers():
        calibration = calibrate(layer, hidden, src.config)
        measured = plan.layout.measure(layer.self_attn, calibration)
        targets = source_outputs(layer.self_attn, calibration, rope, stream.causal)
        curve = {}
        for r, uniform in splits:
            for width in width_grid(uniform, plan.layout.max_latent(r)):
                attn, _ = convert_attention(plan, idx, layer.self_attn, calibration, measured, (r, width), kv_balance,
                                            dtype)
                curve[r, width] = attention_error(attn, calibration.inputs, targets, stream.causal, stream.position_ids)
        curves.append(curve)
        hidden = [stream.forward(layer, h, position_embeddings=rope) for h in hidden]
    return curves


def allocated_candidates(src, plan: Plan, calib: torch.Tensor, dtype: torch.dtype) -> list[Candidate]:
    """One candidate per K/V balance of the plan, each layer's split (r among the candidates', latent
    width) allocated from the layers' measured error curves, the total that of the uniform splits."""
    n_layers = src.config.num_hidden_layers
    splits = sorted({split for c in plan.candidates for split in c.splits})
    rope_values = {r: plan.layout.n_rope_keys * 2 * r for r, _ in splits}
    total = n_layers * (rope_values[splits[0][0]] + splits[0][1])
    allocated = []
    for balance in dict.fromkeys(c.kv_balance for c in plan.candidates):
        curves = error_curves(src, plan, calib, splits, balance, dtype)
        allocated.append(Candidate(tuple(splits), balance, layer_splits=tuple(allocate(curves, rope_values, total))))
    return allocated
