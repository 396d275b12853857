"""The files of an MLA checkpoint that loads anywhere besides its weights (readers.ShardWriter):
config with auto_map, modeling files, tokenizer, generation config and a model card.

The tokenizer is written twice: beside the model (for `pipeline`, lm-eval and anything that loads
both from one directory, with `trust_remote_code=True`) and alone in TOKENIZER_SUBFOLDER.
`AutoTokenizer.from_pretrained(DIR)` reads DIR's config.json before the tokenizer files, and a config
whose model_type transformers does not know and whose auto_map names custom code makes it ask whether
to run that code (or, with stdin closed, warn that a model of type `mla` instantiates a plain config),
whatever the tokenizer files say. The subfolder has no config.json, so
`AutoTokenizer.from_pretrained(DIR, subfolder="tokenizer")` loads the stock tokenizer with no custom code.
"""

from __future__ import annotations

import shutil
from pathlib import Path


MODELING_DIR = Path(__file__).parent.parent / "modeling"
MODELING_FILES = ("configuration_mla.py", "modeling_mla.py", "latent_cache.py")
TOKENIZER_SUBFOLDER = "tokenizer"
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
        "only the latent `c_kv` and the RoPE keys. The tokenizer is the source's and needs no custom code: "
        f"`AutoTokenizer.from_pretrained(path, subfolder=\"{TOKENIZER_SUBFOLDER}\")`.", "",
        "| setting | value |", "|---|---|",
        f"| source | {config.source_model} ({config.source_family}) |",
        f"| latent c_kv | {config.layer_latent_dims or config.latent_dim} |",
        f"| rope_pairs (r) | {config.layer_rope_pairs or config.rope_pairs} ({config.rope_layout}) |",
        f"| rope strategy | {conv.get('rope', '?')} |",
        f"| low-rank | {config.svd}, {conv.get('weighting', '?')} weighting, refit {conv.get('refit', 'none')} |",
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
        tokenizer.save_pretrained(directory / TOKENIZER_SUBFOLDER)
    for name in MODELING_FILES:
        shutil.copy(MODELING_DIR / name, directory / name)
    (directory / "README.md").write_text(model_card(config))
