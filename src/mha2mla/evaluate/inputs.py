"""What a run asks of a model, checked before it runs: the latent cache's bit width (an MLA model's
LatentCache stores 16-bit values or packed 4/2-bit codes; modeling/latent_cache.py) and the context length."""

from __future__ import annotations

from ..errors import UserError

KV_BITS = (16, 4, 2)


def is_mla(model) -> bool:
    return getattr(model.config, "model_type", None) == "mla"


def check_kv_bits(kv_bits: int | None, model=None) -> None:
    """A UserError unless `kv_bits` is None or one of 16/4/2 and, when given, `model` is an MLA model."""
    if kv_bits is None:
        return
    if kv_bits not in KV_BITS:
        raise UserError(f"--kv-bits must be 16, 4 or 2, got {kv_bits}")
    if model is not None and not is_mla(model):
        raise UserError(f"--kv-bits sets the latent cache of an MLA model, but this is a "
                        f"'{model.config.model_type}' model: convert it first (mha2mla convert)")


def context_length(model) -> int:
    return model.config.max_position_embeddings


def check_fits_context(model, tokens: int, what: str) -> None:
    """A UserError when `tokens` positions do not fit the model's context."""
    if tokens > context_length(model):
        raise UserError(f"{what} needs {tokens} positions, more than the model's context of "
                        f"{context_length(model)} tokens: shorten it")
