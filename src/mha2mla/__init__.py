"""mha2mla: convert MHA/GQA LLMs to Multi-head Latent Attention, fine-tune them, and serve them with a
latent KV cache inside Hugging Face `generate`.

The public API is loaded on first use, so that `mha2mla --help` answers without importing torch:

    convert(source, out=None, *, recipe="default" | "paper" | Recipe(...), d_kv= | kv_budget= | kv_reduction=, …)
    export(model, out, *, format="deepseek-v3" | "gguf", …)
    load_model(path), load_source(path)
    Recipe, MLAConfig, MLAForCausalLM, LatentCache

Using any of them (or importing `mha2mla.modeling`) registers the MLA config and model with
transformers' Auto classes, so `AutoModelForCausalLM.from_pretrained(mla_dir)` works without
`trust_remote_code`.
"""

from __future__ import annotations

import importlib

_PUBLIC = {"convert": "conversion.pipeline", "export": "exports", "load_model": "io.sources",
           "load_source": "io.sources", "Recipe": "recipes", "MLAConfig": "modeling", "MLAForCausalLM": "modeling",
           "LatentCache": "modeling"}


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'mha2mla' has no attribute {name!r}")
    importlib.import_module(".modeling", __name__)  # registers the Auto classes
    return getattr(importlib.import_module(f".{_PUBLIC[name]}", __name__), name)


__all__ = list(_PUBLIC)
