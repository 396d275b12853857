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
    kv = json.loads(cli("kv-size", out, "--json").stdout.strip().splitlines()[-1])
    assert kv["kv_elements_per_token_per_layer"] == 16
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
