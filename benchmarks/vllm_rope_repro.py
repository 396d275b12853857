"""vLLM-CPU's rotary-embedding kernel on a 3-D query: the minimal reproduction of why DeepSeek models
decode wrong on vLLM's CPU backend (vllm-cpu 0.32.0; run with .venv-vllm/bin/python).

vLLM's DeepSeek-V2/V3 attention rotates q_pe shaped [tokens, heads, qk_rope_head_dim] (and k_pe
[tokens, 1, dim]). Its PyTorch rotary (`forward_native`) and the C++ kernel (`forward_cpu` →
`torch.ops._C.rotary_embedding`) agree on 2-D [tokens, heads·dim] inputs and on one head, and disagree on
a 3-D query of several heads, in both the GPT-J (DeepSeek's) and the NeoX layouts. Prints the largest
difference per case; no model, no weights.
"""

import torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.rotary_embedding import get_rope

with set_current_vllm_config(VllmConfig()):
    torch.manual_seed(0)
    tokens, dim = 7, 64
    positions = torch.arange(tokens)
    for neox in (False, True):
        rope = get_rope(dim, max_position=512, rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
                        is_neox_style=neox, dtype=torch.float32)
        for heads in (1, 9):
            q, k = torch.randn(tokens, heads, dim), torch.randn(tokens, 1, dim)
            want, _ = rope.forward_native(positions, q.clone(), k.clone())
            flat, _ = rope.forward_cpu(positions, q.clone().view(tokens, heads * dim), k.clone().view(tokens, dim))
            three_d, _ = rope.forward_cpu(positions, q.clone(), k.clone())
            print(f"{'neox' if neox else 'gpt-j'} layout, {heads} query heads: kernel vs PyTorch, 2-D input "
                  f"{(flat.view_as(want) - want).abs().max():.2e}, 3-D input {(three_d - want).abs().max():.2e}")
