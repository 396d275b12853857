"""The MLA model: config, modeling file and latent cache (the three files copied into every checkpoint).

Importing this package registers the MLA config and model with transformers' Auto classes, so
`AutoModelForCausalLM.from_pretrained(mla_dir)` works without `trust_remote_code`.
"""

from transformers import AutoConfig, AutoModelForCausalLM

from .configuration_mla import MLAConfig
from .latent_cache import LatentCache
from .modeling_mla import MLAForCausalLM, MLAModel

AutoConfig.register("mla", MLAConfig, exist_ok=True)
AutoModelForCausalLM.register(MLAConfig, MLAForCausalLM, exist_ok=True)

__all__ = ["MLAConfig", "MLAForCausalLM", "MLAModel", "LatentCache"]
