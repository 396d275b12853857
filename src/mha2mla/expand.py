"""GQA → MHA expansion: the equivalent multi-head model, each KV head replicated for its query group.

With G = n_heads / n_kv, query head h reads KV head h // G. Writing those heads out (k_proj and
v_proj rows repeated G times) gives an MHA model with identical outputs, so MHA2MLA can run on any
GQA checkpoint (`--as-mha`), with the latent then shared by n_heads instead of n_kv heads.
"""

from __future__ import annotations

import copy

import torch


def repeat_heads(weight: torch.Tensor, n_kv: int, groups: int) -> torch.Tensor:
    """[n_kv·d_h, …] → [n_kv·groups·d_h, …], head g repeated `groups` times in place."""
    per_head = weight.view(n_kv, -1, *weight.shape[1:])
    return per_head.repeat_interleave(groups, dim=0).reshape(-1, *weight.shape[1:])


def expand_to_mha(model):
    """A new model (same class) whose every attention layer has one KV head per query head."""
    config = model.config
    n_heads, n_kv = config.num_attention_heads, config.num_key_value_heads
    if n_kv == n_heads:
        return model
    groups = n_heads // n_kv
    new_config = copy.deepcopy(config)
    new_config.num_key_value_heads = n_heads
    state = {}
    for name, tensor in model.state_dict().items():
        if any(f"self_attn.{p}." in name for p in ("k_proj", "v_proj")):
            tensor = repeat_heads(tensor, n_kv, groups)
        state[name] = tensor
    expanded = type(model)(new_config).to(model.dtype)
    expanded.load_state_dict(state)
    expanded.config._name_or_path = f"{config._name_or_path} (as MHA)"
    return expanded.eval()
