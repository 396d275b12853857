"""`mha2mla kv-size`: the KV-cache size per token of a model on disk, against its source's, from configs
alone (the arithmetic is configuration_mla's kv_report).

MLA:    n_kv·d_kv + n_rope_heads·2r values per token per layer (c_kv + k_rope)
source: 2·n_kv·d_h values per token per layer (K and V)
DeepSeek-V3 (an `mha2mla export`): kv_lora_rank + qk_rope_head_dim values, the one vector per token
per layer that transformers' cache and vLLM's MLA backends hold; compared against the source the
export records (mha2mla_export), else against the MHA cache of the same heads, H·(d_qk + d_v).

Bytes use the model's dtype (2 for bf16/fp16, 4 for fp32) unless told otherwise; the quantized
rows use the packed int4/int2 layout of latent_cache (codes + fp16 scale/zero per group).
"""

from __future__ import annotations

from transformers import AutoConfig

from ..errors import UserError
from ..io.sources import BUNDLED, load_model
from ..modeling.configuration_mla import kv_report


def kv_size_of(model_path, source=None) -> dict:
    """kv_report for a model directory/alias (configs only, no weights loaded)."""
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
