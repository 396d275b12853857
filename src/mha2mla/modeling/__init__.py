"""The MLA model: config, modeling file and latent cache (copied into every checkpoint)."""

from .configuration_mla import MLAConfig
from .latent_cache import LatentCache
from .modeling_mla import MLAForCausalLM, MLAModel

__all__ = ["MLAConfig", "MLAForCausalLM", "MLAModel", "LatentCache"]
