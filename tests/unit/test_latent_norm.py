"""The optional latent RMSNorm of the MLA model (config.latent_norm): absorbed and expanded attention
agree, cached decoding equals the full forward, it survives save → load, and `add_latent_norm`
inserts it into a layer keeping the layer's function."""

from __future__ import annotations

import pytest
import torch

from mha2mla import LatentCache, MLAForCausalLM
from mha2mla.conversion.stages.latent_norm import add_latent_norm, latent_mean_squares, norm_parameters
from mha2mla.modeling.modeling_mla import CACHE_NAME
from tiny import tiny_mla, tokens

VARIANTS = {
    "shared": dict(rope_layout="shared", latent_norm=True),
    "per_head_bias": dict(attention_bias=True, latent_norm=True),
    "split": dict(svd="split", latent_norm=True, num_key_value_heads=4),
}


def normed(seed: int = 0, **overrides) -> MLAForCausalLM:
    """A tiny MLA model with a latent norm whose weights are random (so a missed norm shows)."""
    model = tiny_mla(seed, **overrides)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.kv_norm.weight.uniform_(0.5, 2.0)
    return model


@pytest.mark.parametrize("variant", VARIANTS)
@torch.no_grad()
def test_cached_decode_equals_full_forward(variant):
    model = normed(**VARIANTS[variant])
    ids = tokens(2, 20)
    full = model(ids).logits[:, 13:19]
    cache = LatentCache(model.config)
    prefix = model(ids[:, :14], use_cache=True, **{CACHE_NAME: cache}).logits[:, -1:]
    steps = [prefix] + [model(ids[:, t:t + 1], use_cache=True, **{CACHE_NAME: cache}).logits for t in range(14, 19)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_absorbed_equals_expanded():
    model = normed(**VARIANTS["shared"])
    attn = model.model.layers[0].self_attn
    x = torch.randn(2, 9, model.config.hidden_size)
    B, T = x.shape[:2]
    q = attn.q_proj(x).view(B, T, attn.n_heads, -1).transpose(1, 2)
    q_nope, q_rope = q.split([attn.d_nope, attn.d_rope], dim=-1)
    k_rope = attn.k_rope_proj(x).view(B, T, attn.n_rope, attn.d_rope).transpose(1, 2)
    c_kv = attn.kv_norm(attn.kv_down(x)).unsqueeze(1)
    mask = torch.ones(T, T, dtype=torch.bool).tril()[None, None]
    torch.testing.assert_close(attn.absorbed(q_nope, q_rope, c_kv, k_rope, mask),
                               attn.expanded(q_nope, q_rope, c_kv, k_rope, mask), atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_the_norm_is_applied_and_survives_save_and_load(tmp_path):
    model = normed(**VARIANTS["shared"])
    ids = tokens(1, 12)
    before = model(ids).logits
    model.model.layers[0].self_attn.kv_norm.weight.mul_(3.0)
    assert (model(ids).logits - before).abs().max() > 1e-3       # the norm's weight reaches the logits
    model.save_pretrained(tmp_path)
    loaded = MLAForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.latent_norm and loaded.model.layers[0].self_attn.kv_norm is not None
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits)


@torch.no_grad()
def test_one_eps_per_layer_is_kept(tmp_path):
    model = normed(**VARIANTS["shared"], latent_norm_eps=[1e-6, 3.5])
    assert [layer.self_attn.kv_norm.eps for layer in model.model.layers] == [1e-6, 3.5]
    model.save_pretrained(tmp_path)
    loaded = MLAForCausalLM.from_pretrained(tmp_path)
    assert [layer.self_attn.kv_norm.eps for layer in loaded.model.layers] == [1e-6, 3.5]


@torch.no_grad()
def test_a_model_without_the_norm_has_no_norm_module():
    model = tiny_mla()
    assert not model.config.latent_norm
    assert all(layer.self_attn.kv_norm is None for layer in model.model.layers)


def attention_output(attn, x):
    position_ids = torch.arange(x.shape[1])[None].expand(x.shape[0], -1)
    return attn(x, position_ids)


@pytest.mark.parametrize("method, tol", [("near_linear", 1e-3), ("rms", None)])
@torch.no_grad()
def test_add_latent_norm_keeps_the_layer_function(method, tol):
    model = tiny_mla(rope_layout="shared")
    attn = model.model.layers[0].self_attn
    x = torch.randn(2, 16, model.config.hidden_size)
    reference = attention_output(attn, x)
    add_latent_norm(attn, x, method=method)
    out = attention_output(attn, x)
    relative = float((out - reference).norm() / reference.norm())
    if tol is not None:
        assert relative < tol
    else:  # the plain norm rescales every token's latent to one RMS: not exact, but bounded
        assert relative < 1.0


def test_near_linear_error_is_the_stated_tolerance():
    ms = torch.tensor([0.5, 2.0, 8.0], dtype=torch.float64)
    eps, w = norm_parameters(ms, "near_linear", tolerance=1e-4)
    c_scale = w / (ms + eps).sqrt()                             # what the norm does to c, per token
    assert float(1 - c_scale[-1]) == pytest.approx(1e-4, rel=1e-3)
    assert w == pytest.approx(float(ms.max().sqrt()) * 70.71, rel=1e-3)   # natural scale: sqrt(max ms / 2e-4)


def test_latent_mean_squares_is_per_token():
    w = torch.eye(3)
    x = torch.tensor([[[1.0, 1.0, 1.0], [3.0, 0.0, 0.0]]])
    assert latent_mean_squares(w, x).tolist() == [1.0, 3.0]
