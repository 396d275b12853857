"""`mha2mla generate` and `mha2mla bench decode` as a user runs them (`main(argv)` in-process, conftest's
`cli`; bench decode measures each model in its own subprocess itself).

Bad input must end in one line `error: …` and exit status 2, never a traceback. The models are
tiny random checkpoints (an MLA one and a Llama source, context 64) with the tiny tokenizer.
"""

from __future__ import annotations

import json

import pytest
import torch

from tiny import tiny_source

CONTEXT = 64
BENCH_KEYS = {"context", "batch", "source_prefill_s", "mla_prefill_s", "source_decode_tok_s", "mla_decode_tok_s",
              "decode_tok_s_ratio", "source_peak_mb", "mla_peak_mb", "source_kv_bytes", "mla_kv_bytes"}


@pytest.fixture(scope="session")
def tiny_dirs(tokenizer, tmp_path_factory):
    """(MLA checkpoint dir, Llama source dir): random weights, vocabulary of the tiny tokenizer."""
    from mha2mla import MLAConfig, MLAForCausalLM

    root = tmp_path_factory.mktemp("tiny_models")
    torch.manual_seed(0)
    mla = MLAForCausalLM(MLAConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, d_kv=8,
                                   rope_pairs=2, max_position_embeddings=CONTEXT, kv_residual=4, kv_group_size=4))
    source = tiny_source(vocab=len(tokenizer), max_position_embeddings=CONTEXT)
    for name, model in (("mla", mla), ("source", source)):
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    return root / "mla", root / "source"


def assert_user_error(proc, *words: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr
    assert all(w in errors[0] for w in words), errors[0]


# --- generate --------------------------------------------------------------------------------------

@pytest.mark.parametrize("bits", [None, 4])
def test_generate_streams_the_prompt_and_its_continuation(cli, tiny_dirs, bits):
    mla, _ = tiny_dirs
    extra = ["--kv-bits", bits] if bits else []
    proc = cli("generate", mla, "Once upon a time", "--max-new-tokens", 8, *extra)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("Once upon a time") and len(proc.stdout) > len("Once upon a time")


def test_generate_from_an_empty_prompt_starts_at_the_bos_token(cli, tiny_dirs):
    proc = cli("generate", tiny_dirs[0], "", "--max-new-tokens", 4)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip(), proc.stdout


def test_generate_rejects_kv_bits_outside_16_4_2(cli, tiny_dirs):
    assert_user_error(cli("generate", tiny_dirs[0], "hello", "--kv-bits", 8), "--kv-bits", "16, 4 or 2")


def test_generate_rejects_kv_bits_on_a_source_model(cli, tiny_dirs):
    assert_user_error(cli("generate", tiny_dirs[1], "hello", "--kv-bits", 4), "MLA", "convert")


def test_generate_rejects_a_prompt_longer_than_the_context(cli, tiny_dirs):
    assert_user_error(cli("generate", tiny_dirs[0], "word " * (2 * CONTEXT), "--max-new-tokens", 4),
                      "context of 64")


# --- bench decode ----------------------------------------------------------------------------------

def test_bench_decode_json_row_per_context_and_batch(cli, tiny_dirs):
    mla, source = tiny_dirs
    proc = cli("bench", "decode", mla, "--source", source, "--context", 24, "--batch", 2, "--new-tokens", 4,
                   "--chunk", 10, "--json")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1
    (row,) = json.loads(lines[0])["rows"]
    assert set(row) == BENCH_KEYS and (row["context"], row["batch"]) == (24, 2)
    assert row["decode_tok_s_ratio"] == pytest.approx(row["mla_decode_tok_s"] / row["source_decode_tok_s"])
    # 29 cached tokens (24 prompt + warm-up + 4 steps) × 2 rows × 2 layers, fp32:
    # MLA n_kv·(d_kv + 2r) = 2·(8 + 4), source 2·n_kv·d_h = 2·2·16 values per token and layer
    assert row["mla_kv_bytes"] == 29 * 2 * 2 * 4 * 2 * (8 + 4)
    assert row["source_kv_bytes"] == 29 * 2 * 2 * 4 * 2 * 2 * 16
    assert row["source_peak_mb"] > 0 and row["mla_peak_mb"] > 0


@pytest.mark.parametrize("args, words", [
    (["--kv-bits", 3], ["--kv-bits", "16, 4 or 2"]),
    (["--context", "1024,abc"], ["--context", "1024,abc"]),
    (["--context", 0], ["--context", "positive"]),
    (["--context", CONTEXT], ["context of 64"]),
    (["--context", 24, "--batch", 10**12], ["--batch 1000000000000", "GiB available", "the largest that fits is --batch"]),
])
def test_bench_decode_rejects_bad_options(cli, tiny_dirs, args, words):
    mla, source = tiny_dirs
    assert_user_error(cli("bench", "decode", mla, "--source", source, *args), *words)


def test_bench_decode_needs_an_mla_model(cli, tiny_dirs):
    _, source = tiny_dirs
    assert_user_error(cli("bench", "decode", source, "--source", source), "MLA checkpoint", "convert")
