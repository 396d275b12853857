"""`mha2mla export --format deepseek-v3` through the Python API: its logits match the MLA model's and greedy
generation gives the same tokens; what DeepSeek's format cannot hold is refused or exported with the gap
measured. (Loading where mha2mla is not importable, and the CLI: tests/cli/test_export_cli.py.)

Tolerances: exact mappings (a model with its own latent norm; biases folded) within 1e-4 of the MLA
logits in float32; the near-linear latent norm within 1e-3 (its stated relative latent error is 1e-6).
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from transformers import DeepseekV3ForCausalLM

from tiny import TINY_VOCAB, convert_tiny, mla_run, stock_model, tiny_mla, tiny_source
from mha2mla import convert as convert_model
from mha2mla.exports.deepseek_v3 import engine_shape, export_checkpoint
from mha2mla.errors import UserError
from mha2mla.conversion.stages.latent_norm import add_latent_norm

EXACT, NEAR_LINEAR = 1e-4, 1e-3


def test_export_from_a_checkpoint_streams_the_same_tensors(exported_tiny, tiny_mla_model, tokenizer, calib_text,
                                                           tmp_path):
    """Exporting the saved checkpoint (read a layer at a time from its safetensors) writes exactly what the
    export of the model in memory wrote, and measures the same gap."""
    from safetensors.torch import load_file

    out, report = exported_tiny
    tiny_mla_model.save_pretrained(tmp_path / "mla")
    tokenizer.save_pretrained(tmp_path / "mla")
    streamed = export_checkpoint(tmp_path / "mla", tmp_path / "ds", calib_data=[calib_text], calib_seq_len=64)
    want, got = load_file(out / "model.safetensors"), load_file(tmp_path / "ds" / "model.safetensors")
    assert want.keys() == got.keys() and all(torch.equal(want[name], got[name]) for name in want)
    assert streamed["logits_gap"] == report["logits_gap"]


def test_a_tied_head_is_written_untied(tokenizer, calib_text, tmp_path):
    """vLLM's DeepSeek model never ties its LM head to the embeddings, so the export always writes
    lm_head.weight — for a tied source, its embeddings, unscaled — and computes the MLA model's logits."""
    from safetensors.torch import load_file

    src = tiny_source("llama", n_kv=2, tie_word_embeddings=True)
    model, _ = convert_model((src, tokenizer), calib_data=[calib_text], calib_samples=4, calib_seq_len=32,
                             progress=False)
    assert model.config.tie_word_embeddings
    export_checkpoint((model, tokenizer), tmp_path / "ds", calib_data=[calib_text], calib_seq_len=64)
    assert json.loads((tmp_path / "ds" / "config.json").read_text())["tie_word_embeddings"] is False
    assert torch.equal(load_file(tmp_path / "ds" / "model.safetensors")["lm_head.weight"],
                       model.model.embed_tokens.weight)
    logits, greedy = mla_run(stock_model(tmp_path / "ds"))
    want_logits, want_greedy = mla_run(model)
    assert (logits - want_logits).abs().max() < NEAR_LINEAR * want_logits.abs().max() and greedy == want_greedy


def test_a_bfloat16_checkpoint_exports_in_bfloat16(tiny_mla_model, tokenizer, calib_text, tmp_path):
    """The export keeps the checkpoint's dtype, and its gap is measured in it (DeepSeek's layers too)."""
    copy.deepcopy(tiny_mla_model).to(torch.bfloat16).save_pretrained(tmp_path / "mla")
    tokenizer.save_pretrained(tmp_path / "mla")
    report = export_checkpoint(tmp_path / "mla", tmp_path / "ds", calib_data=[calib_text], calib_seq_len=64)
    assert json.loads((tmp_path / "ds" / "config.json").read_text())["dtype"] == "bfloat16"
    assert report["logits_gap"]["max_abs"] < 0.05 * report["logits_gap"]["max_abs_logit"]


@torch.no_grad()
def test_query_bias_is_refused_or_dropped_with_the_gap_and_other_biases_fold_exactly(tokenizer, calib_text, tmp_path):
    model = convert_tiny(tokenizer, calib_text, family="qwen2")
    with pytest.raises(UserError, match="--drop-query-bias"):
        export_checkpoint((model, tokenizer), tmp_path / "a", calib_data=[calib_text], calib_seq_len=64)
    dropped = export_checkpoint((model, tokenizer), tmp_path / "b", calib_data=[calib_text], calib_seq_len=64,
                                drop_query_bias=True)
    assert dropped["query_bias_dropped"] and dropped["logits_gap"]["max_abs"] > NEAR_LINEAR
    for layer in model.model.layers:       # without query biases, k_rope/k_up/v_up biases map exactly
        layer.self_attn.q_proj.bias.zero_()
    kept = export_checkpoint((model, tokenizer), tmp_path / "c", calib_data=[calib_text], calib_seq_len=64)
    assert not kept["query_bias_dropped"] and kept["logits_gap"]["max_abs"] < NEAR_LINEAR


@torch.no_grad()
def test_a_model_with_its_own_latent_norm_exports_exactly_with_padded_layers_and_vllm_shapes(
        tokenizer, calib_text, tmp_path):
    """Per-layer latent widths (padded to one), random kept frequencies, a RoPE key padded to vLLM's 64."""
    model = tiny_mla(vocab_size=TINY_VOCAB, rope_layout="shared", layer_latent_dims=[6, 11], rope_pairs=3,
                     kept_pairs=[[[5, 0, 2]], [[7, 1, 3]]], latent_norm=True, latent_norm_eps=[1e-6, 0.3])
    for layer in model.model.layers:
        layer.self_attn.kv_norm.weight.uniform_(0.5, 2.0)
    report = export_checkpoint((model, tokenizer), tmp_path / "ds", calib_data=[calib_text], calib_seq_len=64,
                               pad_for="vllm")
    assert (report["kv_lora_rank"], report["qk_rope_head_dim"]) == (512, 64)
    assert report["latent_norm"] == "the model's own" and report["logits_gap"]["max_abs"] < EXACT
    logits, greedy = mla_run(stock_model(tmp_path / "ds"))
    want_logits, want_greedy = mla_run(model)
    assert (logits - want_logits).abs().max() < EXACT and greedy == want_greedy


@torch.no_grad()
def test_add_latent_norm_then_export_is_exact(tiny_mla_model, tokenizer, calib_text, tmp_path):
    """The conversion option: a model given the norm (by the default method) exports with no further gap."""
    model = copy.deepcopy(tiny_mla_model)
    x = torch.randn(4, 32, model.config.hidden_size)
    eps = [add_latent_norm(layer.self_attn, layer.input_layernorm(x)) for layer in model.model.layers]
    model.config.latent_norm, model.config.latent_norm_eps = True, eps
    report = export_checkpoint((model, tokenizer), tmp_path / "ds", calib_data=[calib_text], calib_seq_len=64)
    assert report["latent_norm"] == "the model's own" and report["logits_gap"]["max_abs"] < EXACT


@torch.no_grad()
def test_scaled_rope_is_carried_from_the_source(tokenizer, calib_text, tmp_path):
    """Llama-3 RoPE scaling: the MLA config keeps the scaled frequencies, not the parameters; the export
    refuses to guess them and takes them from the source."""
    llama3 = dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                  original_max_position_embeddings=64)
    src = tiny_source("llama", n_kv=2, rope_parameters=llama3)
    src.save_pretrained(tmp_path / "src")
    tokenizer.save_pretrained(tmp_path / "src")
    model = convert_model((src, tokenizer), calib_data=[calib_text], calib_samples=4, calib_seq_len=32,
                          progress=False)[0]
    with pytest.raises(UserError, match="--source"):
        export_checkpoint((model, tokenizer), tmp_path / "a", calib_data=[calib_text], calib_seq_len=64)
    report = export_checkpoint((model, tokenizer), tmp_path / "b", calib_data=[calib_text], calib_seq_len=64,
                               source=tmp_path / "src")
    assert json.loads((tmp_path / "b" / "config.json").read_text())["rope_parameters"]["rope_type"] == "llama3"
    assert report["logits_gap"]["max_abs"] < NEAR_LINEAR


def test_load_model_opens_the_export_for_eval_and_generate(exported_tiny):
    from mha2mla import load_model

    model, _ = load_model(exported_tiny[0])
    assert type(model) is DeepseekV3ForCausalLM


@pytest.mark.parametrize("engine, latent, shape", [("vllm", 6, (512, 64)), ("vllm-gpu", 6, (256, 64)),
                                                   ("vllm-gpu", 300, (448, 64)), ("llama.cpp-cuda", 100, (128, 64)),
                                                   ("llama.cpp-cuda", 129, (256, 64)), ("96+32", 72, (96, 32))])
def test_padding_takes_the_engines_narrowest_shape_that_holds_the_latent(engine, latent, shape):
    assert engine_shape(engine, latent) == shape


def test_padding_for_a_narrower_engine_or_an_unknown_one_is_refused(tokenizer, calib_text, tmp_path):
    with pytest.raises(UserError, match="600 wide, more than vllm's largest kv_lora_rank 512"):
        engine_shape("vllm", 600)
    with pytest.raises(UserError, match="100 wide, more than 64[+]32's largest kv_lora_rank 64"):
        engine_shape("64+32", 100)
    with pytest.raises(UserError, match="even RoPE key"):
        engine_shape("96+33", 72)
    model = tiny_mla(vocab_size=TINY_VOCAB, rope_layout="shared")
    with pytest.raises(UserError, match="unknown engine 'sglang'.*vllm, vllm-gpu, llama.cpp-cuda, or a shape L[+]R"):
        export_checkpoint((model, tokenizer), tmp_path / "ds", calib_data=[calib_text], pad_for="sglang")
    assert not (tmp_path / "ds").exists()


@pytest.mark.parametrize("pad_for, shape", [("vllm-gpu", (256, 64)), ("32+16", (32, 16))])
@torch.no_grad()
def test_padding_is_exact(tiny_mla_model, tokenizer, calib_text, tmp_path, pad_for, shape):
    """An engine's shape or an explicit L+R: zero rows and RoPE slots that change no score."""
    report = export_checkpoint((tiny_mla_model, tokenizer), tmp_path / "ds", calib_data=[calib_text],
                               calib_seq_len=64, pad_for=pad_for)
    assert (report["kv_lora_rank"], report["qk_rope_head_dim"]) == shape
    logits, greedy = mla_run(stock_model(tmp_path / "ds"))
    want_logits, want_greedy = mla_run(tiny_mla_model)
    assert (logits - want_logits).abs().max() < NEAR_LINEAR * want_logits.abs().max() and greedy == want_greedy


def test_vllm_padding_refuses_what_vllm_cannot_run(tokenizer, calib_text, tmp_path):
    model = tiny_mla(vocab_size=TINY_VOCAB, rope_layout="shared", attention_bias=True)
    with pytest.raises(UserError, match="vLLM"):
        export_checkpoint((model, tokenizer), tmp_path / "ds", calib_data=[calib_text], pad_for="vllm")
