"""`mha2mla export` as a user runs it: the DeepSeek-V3 checkpoint loads with stock transformers in a fresh
process where mha2mla is not importable (its logits match the MLA model's, greedy generation gives the same
tokens), and the CLI (`main(argv)` in-process): kv-size of an export, the GGUF export's report, and every
refusal in one line (exit 2) with nothing written.

The Python API's exactness and gaps: tests/unit/test_export.py and tests/unit/test_export_gguf.py.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

from tiny import PROMPT, TINY_VOCAB, convert_tiny, mla_run
from mha2mla.cli import main
from mha2mla.errors import UserError
from mha2mla.modeling import MLAConfig

NEAR_LINEAR = 1e-3

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


# --- DeepSeek-V3 ------------------------------------------------------------------------------------------

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


def test_per_head_rope_at_one_frequency_is_refused(tokenizer, calib_text, tmp_path, capsys):
    convert_tiny(tokenizer, calib_text, out=tmp_path / "mla", rope="high", d_kv=8)
    capsys.readouterr()
    assert main(["export", str(tmp_path / "mla"), str(tmp_path / "ds"), "--calib-data", str(calib_text)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "default recipe (one shared RoPE key)" in err
    assert not (tmp_path / "ds").exists()


@pytest.mark.parametrize("pad_for, message", [("sglang", "unknown engine 'sglang'"),
                                              ("64+33", "even RoPE key"), ("2+16", "more than 2[+]16's largest")])
def test_a_bad_pad_for_is_one_line_and_exit_2(mla_dir, tmp_path, capsys, pad_for, message):
    """An unknown engine, an odd RoPE key, a shape narrower than the model's latent."""
    capsys.readouterr()
    assert main(["export", str(mla_dir), str(tmp_path / "ds"), "--pad-for", pad_for]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.search(message, err)
    assert not (tmp_path / "ds").exists()


def test_export_prints_the_cache_size_and_the_gap(exported_tiny, capsys):
    from mha2mla.cli import _print_export

    _print_export(exported_tiny[1])
    out = capsys.readouterr().out
    assert "KV cache per token per layer" in out and "logits gap to the MLA model: max" in out


# --- GGUF ------------------------------------------------------------------------------------------------

def test_cli_export_refuses_an_existing_file_then_replaces_it_and_reports(mla_dir, tiny_gguf, calib_text, tmp_path,
                                                                          capsys):
    from mha2mla.cli import _print_export

    out = tmp_path / "out" / "smol.gguf"
    out.parent.mkdir()
    out.write_bytes(b"")
    args = ["export", str(mla_dir), str(out), "--format", "gguf", "--type", "q8_0", "--source", str(tiny_gguf),
            "--calib-data", str(calib_text), "--json"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--overwrite" in err and out.stat().st_size == 0
    assert main(args + ["--overwrite"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["format"] == "gguf" and report["tensor_type"] == "q8_0"
    assert report["file_bytes"] == out.stat().st_size and [p.name for p in out.parent.iterdir()] == ["smol.gguf"]
    assert report["kv_values_per_token_per_layer"] == report["mla_kv_values_per_token_per_layer"]
    assert report["logits_gap"]["top1_agreement"] == 1.0
    _print_export(report)
    printed = capsys.readouterr().out
    assert "KV cache per token per layer" in printed and "Q8_0" in printed and "logits gap" in printed


def refusal(tmp_path, capsys, source, config_dir, *extra) -> str:
    """The one-line error of exporting `config_dir` to GGUF through the CLI (exit 2, nothing written)."""
    capsys.readouterr()
    assert main(["export", str(config_dir), str(tmp_path / "m.gguf"), "--format", "gguf",
                 "--source", str(source), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error:")
    assert [p.name for p in tmp_path.iterdir()] == [config_dir.name]
    return err


def mla_config_dir(tmp_path, **fields):
    """A directory holding only an MLA config: every refusal is read from the config."""
    config = MLAConfig(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, d_kv=8, rope_pairs=2, rope_layout="shared",
                       **fields)
    config.save_pretrained(tmp_path / "mla")
    return tmp_path / "mla"


def test_attention_biases_are_refused(tiny_gguf, tmp_path, capsys):
    err = refusal(tmp_path, capsys, tiny_gguf, mla_config_dir(tmp_path, attention_bias=True))
    assert "attention biases" in err and "--format deepseek-v3" in err


def test_scaled_rope_is_refused(tiny_gguf, tmp_path, capsys):
    default = MLAConfig(hidden_size=64, num_attention_heads=4).rope_inv_freq
    err = refusal(tmp_path, capsys, tiny_gguf, mla_config_dir(tmp_path, rope_inv_freq=[f / 8 for f in default]))
    assert "RoPE is scaled" in err


def test_per_head_rope_is_refused_by_the_deepseek_export(tiny_gguf, tmp_path, capsys):
    config_dir = mla_config_dir(tmp_path)
    config = json.loads((config_dir / "config.json").read_text())
    config.update(rope_layout="per_head", kept_pairs=[[[0, 1], [0, 1]]] * 2)
    (config_dir / "config.json").write_text(json.dumps(config))
    assert "default recipe (one shared RoPE key)" in refusal(tmp_path, capsys, tiny_gguf, config_dir)


def test_a_source_that_is_not_gguf_is_refused(tiny_gguf, tmp_path, capsys):
    config_dir = mla_config_dir(tmp_path)
    err = refusal(tmp_path, capsys, tiny_gguf, config_dir, "--source", str(config_dir))
    assert "--source" in err and "GGUF file" in err


def test_unknown_tensor_type_and_deepseek_options_are_refused(tiny_gguf, tmp_path, capsys):
    import mha2mla

    with pytest.raises(UserError, match="q8_0"):                 # mha2mla.export(format="gguf") is export_gguf
        mha2mla.export(mla_config_dir(tmp_path), tmp_path / "m.gguf", format="gguf", tensor_type="q4_0")
    assert "--pad-for" in refusal(tmp_path, capsys, tiny_gguf, tmp_path / "mla", "--pad-for", "vllm")
