"""Recipes: the conversion's method as plain data, the one source of its defaults.

A `Recipe` says how a source becomes MLA, whatever the cache size: which part of the keys keeps RoPE,
how the low-rank step weights its errors, what is re-fitted, whether the latent gets DeepSeek's norm,
how the cache is spread over the layers, and whether each layer is then trained to reproduce the
source's attention output. The size (d_kv, a budget or a reduction) and the run
(device, dtype, calibration text) are not part of it. Two are named:

    default   RoPE concentration (one shared RoPE key, PCA over 4 folded frequencies), query-aware
              keys, sequential calibration, v_up and o_proj re-fitted: the best measured on SmolLM2-135M
              and Qwen2.5-0.5B (docs/results.md; docs/experiments.md keeps what each choice beat)
    paper     the MHA2MLA paper's: 2-norm partial RoPE per KV head, weight-only joint SVD, nothing re-fitted

Every field stays reachable from Python (`Recipe(weighting="activation")`, `recipe.replace(...)`) for
the ablation benchmarks; the CLI exposes the recipe's name and the options that won somewhere.
This module imports nothing heavy, so the CLI can build a Recipe before torch is loaded.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .errors import UserError

PER_HEAD_STRATEGIES = ("high", "low", "uniform", "2-norm")  # partial RoPE, r pairs per KV head (rope/partial.py)
SHARED_STRATEGIES = ("pca",)                               # RoPE concentration, one shared RoPE key (rope/pca.py)
ROPE_STRATEGIES = PER_HEAD_STRATEGIES + SHARED_STRATEGIES
WEIGHTINGS = ("weight", "activation", "output", "query")   # the low-rank step's error weighting (lowrank.py)
SVDS = ("joint", "split")                                  # one latent for K and V, or a half each
REFITS = ("none", "v", "vo")                               # nothing; v_up; v_up then o_proj (refit.py)
LATENT_NORMS = ("near_linear", "rms")                      # how a latent RMSNorm keeps the function (latent_norm.py)
ALLOCATIONS = ("uniform", "per-layer", "global")           # how the cache is spread over the layers


@dataclass(frozen=True)
class Recipe:
    """How to convert. `rope`: the RoPE layout's strategy (ROPE_STRATEGIES; `pca` = RoPE concentration
    with `freq_fold` adjacent frequencies per PCA). `weighting`: what the low-rank step's error is
    measured on (WEIGHTINGS). `svd`: joint or split latent. `kv_balance`: β weighting value errors
    against key errors, or "auto" (β among search.AUTO_BALANCES, chosen on held-out text).
    `sequential`: calibrate each layer on the converted layers' outputs (compensating their error)
    rather than the source's. `refit`: REFITS. `latent_norm`: None or a LATENT_NORMS method.
    `allocate`: every layer the same split (uniform), each layer its pick among the budget's splits by
    its attention-output error (per-layer), or RoPE dims and latent width per layer from one total by
    measured error curves (global). `reconstruct`: Adam steps per layer training the converted attention
    to reproduce the source's output on the calibration inputs, at `reconstruct_lr` (0: none)."""

    rope: str = "pca"
    freq_fold: int = 4
    weighting: str = "query"
    svd: str = "joint"
    kv_balance: float | str = 1.0
    sequential: bool = True
    refit: str = "vo"
    latent_norm: str | None = None
    allocate: str = "uniform"
    reconstruct: int = 0
    reconstruct_lr: float = 1e-3

    def replace(self, **changes) -> "Recipe":
        """This recipe with some fields changed (an unknown field is a UserError)."""
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise UserError(f"unknown recipe setting {sorted(unknown)[0]!r}: use one of "
                            f"{', '.join(f.name for f in dataclasses.fields(self))}")
        return dataclasses.replace(self, **changes)

    @property
    def shared_rope(self) -> bool:
        return self.rope in SHARED_STRATEGIES

    def validate(self) -> "Recipe":
        """This recipe, or a UserError naming the first setting out of its choices."""
        for name, value, choices in (("rope", self.rope, ROPE_STRATEGIES), ("weighting", self.weighting, WEIGHTINGS),
                                     ("svd", self.svd, SVDS), ("refit", self.refit, REFITS),
                                     ("allocate", self.allocate, ALLOCATIONS)):
            if value not in choices:
                raise UserError(f"unknown {name} {value!r}: use one of {', '.join(choices)}")
        if self.latent_norm is not None and self.latent_norm not in LATENT_NORMS:
            raise UserError(f"unknown latent_norm {self.latent_norm!r}: use None or one of {', '.join(LATENT_NORMS)}")
        if self.freq_fold < 1:
            raise UserError(f"freq_fold must be at least 1 (got {self.freq_fold})")
        if self.kv_balance != "auto" and not (isinstance(self.kv_balance, (int, float)) and self.kv_balance > 0):
            raise UserError(f"kv_balance must be a positive number or 'auto' (got {self.kv_balance!r})")
        if not (isinstance(self.reconstruct, int) and self.reconstruct >= 0):
            raise UserError(f"--reconstruct takes a number of steps ≥ 0 (got {self.reconstruct!r})")
        if not self.reconstruct_lr > 0:
            raise UserError(f"reconstruct_lr must be positive (got {self.reconstruct_lr})")
        if self.allocate == "global" and self.svd == "split":
            raise UserError("the global allocation sets each layer's latent width itself: use svd='joint'")
        return self


RECIPES = {
    "default": Recipe(),
    "paper": Recipe(rope="2-norm", freq_fold=1, weighting="weight", sequential=False, refit="none"),
}


def recipe_of(recipe: str | Recipe, **changes) -> Recipe:
    """A Recipe from a name of RECIPES or a Recipe, with `changes` applied, validated."""
    if isinstance(recipe, str):
        if recipe not in RECIPES:
            raise UserError(f"unknown recipe '{recipe}': use one of {', '.join(RECIPES)} or a mha2mla.Recipe")
        recipe = RECIPES[recipe]
    return recipe.replace(**changes).validate()
