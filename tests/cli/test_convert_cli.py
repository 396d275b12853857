"""`mha2mla convert` / `kv-size` / `eval ppl` through the CLI (`main(argv)` in-process, conftest's `cli`):
happy path and every bad input; and a converted checkpoint loading in a fresh process without the package.

Each bad input must give exactly one line `error: …` on stderr, exit status 2, no traceback, and
leave nothing in OUT.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from tiny import ids_for, tiny_source

from mha2mla import convert as convert_model


def assert_user_error(run, out=None, needle=""):
    assert run.returncode == 2, (run.returncode, run.stderr[-1500:])
    lines = [line for line in run.stderr.strip().splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1, run.stderr
    assert "Traceback" not in run.stderr
    assert needle.lower() in errors[0].lower(), errors[0]
    if out is not None:
        assert not out.exists() or not any(out.iterdir()), list(out.iterdir())
        leftovers = [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.tmp")]
        assert not leftovers


def test_convert_json_and_kv_size(cli, tiny_dir, calib_text, tmp_path):
    out = tmp_path / "mla"
    run = cli("convert", tiny_dir, out, "--recipe", "paper", "--d-kv", 4, "--rope-pairs", 2, "--calib-size", "2x32",
              "--calib-data", calib_text, "--json")
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["kv"]["kv_elements_per_token_per_layer"] == 2 * (4 + 4)
    assert report["process_peak_rss_mb"] > 100 and report["device"] in ("cpu", "cuda")
    assert (report["rope"], report["weighting"], report["refit"], report["calib_samples"]) == ("2-norm", "weight", "none", 2)
    kv = json.loads(cli("kv-size", out, "--json").stdout.strip().splitlines()[-1])
    assert kv["kv_elements_per_token_per_layer"] == 16 and kv["d_kv"] == 4   # per-head: latent per KV head
    assert kv["reduction_pct"] == pytest.approx(75.0)
    assert set(kv["quantized"]) == {"4", "2"}
    again = cli("convert", tiny_dir, out, "--d-kv", 4, "--calib-data", calib_text)
    assert_user_error(again, needle="--overwrite")
    assert (out / "config.json").exists()  # the refused run left the existing output alone


def test_eval_ppl_json(cli, tiny_dir, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 60)
    run = cli("eval", "ppl", tiny_dir, "--data", text, "--seq-len", 64, "--windows", 2, "--json")
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["windows"] == 2 and result["tokens"] == 2 * 63 and result["ppl"] > 1


@pytest.mark.parametrize("args,needle", [
    (["--d-kv", "0"], "--d-kv"),
    (["--d-kv", "-4"], "--d-kv"),
    (["--dtype", "int8"], "--dtype"),
    (["--device", "tpu:x"], "--device"),
    (["--d-kv", "100"], "--d-kv"),
    (["--rope-pairs", "0"], "--rope-pairs"),
    (["--rope-pairs", "9"], "--rope-pairs"),
    (["--kv-reduction", "150"], "--kv-reduction"),
    (["--calib-size", "0x32"], "--calib-size"),
    (["--allocate", "per-layer"], "--kv-budget"),
    (["--reconstruct", "-1"], "--reconstruct"),
])
def test_bad_options(cli, tiny_dir, calib_text, tmp_path, args, needle):
    out = tmp_path / "out"
    assert_user_error(cli("convert", tiny_dir, out, "--recipe", "paper", "--calib-data", calib_text, *args), out, needle)


def test_missing_path(cli, tmp_path):
    out = tmp_path / "out"
    assert_user_error(cli("convert", tmp_path / "nope", out), out, "not found")


def test_unsupported_family(cli, tmp_path):
    from transformers import GPT2Config

    src = tmp_path / "gpt2"
    GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(src)
    out = tmp_path / "out"
    assert_user_error(cli("convert", src, out), out, "supported families")


def test_calibration_text_too_short(cli, tiny_dir, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("Too short.")
    out = tmp_path / "out"
    assert_user_error(cli("convert", tiny_dir, out, "--calib-data", short), out, "calibration text")


def test_corrupt_safetensors(cli, tiny_dir, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(tiny_dir, bad)
    weights = bad / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: 5000])
    out = tmp_path / "out"
    assert_user_error(cli("convert", bad, out), out, "weights")


def write_gguf(path, arch: str, tensor_type=None) -> None:
    """A minimal GGUF file: an architecture and one tensor (of `tensor_type` where given)."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), arch)
    data = np.zeros((4, 32), dtype=np.int32 if tensor_type == gguf.GGMLQuantizationType.I32 else np.float32)
    writer.add_tensor("token_embd.weight", data, raw_dtype=tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_bad_gguf_files(cli, tiny_gguf, tmp_path):
    import gguf

    out = tmp_path / "out"
    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_text("this is not a model\n" * 10)
    assert_user_error(cli("convert", not_gguf, out), out, "not a readable GGUF")
    # a tiny Llama GGUF (conftest's tiny_gguf) cut inside its metadata (the tokenizer's strings), and inside
    # its tensor data
    data = tiny_gguf.read_bytes()
    start = gguf.GGUFReader(tiny_gguf).data_offset
    for n, cut in enumerate((start // 2, (start + len(data)) // 2)):
        truncated = tmp_path / f"cut{n}.gguf"
        truncated.write_bytes(data[:cut])
        assert_user_error(cli("convert", truncated, out), out, "GGUF")
    gpt2 = tmp_path / "gpt2.gguf"
    write_gguf(gpt2, "gpt2")
    assert_user_error(cli("convert", gpt2, out), out, "architecture 'gpt2'")
    ints = tmp_path / "ints.gguf"
    write_gguf(ints, "llama", gguf.GGMLQuantizationType.I32)
    assert_user_error(cli("convert", ints, out), out, "cannot be dequantized")
    assert_user_error(cli("eval", "ppl", not_gguf), None, "not a readable GGUF")


def test_qk_norm_source_is_refused(cli, tokenizer, tmp_path):
    src = tmp_path / "qwen3"
    tiny_source("qwen3").save_pretrained(src)
    tokenizer.save_pretrained(src)
    out = tmp_path / "out"
    assert_user_error(cli("convert", src, out), out, "QK-norm")


def test_missing_shard(cli, tokenizer, tmp_path):
    src = tmp_path / "sharded"
    tiny_source("llama").save_pretrained(src, max_shard_size="100KB")
    tokenizer.save_pretrained(src)
    assert len(list(src.glob("model-*.safetensors"))) > 1
    sorted(src.glob("model-*.safetensors"))[0].unlink()
    out = tmp_path / "out"
    assert_user_error(cli("convert", src, out), out, "missing")


def test_kv_budget_cli_and_errors(cli, tiny_dir, calib_text, tmp_path):
    out = tmp_path / "mla"
    common = ["--calib-data", str(calib_text), "--calib-size", "2x32"]
    run = cli("convert", tiny_dir, out, "--kv-budget", "30", *common, "--json")
    assert run.returncode == 0, run.stderr[-2000:]
    kv = cli("kv-size", out, "--json")
    assert kv.returncode == 0 and len(kv.stdout.strip().splitlines()) == 1
    report = json.loads(kv.stdout.strip().splitlines()[-1])
    # shared RoPE key: d_kv names the paper's layout of the same size, 2·(d_kv + 2·d_h/16) = 30 with d_h 16
    assert report["kv_elements_per_token_per_layer"] == 30 and report["d_kv"] == 13
    for budget in ("2", "64", "1000"):  # below the smallest possible; the source's own size; above it
        bad = tmp_path / f"bad{budget}"
        run = cli("convert", tiny_dir, bad, "--kv-budget", budget, *common)
        assert run.returncode == 2 and "Traceback" not in run.stderr
        assert [line for line in run.stderr.splitlines() if line.startswith("error: ")][0].count("--kv-budget")
        assert not bad.exists()


# --- the process boundary is the point: a checkpoint loads where mha2mla cannot be imported -------------

@pytest.mark.parametrize("name", ["llama-gqa", "qwen2-bias"])
def test_save_load_in_fresh_process_without_package(name, tokenizer, calib_text, tmp_path):
    family = {"llama-gqa": "llama", "qwen2-bias": "qwen2"}[name]
    src = tiny_source(family, n_kv=2)
    mla = convert_model((src, tokenizer), tmp_path / "mla", d_kv=8, calib_data=[calib_text],
                        calib_samples=4, calib_seq_len=32, progress=False)[0]
    ids = ids_for()
    torch.save(ids, tmp_path / "ids.pt")
    script = textwrap.dedent(f"""
        import sys
        sys.modules["mha2mla"] = None  # the checkpoint must load without the package
        import torch
        from transformers import AutoModelForCausalLM
        from transformers import AutoModelForCausalLM, AutoTokenizer
        model = AutoModelForCausalLM.from_pretrained({str(tmp_path / 'mla')!r}, trust_remote_code=True)
        ids = torch.load({str(tmp_path / 'ids.pt')!r})
        torch.save(model(ids).logits, {str(tmp_path / 'logits.pt')!r})
        print(type(model).__module__)
        # the tokenizer alone: no custom code, so no prompt and no warning
        tokenizer = AutoTokenizer.from_pretrained({str(tmp_path / 'mla')!r}, subfolder="tokenizer")
        print(tokenizer("hello world").input_ids)
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path,
                         stdin=subprocess.DEVNULL)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "modeling_mla" in run.stdout
    assert str(tokenizer("hello world").input_ids) in run.stdout
    assert "custom code" not in run.stdout + run.stderr and "instantiate a model of type" not in run.stderr
    loaded = torch.load(tmp_path / "logits.pt")
    assert (loaded - mla(ids).logits).abs().max().item() == 0.0
    for f in ("configuration_mla.py", "modeling_mla.py", "latent_cache.py", "README.md", "tokenizer.json",
              "model.safetensors", "generation_config.json"):
        assert (tmp_path / "mla" / f).exists(), f


def test_using_the_package_registers_the_auto_classes(mla_dir, tmp_path):
    """A fresh process: `import mha2mla` alone loads nothing (the CLI's --help needs no torch); touching a
    public name registers the MLA config and model, and the stock Auto class then loads the checkpoint
    without trust_remote_code."""
    script = textwrap.dedent(f"""
        import sys
        import mha2mla
        assert "torch" not in sys.modules
        mha2mla.load_model
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(mla_dir)!r})
        print(type(model).__module__, type(model).__name__)
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path,
                         stdin=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["mha2mla.modeling.modeling_mla", "MLAForCausalLM"]
