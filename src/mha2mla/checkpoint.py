"""Write an MLA checkpoint that loads anywhere: weights, config with auto_map, modeling files,
tokenizer, generation config and a model card; written to a temp dir, then renamed into place.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from .sources import save_atomically

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


def save_mla(model, tokenizer, out: Path) -> None:
    """Save an MLA model as a self-contained checkpoint at `out` (atomically)."""
    model.config.auto_map = dict(AUTO_MAP)

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        for name in MODELING_FILES:
            shutil.copy(MODELING_DIR / name, tmp / name)
        (tmp / "README.md").write_text(model_card(model.config))

    save_atomically(Path(out), write)


def read_config(path: Path) -> dict:
    return json.loads((Path(path) / "config.json").read_text())
