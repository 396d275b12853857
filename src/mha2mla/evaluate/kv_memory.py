"""KV-cache size per token: the MLA model's latent cache against its source's full K/V cache.

MLA:    n_kv·d_kv + n_rope_heads·2r values per token per layer (c_kv + k_rope)
source: 2·n_kv·d_h values per token per layer (K and V)
DeepSeek-V3 (an `mha2mla export`): kv_lora_rank + qk_rope_head_dim values, the one vector per token
per layer that transformers' cache and vLLM's MLA backends hold; compared against the source the
export records (mha2mla_export), else against the MHA cache of the same heads, H·(d_qk + d_v).

Bytes use the model's dtype (2 for bf16/fp16, 4 for fp32) unless told otherwise; the quantized
rows use the packed int4/int2 layout of latent_cache (codes + fp16 scale/zero per group).
"""

from __future__ import annotations

from ..errors import UserError
from ..modeling.latent_cache import kv_bytes_per_token_per_layer
from ..sources import head_dim_of


def source_elements_per_token_per_layer(config) -> int:
    if getattr(config, "model_type", None) == "deepseek_v3":
        export = getattr(config, "mha2mla_export", None) or {}
        return export.get("source_kv_values_per_token_per_layer",
                          config.num_attention_heads * (config.qk_head_dim + config.v_head_dim))
    return 2 * config.num_key_value_heads * head_dim_of(config)


def kv_elements_per_token_per_layer(config) -> int:
    if getattr(config, "model_type", None) == "mla":
        return config.kv_elements_per_token_per_layer
    if getattr(config, "model_type", None) == "deepseek_v3":
        return config.kv_lora_rank + config.qk_rope_head_dim
    return source_elements_per_token_per_layer(config)


def kv_report(config, source_config=None, dtype_bytes: int = 2, original_config=None) -> dict:
    """The kv-size JSON of DESIGN.md: elements and bytes per token per layer, source bytes, reduction.

    `source_config` is the model the reduction is measured against (the MLA model's own source
    by default: its head geometry is in the MLA config); `original_config` is the un-expanded model
    when the source was expanded with --as-mha.
    """
    elements = kv_elements_per_token_per_layer(config)
    source_elements = (kv_elements_per_token_per_layer(source_config) if source_config is not None
                       else source_elements_per_token_per_layer(config))
    report = {
        "kv_elements_per_token_per_layer": elements,
        "kv_bytes_per_token": elements * dtype_bytes,
        "source_kv_bytes_per_token": source_elements * dtype_bytes,
        "reduction_pct": 100.0 * (1 - elements / source_elements),
        "num_layers": config.num_hidden_layers,
        "dtype_bytes": dtype_bytes,
    }
    if original_config is not None:
        original = kv_elements_per_token_per_layer(original_config)
        report["reduction_vs_original_pct"] = 100.0 * (1 - elements / original)
    if getattr(config, "model_type", None) == "mla":
        report["d_kv"] = config.d_kv
        per_layer = [config.kv_elements_at(i) for i in range(config.num_hidden_layers)]
        report["per_layer"] = {"min": min(per_layer), "mean": sum(per_layer) / len(per_layer), "max": max(per_layer)}
        report["quantized"] = {
            str(bits): {
                "kv_bytes_per_token": kv_bytes_per_token_per_layer(config, bits),
                "reduction_pct": 100.0 * (1 - kv_bytes_per_token_per_layer(config, bits)
                                          / (source_elements * dtype_bytes)),
            }
            for bits in (4, 2)
        }
    return report


def kv_size_of(model_path, source=None) -> dict:
    """kv_report for a model directory/alias (configs only, no weights loaded)."""
    from transformers import AutoConfig

    from ..sources import BUNDLED, load_model

    def config_of(path):
        if str(path) in BUNDLED or str(path).endswith(".gguf"):
            return load_model(path)[0].config
        try:
            return AutoConfig.from_pretrained(path)
        except (OSError, ValueError) as e:
            raise UserError(f"cannot read a model config at {path} ({str(e).splitlines()[0][:120]}); "
                            f"give a model directory or alias") from None

    config = config_of(model_path)
    source_config = config_of(source) if source is not None else None
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "bfloat16"
    dtype_bytes = 4 if "32" in str(dtype) else 2
    return kv_report(config, source_config=source_config, dtype_bytes=dtype_bytes)
