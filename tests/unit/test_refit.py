"""The output refit: ridge least squares, and a lower attention-output error than the factorisation alone."""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_source

from mha2mla import convert as convert_model
from mha2mla.io.text import pack_blocks
from mha2mla.errors import UserError
from mha2mla.conversion.stages.refit import mla_head_outputs, ridge_fit, source_attention


def test_ridge_fit_recovers_an_exact_map_and_falls_back_to_the_prior():
    gen = torch.Generator().manual_seed(0)
    w, feats = torch.randn(5, 8, generator=gen, dtype=torch.float64), torch.randn(8, 200, generator=gen,
                                                                                 dtype=torch.float64)
    target = w @ feats
    assert torch.allclose(ridge_fit(target @ feats.T, feats @ feats.T, torch.zeros_like(w)), w, atol=1e-3)
    prior = torch.randn(5, 8, generator=gen, dtype=torch.float64)
    few = feats[:, :3]  # 3 samples for 8 features: the data fix only a 3-dim subspace
    fitted = ridge_fit((w @ few) @ few.T, few @ few.T, prior)
    assert torch.allclose(fitted @ few, w @ few, atol=1e-2)  # fits the data …
    null = torch.linalg.svd(few.T).Vh[3:].T  # … and keeps the prior where the data say nothing
    assert torch.allclose(fitted @ null, prior @ null, atol=1e-6)


@pytest.fixture(scope="module")
def first_layer_error(tokenizer, calib_text):
    """Squared error of layer 0's attention output against the source's, on its calibration inputs."""
    src = tiny_source("llama", n_heads=4, n_kv=2, head_dim=16, layers=2)
    blocks = pack_blocks(tokenizer, [calib_text], 32, 8)
    s_attn, layer = src.model.layers[0].self_attn, src.model.layers[0]
    with torch.no_grad():
        x = layer.input_layernorm(src.model.embed_tokens(blocks))
        positions = torch.arange(32)[None]
        rope = src.model.rotary_emb(x, positions)
        causal = torch.full((32, 32), torch.finfo(x.dtype).min).triu(1)[None, None]
        _, target = source_attention(s_attn, x, rope, causal, 4, 2, 16)
        target = target.double() @ s_attn.o_proj.weight.double().T

    def error(refit: str) -> float:
        mla = convert_model((src, tokenizer), d_kv=3, rope_pairs=2, rope="2-norm", refit=refit,
                            calib_data=[calib_text], calib_samples=8, calib_seq_len=32, progress=False)[0]
        m_attn = mla.model.layers[0].self_attn
        with torch.no_grad():
            got = mla_head_outputs(m_attn, x, positions, causal).double() @ m_attn.o_proj.weight.double().T
        return float((got - target).pow(2).sum())

    return {refit: error(refit) for refit in ("none", "v", "vo")}


def test_refit_lowers_the_attention_output_error(first_layer_error):
    print(first_layer_error)
    assert first_layer_error["vo"] < first_layer_error["v"] < first_layer_error["none"]


def test_unknown_refit_is_a_user_error(tokenizer, calib_text):
    with pytest.raises(UserError, match="unknown refit .bogus.: use one of none, v, vo"):
        convert_model((tiny_source("llama"), tokenizer), d_kv=3, rope_pairs=2, refit="bogus",
                      calib_data=[calib_text], calib_samples=2, calib_seq_len=32, progress=False)
