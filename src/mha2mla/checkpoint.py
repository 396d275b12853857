"""The files of an MLA checkpoint that loads anywhere besides its weights (weights.ShardWriter):
config with auto_map, modeling files, tokenizer, generation config and a model card.
"""

from __future__ import annotations

import shutil
from pathlib import Path


MODELING_DIR = Path(__file__).parent / "modeling"
MODELING_FILES = ("configuration_mla.py", "modeling_mla.py", "latent_cache.py")
AUTO_MAP = {"AutoConfig": "configuration_mla.MLAConfig", "AutoModelForCausalLM": "modeling_mla.MLAForCausalLM"}


def model_card(config) -> str:
    conv = getattr(config, "conversion", None) or {}
    kv = conv.get("kv", {})
    lines = [
        "---", "library_name: transformers", "tags: [mla, mha2mla]", "---", "",
        f"# MLA conversion of {config.source_model}", "",
        "Multi-head Latent Attention model made by [mha2mla](https://pypi.org/project/mha2mla/) "
        "(MHA2MLA: partial RoPE + low-rank joint K/V). Load it with "
        "`AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)`; `generate()` then caches "
        "only the latent `c_kv` and the RoPE keys.", "",
        "| setting | value |", "|---|---|",
        f"| source | {config.source_model} ({config.source_family}) |",
        f"| latent c_kv | {config.layer_latent_dims or config.latent_dim} |",
        f"| rope_pairs (r) | {config.layer_rope_pairs or config.rope_pairs} ({config.rope_layout}) |",
        f"| rope strategy | {conv.get('rope_strategy', '?')} |",
        f"| low-rank | {config.svd}, {conv.get('init', '?')} init, refit {conv.get('refit', 'none')} |",
    ]
    if kv:
        lines += [f"| KV cache per token per layer | {kv['kv_elements_per_token_per_layer']} values, "
                  f"{kv['kv_bytes_per_token']} bytes at 16 bit (source {kv['source_kv_bytes_per_token']}) |",
                  f"| KV reduction | {kv['reduction_pct']:.2f} % |"]
    if conv.get("ppl") is not None:
        lines.append(f"| perplexity (before fine-tuning) | {conv['ppl']:.2f} |")
    return "\n".join(lines) + "\n"


def write_checkpoint_files(config, tokenizer, generation_config, directory: Path) -> None:
    """Everything of a checkpoint but the weights: config (with auto_map), generation config,
    tokenizer, the modeling files and the model card."""
    config.auto_map = dict(AUTO_MAP)
    config.save_pretrained(directory)
    if generation_config is not None:
        generation_config.save_pretrained(directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    for name in MODELING_FILES:
        shutil.copy(MODELING_DIR / name, directory / name)
    (directory / "README.md").write_text(model_card(config))
