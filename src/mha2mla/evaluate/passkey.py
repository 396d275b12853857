"""Synthetic passkey retrieval: can the model find a number hidden in a long irrelevant text?

The classic test (Mohtashami & Jaggi, "Landmark Attention", 2023; used by LongLoRA and others): a
plain (chat-free) prompt states that a pass key is hidden, repeats a filler paragraph until the
prompt is about `context` tokens long, hides "The pass key is 12345. Remember it. 12345 is the pass
key." at a random depth, and ends with "What is the pass key? The pass key is". The model answers
with greedy `generate()`; an answer is right when the first number it produces is the key.

Everything is offline and deterministic: seed s draws the 5-digit key and the depth, the same for
every context length, so lengths are comparable.
"""

from __future__ import annotations

import random
import re
import sys
from typing import Sequence

import torch

from ..errors import UserError
from .tasks import as_model

INTRO = ("There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it. "
         "I will quiz you about the pass key.")
FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = " What is the pass key? The pass key is"


def _n_tokens(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def passkey_prompt(tokenizer, context: int, key: int, depth: float) -> str:
    """A prompt of at most `context` tokens with the key hidden after a `depth` fraction of the filler."""
    fixed = _n_tokens(tokenizer, INTRO + NEEDLE.format(key=key) + QUESTION)
    repeats = (context - fixed) // _n_tokens(tokenizer, FILLER)
    if repeats < 1:
        raise UserError(f"context {context} is too short for the passkey prompt (use at least {fixed + 32} tokens)")
    before = round(depth * repeats)
    return INTRO + FILLER * before + NEEDLE.format(key=key) + FILLER * (repeats - before) + QUESTION


def draw(seed: int) -> tuple[int, float]:
    """The (5-digit key, depth in [0, 1]) of one seed."""
    rng = random.Random(seed)
    return rng.randint(10000, 99999), rng.random()


def answer_of(text: str) -> int | None:
    """The first number in the generated text, if any."""
    match = re.search(r"\d+", text)
    return int(match.group()) if match else None


@torch.no_grad()
def retrieve(model, tokenizer, prompt: str, max_new_tokens: int = 10) -> str:
    """The greedy continuation of the prompt."""
    ids = tokenizer(prompt, return_tensors="pt").to(model.device)
    out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    return tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)


def passkey_accuracy(model_or_path, contexts: Sequence[int] = (1024, 2048, 4096), seeds: int = 5,
                     dtype=None) -> dict:
    """{"results": {"<context>": {"accuracy": float, "n": int}}} over `seeds` prompts per context length.

    `model_or_path`: a path/alias for `load_model` or a (model, tokenizer) pair; `dtype` as in
    `evaluate_tasks` (None keeps the model's own).
    """
    if seeds < 1:
        raise UserError(f"--seeds must be ≥ 1 (got {seeds})")
    if not contexts or any(c < 1 for c in contexts):
        raise UserError(f"give positive context lengths in tokens, e.g. 1024,2048,4096 (got {list(contexts)})")
    model, tokenizer = as_model(model_or_path, dtype)
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit and max(contexts) > limit:
        raise UserError(f"context {max(contexts)} exceeds the model's {limit} positions (use ≤ {limit})")
    results = {}
    for context in contexts:
        correct = 0
        for seed in range(seeds):
            key, depth = draw(seed)
            text = retrieve(model, tokenizer, passkey_prompt(tokenizer, context, key, depth))
            correct += answer_of(text) == key
            print(f"passkey {context} tokens, seed {seed}: key {key} at depth {depth:.2f} → {text.strip()!r}",
                  file=sys.stderr)
        results[str(context)] = {"accuracy": correct / seeds, "n": seeds}
    return {"results": results}
