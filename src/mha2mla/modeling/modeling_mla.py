"""Multi-head Latent Attention (MLA) decoder, for models converted from MHA/GQA by MHA2MLA.

Self-contained (torch + transformers only): this file, configuration_mla.py and latent_cache.py are
copied into every checkpoint, so `AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`
works where mha2mla is not installed. The blocks around attention are the source family's
(RMSNorm, SwiGLU MLP, optional q/k/v bias); one model class serves Llama, Mistral and Qwen2.

Attention of query head h (in KV group g, RoPE head ρ) for x_t, with H query heads, n_kv groups:

    q_t = q_proj x_t = [q_nope (d_nope) | q_rope (2r)]         per head
    c_kv_t = kv_down x_t  (RMSNorm'd by kv_norm with config.latent_norm)   n_kv·d_kv, cached
    k_rope_t = RoPE(k_rope_proj x_t)                          2r per RoPE head, cached
    k_nope_t = k_up c_kv_t,  v_t = v_up c_kv_t                per KV group (never cached)
    score(t, s) = (q_nope,h · k_nope,g,s + RoPE(q_rope,h) · k_rope,ρ,s) / sqrt(d_h)

RoPE rotates only the kept frequency pairs, each with the source's own frequency, in the
rotate_half layout ([re_1 … re_r, im_1 … im_r]). Two ways to evaluate the same scores:

* expanded: rebuild k_nope and v from c_kv for every cached token and attend as GQA with
  transformers' attention function of `config._attn_implementation` (eager, sdpa, flash);
* absorbed: q_nope·(W_uk c) = (W_ukᵀ q_nope)·c and Σ p_s W_uv c_s = W_uv Σ p_s c_s, so queries
  attend directly over the cached latent, as multi-query attention with one key
  [c_kv | k_rope_ρ] per RoPE head and the latent as value, and K and V are never rebuilt. k_up's
  bias adds a per-query constant to the scores, which softmax ignores; v_up's bias passes through
  because the probabilities sum to one.

A cached forward takes whichever costs fewer multiply-adds for its query and key counts (see
`absorbed_is_cheaper`): a decode step and a prefill chunk over a long cached past are absorbed, so a
token's latent is never expanded again; a forward without a past is expanded. Fused attention kernels
want one head size for queries, keys and values, so the narrower side is zero-padded (zeros change
no score and the padded output columns are dropped); in the absorbed form with a joint latent the
value is the key itself, whose first columns are the latent.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils import can_return_tuple
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

from .configuration_mla import MLAConfig
from .latent_cache import LatentCache

# transformers 5.24 renamed the cache argument/output field `past_key_values` to `cache`.
CACHE_NAME = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"

# Attention implementations whose masks (None, boolean or additive, [B, 1, T, S]) torch's SDPA
# takes as they are, so the absorbed form can use them; with others every forward is expanded.
SDPA_MASKS = ("sdpa", "eager")


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


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, n·G, T, 2r] with cos/sin [B, n, T, 2r]: head i uses RoPE head i // G."""
    groups = x.shape[1] // cos.shape[1]
    if groups > 1:
        cos, sin = cos.repeat_interleave(groups, dim=1), sin.repeat_interleave(groups, dim=1)
    return x * cos + rotate_half(x) * sin


def pad_last(x: torch.Tensor, width: int) -> torch.Tensor:
    """x zero-padded on its last dim to `width` (as it is when already that wide)."""
    return F.pad(x, (0, width - x.shape[-1])) if x.shape[-1] < width else x


def eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Attention by explicit softmax(q·kᵀ·scaling + mask)·v, GQA by repeating K/V; output [B, T, H, D]."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            attention_mask = torch.zeros_like(attention_mask, dtype=weights.dtype).masked_fill(
                ~attention_mask, torch.finfo(weights.dtype).min)
        weights = weights + attention_mask
    weights = F.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = F.dropout(weights, p=dropout, training=module.training)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


class MLARotaryEmbedding(nn.Module):
    """cos/sin of one layer's kept frequency pairs: `inv_freq[ρ, i]` is the source's frequency of the
    i-th pair kept on RoPE head ρ (a non-persistent buffer, rebuilt from the config on loading)."""

    def __init__(self, config: MLAConfig, layer_idx: int):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        self.scaling = config.rope_attention_scaling
        self.register_buffer("inv_freq", self.frequencies(config.kept_pairs[layer_idx], config.rope_inv_freq),
                             persistent=False)

    @staticmethod
    def frequencies(kept_pairs: list[list[int]], inv_freq: list[float]) -> torch.Tensor:
        """[n_rope, r] frequencies inv_freq[k] for k in kept_pairs[ρ]."""
        return torch.tensor([[inv_freq[i] for i in head] for head in kept_pairs], dtype=torch.float32)

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for positions [B, T] → each [B, n_rope, T, 2r]."""
        angles = position_ids[:, None, :, None].float() * self.inv_freq.float()[None, :, None, :]
        angles = torch.cat((angles, angles), dim=-1)
        return (angles.cos() * self.scaling).to(dtype), (angles.sin() * self.scaling).to(dtype)


class MLAAttention(nn.Module):
    def __init__(self, config: MLAConfig, layer_idx: int):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        self.n_heads, self.n_kv = config.num_attention_heads, config.num_key_value_heads
        self.n_rope = config.n_rope_heads
        self.num_key_value_groups = self.n_heads // self.n_kv   # read by transformers' attention functions
        self.is_causal = True
        self.head_dim, self.d_nope = config.head_dim, config.d_nope_at(layer_idx)
        self.d_rope = 2 * config.rope_pairs_at(layer_idx)
        self.scaling = config.head_dim**-0.5
        latent = config.latent_dim_at(layer_idx)
        if config.svd == "split":
            self.k_latent, self.v_latent = slice(0, latent // 2), slice(latent // 2, latent)
        else:
            self.k_latent = self.v_latent = slice(0, latent)
        self.k_width, self.v_width = len(range(latent)[self.k_latent]), len(range(latent)[self.v_latent])
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.n_heads * (self.d_nope + self.d_rope), bias=bias)
        self.k_rope_proj = nn.Linear(config.hidden_size, self.n_rope * self.d_rope, bias=bias)
        self.kv_down = nn.Linear(config.hidden_size, latent, bias=False)
        self.kv_norm = MLARMSNorm(latent, config.latent_norm_eps_at(layer_idx)) if config.latent_norm else None
        self.k_up = nn.Linear(self.k_width, self.n_kv * self.d_nope, bias=bias)
        self.v_up = nn.Linear(self.v_width, self.n_kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, config.hidden_size, bias=config.o_proj_bias)
        self.rotary_emb = MLARotaryEmbedding(config, layer_idx)

    def set_rope_pairs(self, kept_pairs: list[list[int]], inv_freq: list[float]) -> None:
        """Use frequencies inv_freq[k] for k in kept_pairs[ρ] on RoPE head ρ ([n_rope][r] indices)."""
        self.rotary_emb.inv_freq = MLARotaryEmbedding.frequencies(kept_pairs, inv_freq).to(self.q_proj.weight.device)

    def absorbed_is_cheaper(self, queries: int, keys: int) -> bool:
        """Whether attending over the latent costs fewer multiply-adds than rebuilding K and V for `keys`
        tokens: absorbed = H·T·S·2·(L_k + 2r) + H·T·(d_nope·L_k + L_v·d_h) (scores and latent values
        at the absorbed width, plus the query and output maps); expanded = H·T·S·2·max(d_nope + 2r, d_h)
        + S·n_kv·(L_k·d_nope + L_v·d_h) (scores and values, plus rebuilding K and V)."""
        H, T, S = self.n_heads, queries, keys
        absorbed = H * T * S * 2 * (self.k_width + self.d_rope) + H * T * (
            self.d_nope * self.k_width + self.v_width * self.head_dim)
        expanded = H * T * S * 2 * max(self.d_nope + self.d_rope, self.head_dim) + S * self.n_kv * (
            self.k_width * self.d_nope + self.v_width * self.head_dim)
        return absorbed <= expanded

    def forward(self, hidden_states, position_ids, attention_mask=None, cache: Cache | None = None, **kwargs):
        B, T, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(B, T, self.n_heads, -1).transpose(1, 2)
        q_nope, q_rope = q.split([self.d_nope, self.d_rope], dim=-1)
        k_rope = self.k_rope_proj(hidden_states).view(B, T, self.n_rope, self.d_rope).transpose(1, 2)
        cos, sin = self.rotary_emb(position_ids, q.dtype)
        q_rope, k_rope = apply_rope(q_rope, cos, sin), apply_rope(k_rope, cos, sin)
        c_kv = self.kv_down(hidden_states)
        if self.kv_norm is not None:
            c_kv = self.kv_norm(c_kv)
        c_kv = c_kv.unsqueeze(1)                                            # [B, 1, T, n_kv·d_kv]
        if cache is not None:
            c_kv, k_rope = cache.update(c_kv, k_rope, self.layer_idx)      # now over all S tokens
        if (cache is not None and self.config._attn_implementation in SDPA_MASKS
                and self.absorbed_is_cheaper(T, c_kv.shape[2])):
            out = self.absorbed(q_nope, q_rope, c_kv, k_rope, attention_mask)
        else:
            out = self.expanded(q_nope, q_rope, c_kv, k_rope, attention_mask, **kwargs)
        return self.o_proj(out.reshape(B, T, -1))

    def expanded(self, q_nope, q_rope, c_kv, k_rope, attention_mask, **kwargs):
        """K and V rebuilt for every token, attended as GQA by the configured attention function → [B, T, H, d_h]."""
        B, S = c_kv.shape[0], c_kv.shape[2]
        k_nope = self.k_up(c_kv[..., self.k_latent]).view(B, S, self.n_kv, self.d_nope).transpose(1, 2)
        v = self.v_up(c_kv[..., self.v_latent]).view(B, S, self.n_kv, self.head_dim).transpose(1, 2)
        k_rope = k_rope.repeat_interleave(self.n_kv // self.n_rope, dim=1)
        width = max(self.d_nope + self.d_rope, self.head_dim)
        q = pad_last(torch.cat([q_nope, q_rope], dim=-1), width)           # [B, H, T, width]
        k = pad_last(torch.cat([k_nope, k_rope], dim=-1), width)           # [B, n_kv, S, width]
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
        out, _ = attention(self, q, k, pad_last(v, width), attention_mask, dropout=0.0, scaling=self.scaling, **kwargs)
        return out[..., :self.head_dim]

    def absorbed(self, q_nope, q_rope, c_kv, k_rope, attention_mask):
        """Multi-query attention over the latent (one key head per RoPE head) → [B, T, H, d_h]."""
        B, H, T, _ = q_nope.shape
        S, G = c_kv.shape[2], H // self.n_kv
        w_uk = self.k_up.weight.view(self.n_kv, self.d_nope, -1)           # [n_kv, d_nope, L_k]
        q_lat = torch.einsum("bngtd,ndl->bngtl", q_nope.reshape(B, self.n_kv, G, T, -1), w_uk)
        q_lat = q_lat.reshape(B, H, T, -1)                                 # [B, H, T, L_k]
        if T == 1:
            out_lat = self.latent_scores_attention(q_lat, q_rope, c_kv, k_rope, attention_mask)
        else:
            q = torch.cat([q_lat, q_rope], dim=-1)                         # [B, H, T, L_k + 2r]
            c_k = c_kv[..., self.k_latent].expand(B, self.n_rope, S, self.k_width)
            k = torch.cat([c_k, k_rope], dim=-1)                           # [B, n_rope, S, L_k + 2r]
            if self.v_latent == self.k_latent:
                v = k                                                      # its first L_v columns are c_kv
            else:
                v = pad_last(c_kv[..., self.v_latent], k.shape[-1]).expand(B, self.n_rope, S, k.shape[-1])
            out_lat = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, scale=self.scaling,
                                                     is_causal=attention_mask is None, enable_gqa=H > self.n_rope)
        out_lat = out_lat[..., :self.v_width]
        w_uv = self.v_up.weight.view(self.n_kv, self.head_dim, -1)         # [n_kv, d_h, L_v]
        out = torch.einsum("bngtl,ndl->btngd", out_lat.reshape(B, self.n_kv, G, T, -1), w_uv)
        if self.v_up.bias is not None:
            out = out + self.v_up.bias.view(1, 1, self.n_kv, 1, self.head_dim)
        return out.reshape(B, T, H, self.head_dim)

    def latent_scores_attention(self, q_lat, q_rope, c_kv, k_rope, attention_mask):
        """One query per head: scores as the sum of two products against the cached tensors as they
        lie (the heads of each RoPE head as its rows), so the latent is read twice and never copied."""
        B, H = q_lat.shape[:2]
        rows = H // self.n_rope
        scores = (torch.matmul(q_lat.view(B, self.n_rope, rows, -1), c_kv[..., self.k_latent].transpose(2, 3))
                  + torch.matmul(q_rope.view(B, self.n_rope, rows, -1), k_rope.transpose(2, 3))) * self.scaling
        if attention_mask is not None:
            scores = (scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
                      if attention_mask.dtype == torch.bool else scores + attention_mask)
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q_lat.dtype)
        return torch.matmul(probs, c_kv[..., self.v_latent]).view(B, H, 1, -1)


class MLADecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config: MLAConfig, layer_idx: int):
        super().__init__()
        self.self_attn = MLAAttention(config, layer_idx)
        self.mlp = MLAMLP(config)
        self.input_layernorm = MLARMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = MLARMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden_states, position_ids, attention_mask=None, cache=None, **kwargs):
        hidden_states = hidden_states + self.self_attn(self.input_layernorm(hidden_states), position_ids,
                                                       attention_mask, cache, **kwargs)
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class MLAPreTrainedModel(PreTrainedModel):
    config_class = MLAConfig
    config: MLAConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["MLADecoderLayer"]
    _supports_sdpa = True
    _supports_flash_attn = True
    _can_record_outputs = {"hidden_states": MLADecoderLayer}

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
        elif isinstance(module, MLARotaryEmbedding):
            with torch.no_grad():
                module.inv_freq.copy_(module.frequencies(self.config.kept_pairs[module.layer_idx],
                                                         self.config.rope_inv_freq))


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

    @merge_with_config_defaults
    @capture_outputs
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache: Cache | None = None,
                inputs_embeds=None, use_cache=None, past_key_values: Cache | None = None,
                **kwargs) -> BaseModelOutputWithPast:
        cache = cache if cache is not None else past_key_values   # the name before transformers 5.24
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        B, T, _ = inputs_embeds.shape
        if use_cache and cache is None:
            cache = LatentCache(self.config)
        if position_ids is None:
            if attention_mask is not None:  # count real tokens, so left padding does not shift positions
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)[:, -T:]
            else:
                past = cache.get_seq_length() if cache is not None else 0
                position_ids = torch.arange(past, past + T, device=inputs_embeds.device)[None].expand(B, T)
        make_mask = create_sliding_window_causal_mask if self.config.sliding_window else create_causal_mask
        mask = make_mask(self.config, inputs_embeds, attention_mask, cache, position_ids)
        hidden = inputs_embeds
        for layer in self.layers:
            hidden = layer(hidden, position_ids, mask, cache, **kwargs)
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

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache: Cache | None = None,
                inputs_embeds=None, labels=None, use_cache=None, logits_to_keep: int = 0,
                past_key_values: Cache | None = None, **kwargs) -> CausalLMOutputWithPast:
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         cache=cache if cache is not None else past_key_values, inputs_embeds=inputs_embeds,
                         use_cache=use_cache, **kwargs)
        hidden = out.last_hidden_state
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits, hidden_states=out.hidden_states,
                                      **{CACHE_NAME: getattr(out, CACHE_NAME)})

    def prepare_inputs_for_generation(self, input_ids, *args, **kwargs):
        """generate()'s default cache for this model is a LatentCache(config), so config.kv_bits: an empty
        plain DynamicCache (what generate makes when no cache is passed) is replaced by one; any other
        cache is used as it is."""
        cache = kwargs.get(CACHE_NAME)
        if type(cache) is DynamicCache and cache.get_seq_length() == 0:
            kwargs[CACHE_NAME] = LatentCache(self.config)
        return super().prepare_inputs_for_generation(input_ids, *args, **kwargs)
