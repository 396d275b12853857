"""`mha2mla export --format deepseek-v3`: the checkpoint loads with stock transformers where mha2mla is
not importable, its logits match the MLA model's and greedy generation gives the same tokens; what
DeepSeek's format cannot hold is refused in one line (exit 2) or exported with the gap measured.

Tolerances: exact mappings (a model with its own latent norm; biases folded) within 1e-4 of the MLA
logits in float32; the near-linear latent norm within 1e-3 (its stated relative latent error is 1e-6).
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, DeepseekV3ForCausalLM

from conftest import tiny_source
from mha2mla.cli import main
from mha2mla.convert import convert_model
from mha2mla.exports.deepseek_v3 import export_checkpoint
from mha2mla.errors import UserError
from mha2mla.latent_norm import add_latent_norm
from test_latent_cache import tiny_mla

EXACT, NEAR_LINEAR = 1e-4, 1e-3
PROMPT = [1, 17, 4242, 911, 36, 2048, 5, 77]

# Runs in a fresh interpreter where `import mha2mla` fails: the checkpoint must stand on stock transformers.
STOCK = """
import json, sys, torch
sys.modules["mha2mla"] = None
from transformers import AutoConfig, AutoModelForCausalLM
path, ids = sys.argv[1], torch.tensor([json.loads(sys.argv[2])])
model = AutoModelForCausalLM.from_pretrained(path).eval()
with torch.no_grad():
    logits = model(ids).logits[0]
    greedy = model.generate(ids, max_new_tokens=int(sys.argv[3]), do_sample=False)[0, ids.shape[1]:]
torch.save(logits, sys.argv[4])
print(json.dumps({"class": type(model).__name__, "greedy": greedy.tolist()}))
"""


def stock_run(path, tmp_path, new_tokens: int = 8):
    """(logits [T, V], greedy tokens, class name) of the exported checkpoint loaded by stock transformers."""
    out = tmp_path / "logits.pt"
    run = subprocess.run([sys.executable, "-c", STOCK, str(path), json.dumps(PROMPT), str(new_tokens), str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    return torch.load(out), result["greedy"], result["class"]


@torch.no_grad()
def mla_run(model, new_tokens: int = 8):
    """(logits [T, V], greedy tokens) of a model in this process (an MLA model, or an export loaded by
    AutoModelForCausalLM: its config names no custom code, so that is the stock class too)."""
    ids = torch.tensor([PROMPT])
    greedy = model.generate(ids, max_new_tokens=new_tokens, do_sample=False)[0, ids.shape[1]:]
    return model(ids).logits[0], greedy.tolist()


def stock_model(path):
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    assert type(model) is DeepseekV3ForCausalLM
    return model


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    return smollm2[1]


def convert_tiny(tokenizer, wiki_dir, family="llama", out=None, **kw):
    src = tiny_source(family, vocab=49152, n_kv=2)
    return convert_model((src, tokenizer), out, calib_data=[wiki_dir], calib_samples=4, calib_seq_len=32,
                         progress=False, **kw)[0]


@pytest.fixture(scope="module")
def tiny_mla_model(tokenizer, wiki_dir):
    """A tiny GQA Llama converted by the default recipe (shared RoPE key by PCA)."""
    return convert_tiny(tokenizer, wiki_dir)


@pytest.fixture(scope="module")
def exported_tiny(tiny_mla_model, tokenizer, wiki_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "ds"
    return out, export_checkpoint((tiny_mla_model, tokenizer), out, calib_data=[wiki_dir], calib_seq_len=64)


def test_exported_checkpoint_loads_with_stock_transformers_and_matches(exported_tiny, tiny_mla_model, tmp_path):
    out, report = exported_tiny
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV3ForCausalLM"] and config["model_type"] == "deepseek_v3"
    assert config["q_lora_rank"] is None and config["rope_interleave"] is True
    assert config["first_k_dense_replace"] == config["num_hidden_layers"]         # dense MLPs in every layer
    assert config["kv_lora_rank"] == tiny_mla_model.config.latent_dim
    logits, greedy, cls = stock_run(out, tmp_path)
    assert cls == "DeepseekV3ForCausalLM"
    want_logits, want_greedy = mla_run(tiny_mla_model)
    assert (logits - want_logits).abs().max() < NEAR_LINEAR
    assert greedy == want_greedy
    assert report["logits_gap"]["max_abs"] < NEAR_LINEAR and report["logits_gap"]["top1_agreement"] == 1.0
    assert report["kv_values_per_token_per_layer"] == report["mla_kv_values_per_token_per_layer"]


def test_export_from_a_checkpoint_streams_the_same_tensors(exported_tiny, tiny_mla_model, tokenizer, wiki_dir,
                                                           tmp_path):
    """Exporting the saved checkpoint (read a layer at a time from its safetensors) writes exactly what the
    export of the model in memory wrote, and measures the same gap."""
    from safetensors.torch import load_file

    out, report = exported_tiny
    tiny_mla_model.save_pretrained(tmp_path / "mla")
    tokenizer.save_pretrained(tmp_path / "mla")
    streamed = export_checkpoint(tmp_path / "mla", tmp_path / "ds", calib_data=[wiki_dir], calib_seq_len=64)
    want, got = load_file(out / "model.safetensors"), load_file(tmp_path / "ds" / "model.safetensors")
    assert want.keys() == got.keys() and all(torch.equal(want[name], got[name]) for name in want)
    assert streamed["logits_gap"] == report["logits_gap"]


def test_a_bfloat16_checkpoint_exports_in_bfloat16(tiny_mla_model, tokenizer, wiki_dir, tmp_path):
    """The export keeps the checkpoint's dtype, and its gap is measured in it (DeepSeek's layers too)."""
    copy.deepcopy(tiny_mla_model).to(torch.bfloat16).save_pretrained(tmp_path / "mla")
    tokenizer.save_pretrained(tmp_path / "mla")
    report = export_checkpoint(tmp_path / "mla", tmp_path / "ds", calib_data=[wiki_dir], calib_seq_len=64)
    assert json.loads((tmp_path / "ds" / "config.json").read_text())["dtype"] == "bfloat16"
    assert report["logits_gap"]["max_abs"] < 0.05 * report["logits_gap"]["max_abs_logit"]


def test_kv_size_reads_the_exported_checkpoint(exported_tiny, capsys):
    out, report = exported_tiny
    assert main(["kv-size", str(out), "--json"]) == 0
    kv = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert kv["kv_elements_per_token_per_layer"] == report["kv_lora_rank"] + report["qk_rope_head_dim"]
    assert kv["source_kv_bytes_per_token"] == report["source_kv_values_per_token_per_layer"] * kv["dtype_bytes"]


def test_existing_output_is_refused_without_overwrite(exported_tiny, tmp_path, capsys):
    out, _ = exported_tiny
    mla_dir = tmp_path / "mla"
    (mla_dir / "x").parent.mkdir()
    (mla_dir / "x").write_text("")
    assert main(["export", str(mla_dir), str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "--overwrite" in err and len(err.splitlines()) == 1


def test_per_head_rope_at_one_frequency_is_refused(tokenizer, wiki_dir, tmp_path, capsys):
    convert_tiny(tokenizer, wiki_dir, out=tmp_path / "mla", rope_strategy="high", d_kv=8)
    capsys.readouterr()
    assert main(["export", str(tmp_path / "mla"), str(tmp_path / "ds"), "--calib-data", str(wiki_dir)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--rope-strategy pca" in err
    assert not (tmp_path / "ds").exists()


@torch.no_grad()
def test_query_bias_is_refused_or_dropped_with_the_gap_and_other_biases_fold_exactly(tokenizer, wiki_dir, tmp_path):
    model = convert_tiny(tokenizer, wiki_dir, family="qwen2")
    with pytest.raises(UserError, match="--drop-query-bias"):
        export_checkpoint((model, tokenizer), tmp_path / "a", calib_data=[wiki_dir], calib_seq_len=64)
    dropped = export_checkpoint((model, tokenizer), tmp_path / "b", calib_data=[wiki_dir], calib_seq_len=64,
                                drop_query_bias=True)
    assert dropped["query_bias_dropped"] and dropped["logits_gap"]["max_abs"] > NEAR_LINEAR
    for layer in model.model.layers:       # without query biases, k_rope/k_up/v_up biases map exactly
        layer.self_attn.q_proj.bias.zero_()
    kept = export_checkpoint((model, tokenizer), tmp_path / "c", calib_data=[wiki_dir], calib_seq_len=64)
    assert not kept["query_bias_dropped"] and kept["logits_gap"]["max_abs"] < NEAR_LINEAR


@torch.no_grad()
def test_a_model_with_its_own_latent_norm_exports_exactly_with_padded_layers_and_vllm_shapes(
        tokenizer, wiki_dir, tmp_path):
    """Per-layer latent widths (padded to one), random kept frequencies, a RoPE key padded to vLLM's 64."""
    model = tiny_mla(vocab_size=49152, rope_layout="shared", layer_latent_dims=[6, 11], rope_pairs=3,
                     kept_pairs=[[[5, 0, 2]], [[7, 1, 3]]], latent_norm=True, latent_norm_eps=[1e-6, 0.3])
    for layer in model.model.layers:
        layer.self_attn.kv_norm.weight.uniform_(0.5, 2.0)
    report = export_checkpoint((model, tokenizer), tmp_path / "ds", calib_data=[wiki_dir], calib_seq_len=64,
                               pad_for="vllm")
    assert (report["kv_lora_rank"], report["qk_rope_head_dim"]) == (512, 64)
    assert report["latent_norm"] == "the model's own" and report["logits_gap"]["max_abs"] < EXACT
    logits, greedy = mla_run(stock_model(tmp_path / "ds"))
    want_logits, want_greedy = mla_run(model)
    assert (logits - want_logits).abs().max() < EXACT and greedy == want_greedy


@torch.no_grad()
def test_add_latent_norm_then_export_is_exact(tiny_mla_model, tokenizer, wiki_dir, tmp_path):
    """The conversion option: a model given the norm (by the default method) exports with no further gap."""
    model = copy.deepcopy(tiny_mla_model)
    x = torch.randn(4, 32, model.config.hidden_size)
    eps = [add_latent_norm(layer.self_attn, layer.input_layernorm(x)) for layer in model.model.layers]
    model.config.latent_norm, model.config.latent_norm_eps = True, eps
    report = export_checkpoint((model, tokenizer), tmp_path / "ds", calib_data=[wiki_dir], calib_seq_len=64)
    assert report["latent_norm"] == "the model's own" and report["logits_gap"]["max_abs"] < EXACT


@pytest.fixture(scope="module")
def smollm2_pca(smollm2, wiki_dir):
    """SmolLM2-135M's first 2 layers (its real weights, vocabulary and GQA heads; the whole model takes
    minutes to convert) converted with a shared RoPE key (pca, r = 8, d_kv = 16), little calibration."""
    model, tokenizer = smollm2
    head = copy.deepcopy(model)
    head.model.layers = head.model.layers[:2]
    head.config.num_hidden_layers = 2
    return convert_model((head, tokenizer), d_kv=16, rope_pairs=8, init="weight", refit="none",
                         calib_data=[wiki_dir], calib_samples=2, calib_seq_len=64, progress=False)


def test_smollm2_export_matches_the_mla_model(smollm2_pca, wiki_dir, tmp_path):
    model, tokenizer = smollm2_pca
    report = export_checkpoint(smollm2_pca, tmp_path / "ds", calib_data=[wiki_dir], calib_samples=2,
                               calib_seq_len=64)
    assert report["qk_rope_head_dim"] == 16 and report["kv_lora_rank"] == model.config.latent_dim
    assert report["logits_gap"]["top1_agreement"] == 1.0
    logits, greedy = mla_run(stock_model(tmp_path / "ds"), new_tokens=12)
    want_logits, want_greedy = mla_run(model, new_tokens=12)
    assert (logits - want_logits).abs().max() < NEAR_LINEAR * want_logits.abs().max()
    assert greedy == want_greedy


@torch.no_grad()
def test_scaled_rope_is_carried_from_the_source(tokenizer, wiki_dir, tmp_path):
    """Llama-3 RoPE scaling: the MLA config keeps the scaled frequencies, not the parameters; the export
    refuses to guess them and takes them from the source."""
    llama3 = dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                  original_max_position_embeddings=64)
    src = tiny_source("llama", vocab=49152, n_kv=2, rope_parameters=llama3)
    src.save_pretrained(tmp_path / "src")
    tokenizer.save_pretrained(tmp_path / "src")
    model = convert_model((src, tokenizer), calib_data=[wiki_dir], calib_samples=4, calib_seq_len=32,
                          progress=False)[0]
    with pytest.raises(UserError, match="--source"):
        export_checkpoint((model, tokenizer), tmp_path / "a", calib_data=[wiki_dir], calib_seq_len=64)
    report = export_checkpoint((model, tokenizer), tmp_path / "b", calib_data=[wiki_dir], calib_seq_len=64,
                               source=tmp_path / "src")
    assert json.loads((tmp_path / "b" / "config.json").read_text())["rope_parameters"]["rope_type"] == "llama3"
    assert report["logits_gap"]["max_abs"] < NEAR_LINEAR


def test_export_prints_the_cache_size_and_the_gap(exported_tiny, capsys):
    from mha2mla.cli import _print_export

    _print_export(exported_tiny[1])
    out = capsys.readouterr().out
    assert "KV cache per token per layer" in out and "logits gap to the MLA model: max" in out


def test_load_model_opens_the_export_for_eval_and_generate(exported_tiny):
    from mha2mla import load_model

    model, _ = load_model(exported_tiny[0])
    assert type(model) is DeepseekV3ForCausalLM


def test_vllm_padding_refuses_what_vllm_cannot_run(tokenizer, wiki_dir, tmp_path):
    model = tiny_mla(vocab_size=49152, rope_layout="shared", attention_bias=True)
    with pytest.raises(UserError, match="vLLM"):
        export_checkpoint((model, tokenizer), tmp_path / "ds", calib_data=[wiki_dir], pad_for="vllm")
