"""The search: convert every candidate of the plan, keep the one with the lowest held-out loss.

Each candidate (a split × a K/V balance, or a per-layer allocation; plan.Candidate) is converted in a
streaming pass of its own into a directory of its own, and scored as it goes by its next-token loss on
held-out text (the first tokens of the calibration corpus's next documents after those of the
calibration samples: other text, so the score rewards generalising, not fitting the calibration
article). The scores are logged; the best candidate's files are kept.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable
from pathlib import Path

from .plan import Candidate


def search(candidates: list[Candidate], convert: Callable, directory: Path):
    """Convert every candidate into a directory of its own under `directory` (convert(candidate, dir)
    → a Converted with its held-out loss), keep the lowest loss's files, moved up into `directory`
    → (its Converted, [what was tried, for the conversion record])."""
    best, tried = None, []
    for i, candidate in enumerate(candidates):
        where = directory / f"candidate-{i}"
        where.mkdir()
        converted = convert(candidate, where)
        if len(candidates) > 1:
            tried.append({**describe(converted), "kv_balance": candidate.kv_balance,
                          "held_out_loss": converted.loss})
            print(f"  candidate: {spread(converted)}, K/V balance {candidate.kv_balance:g} → held-out loss "
                  f"{converted.loss:.4f}", file=sys.stderr)
        if best is None or converted.loss < best[0].loss:
            if best is not None:
                shutil.rmtree(best[1])
            best = (converted, where)
        else:
            shutil.rmtree(where)
    converted, where = best
    for file in where.iterdir():
        file.rename(directory / file.name)
    where.rmdir()
    return converted, tried


def spread(converted) -> str:
    """A candidate's RoPE dims and latent widths: the one split, the range over layers, or "per layer"."""
    rope = [layer.rope_dims for layer in converted.layers]
    latent = [layer.split[1] for layer in converted.layers]
    if converted.candidate.layer_splits:
        return f"rope dims {min(rope)}–{max(rope)}, latent {min(latent)}–{max(latent)} by layer"
    return "per layer" if converted.candidate.per_layer else f"rope dims {rope[0]}, latent {latent[0]}"


def describe(converted) -> dict:
    """The split a converted candidate has: per layer, or the one all layers share."""
    r = [layer.split[0] for layer in converted.layers]
    latent = [layer.split[1] for layer in converted.layers]
    if converted.candidate.per_layer:
        return {"rope_pairs": r, "latent_dim": latent}
    return {"rope_pairs": r[0], "latent_dim": latent[0]}
