"""Configuration of a Multi-head Latent Attention (MLA) decoder converted from an MHA/GQA model.

The transformer around attention is the source family's (Llama, Mistral, Qwen2: RMSNorm, SwiGLU MLP,
optional q/k/v bias, optional sliding window); its fields keep their source names. What MLA adds:

* `d_kv`: the cache size in the paper's terms. A "per_head" model is the paper's layout and d_kv
  is its latent width per KV head: `latent_dim` = n_kv·d_kv. A "shared" model is named by the
  paper's default layout (d_h/16 RoPE pairs per KV head) that caches as many values:
  n_kv·(d_kv + 2·d_h/16) = latent_dim + 2r, so d_kv only names its size (SmolLM2 at 72 values:
  d_kv = 16, with a 56-wide latent and 16 RoPE dims). `latent_dim` follows from d_kv by these
  equations unless given; a conversion gives both (d_kv may then be fractional, e.g. for budgets
  that are not a multiple of n_kv, or the mean over layers of different widths).
* `rope_pairs` (r): frequency pairs that keep RoPE per rope head; `kept_pairs[layer][rope_head]`
  lists them as indices into `rope_inv_freq` (the source's own frequencies, scaling included).
* `rope_layout`: "per_head" (one RoPE key of 2r dims per KV head, the paper's partial RoPE) or
  "shared" (one RoPE key of 2r dims shared by every query head, DeepSeek's k_pe layout).
* `layer_rope_pairs`, `layer_latent_dims`: per-layer values of r and latent_dim where a conversion
  split each layer's budget on its own (None: every layer uses `rope_pairs` and `latent_dim`).
* the position-free query/key part of a head has d_h − 2r dims ("per_head") or d_h ("shared").
* `svd`: "joint" (K and V read the whole latent) or "split" (each reads its own half).
* `latent_norm`: an RMSNorm (`kv_norm`) on c_kv before it is cached, as DeepSeek's `kv_a_layernorm`;
  a model made with it exports to the DeepSeek-V3 format exactly (False in checkpoints made without
  it). `latent_norm_eps`: its eps, one number or one per layer (a large eps keeps the norm near-linear
  at the latent's natural scale; see latent_norm.py).
* `kv_bits`: default bit width of the latent cache (16 = unquantized, 4 or 2 = packed integers with
  `kv_residual` recent tokens kept in full precision, groups of `kv_group_size` values).

KV cache per token of layer i = latent_dim_i + n_rope_heads·2r_i values; `kv_elements_per_token_per_layer`
is their mean over layers. This file is the one place for KV-size arithmetic: the MLA cache (16-bit
and packed int4/int2, the layout latent_cache.py stores), the source's 2·n_kv·d_h, a DeepSeek-V3
export's kv_lora_rank + qk_rope_head_dim, the paper's d_kv, and the kv-size report built on them.
"""

from transformers import PretrainedConfig


def head_dim_of(config) -> int:
    """A config's head size (its `head_dim`, else hidden_size / heads)."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def paper_rope_pairs(head_dim: int) -> int:
    """The paper's default RoPE pairs per KV head: d_h/16 (at least one)."""
    return max(1, head_dim // 16)


def paper_cache_values(n_kv: int, head_dim: int, d_kv: float) -> float:
    """Values per token per layer the paper's layout caches at d_kv: n_kv·(d_kv + 2·d_h/16)."""
    return n_kv * (d_kv + 2 * paper_rope_pairs(head_dim))


def group_size_for(width: int, group_size: int) -> int:
    """The largest divisor of `width` not above `group_size` (quantization groups tile a token's vector)."""
    return max(g for g in range(1, min(width, group_size) + 1) if width % g == 0)


def quantized_bytes_per_token(width: int, bits: int, group_size: int) -> float:
    """Bytes one token's vector of `width` values costs quantized: codes + fp16 scale and zero per group."""
    groups = width // group_size_for(width, group_size)
    return width * bits / 8 + groups * 2 * 2


class MLAConfig(PretrainedConfig):
    model_type = "mla"
    keys_to_ignore_at_inference = ["past_key_values", "cache"]

    def __init__(
        self,
        vocab_size=32000,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=None,
        hidden_act="silu",
        max_position_embeddings=2048,
        initializer_range=0.02,
        rms_norm_eps=1e-6,
        use_cache=True,
        tie_word_embeddings=False,
        attention_bias=False,
        o_proj_bias=False,
        mlp_bias=False,
        sliding_window=None,
        rope_theta=10000.0,
        rope_inv_freq=None,
        rope_attention_scaling=1.0,
        d_kv=None,
        latent_dim=None,
        rope_pairs=4,
        kept_pairs=None,
        rope_layout="per_head",
        layer_rope_pairs=None,
        layer_latent_dims=None,
        svd="joint",
        kv_bits=16,
        kv_residual=128,
        kv_group_size=32,
        latent_norm=False,
        latent_norm_eps=1e-6,
        source_model=None,
        source_family="llama",
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.hidden_act = hidden_act
        self.max_position_embeddings = max_position_embeddings
        self.initializer_range = initializer_range
        self.rms_norm_eps = rms_norm_eps
        self.use_cache = use_cache
        self.attention_bias = attention_bias
        self.o_proj_bias = o_proj_bias
        self.mlp_bias = mlp_bias
        self.sliding_window = sliding_window
        self.rope_theta = rope_theta
        half = self.head_dim // 2
        self.rope_inv_freq = rope_inv_freq or [rope_theta ** (-2 * i / self.head_dim) for i in range(half)]
        self.rope_attention_scaling = rope_attention_scaling
        self.rope_pairs = rope_pairs
        self.rope_layout = rope_layout
        if latent_dim is None:
            d_kv = 16 if d_kv is None else d_kv
            latent_dim = (num_key_value_heads * d_kv if rope_layout == "per_head" else
                          int(paper_cache_values(num_key_value_heads, self.head_dim, d_kv)) - 2 * rope_pairs)
        self.latent_dim = latent_dim
        self.layer_rope_pairs = layer_rope_pairs
        self.layer_latent_dims = layer_latent_dims
        n_rope_heads = num_key_value_heads if rope_layout == "per_head" else 1
        self.kept_pairs = kept_pairs or [[list(range(half - self.rope_pairs_at(i), half))] * n_rope_heads
                                         for i in range(num_hidden_layers)]
        self.d_kv = self.paper_d_kv() if d_kv is None else d_kv
        self.svd = svd
        self.kv_bits = kv_bits
        self.kv_residual = kv_residual
        self.kv_group_size = kv_group_size
        self.latent_norm = latent_norm
        self.latent_norm_eps = latent_norm_eps
        self.source_model = source_model
        self.source_family = source_family
        super().__init__(pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                         tie_word_embeddings=tie_word_embeddings, **kwargs)

    @property
    def n_rope_heads(self) -> int:
        return self.num_key_value_heads if self.rope_layout == "per_head" else 1

    def rope_pairs_at(self, layer: int) -> int:
        return self.layer_rope_pairs[layer] if self.layer_rope_pairs else self.rope_pairs

    def latent_norm_eps_at(self, layer: int) -> float:
        eps = self.latent_norm_eps
        return eps[layer] if isinstance(eps, list) else eps

    def latent_dim_at(self, layer: int) -> int:
        return self.layer_latent_dims[layer] if self.layer_latent_dims else self.latent_dim

    def d_nope_at(self, layer: int) -> int:
        return self.head_dim - 2 * self.rope_pairs_at(layer) if self.rope_layout == "per_head" else self.head_dim

    def kv_elements_at(self, layer: int) -> int:
        return self.latent_dim_at(layer) + self.n_rope_heads * 2 * self.rope_pairs_at(layer)

    @property
    def kv_elements_per_token_per_layer(self) -> float:
        per_layer = [self.kv_elements_at(i) for i in range(self.num_hidden_layers)]
        mean = sum(per_layer) / len(per_layer)
        return int(mean) if mean == int(mean) else mean

    def paper_d_kv(self) -> int | float:
        """The d_kv that names this cache in the paper's terms: the latent per KV head ("per_head"), or the
        d_kv of the paper's layout caching as many values ("shared"); the mean over layers."""
        n_kv = self.num_key_value_heads
        if self.rope_layout == "per_head":
            width = sum(self.latent_dim_at(i) for i in range(self.num_hidden_layers)) / self.num_hidden_layers / n_kv
        else:
            width = self.kv_elements_per_token_per_layer / n_kv - 2 * paper_rope_pairs(self.head_dim)
        return int(width) if width == int(width) else round(width, 2)

    def kv_bytes_per_token_per_layer(self, bits: int = 16, dtype_bytes: int = 2) -> float:
        """Cache bytes per token and layer (mean over layers) at long context (the full-precision residual
        window excluded): c_kv quantized as one vector of latent_dim values per token, k_rope as one of 2r
        values per RoPE head and token (the layouts latent_cache stores)."""
        def layer_bytes(i: int) -> float:
            if bits == 16:
                return self.kv_elements_at(i) * dtype_bytes
            latent, rope = self.latent_dim_at(i), 2 * self.rope_pairs_at(i)
            return (quantized_bytes_per_token(latent, bits, self.kv_group_size)
                    + self.n_rope_heads * quantized_bytes_per_token(rope, bits, self.kv_group_size))

        return sum(layer_bytes(i) for i in range(self.num_hidden_layers)) / self.num_hidden_layers


def kv_values(config) -> int | float:
    """Cached values per token per layer of any model mha2mla reads: an MLA model's latent + RoPE keys, a
    DeepSeek-V3 export's kv_lora_rank + qk_rope_head_dim, an MHA/GQA source's keys and values 2·n_kv·d_h."""
    kind = getattr(config, "model_type", None)
    if kind == "mla":
        return config.kv_elements_per_token_per_layer
    if kind == "deepseek_v3":
        return config.kv_lora_rank + config.qk_rope_head_dim
    return 2 * config.num_key_value_heads * head_dim_of(config)


def source_kv_values(config) -> int:
    """Cached values per token per layer of the model `config`'s model was made from: an MLA model's
    source (its head geometry), the source an export records (else the MHA cache of its heads), or the
    model itself."""
    kind = getattr(config, "model_type", None)
    if kind == "mla":
        return 2 * config.num_key_value_heads * config.head_dim
    if kind == "deepseek_v3":
        export = getattr(config, "mha2mla_export", None) or {}
        return export.get("source_kv_values_per_token_per_layer",
                          config.num_attention_heads * (config.qk_head_dim + config.v_head_dim))
    return kv_values(config)


def kv_report(config, source_config=None, dtype_bytes: int = 2, original_config=None) -> dict:
    """The kv-size report (DESIGN.md's JSON): values and bytes per token per layer, the source's bytes and
    the reduction against `source_config` (default: the model's own source); `original_config`: the
    un-expanded model when the source was expanded to MHA. MLA models add d_kv, the per-layer spread and
    the int4/int2 rows."""
    values = kv_values(config)
    source = kv_values(source_config) if source_config is not None else source_kv_values(config)
    report = {"kv_elements_per_token_per_layer": values, "kv_bytes_per_token": values * dtype_bytes,
              "source_kv_bytes_per_token": source * dtype_bytes, "reduction_pct": 100.0 * (1 - values / source),
              "num_layers": config.num_hidden_layers, "dtype_bytes": dtype_bytes}
    if original_config is not None:
        report["reduction_vs_original_pct"] = 100.0 * (1 - values / kv_values(original_config))
    if getattr(config, "model_type", None) == "mla":
        per_layer = [config.kv_elements_at(i) for i in range(config.num_hidden_layers)]
        report["d_kv"] = config.d_kv
        report["per_layer"] = {"min": min(per_layer), "mean": sum(per_layer) / len(per_layer), "max": max(per_layer)}
        report["quantized"] = {str(bits): {"kv_bytes_per_token": config.kv_bytes_per_token_per_layer(bits),
                                           "reduction_pct": 100.0 * (1 - config.kv_bytes_per_token_per_layer(bits)
                                                                     / (source * dtype_bytes))}
                               for bits in (4, 2)}
    return report
