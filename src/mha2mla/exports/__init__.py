"""Exports: an MLA checkpoint written in another library's model format, registered by format name.

    deepseek-v3   stock transformers `DeepseekV3ForCausalLM`, vLLM, SGLang (deepseek_v3.py)
    gguf          llama.cpp's `deepseek2` GGUF, mapped from the DeepSeek-V3 export (gguf.py)

`export` dispatches by name; an option the chosen format does not take is a UserError naming it.
"""

from __future__ import annotations

import inspect

from ..errors import UserError
from .deepseek_v3 import export_checkpoint
from .gguf import export_gguf

EXPORTS = {"deepseek-v3": export_checkpoint, "gguf": export_gguf}


def export(model, out, *, format: str = "deepseek-v3", **options) -> dict:
    """Export `model` (an MLA checkpoint directory or an (MLAForCausalLM, tokenizer) pair) to `out` in
    `format` → the export's report (shapes, KV values per token per layer, the logits gap)."""
    if format not in EXPORTS:
        raise UserError(f"unknown export format '{format}': use one of {', '.join(EXPORTS)}")
    accepted = inspect.signature(EXPORTS[format]).parameters
    for name in options:
        if name not in accepted:
            raise UserError(f"--{name.replace('_', '-')} is not an option of --format {format}")
    return EXPORTS[format](model, out, **options)
