"""The conversion plan: everything decided before a weight is read — once, immutable.

From the source config, a Recipe and a size, the plan fixes the RoPE layout, the candidate
conversions, the calibration sizes and the MLA config's fields that come from the source.

Sizes. A converted layer caches latent + n_rope_keys·2r values per token (rope.layout). The size is
one of:
  * d_kv (the paper's): a latent of n_kv·d_kv with r pairs per KV head (default d_h/16); for the
    shared RoPE key without r, the paper's cache size n_kv·(d_kv + 2·d_h/16) with a ROPE_SHARE of it
    for the RoPE key (MLAConfig's docstring);
  * a budget of values per token per layer, or a reduction in percent below the source's cache: with
    r given, the one split it leaves; otherwise ROPE_SHARES of it for RoPE, the rest for the latent —
    several splits, among which the search (search.py) picks on held-out text.
Candidates are those splits × the recipe's K/V balances (one candidate with them all when each layer
picks its own split: `allocate="per-layer"`). The search needs HELD_OUT_BLOCKS documents beyond the
calibration text when there is more than one candidate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import UserError
from ..io.text import calibration_blocks, default_train_text, text_files
from ..modeling import MLAConfig
from ..modeling.configuration_mla import head_dim_of, paper_cache_values, paper_rope_pairs, source_kv_values
from ..recipes import Recipe
from .stages.rope.layout import RopeLayout, layout_for
from .stream import source_rotary

ROPE_SHARE = 1 / 4                  # share of a shared-key budget for the RoPE key, without a search
ROPE_SHARES = (1 / 5, 1 / 4, 1 / 3)  # shares the budget search tries (few: it converts once per share)
HELD_OUT_BLOCKS = 4  # held-out documents (one block each) that score the candidates
AUTO_BALANCES = (0.25, 1.0, 4.0)  # K/V balances β tried by kv_balance="auto"
CALIB_BATCH = 4  # calibration blocks per forward pass

Split = tuple[int, int]  # (rope_pairs, latent width)


@dataclass(frozen=True)
class Candidate:
    """One conversion the search tries: the splits each layer may choose among (one: every layer takes
    it; several: each layer picks by its attention-output error), the K/V balance β of the
    factorisation, and optionally each layer's own split, allocated from one total (allocate.py)."""
    splits: tuple[Split, ...]
    kv_balance: float
    layer_splits: tuple[Split, ...] | None = None

    def options(self, layer: int) -> list[Split]:
        """The splits layer `layer` may take."""
        if self.layer_splits is not None:
            return [self.layer_splits[layer]]
        return list(self.splits)

    @property
    def per_layer(self) -> bool:
        """Whether layers may end up with different splits."""
        return len(self.splits) > 1 or self.layer_splits is not None


@dataclass(frozen=True)
class Plan:
    recipe: Recipe
    layout: RopeLayout
    candidates: tuple[Candidate, ...]
    calib_samples: int
    calib_seq_len: int
    fields: dict  # the MLA config's fields that come from the source: MLAConfig(**fields, <widths>)

    @property
    def held_out_blocks(self) -> int:
        return HELD_OUT_BLOCKS if len(self.candidates) > 1 else 0

    def texts(self, tokenizer, calib_data) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(calibration blocks, held-out blocks or None without a search) of the calibration text."""
        paths = text_files(calib_data) if calib_data else [default_train_text()]
        calib, held_out = calibration_blocks(tokenizer, paths, self.calib_seq_len, self.calib_samples,
                                             self.held_out_blocks)
        if len(held_out) < self.held_out_blocks:
            raise UserError(f"the budget search needs {self.held_out_blocks} more documents of at least "
                            f"{self.calib_seq_len} tokens after the calibration samples: add text or lower "
                            f"--calib-size")
        return calib, held_out if self.held_out_blocks else None

    def mla_config(self, **widths) -> MLAConfig:
        """The MLA config of the source's fields and `widths` (rope_pairs, latent_dim, kept_pairs, …)."""
        return MLAConfig(**self.fields, **widths)

    def layer_config(self, split: Split) -> MLAConfig:
        """The config a layer converted at `split` is built with (its RoPE frequencies are set after)."""
        r, latent = split
        half = self.fields["head_dim"] // 2
        placeholder = [[[i % half for i in range(r)]] * self.layout.n_rope_keys] * self.fields["num_hidden_layers"]
        config = self.mla_config(rope_pairs=r, latent_dim=latent, kept_pairs=placeholder)
        config._attn_implementation = "sdpa"   # layers built outside a PreTrainedModel
        return config


def source_fields(config, layout: RopeLayout, svd: str, source_name: str, dtype: torch.dtype) -> dict:
    """The MLA config's fields that the source decides: its transformer, RoPE frequencies and family."""
    family = config.model_type
    rotary = source_rotary(config)
    return dict(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, head_dim=head_dim_of(config), hidden_act=config.hidden_act,
        max_position_embeddings=config.max_position_embeddings, initializer_range=config.initializer_range,
        rms_norm_eps=config.rms_norm_eps, tie_word_embeddings=config.tie_word_embeddings,
        attention_bias=bool(getattr(config, "attention_bias", family == "qwen2")),
        o_proj_bias=bool(getattr(config, "attention_bias", False)) and family != "qwen2",
        mlp_bias=bool(getattr(config, "mlp_bias", False)),
        sliding_window=(config.sliding_window if family == "mistral" or getattr(config, "use_sliding_window", False)
                        else None),
        rope_theta=(getattr(config, "rope_parameters", None) or {}).get("rope_theta", getattr(config, "rope_theta", None)),
        rope_inv_freq=rotary.inv_freq.tolist(), rope_attention_scaling=float(getattr(rotary, "attention_scaling", 1.0)),
        rope_layout=layout.name, svd=svd, source_model=source_name, source_family=family,
        pad_token_id=config.pad_token_id, bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
        dtype=dtype)


def budget_splits(config, budget: int, layout: RopeLayout, rope_pairs: int | None = None) -> list[Split]:
    """The splits of a budget worth trying: the one `rope_pairs` leaves, or ROPE_SHARES of it for RoPE."""
    source = source_kv_values(config)
    smallest = layout.n_rope_keys * 2 + 1
    if not smallest <= budget < source:
        raise UserError(f"--kv-budget {budget} is out of range: use {smallest} … {source - 1} values per token "
                        f"per layer (the source caches {source})")
    if rope_pairs is not None:
        return [(rope_pairs, budget - layout.n_rope_keys * 2 * rope_pairs)]
    options = []
    for share in ROPE_SHARES:
        r = layout.pairs_for(budget, share)
        latent = budget - layout.n_rope_keys * 2 * r
        if 1 <= latent <= layout.max_latent(r) and (r, latent) not in options:
            options.append((r, latent))
    if not options:
        raise UserError(f"--kv-budget {budget} cannot be split into RoPE dims and a latent for this model")
    return options


def d_kv_split(config, layout: RopeLayout, d_kv: int, rope_pairs: int | None) -> Split:
    """The one split a d_kv names (MLAConfig's docstring)."""
    n_kv, head_dim = config.num_key_value_heads, head_dim_of(config)
    if layout.name == "shared" and rope_pairs is None:
        budget = int(paper_cache_values(n_kv, head_dim, d_kv))
        pairs = layout.pairs_for(budget, ROPE_SHARE)
        return pairs, budget - 2 * pairs
    return rope_pairs if rope_pairs is not None else paper_rope_pairs(head_dim), n_kv * d_kv


def check_split(layout: RopeLayout, split: Split, svd: str, n_kv: int) -> None:
    """A split the layout can hold, or a UserError."""
    r, latent = split
    layout.check(r)
    limit = layout.max_latent(r)
    if not 1 <= latent <= limit:
        raise UserError(f"a latent of {latent} values is out of range: use 1 … {limit} (the rank available with "
                        f"{n_kv} KV heads and r={r}; per KV head, --d-kv 1 … {limit // n_kv})")
    if svd == "split" and latent % 2:
        raise UserError("a split SVD needs an even latent width: choose an even size")


def splits_for(config, layout: RopeLayout, d_kv, rope_pairs, kv_budget, kv_reduction) -> list[Split]:
    """The splits of the size given as exactly one of d_kv (default 16), kv_budget and kv_reduction."""
    given = [name for name, v in (("--d-kv", d_kv), ("--kv-budget", kv_budget), ("--kv-reduction", kv_reduction))
             if v is not None]
    if len(given) > 1:
        raise UserError(f"{' and '.join(given)} both set the cache size: give one")
    if rope_pairs is not None and rope_pairs < 1:
        raise UserError(f"--rope-pairs must be at least 1 (got {rope_pairs})")
    if kv_reduction is not None:
        if not 0 < kv_reduction < 100:
            raise UserError(f"--kv-reduction {kv_reduction} must be between 0 and 100 (percent)")
        kv_budget = math.floor(source_kv_values(config) * (1 - kv_reduction / 100))
    if kv_budget is not None:
        return budget_splits(config, kv_budget, layout, rope_pairs)
    d_kv = 16 if d_kv is None else d_kv
    if d_kv < 1:
        raise UserError(f"--d-kv must be at least 1 (got {d_kv})")
    return [d_kv_split(config, layout, d_kv, rope_pairs)]


def kv_balances(kv_balance: float | str) -> tuple[float, ...]:
    return AUTO_BALANCES if kv_balance == "auto" else (float(kv_balance),)


def plan_conversion(config, recipe: Recipe, *, source_name: str, dtype: torch.dtype, d_kv=None, rope_pairs=None,
                    kv_budget=None, kv_reduction=None, calib_samples: int = 16, calib_seq_len: int = 512) -> Plan:
    """The plan for converting a source of this config by `recipe` at the size given (see splits_for);
    `dtype`: the checkpoint's storage dtype."""
    if calib_samples < 1:
        raise UserError("--calib-size needs at least 1 calibration block")
    layout = layout_for(recipe.rope, config, recipe.freq_fold)
    splits = splits_for(config, layout, d_kv, rope_pairs, kv_budget, kv_reduction)
    for split in splits:
        check_split(layout, split, recipe.svd, config.num_key_value_heads)
    if recipe.allocate == "per-layer" and kv_budget is None and kv_reduction is None:
        raise UserError("--allocate per-layer picks each layer's split among a budget's: give --kv-budget or "
                        "--kv-reduction instead of --d-kv")
    per_layer = recipe.allocate == "per-layer"
    plans = [tuple(splits)] if per_layer else [(split,) for split in splits]
    candidates = tuple(Candidate(p, b) for p in plans for b in kv_balances(recipe.kv_balance))
    return Plan(recipe, layout, candidates, calib_samples, calib_seq_len,
                source_fields(config, layout, recipe.svd, source_name, dtype))
