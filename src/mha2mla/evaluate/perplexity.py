"""Perplexity on held-out text: exp(mean next-token NLL) over non-overlapping windows.

The text is tokenized once (no special tokens) and cut into `windows` consecutive windows of
`seq_len` tokens from its start; every token but each window's first is predicted. The same
windows for every model make numbers comparable across source and converted models.
"""

from __future__ import annotations

import math

import torch
from tqdm.auto import tqdm

from ..errors import UserError
from ..io.sources import load_model
from ..io.text import default_eval_text, read_documents


def eval_windows(tokenizer, path, seq_len: int, windows: int | None) -> torch.Tensor:
    if seq_len < 2:
        raise UserError(f"--seq-len {seq_len} is too short (use at least 2)")
    if windows is not None and windows < 1:
        raise UserError(f"--windows {windows} must be at least 1")
    text = "\n\n".join(read_documents([path]))
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"][0]
    available = ids.numel() // seq_len
    if available == 0:
        raise UserError(f"{path} has {ids.numel()} tokens, fewer than one window of {seq_len} "
                        f"(lower --seq-len or use a longer file)")
    n = available if windows is None else min(windows, available)
    return ids[: n * seq_len].view(n, seq_len)


@torch.no_grad()
def perplexity(model, tokenizer, path=None, seq_len: int = 1024, windows: int | None = None,
               progress: bool = True) -> dict:
    """{"ppl", "tokens", "seq_len", "windows"} of `model` on the text file at `path` (WikiText-2 by default)."""
    blocks = eval_windows(tokenizer, path or default_eval_text(), seq_len, windows)
    device = next(model.parameters()).device
    nll, count = 0.0, 0
    for block in tqdm(blocks, desc="perplexity", disable=not progress):
        ids = block[None].to(device)
        logits = model(ids, use_cache=False).logits[0, :-1].float()
        nll += torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum").item()
        count += ids.shape[1] - 1
    return {"ppl": math.exp(nll / count), "tokens": count, "seq_len": seq_len, "windows": len(blocks)}


def perplexity_of(model_path, data=None, seq_len: int = 1024, windows: int | None = None) -> dict:
    model, tokenizer = load_model(model_path)
    return perplexity(model, tokenizer, data, seq_len, windows)
