"""Multi-head Latent Attention (MLA) decoder, for models converted from MHA/GQA by MHA2MLA.

Self-contained (torch + transformers only): this file, configuration_mla.py and latent_cache.py are
copied into every checkpoint, so `AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`
works where mha2mla is not installed. The blocks around attention are the source family's
(RMSNorm, SwiGLU MLP, optional q/k/v bias); one model class serves Llama, Mistral and Qwen2.

Attention of query head h (in KV group g, RoPE head ρ) for x_t, with H query heads, n_kv groups:

    q_t = q_proj x_t = [q_nope (d_nope) | q_rope (2r)]         per head
    c_kv_t = kv_down x_t                                      n_kv·d_kv, cached
    k_rope_t = RoPE(k_rope_proj x_t)                          2r per RoPE head, cached
    k_nope_t = k_up c_kv_t,  v_t = v_up c_kv_t                per KV group (never cached)
    score(t, s) = (q_nope,h · k_nope,g,s + RoPE(q_rope,h) · k_rope,ρ,s) / sqrt(d_h)

RoPE rotates only the kept frequency pairs, each with the source's own frequency, in the
rotate_half layout ([re_1 … re_r, im_1 … im_r]). Two ways to evaluate the same scores:

* expanded: rebuild k_nope and v from c_kv and call SDPA — used for prefill and training, where
  many queries share each rebuilt key;
* absorbed: q_nope·(W_uk c) = (W_ukᵀ q_nope)·c and Σ p_s W_uv c_s = W_uv Σ p_s c_s, so a decode
  step attends directly over the cached latent (shared by all heads, like MQA) and never rebuilds
  K or V. k_up's bias adds a per-query constant to the scores, which softmax ignores; v_up's bias
  passes through because the probabilities sum to one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from .configuration_mla import MLAConfig
from .latent_cache import LatentCache

# transformers 5.24 renamed the cache argument/output field `past_key_values` to `cache`.
CACHE_NAME = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"

# Queries per step up to which a cached forward uses the absorbed path. Measured on a 2-core CPU
# (1 thread; SmolLM2-135M shape: 9 heads, 3 KV heads, r=4; 4 layers; CPU ms per forward, absorbed vs
# expanded): 1 query over 4096 cached tokens, batch 8: 27 vs 321; 16 queries, same: 208 vs 362
# (d_kv=16), 257 vs 449 (d_kv=32), and absorbed is faster at 16 queries for every context (1024,
# 4096), batch (1, 8) and d_kv (16, 32) tried; at 32 it is slower in 4 of those 8 cases, and from 48
# on expanded wins: the rebuilt keys are then shared by enough queries.
ABSORB_MAX_QUERY = 16


class MLARMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class MLAMLP(nn.Module):
    def __init__(self, config: MLAConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_cos_sin(position_ids: torch.Tensor, inv_freq: torch.Tensor, scaling: float, dtype: torch.dtype):
    """cos/sin for positions [B, T] and per-head frequencies [n, r] → each [B, n, T, 2r]."""
    angles = position_ids[:, None, :, None].float() * inv_freq[None, :, None, :]
    angles = torch.cat((angles, angles), dim=-1)
    return (angles.cos() * scaling).to(dtype), (angles.sin() * scaling).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, n·G, T, 2r] with cos/sin [B, n, T, 2r]: head i uses RoPE head i // G."""
    groups = x.shape[1] // cos.shape[1]
    if groups > 1:
        cos, sin = cos.repeat_interleave(groups, dim=1), sin.repeat_interleave(groups, dim=1)
    return x * cos + rotate_half(x) * sin


def additive_attention_mask(attention_mask: torch.Tensor | None, batch: int, q_len: int, kv_len: int,
                            sliding_window: int | None, dtype: torch.dtype, device) -> torch.Tensor:
    """[B, 1, q_len, kv_len] additive mask: causal, padding (2D mask over all kv positions), window."""
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    k_pos = torch.arange(kv_len, device=device)[None, :]
    allowed = (k_pos <= q_pos)[None, None]
    if sliding_window is not None:
        allowed = allowed & (q_pos - k_pos < sliding_window)[None, None]
    if attention_mask is not None:
        allowed = allowed & attention_mask[:, None, None, -kv_len:].bool()
    allowed = allowed.expand(batch, 1, q_len, kv_len)
    return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)


class MLAAttention(nn.Module):
    def __init__(self, config: MLAConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv = config.num_attention_heads, config.num_key_value_heads
        self.n_rope = config.n_rope_heads
        self.head_dim, self.d_nope = config.head_dim, config.d_nope_at(layer_idx)
        self.d_rope = 2 * config.rope_pairs_at(layer_idx)
        self.scaling = config.head_dim**-0.5
        latent = config.latent_dim_at(layer_idx)
        if config.svd == "split":
            self.k_latent, self.v_latent = slice(0, latent // 2), slice(latent // 2, latent)
        else:
            self.k_latent = self.v_latent = slice(0, latent)
        k_width, v_width = len(range(latent)[self.k_latent]), len(range(latent)[self.v_latent])
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.n_heads * (self.d_nope + self.d_rope), bias=bias)
        self.k_rope_proj = nn.Linear(config.hidden_size, self.n_rope * self.d_rope, bias=bias)
        self.kv_down = nn.Linear(config.hidden_size, latent, bias=False)
        self.k_up = nn.Linear(k_width, self.n_kv * self.d_nope, bias=bias)
        self.v_up = nn.Linear(v_width, self.n_kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, config.hidden_size, bias=config.o_proj_bias)
        self.rope_scaling = config.rope_attention_scaling
        self.set_rope_pairs(config.kept_pairs[layer_idx], config.rope_inv_freq)

    def set_rope_pairs(self, kept_pairs: list[list[int]], inv_freq: list[float]) -> None:
        """Use frequencies inv_freq[k] for k in kept_pairs[ρ] on RoPE head ρ ([n_rope][r] indices)."""
        # an explicit device: from_pretrained builds modules under a meta-device context, and this
        # tensor is no parameter or buffer that loading would materialise
        self._inv_freq = torch.tensor([[inv_freq[i] for i in head] for head in kept_pairs], dtype=torch.float32,
                                      device="cpu")

    def forward(self, hidden_states, position_ids, attention_mask, cache: Cache | None = None):
        B, T, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(B, T, self.n_heads, -1).transpose(1, 2)
        q_nope, q_rope = q.split([self.d_nope, self.d_rope], dim=-1)
        k_rope = self.k_rope_proj(hidden_states).view(B, T, self.n_rope, self.d_rope).transpose(1, 2)
        self._inv_freq = self._inv_freq.to(hidden_states.device)
        cos, sin = rope_cos_sin(position_ids, self._inv_freq, self.rope_scaling, q.dtype)
        q_rope, k_rope = apply_rope(q_rope, cos, sin), apply_rope(k_rope, cos, sin)
        c_kv = self.kv_down(hidden_states).unsqueeze(1)                     # [B, 1, T, n_kv·d_kv]
        if cache is not None:
            c_kv, k_rope = cache.update(c_kv, k_rope, self.layer_idx)      # now over all S tokens
        if cache is not None and T <= ABSORB_MAX_QUERY:
            out = self._absorbed(q_nope, q_rope, c_kv, k_rope, attention_mask)
        else:
            out = self._expanded(q_nope, q_rope, c_kv, k_rope, attention_mask)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))

    def _expanded(self, q_nope, q_rope, c_kv, k_rope, attention_mask):
        B, S = c_kv.shape[0], c_kv.shape[2]
        k_nope = self.k_up(c_kv[..., self.k_latent]).view(B, S, self.n_kv, self.d_nope).transpose(1, 2)
        v = self.v_up(c_kv[..., self.v_latent]).view(B, S, self.n_kv, self.head_dim).transpose(1, 2)
        k_rope = k_rope.repeat_interleave(self.n_kv // self.n_rope, dim=1)
        k = torch.cat([k_nope, k_rope], dim=-1)                            # [B, n_kv, S, d_nope + 2r]
        q = torch.cat([q_nope, q_rope], dim=-1)                            # [B, H, T, d_nope + 2r]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, scale=self.scaling,
                                              enable_gqa=self.n_heads > self.n_kv)

    def _absorbed(self, q_nope, q_rope, c_kv, k_rope, attention_mask):
        """Attention over the latent as one shared key/value head: SDPA reads c_kv once (a fused pass),
        with the RoPE scores of every head, plus the mask, as its additive bias."""
        B, H, T, _ = q_nope.shape
        S, G = c_kv.shape[2], H // self.n_kv
        w_uk = self.k_up.weight.view(self.n_kv, self.d_nope, -1)           # [n_kv, d_nope, L_k]
        q_lat = torch.einsum("bngtd,ndl->bngtl", q_nope.reshape(B, self.n_kv, G, T, -1), w_uk)
        q_r = q_rope.reshape(B, self.n_rope, (H // self.n_rope) * T, self.d_rope)
        bias = torch.matmul(q_r, k_rope.transpose(2, 3)).view(B, H, T, S) * self.scaling
        if attention_mask is not None:
            bias = bias + attention_mask
        out_lat = F.scaled_dot_product_attention(                          # [B, 1, H·T, L_v]
            q_lat.reshape(B, 1, H * T, -1), c_kv[..., self.k_latent], c_kv[..., self.v_latent],
            attn_mask=bias.view(B, 1, H * T, S), scale=self.scaling)
        w_uv = self.v_up.weight.view(self.n_kv, self.head_dim, -1)         # [n_kv, d_h, L_v]
        out = torch.einsum("bngtl,ndl->bngtd", out_lat.view(B, self.n_kv, G, T, -1), w_uv)
        if self.v_up.bias is not None:
            out = out + self.v_up.bias.view(1, self.n_kv, 1, 1, self.head_dim)
        return out.reshape(B, H, T, self.head_dim)


class MLADecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config: MLAConfig, layer_idx: int):
        super().__init__()
        self.self_attn = MLAAttention(config, layer_idx)
        self.mlp = MLAMLP(config)
        self.input_layernorm = MLARMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = MLARMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden_states, position_ids, attention_mask, cache=None):
        attn_out = self.self_attn(self.input_layernorm(hidden_states), position_ids, attention_mask, cache)
        return self.after_attention(hidden_states, attn_out)

    def after_attention(self, hidden_states, attn_out):
        """The rest of the layer once its attention output is known: residual, then the MLP block."""
        hidden_states = hidden_states + attn_out
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class MLAPreTrainedModel(PreTrainedModel):
    config_class = MLAConfig
    config: MLAConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["MLADecoderLayer"]
    _supports_sdpa = True

    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, MLARMSNorm):
            nn.init.ones_(module.weight)


def _pick_cache(kwargs: dict) -> Cache | None:
    """The cache under either name (`cache` from transformers 5.24 on, `past_key_values` before)."""
    cache, legacy = kwargs.pop("cache", None), kwargs.pop("past_key_values", None)
    return cache if cache is not None else legacy


class MLAModel(MLAPreTrainedModel):
    def __init__(self, config: MLAConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(MLADecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = MLARMSNorm(config.hidden_size, config.rms_norm_eps)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None,
                use_cache=None, **kwargs) -> BaseModelOutputWithPast:
        cache = _pick_cache(kwargs)
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        B, T, _ = inputs_embeds.shape
        if use_cache and cache is None:
            cache = LatentCache(self.config)
        past = cache.get_seq_length() if cache is not None else 0
        if position_ids is None:
            if attention_mask is not None:  # count real tokens, so left padding does not shift positions
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)[:, -T:]
            else:
                position_ids = torch.arange(past, past + T, device=inputs_embeds.device)[None].expand(B, T)
        mask = additive_attention_mask(attention_mask, B, T, past + T, self.config.sliding_window,
                                       inputs_embeds.dtype, inputs_embeds.device)
        hidden = inputs_embeds
        for layer in self.layers:
            hidden = layer(hidden, position_ids, mask, cache)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden), **{CACHE_NAME: cache})


class MLAForCausalLM(MLAPreTrainedModel, GenerationMixin):
    """The MLA decoder with its LM head.

    `generate()` caches with a LatentCache (c_kv and k_rope only) and decodes through the absorbed
    path. Its storage follows `config.kv_bits` (16: the model's dtype; 4 or 2: packed integers with
    the newest `config.kv_residual` tokens kept exact); to choose per call, pass one:
    `model.generate(ids, cache=LatentCache(model.config, kv_bits=4))` (`past_key_values=` before
    transformers 5.24). `use_cache=False` recomputes every step without a cache.
    """

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: MLAConfig):
        super().__init__(config)
        self.model = MLAModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None,
                labels=None, use_cache=None, logits_to_keep: int = 0, **kwargs) -> CausalLMOutputWithPast:
        cache = _pick_cache(kwargs)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         inputs_embeds=inputs_embeds, use_cache=use_cache, **{CACHE_NAME: cache})
        hidden = out.last_hidden_state
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size,
                                      **{k: v for k, v in kwargs.items() if k == "num_items_in_batch"})
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE_NAME: getattr(out, CACHE_NAME)})

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        """generate() gets a LatentCache(config) — so config.kv_bits — unless the caller passed a cache
        or turned caching off."""
        if (model_kwargs.get(CACHE_NAME) is None and generation_config.use_cache is not False
                and generation_config.cache_implementation is None):
            model_kwargs[CACHE_NAME] = LatentCache(self.config)
        return super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
