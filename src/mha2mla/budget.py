"""The cache budget: which (rope_pairs, latent_dim) splits to convert, and the held-in search among them.

A converted layer caches latent_dim + n_rope_keys·2r values per token (rope_layout). The size is given
either as the paper's d_kv (and r), which fixes one split, or as a budget of values per token per
layer, which several splits meet: ROPE_SHARES of it for RoPE, the rest for the latent. The search
converts the model once per candidate (split × K/V balance), scores each by its next-token loss on
held-in text (the first tokens of the calibration corpus's next HELD_IN_BLOCKS documents after those
of the calibration samples: other text, so the score rewards generalising, not fitting the
calibration article), logs them, and keeps the best candidate's files.
"""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from .errors import UserError
from .evaluate.kv_memory import source_elements_per_token_per_layer
from .sources import head_dim_of

ROPE_SHARE = 1 / 4                  # share of a pca budget for the shared RoPE key, without a search
ROPE_SHARES = (1 / 5, 1 / 4, 1 / 3)  # shares the budget search tries (few: it converts once per share)
HELD_IN_BLOCKS = 4  # held-in documents (one block each) that score the candidates
AUTO_BALANCES = (0.25, 1.0, 4.0)  # K/V balances β tried by --kv-balance auto


@dataclass(frozen=True)
class Candidate:
    """One conversion the search tries: the splits each layer may choose among (one: every layer
    takes it; several: --per-layer-split), the K/V balance β of the factorisation, and optionally
    each layer's own split, allocated from one total (global allocation, allocate)."""
    splits: tuple[tuple[int, int], ...]
    kv_balance: float
    layer_splits: tuple[tuple[int, int], ...] | None = None

    def options(self, layer: int) -> list[tuple[int, int]]:
        """The (rope_pairs, latent_dim) splits layer `layer` may take."""
        if self.layer_splits is not None:
            return [self.layer_splits[layer]]
        return list(self.splits)

    @property
    def per_layer(self) -> bool:
        """Whether layers may end up with different splits."""
        return len(self.splits) > 1 or self.layer_splits is not None


def budget_splits(config, budget: int, layout) -> list[tuple[int, int]]:
    """(rope_pairs, latent_dim) splits of a budget worth trying: ROPE_SHARES of it for RoPE."""
    source = source_elements_per_token_per_layer(config)
    smallest = layout.n_rope_keys * 2 + 1
    if not smallest <= budget < source:
        raise UserError(f"--kv-budget {budget} is out of range: use {smallest} … {source - 1} values per token "
                        f"per layer (the source caches {source})")
    options = []
    for share in ROPE_SHARES:
        r = layout.pairs_for(budget, share)
        latent = budget - layout.n_rope_keys * 2 * r
        if 1 <= latent <= layout.max_latent(r) and (r, latent) not in options:
            options.append((r, latent))
    if not options:
        raise UserError(f"--kv-budget {budget} cannot be split into RoPE dims and a latent for this model")
    return options


def d_kv_split(config, layout, d_kv: int, rope_pairs: int | None) -> tuple[int, int]:
    """The one split a d_kv names (MLAConfig's docstring): n_kv·d_kv latent with r pairs per head
    (default d_h/16); for the shared layout without r, the paper's cache size
    n_kv·(d_kv + 2·d_h/16) with a ROPE_SHARE of it for the shared RoPE key."""
    n_kv, paper_pairs = config.num_key_value_heads, max(1, head_dim_of(config) // 16)
    if layout.name == "shared" and rope_pairs is None:
        budget = n_kv * (d_kv + 2 * paper_pairs)
        pairs = layout.pairs_for(budget, ROPE_SHARE)
        return pairs, budget - 2 * pairs
    return rope_pairs if rope_pairs is not None else paper_pairs, n_kv * d_kv


def kv_balances(kv_balance: float | str) -> tuple[float, ...]:
    """--kv-balance β, or AUTO_BALANCES for `auto`."""
    if kv_balance == "auto":
        return AUTO_BALANCES
    try:
        balance = float(kv_balance)
    except ValueError:
        raise UserError(f"--kv-balance {kv_balance} is not a number or 'auto'") from None
    if balance <= 0:
        raise UserError(f"--kv-balance must be positive (got {kv_balance})")
    return (balance,)


def candidates_for(splits: list[tuple[int, int]], balances: tuple[float, ...], per_layer: bool) -> list[Candidate]:
    plans = [tuple(splits)] if per_layer else [(split,) for split in splits]
    return [Candidate(plan, b) for plan in plans for b in balances]


def search(candidates: list[Candidate], convert, directory: Path):
    """Convert every candidate into a directory of its own under `directory` (convert(candidate, dir)
    → (MLAConfig, held-in loss)), keep the lowest loss's files, moved up into `directory`
    → (its MLAConfig, its Candidate, [what was tried, for the conversion record])."""
    best, tried = None, []
    for i, candidate in enumerate(candidates):
        where = directory / f"candidate-{i}"
        where.mkdir()
        config, loss = convert(candidate, where)
        if len(candidates) > 1:
            record = describe(config, candidate)
            tried.append({**record, "kv_balance": candidate.kv_balance, "held_in_loss": loss})
            rope = config.n_rope_heads * 2 * config.rope_pairs
            what = (allocated(config) if candidate.layer_splits else "per layer" if candidate.per_layer
                    else f"rope dims {rope}, latent {config.latent_dim}")
            print(f"  candidate: {what}, K/V balance {candidate.kv_balance:g} → held-in loss {loss:.4f}",
                  file=sys.stderr)
        if best is None or loss < best[0]:
            if best is not None:
                shutil.rmtree(best[3])
            best = (loss, config, candidate, where)
        else:
            shutil.rmtree(where)
    _, config, candidate, where = best
    for file in where.iterdir():
        file.rename(directory / file.name)
    where.rmdir()
    return config, candidate, tried


def allocated(config) -> str:
    """The spread of an allocated conversion's RoPE dims and latent widths over the layers."""
    n = range(config.num_hidden_layers)
    rope = [config.n_rope_heads * 2 * config.rope_pairs_at(i) for i in n]
    latent = [config.latent_dim_at(i) for i in n]
    return f"rope dims {min(rope)}–{max(rope)}, latent {min(latent)}–{max(latent)} by layer"


def describe(config, candidate: Candidate) -> dict:
    """The split a converted candidate has: per layer, or the one all layers share."""
    if candidate.per_layer:
        return {"rope_pairs": [config.rope_pairs_at(i) for i in range(config.num_hidden_layers)],
                "latent_dim": [config.latent_dim_at(i) for i in range(config.num_hidden_layers)]}
    return {"rope_pairs": config.rope_pairs, "latent_dim": config.latent_dim}
