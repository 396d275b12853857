"""Layer-wise reconstruction: a converted attention layer trained to reproduce the source layer's output.

The closed-form stages each solve their own least squares (the keys and values in the low-rank step,
v_up and o_proj in the refit), but the layer's output o = W_o · softmax(q·kᵀ/√d_h) · v depends on all
of them at once, and nonlinearly. Starting from the closed-form solution, the MLA attention's
parameters θ are trained with Adam on the layer's calibration inputs x — teacher-forced, as the refit
is: x comes through the already-converted layers — to minimise the relative output error against the
source layer's own attention on the same inputs,

    L(θ) = Σ_b ‖o_MLA(x_b; θ) − o_src(x_b)‖² / Σ_b ‖o_src(x_b)‖²,

one calibration block b (of T tokens) per step, round robin, for `steps` steps at learning rate `lr`
decayed to zero on a cosine: a step costs one block's attention forward and backward. Adam's steps
are normalised, so they do not vanish with the gradient: where training does not lower L on the
calibration inputs (a layer already exact, or nearly), the layer keeps its closed-form parameters. The parameters trained are PARAMETERS (all of them by default: q_proj and
k_rope_proj, kv_down, k_up, v_up, o_proj).
"""

from __future__ import annotations

import math

import torch

from .calibration import attention_error

PARAMETERS = ("q_proj", "k_rope_proj", "kv_down", "k_up", "v_up", "o_proj")


def relative_error(got: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (got - target).float().pow(2).sum() / target.float().pow(2).sum()


def reconstruct(attn, inputs: list[torch.Tensor], targets: list[torch.Tensor], position_ids: torch.Tensor,
                causal: torch.Tensor, steps: int, lr: float, parameters: tuple[str, ...] = PARAMETERS
                ) -> tuple[float, float]:
    """Train `attn` (an MLAAttention) in place for `steps` Adam steps → (error before, error after) on
    all the calibration batches, the closed form kept where training did not lower it. `targets`: the
    source attention's outputs on `inputs`."""
    trained = [p for name in parameters for p in getattr(attn, name).parameters()]
    frozen = [p for p in attn.parameters() if all(p is not q for q in trained)]
    closed_form = {name: t.clone() for name, t in attn.state_dict().items()}
    before = attention_error(attn, inputs, targets, causal, position_ids)
    optimizer = torch.optim.Adam(trained, lr=lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * s / steps)))
    for p in frozen:
        p.requires_grad_(False)
    blocks = [(x[i:i + 1], target[i:i + 1]) for x, target in zip(inputs, targets) for i in range(len(x))]
    with torch.enable_grad():
        for step in range(steps):
            x, target = blocks[step % len(blocks)]
            loss = relative_error(attn(x, position_ids.expand(x.shape[0], -1), causal), target)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
    for p in frozen:
        p.requires_grad_(True)
    after = attention_error(attn, inputs, targets, causal, position_ids)
    if after >= before:
        attn.load_state_dict(closed_form)
        return before, before
    return before, after
