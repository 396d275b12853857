"""`mha2mla convert` / `kv-size` / `eval ppl` through the CLI: happy path and every bad input.

Each bad input must give exactly one line `error: …` on stderr, exit status 2, no traceback, and
leave nothing in OUT.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import tiny_source


def cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "mha2mla.cli", *map(str, args)], capture_output=True,
                          text=True, cwd=cwd)


@pytest.fixture(scope="module")
def tiny_dir(smollm2, tmp_path_factory):
    """A tiny random Llama GQA source saved as a HF directory with the SmolLM2 tokenizer."""
    path = tmp_path_factory.mktemp("tiny") / "src"
    tiny_source("llama", vocab=49152, n_kv=2).save_pretrained(path)
    smollm2[1].save_pretrained(path)
    return path


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


def test_convert_json_and_kv_size(tiny_dir, wiki_dir, tmp_path):
    out = tmp_path / "mla"
    run = cli("convert", tiny_dir, out, "--recipe", "paper", "--d-kv", 4, "--rope-pairs", 2, "--calib-samples", 2,
              "--calib-seq-len", 32, "--calib-data", wiki_dir, "--json")
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["kv"]["kv_elements_per_token_per_layer"] == 2 * (4 + 4)
    assert report["process_peak_rss_mb"] > 100 and report["device"] in ("cpu", "cuda")
    kv = json.loads(cli("kv-size", out, "--json").stdout.strip().splitlines()[-1])
    assert kv["kv_elements_per_token_per_layer"] == 16 and kv["d_kv"] == 4   # per-head: latent per KV head
    assert kv["reduction_pct"] == pytest.approx(75.0)
    assert set(kv["quantized"]) == {"4", "2"}
    again = cli("convert", tiny_dir, out, "--d-kv", 4, "--calib-data", wiki_dir)
    assert_user_error(again, needle="--overwrite")
    assert (out / "config.json").exists()  # the refused run left the existing output alone


def test_eval_ppl_json(tiny_dir, tmp_path):
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
    (["--rope-strategy", "uniform", "--rope-pairs", "3"], "uniform"),
    (["--kv-balance", "heavy"], "--kv-balance"),
    (["--kv-balance", "-1"], "--kv-balance"),
    (["--kv-reduction", "150"], "--kv-reduction"),
    (["--calib-samples", "0"], "--calib-samples"),
    (["--per-layer-split"], "--kv-budget"),
])
def test_bad_options(tiny_dir, wiki_dir, tmp_path, args, needle):
    out = tmp_path / "out"
    assert_user_error(cli("convert", tiny_dir, out, "--recipe", "paper", "--calib-data", wiki_dir, *args), out, needle)


def test_missing_path(tmp_path):
    out = tmp_path / "out"
    assert_user_error(cli("convert", tmp_path / "nope", out), out, "not found")


def test_unsupported_family(tmp_path):
    from transformers import GPT2Config

    src = tmp_path / "gpt2"
    GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(src)
    out = tmp_path / "out"
    assert_user_error(cli("convert", src, out), out, "supported families")


def test_calibration_text_too_short(tiny_dir, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("Too short.")
    out = tmp_path / "out"
    assert_user_error(cli("convert", tiny_dir, out, "--calib-data", short), out, "calibration text")


def test_corrupt_safetensors(tiny_dir, tmp_path):
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


def test_bad_gguf_files(smollm2, tmp_path):
    import gguf

    from mha2mla.sources import bundled_gguf

    out = tmp_path / "out"
    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_text("this is not a model\n" * 10)
    assert_user_error(cli("convert", not_gguf, out), out, "not a readable GGUF")
    truncated = tmp_path / "cut.gguf"
    with open(bundled_gguf("smollm2-135m"), "rb") as f:
        truncated.write_bytes(f.read(1_000_000))
    assert_user_error(cli("convert", truncated, out), out, "GGUF")
    gpt2 = tmp_path / "gpt2.gguf"
    write_gguf(gpt2, "gpt2")
    assert_user_error(cli("convert", gpt2, out), out, "architecture 'gpt2'")
    ints = tmp_path / "ints.gguf"
    write_gguf(ints, "llama", gguf.GGMLQuantizationType.I32)
    assert_user_error(cli("convert", ints, out), out, "cannot be dequantized")
    assert_user_error(cli("eval", "ppl", not_gguf), None, "not a readable GGUF")


def test_qk_norm_source_is_refused(smollm2, tmp_path):
    src = tmp_path / "qwen3"
    tiny_source("qwen3", vocab=49152).save_pretrained(src)
    smollm2[1].save_pretrained(src)
    out = tmp_path / "out"
    assert_user_error(cli("convert", src, out), out, "QK-norm")


def test_missing_shard(smollm2, tmp_path):
    src = tmp_path / "sharded"
    tiny_source("llama", vocab=49152).save_pretrained(src, max_shard_size="1MB")
    smollm2[1].save_pretrained(src)
    sorted(src.glob("model-*.safetensors"))[0].unlink()
    out = tmp_path / "out"
    assert_user_error(cli("convert", src, out), out, "missing")
