"""mha2mla: convert MHA/GQA LLMs to Multi-head Latent Attention, fine-tune them, and serve them with a
latent KV cache inside Hugging Face `generate`.

Importing the package registers the MLA config and model with transformers' Auto classes, so
`AutoModelForCausalLM.from_pretrained(mla_dir)` works without `trust_remote_code`.
"""

from transformers import AutoConfig, AutoModelForCausalLM

from .modeling import LatentCache, MLAConfig, MLAForCausalLM
from .sources import load_model, load_source
from . import convert as _conversion  # the submodule, imported before the function below takes its name

AutoConfig.register("mla", MLAConfig, exist_ok=True)
AutoModelForCausalLM.register(MLAConfig, MLAForCausalLM, exist_ok=True)


def convert(*args, **kwargs):
    """Convert a source model to MLA; see `mha2mla.convert.convert_model`.

    (The submodule `mha2mla.convert` is imported above first: importing a submodule for the first time
    binds its name on the package, which would otherwise replace this function once anything ran
    `from mha2mla.convert import …`.)"""
    return _conversion.convert_model(*args, **kwargs)


def export(model, out, *, format: str = "deepseek-v3", **kwargs):
    """Export an MLA model to another format: "deepseek-v3" (`mha2mla.exports.deepseek_v3.export_checkpoint`)
    or "gguf" for llama.cpp (`mha2mla.exports.gguf.export_gguf`)."""
    if format == "gguf":
        from .exports.gguf import export_gguf

        return export_gguf(model, out, **kwargs)
    from .exports.deepseek_v3 import export_checkpoint

    return export_checkpoint(model, out, format=format, **kwargs)


__all__ = ["load_source", "load_model", "convert", "export", "MLAConfig", "MLAForCausalLM", "LatentCache"]
