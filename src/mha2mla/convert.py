"""MHA/GQA source → MLA model: the MHA2MLA conversion, one layer at a time.

For each layer, from calibration statistics:
  1. choose the kept RoPE pairs per KV head (partial_rope);
  2. q_proj rows of each head are reordered to [NoPE dims | RoPE dims]; k_rope_proj takes the kept
     pairs' rows of W_k;
  3. the NoPE rows of W_k and all of W_v are factored into kv_down, k_up, v_up (lowrank).
Everything else (embeddings, norms, MLP, o_proj, biases) is copied. With all pairs kept and full
rank the MLA model computes exactly what the source does.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from .calibration import calibrate, source_layer_step
from .checkpoint import save_mla
from .data import default_train_text, pack_blocks
from .errors import UserError
from .evaluate.kv_memory import kv_report
from .expand import expand_to_mha
from .lowrank import cholesky_factor, joint_factors, key_row_weight, value_row_weight
from .modeling import MLAConfig, MLAForCausalLM
from .partial_rope import check_rope_pairs, select_pairs, split_dims
from .sources import check_family, load_source

INITS = ("weight", "activation", "output")


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def max_d_kv(config, rope_pairs: int) -> int:
    """The largest d_kv: the rank of [W_k_nope; W_v] is at most min(rows, hidden) (split: per half)."""
    d_h, n_kv = head_dim_of(config), config.num_key_value_heads
    rows = n_kv * (2 * d_h - 2 * rope_pairs)
    return min(rows, config.hidden_size) // n_kv


def check_output_dir(out, overwrite: bool) -> None:
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise UserError(f"output {out} exists and is not empty (pass --overwrite or choose another directory)")


def mla_config_for(source_config, rope_pairs: int, d_kv: int, svd: str, kept_pairs, inv_freq, scaling,
                   source_name: str) -> MLAConfig:
    c = source_config
    family = c.model_type
    sliding = c.sliding_window if family == "mistral" or getattr(c, "use_sliding_window", False) else None
    return MLAConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=head_dim_of(c), hidden_act=c.hidden_act,
        max_position_embeddings=c.max_position_embeddings, initializer_range=c.initializer_range,
        rms_norm_eps=c.rms_norm_eps, tie_word_embeddings=c.tie_word_embeddings,
        attention_bias=bool(getattr(c, "attention_bias", family == "qwen2")),
        o_proj_bias=bool(getattr(c, "attention_bias", False)) and family != "qwen2",
        mlp_bias=bool(getattr(c, "mlp_bias", False)), sliding_window=sliding,
        rope_theta=(getattr(c, "rope_parameters", None) or {}).get("rope_theta", getattr(c, "rope_theta", None)),
        rope_inv_freq=inv_freq, rope_attention_scaling=scaling, d_kv=d_kv, rope_pairs=rope_pairs,
        kept_pairs=kept_pairs, svd=svd, source_model=source_name, source_family=family,
        pad_token_id=c.pad_token_id, bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id)


def rows(weight: torch.Tensor, heads: int, dims_per_head: list[list[int]]) -> torch.Tensor:
    """Select, head by head, the given dims (rows) of a [heads·d_h, …] projection."""
    per_head = weight.view(heads, -1, *weight.shape[1:])
    return torch.cat([per_head[h, dims] for h, dims in enumerate(dims_per_head)])


def output_weights(src_attn, nope, stats, groups: int, d_h: int, kv_balance: float):
    """Block-diagonal output-side weights (S_k, S_v) of the key and value rows (see lowrank)."""
    w_q = src_attn.q_proj.weight.view(-1, d_h, src_attn.q_proj.weight.shape[-1])
    b_q = src_attn.q_proj.bias.view(-1, d_h) if src_attn.q_proj.bias is not None else None
    w_o = src_attn.o_proj.weight.view(src_attn.o_proj.weight.shape[0], -1, d_h)
    s_k, s_v = [], []
    for g, dims in enumerate(nope):
        heads = range(g * groups, (g + 1) * groups)
        s_k.append(key_row_weight([w_q[h, dims] for h in heads],
                                  [b_q[h, dims] if b_q is not None else None for h in heads],
                                  stats.cov, stats.mean, d_h))
        s_v.append(value_row_weight([w_o[:, h] for h in heads]) * kv_balance**0.5)
    return torch.block_diag(*s_k), torch.block_diag(*s_v)


def convert_layer(src_attn, dst_attn, kept: list[list[int]], stats, d_kv: int, svd: str, init: str,
                  kv_balance: float = 1.0) -> None:
    """Fill one MLA attention layer from the source attention layer."""
    n_heads, n_kv, d_h = dst_attn.n_heads, dst_attn.n_kv, dst_attn.head_dim
    groups = n_heads // n_kv
    nope, rope = zip(*(split_dims(k, d_h) for k in kept))            # per KV head
    q_dims = [list(nope[h // groups]) + list(rope[h // groups]) for h in range(n_heads)]
    w_k, w_v = src_attn.k_proj.weight, src_attn.v_proj.weight
    with torch.no_grad():
        dst_attn.q_proj.weight.copy_(rows(src_attn.q_proj.weight, n_heads, q_dims))
        dst_attn.k_rope_proj.weight.copy_(rows(w_k, n_kv, list(rope)))
        chol = cholesky_factor(stats.cov) if init != "weight" else None
        k_weight = v_weight = None
        if init == "output":
            k_weight, v_weight = output_weights(src_attn, nope, stats, groups, d_h, kv_balance)
        down, k_up, v_up = joint_factors(rows(w_k, n_kv, list(nope)), w_v, n_kv * d_kv, svd, chol,
                                         k_weight, v_weight)
        dst_attn.kv_down.weight.copy_(down)
        dst_attn.k_up.weight.copy_(k_up)
        dst_attn.v_up.weight.copy_(v_up)
        dst_attn.o_proj.weight.copy_(src_attn.o_proj.weight)
        if src_attn.q_proj.bias is not None:
            dst_attn.q_proj.bias.copy_(rows(src_attn.q_proj.bias, n_heads, q_dims))
            dst_attn.k_rope_proj.bias.copy_(rows(src_attn.k_proj.bias, n_kv, list(rope)))
            dst_attn.k_up.bias.copy_(rows(src_attn.k_proj.bias, n_kv, list(nope)))
            dst_attn.v_up.bias.copy_(src_attn.v_proj.bias)
        if src_attn.o_proj.bias is not None:
            dst_attn.o_proj.bias.copy_(src_attn.o_proj.bias)


def copy_layer_rest(src_layer, mla_layer) -> None:
    """A decoder layer's norms and MLP: same names in both models."""
    with torch.no_grad():
        for name in ("input_layernorm", "post_attention_layernorm", "mlp"):
            getattr(mla_layer, name).load_state_dict(getattr(src_layer, name).state_dict())


def copy_outer(source, mla) -> None:
    """Embeddings, final norm and LM head."""
    with torch.no_grad():
        mla.model.embed_tokens.load_state_dict(source.model.embed_tokens.state_dict())
        mla.model.norm.load_state_dict(source.model.norm.state_dict())
        if not mla.config.tie_word_embeddings:
            mla.lm_head.load_state_dict(source.lm_head.state_dict())


def validate(config, d_kv: int, rope_pairs: int, rope_strategy: str, svd: str, init: str) -> None:
    check_rope_pairs(rope_pairs, head_dim_of(config), rope_strategy)
    if init not in INITS:
        raise UserError(f"unknown --init {init}: use weight, activation or output")
    if svd not in ("joint", "split"):
        raise UserError(f"unknown --svd {svd}: use joint or split")
    limit = max_d_kv(config, rope_pairs)
    if not 1 <= d_kv <= limit:
        raise UserError(f"--d-kv {d_kv} is out of range: use 1 … {limit} (the rank available with "
                        f"{config.num_key_value_heads} KV heads and r={rope_pairs})")
    if svd == "split" and (config.num_key_value_heads * d_kv) % 2:
        raise UserError("--svd split needs an even latent width n_kv·d_kv: choose an even --d-kv")


@torch.no_grad()
def convert_model(source, out=None, *, d_kv: int = 16, rope_pairs: int | None = None,
                  rope_strategy: str = "2-norm", svd: str = "joint", init: str = "activation",
                  as_mha: bool = False, calib_data=None, calib_samples: int = 16, calib_seq_len: int = 512,
                  kv_balance: float = 1.0, sequential: bool = True, overwrite: bool = False, progress: bool = True):
    """Convert `source` (path/alias or a (model, tokenizer) tuple) to MLA → (MLAForCausalLM, tokenizer).

    With `out`, the checkpoint is written there atomically (refusing a non-empty `out` unless
    `overwrite`). `sequential` calibrates each layer on the outputs of the already converted layers
    before it (so it compensates their error); False follows the source model's activations.
    """
    start = time.perf_counter()
    if out is not None:
        check_output_dir(out, overwrite)
    model, tokenizer = load_source(source) if isinstance(source, (str, Path)) else source
    check_family(model.config)
    original_config = model.config
    if as_mha:
        model = expand_to_mha(model)
    config = model.config
    rope_pairs = rope_pairs if rope_pairs is not None else max(1, head_dim_of(config) // 16)
    validate(config, d_kv, rope_pairs, rope_strategy, svd, init)
    if calib_samples < 1:
        raise UserError("--calib-samples must be at least 1")
    blocks = pack_blocks(tokenizer, calib_data or [default_train_text()], calib_seq_len, calib_samples,
                         what="calibration text")
    rotary = model.model.rotary_emb
    source_name = str(source if isinstance(source, (str, Path)) else config._name_or_path)
    n_kv, d_h = config.num_key_value_heads, head_dim_of(config)
    inv_freq = rotary.inv_freq.tolist()
    placeholder = [select_pairs("high", rope_pairs, d_h, n_kv)] * config.num_hidden_layers
    mla = MLAForCausalLM(mla_config_for(config, rope_pairs, d_kv, svd, placeholder, inv_freq,
                                        float(getattr(rotary, "attention_scaling", 1.0)), source_name))
    mla = mla.to(model.dtype).eval()
    kept_all = []
    seq = blocks.shape[1]
    position_ids = torch.arange(seq)[None]
    causal = torch.full((seq, seq), torch.finfo(model.dtype).min, dtype=model.dtype).triu(1)[None, None]
    rope = rotary(model.model.embed_tokens.weight[:1][None], position_ids)

    def on_layer(idx, stats):
        kept = select_pairs(rope_strategy, rope_pairs, d_h, n_kv, stats.q_norm, stats.k_norm)
        kept_all.append(kept)
        layer = mla.model.layers[idx]
        layer.self_attn.set_rope_pairs(kept, inv_freq)
        convert_layer(model.model.layers[idx].self_attn, layer.self_attn, kept, stats, d_kv, svd, init,
                      kv_balance)
        copy_layer_rest(model.model.layers[idx], layer)
        if not sequential:
            return source_layer_step(model.model.layers[idx], seq, model.dtype, rope)
        return lambda h: layer(h, position_ids.expand(h.shape[0], -1), causal)

    calibrate(model, blocks, on_layer, progress=progress)
    mla.config.kept_pairs = kept_all
    copy_outer(model, mla)
    if mla.config.tie_word_embeddings:
        mla.tie_weights()
    mla.generation_config = model.generation_config
    mla.config.conversion = {
        "rope_strategy": rope_strategy, "init": init, "as_mha": as_mha, "calib_samples": len(blocks),
        "calib_seq_len": calib_seq_len, "seconds": time.perf_counter() - start,
        "kv": kv_report(mla.config, dtype_bytes=mla.dtype.itemsize,
                        original_config=original_config if as_mha else None),
    }
    if out is not None:
        save_mla(mla, tokenizer, Path(out))
    return mla, tokenizer
