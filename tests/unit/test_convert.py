"""Conversion exactness on tiny random models of every supported family, padding (save → load in a fresh
process without the package: tests/cli/test_convert_cli.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny import ids_for, tiny_source

from mha2mla import convert as convert_model
from mha2mla.conversion.stages.rope.layout import layout_for
from mha2mla.conversion.stages.expand import expand_to_mha
from mha2mla.errors import UserError

TOL = 1e-4  # fp32, max abs logit difference

FAMILIES = {
    "llama-mha": ("llama", dict(n_kv=4)),
    "llama-gqa": ("llama", dict(n_kv=2)),
    "mistral": ("mistral", dict(n_kv=2, sliding_window=8)),
    "qwen2-bias": ("qwen2", dict(n_kv=2)),
}


def source(name):
    family, kw = FAMILIES[name]
    return tiny_source(family, **kw)


def convert_tiny(src, tokenizer, calib_text, **kw):
    kw.setdefault("rope", "2-norm")
    return convert_model((src, tokenizer), calib_data=[calib_text], calib_samples=4, calib_seq_len=32,
                         progress=False, **kw)[0]


def full_rank_d_kv(config, rope_pairs):
    """The d_kv at which partial RoPE's latent keeps every position-free key row and value."""
    return layout_for("2-norm", config).max_latent(rope_pairs) // config.num_key_value_heads


def apply_rope_where(x, cos, sin, keep):
    """RoPE on the dims where keep [heads, d_h] is true; x [B, heads, T, d_h]."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = x * cos[:, None] + torch.cat((-x2, x1), dim=-1) * sin[:, None]
    return torch.where(keep[None, :, None, :], rotated, x)


@torch.no_grad()
def masked_rope_reference(src, ids, kept_pairs):
    """The source model computed by hand with RoPE only on the kept pairs of each KV head."""
    cfg = src.config
    H, n_kv, d_h = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    B, T = ids.shape
    pos = torch.arange(T)[None]
    h = src.model.embed_tokens(ids)
    cos, sin = src.model.rotary_emb(h, pos)
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    if getattr(cfg, "sliding_window", None) and cfg.model_type == "mistral":
        mask &= ~torch.ones(T, T, dtype=torch.bool).tril(-cfg.sliding_window)
    for layer, kept in zip(src.model.layers, kept_pairs):
        keep = torch.zeros(n_kv, d_h, dtype=torch.bool)
        for g, pairs in enumerate(kept):
            keep[g, pairs] = True
            keep[g, [p + d_h // 2 for p in pairs]] = True
        a = layer.self_attn
        x = layer.input_layernorm(h)
        q = a.q_proj(x).view(B, T, H, d_h).transpose(1, 2)
        k = a.k_proj(x).view(B, T, n_kv, d_h).transpose(1, 2)
        v = a.v_proj(x).view(B, T, n_kv, d_h).transpose(1, 2)
        q = apply_rope_where(q, cos, sin, keep.repeat_interleave(H // n_kv, 0))
        k = apply_rope_where(k, cos, sin, keep)
        k, v = k.repeat_interleave(H // n_kv, 1), v.repeat_interleave(H // n_kv, 1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        h = h + a.o_proj(out.transpose(1, 2).reshape(B, T, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return src.lm_head(src.model.norm(h))


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("init", ["weight", "activation", "output"])
def test_full_rank_all_pairs_equals_source(name, init, tokenizer, calib_text):
    src = source(name)
    d_h = src.config.head_dim
    mla = convert_tiny(src, tokenizer, calib_text, rope_pairs=d_h // 2, d_kv=full_rank_d_kv(src.config, d_h // 2), weighting=init)
    ids = ids_for()
    diff = (mla(ids).logits - src(ids).logits).abs().max().item()
    assert diff <= TOL, diff


def test_full_rank_calibrated_on_the_source_equals_source(tokenizer, calib_text):
    """sequential=False: every layer calibrated (and re-fit) on the source model's own activations."""
    src = source("llama-gqa")
    d_h = src.config.head_dim
    mla = convert_tiny(src, tokenizer, calib_text, rope_pairs=d_h // 2, d_kv=full_rank_d_kv(src.config, d_h // 2),
                       sequential=False, refit="vo")
    ids = ids_for()
    diff = (mla(ids).logits - src(ids).logits).abs().max().item()
    assert diff <= TOL, diff


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("strategy,init", [("2-norm", "activation"), ("uniform", "weight"), ("high", "output"),
                                           ("low", "query")])
def test_partial_rope_full_rank_equals_masked_reference(name, strategy, init, tokenizer, calib_text):
    src = source(name)
    mla = convert_tiny(src, tokenizer, calib_text, rope_pairs=2, rope=strategy,
                       d_kv=full_rank_d_kv(src.config, 2), weighting=init, refit="none")  # the refit would pull towards the source
    ids = ids_for()
    ref = masked_rope_reference(src, ids, mla.config.kept_pairs)
    diff = (mla(ids).logits - ref).abs().max().item()
    assert diff <= TOL, diff
    assert (src(ids).logits - ref).abs().max().item() > 10 * TOL  # dropping RoPE pairs did change the model


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_matches_rows_alone(side, tokenizer, calib_text):
    src = source("qwen2-bias")
    mla = convert_tiny(src, tokenizer, calib_text, d_kv=8, rope_pairs=2)
    a, b = ids_for(2, 1, 20)[0], ids_for(3, 1, 13)[0]
    pad = 20 - 13
    batch = torch.stack([a, F.pad(b, (pad, 0) if side == "left" else (0, pad))])
    mask = torch.ones_like(batch)
    if side == "left":
        mask[1, :pad] = 0
    else:
        mask[1, 13:] = 0
    logits = mla(batch, attention_mask=mask).logits
    alone_a, alone_b = mla(a[None]).logits[0], mla(b[None]).logits[0]
    assert (logits[0] - alone_a).abs().max().item() <= TOL
    real = slice(pad, None) if side == "left" else slice(0, 13)
    assert (logits[1, real] - alone_b).abs().max().item() <= TOL


def test_as_mha_is_exact(tokenizer, calib_text):
    src = source("llama-gqa")
    mha = expand_to_mha(src)
    assert mha.config.num_key_value_heads == mha.config.num_attention_heads
    ids = ids_for()
    assert (mha(ids).logits - src(ids).logits).abs().max().item() <= TOL
    d_h = src.config.head_dim
    mla = convert_tiny(src, tokenizer, calib_text, as_mha=True, rope_pairs=d_h // 2, d_kv=d_h)
    assert mla.config.num_key_value_heads == 4
    assert (mla(ids).logits - src(ids).logits).abs().max().item() <= TOL
    kv = mla.config.conversion["kv"]
    assert kv["reduction_vs_original_pct"] < kv["reduction_pct"]  # MHA caches twice what the GQA source did


def test_kv_size_matches_config(tokenizer, calib_text):
    src = source("llama-gqa")
    mla = convert_tiny(src, tokenizer, calib_text, d_kv=4, rope_pairs=2)
    kv = mla.config.conversion["kv"]
    assert kv["kv_elements_per_token_per_layer"] == 2 * (2 * 2 + 4)
    assert kv["reduction_pct"] == pytest.approx(100 * (1 - 16 / (2 * 2 * 16)))


@pytest.mark.parametrize("method", ["near_linear", "rms"])
def test_latent_norm_conversion_and_its_exact_export(method, tokenizer, calib_text, tmp_path):
    """--latent-norm: every layer gets DeepSeek's latent RMSNorm as its last stage; near_linear keeps
    the function (the plain conversion's logits), and the DeepSeek-V3 export of the result is exact."""
    from mha2mla.exports.deepseek_v3 import export_checkpoint

    src = source("llama-gqa")
    plain = convert_tiny(src, tokenizer, calib_text, rope="pca", d_kv=8)
    normed = convert_tiny(src, tokenizer, calib_text, rope="pca", d_kv=8, latent_norm=method,
                          out=tmp_path / "mla")
    assert normed.config.latent_norm and normed.config.conversion["latent_norm"] == method
    assert all(layer.self_attn.kv_norm is not None for layer in normed.model.layers)
    ids = ids_for()
    with torch.no_grad():
        gap = (normed(ids).logits - plain(ids).logits).abs().max().item()
    if method == "near_linear":
        assert gap <= 1e-3, gap
    else:
        assert gap > 1e-3  # the ordinary regime rescales every token's latent by median/own RMS
    report = export_checkpoint(tmp_path / "mla", tmp_path / "ds", calib_data=[calib_text], calib_seq_len=64)
    assert report["latent_norm"] == "the model's own" and report["logits_gap"]["max_abs"] < 1e-4


def test_the_public_convert_is_the_function_and_no_submodule_shadows_it():
    """`from mha2mla import convert` (the README's quickstart) gives the pipeline's function, also in a process
    that imported every conversion module first (as the CLI does); no submodule is called `convert`."""
    import importlib
    import inspect

    for name in ("conversion", "conversion.pipeline", "conversion.plan", "exports", "cli"):
        importlib.import_module(f"mha2mla.{name}")
    import mha2mla
    from mha2mla import convert

    assert inspect.isfunction(convert) and convert.__module__ == "mha2mla.conversion.pipeline"
    assert mha2mla.convert is convert and importlib.util.find_spec("mha2mla.convert") is None


@pytest.mark.parametrize("changes, needle", [
    (dict(rope="uniform", rope_pairs=3), "uniform"),   # uniform needs r dividing d_h/2
    (dict(kv_balance="heavy"), "kv_balance"),
    (dict(kv_balance=-1.0), "kv_balance"),
    (dict(weighting="bogus"), "weighting"),
    (dict(svd="split", d_kv=None, kv_budget=11, rope_pairs=1), "even"),  # a 7-wide latent
    (dict(flavour="x"), "unknown recipe setting"),
])
def test_bad_recipe_settings_are_user_errors(changes, needle, tokenizer, calib_text, tmp_path):
    """The ablation settings left the CLI; from Python they are checked as the CLI's options are."""
    with pytest.raises(UserError, match=needle):
        convert_model((tiny_source("llama"), tokenizer), tmp_path / "mla", recipe="paper", calib_data=[calib_text],
                      **{"d_kv": 4, **changes})
    assert not (tmp_path / "mla").exists()
