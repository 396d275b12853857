"""Text generation with a model's own cache: LatentCache for MLA models, transformers' default otherwise.

`--kv-bits` picks the latent cache's storage: 16 keeps the model's dtype, 4 and 2 store packed
integer codes with an fp16 scale and zero per group (a full-precision window of recent tokens
stays exact); see modeling/latent_cache.py. It exists only for MLA models: a source model's
K/V cache is transformers' own.
"""

from __future__ import annotations

import torch
from transformers import TextStreamer

from ..errors import UserError
from ..evaluate.inputs import check_fits_context, check_kv_bits
from ..modeling import LatentCache
from ..modeling.modeling_mla import CACHE_NAME

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
