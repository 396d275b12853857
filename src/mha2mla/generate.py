"""Text generation with a model's own cache: LatentCache for MLA models, transformers' default otherwise.

`--kv-bits` picks the latent cache's storage: 16 keeps the model's dtype, 4 and 2 store packed
integer codes with an fp16 scale and zero per group (a full-precision window of recent tokens
stays exact); see modeling/latent_cache.py. It exists only for MLA models: a source model's
K/V cache is transformers' own.
"""

from __future__ import annotations

import torch
from transformers import TextStreamer

from .errors import UserError
from .modeling import LatentCache
from .modeling.modeling_mla import CACHE_NAME

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


def generation_cache(model, kv_bits: int | None):
    """{cache kwarg: LatentCache} for an MLA model with explicit `kv_bits`; {} lets generate choose."""
    return {CACHE_NAME: LatentCache(model.config, kv_bits=kv_bits)} if kv_bits is not None else {}


@torch.inference_mode()
def generate_text(model, tokenizer, prompt: str, max_new_tokens: int = 64, kv_bits: int | None = None,
                  stream: bool = True) -> str:
    """Greedy continuation of `prompt` (streamed to stdout when `stream`); returns the new text."""
    check_kv_bits(kv_bits, model)
    if max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
    ids = tokenizer(prompt, return_tensors="pt")
    if ids["input_ids"].shape[1] == 0:  # an empty prompt: continue from the beginning-of-sequence token
        if tokenizer.bos_token_id is None:
            raise UserError("the prompt is empty and the tokenizer has no beginning-of-sequence token: give a prompt")
        ids = {"input_ids": torch.tensor([[tokenizer.bos_token_id]]), "attention_mask": torch.ones(1, 1, dtype=torch.long)}
    prompt_len = ids["input_ids"].shape[1]
    check_fits_context(model, prompt_len + max_new_tokens,
                       f"the prompt ({prompt_len} tokens) plus --max-new-tokens {max_new_tokens}")
    streamer = TextStreamer(tokenizer, skip_special_tokens=True) if stream else None
    out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False, streamer=streamer,
                         pad_token_id=tokenizer.pad_token_id, **generation_cache(model, kv_bits))
    return tokenizer.decode(out[0, prompt_len:], skip_special_tokens=True)
