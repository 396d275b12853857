"""GQA → MHA expansion: the equivalent multi-head model, each KV head replicated for its query group.

With G = n_heads / n_kv, query head h reads KV head h // G. Writing those heads out (k_proj and
v_proj rows repeated G times) gives an MHA model with identical outputs, so MHA2MLA can run on any
GQA checkpoint (`--as-mha`), with the latent then shared by n_heads instead of n_kv heads. The
conversion streams the expansion (`expanded_source`: k/v rows repeated as each tensor is read).
"""

from __future__ import annotations

import copy
import dataclasses

import torch


def repeat_heads(weight: torch.Tensor, n_kv: int, groups: int) -> torch.Tensor:
    """[n_kv·d_h, …] → [n_kv·groups·d_h, …], head g repeated `groups` times in place."""
    per_head = weight.view(n_kv, -1, *weight.shape[1:])
    return per_head.repeat_interleave(groups, dim=0).reshape(-1, *weight.shape[1:])


def mha_config(config):
    """A copy of `config` with one KV head per query head."""
    new_config = copy.deepcopy(config)
    new_config.num_key_value_heads = config.num_attention_heads
    new_config._name_or_path = f"{config._name_or_path} (as MHA)"
    return new_config


def expanded_tensor(config, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A source tensor as the MHA model has it: k/v projections with each KV head repeated."""
    n_heads, n_kv = config.num_attention_heads, config.num_key_value_heads
    if any(f"self_attn.{p}." in name for p in ("k_proj", "v_proj")):
        return repeat_heads(tensor, n_kv, n_heads // n_kv)
    return tensor


def expand_to_mha(model):
    """A new model (same class) whose every attention layer has one KV head per query head."""
    config = model.config
    if config.num_key_value_heads == config.num_attention_heads:
        return model
    expanded = type(model)(mha_config(config)).to(model.dtype)
    expanded.load_state_dict({name: expanded_tensor(config, name, t) for name, t in model.state_dict().items()})
    return expanded.eval()


class ExpandedReader:
    """A tensor reader (weights) that gives the tensors of the source's MHA expansion."""

    def __init__(self, reader):
        self._reader = reader
        self.config = mha_config(reader.config)
        self.dtype = reader.dtype

    def names(self) -> set[str]:
        return self._reader.names()

    def get(self, name: str) -> torch.Tensor:
        return expanded_tensor(self._reader.config, name, self._reader.get(name))


def expanded_source(source):
    """A StreamSource (sources) reading the MHA expansion of `source`."""
    return dataclasses.replace(source, reader=ExpandedReader(source.reader), name=f"{source.name} (as MHA)")
