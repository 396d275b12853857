"""Streaming weights: readers (safetensors shards, GGUF, in memory), the shard writer, and the
streaming conversion against the in-memory one (same weights, exactly)."""

from __future__ import annotations

import errno
import json

import pytest
import torch
from tiny import tiny_source, write_llama_gguf
from safetensors.torch import load_file

from mha2mla.conversion.pipeline import convert_checkpoint, convert as convert_model
from mha2mla.errors import UserError
from mha2mla.conversion.stages.lowrank import cholesky_factor
from mha2mla.io.readers import SAFE_INDEX, SAFE_WEIGHTS, SafetensorsReader, ShardWriter

SETTINGS = dict(calib_samples=4, calib_seq_len=32, progress=False)


def test_shard_writer_layout_loads_back(tmp_path):
    tensors = {f"layer.{i}.weight": torch.randn(64, 64) for i in range(5)}
    writer = ShardWriter(tmp_path, max_shard_bytes=2 * 64 * 64 * 4)
    for name, t in tensors.items():
        writer.add(name, t)
    writer.close()
    index = json.loads((tmp_path / SAFE_INDEX).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert shards == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert index["metadata"]["total_size"] == 5 * 64 * 64 * 4
    loaded = {}
    for shard in shards:
        loaded.update(load_file(tmp_path / shard))
    assert loaded.keys() == tensors.keys() and all(torch.equal(loaded[n], t) for n, t in tensors.items())
    assert not list(tmp_path.glob(".shard-*"))

    single = tmp_path / "single"
    single.mkdir()
    writer = ShardWriter(single)
    writer.add("w", torch.ones(3))
    writer.close()
    assert [p.name for p in single.iterdir()] == [SAFE_WEIGHTS]


@pytest.mark.parametrize("family,kw", [("llama", dict(n_kv=2)), ("qwen2", dict(n_kv=2))])
def test_streaming_from_shards_equals_in_memory(family, kw, tokenizer, calib_text, tmp_path):
    """A source saved in several shards converts, streamed, to exactly the weights of the in-memory path."""
    src = tiny_source(family, **kw)
    path = tmp_path / "src"
    src.save_pretrained(path, max_shard_size="100KB")
    tokenizer.save_pretrained(path)
    assert len(json.loads((path / SAFE_INDEX).read_text())["weight_map"]) > 1
    assert len(list(path.glob("*.safetensors"))) > 2
    streamed, saved_tokenizer = convert_model(path, tmp_path / "mla", calib_data=[calib_text], kv_budget=40,
                                              **SETTINGS)
    # the directory's tokenizer (transformers picks its class by the config's model type)
    in_memory, _ = convert_model((src, saved_tokenizer), calib_data=[calib_text], kv_budget=40, **SETTINGS)
    a, b = streamed.state_dict(), in_memory.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert streamed.config.kept_pairs == in_memory.config.kept_pairs
    assert streamed.config.conversion["budget_candidates"] == in_memory.config.conversion["budget_candidates"]


def test_streaming_from_gguf_equals_in_memory(tokenizer, calib_text, tmp_path):
    """A tiny random Llama written as GGUF (with the tiny tokenizer) converts, streamed from the file, to
    exactly the weights of converting the same model in memory."""
    from transformers import AutoTokenizer

    src = tiny_source("llama", n_kv=2, tie_word_embeddings=False)
    path = tmp_path / "tiny.gguf"
    write_llama_gguf(src, path, tokenizer)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    streamed, _ = convert_model(path, tmp_path / "mla", calib_data=[calib_text], kv_budget=40, **SETTINGS)
    in_memory, _ = convert_model((src, tokenizer), calib_data=[calib_text], kv_budget=40, **SETTINGS)
    a, b = streamed.state_dict(), in_memory.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_bf16_source_with_few_calibration_tokens_converts_like_fp32(tokenizer, calib_text, tmp_path):
    """Statistics do not depend on the storage dtype: a bf16 checkpoint is computed in float32 (fewer
    calibration tokens (64) than hidden dims (256): the damping makes the second moment definite)."""
    src = tiny_source("llama", n_heads=8, head_dim=32, n_kv=4)
    for dtype in (torch.bfloat16, torch.float32):
        path = tmp_path / str(dtype)
        src.to(dtype).save_pretrained(path)
        tokenizer.save_pretrained(path)
    settings = dict(calib_data=[calib_text], calib_samples=2, calib_seq_len=32, progress=False, d_kv=8)
    bf16, _ = convert_model(tmp_path / str(torch.bfloat16), **settings)
    fp32, _ = convert_model(tmp_path / str(torch.float32), **settings)
    assert bf16.dtype == torch.bfloat16 and fp32.dtype == torch.float32
    assert bf16.config.conversion["dtype"] == "float32"
    kv_down_bf16 = bf16.model.layers[0].self_attn.kv_down.weight.float()
    kv_down_fp32 = fp32.model.layers[0].self_attn.kv_down.weight
    # the bf16 weights are the fp32 source rounded, so the factors agree to bf16 precision, not exactly
    assert torch.allclose(kv_down_bf16.abs(), kv_down_fp32.abs(), atol=0.05, rtol=0.05)


def test_cholesky_of_singular_or_non_finite_statistics():
    x = torch.randn(8, 64, dtype=torch.float64)  # 8 samples in 64 dims: rank 8
    chol = cholesky_factor(x.T @ x / 8)
    assert torch.isfinite(chol).all()
    with pytest.raises(UserError, match="not finite"):
        cholesky_factor(torch.full((4, 4), float("nan")))
    with pytest.raises(UserError, match="not positive-definite"):
        cholesky_factor(-torch.eye(4, dtype=torch.float64))


def test_full_disk_is_a_user_error_and_leaves_nothing(tokenizer, calib_text, tmp_path, monkeypatch):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("mha2mla.io.readers.save_file", full)
    out = tmp_path / "mla"
    with pytest.raises(UserError, match="disk is full"):
        convert_checkpoint((tiny_source("llama"), tokenizer), out, calib_data=[calib_text], d_kv=4,
                           **SETTINGS)
    assert list(tmp_path.iterdir()) == []


def test_missing_shard_and_truncated_file_are_user_errors(tokenizer, tmp_path):
    src = tiny_source("llama")
    path = tmp_path / "src"
    src.save_pretrained(path, max_shard_size="100KB")
    shards = sorted(path.glob("*.safetensors"))
    data = shards[0].read_bytes()
    shards[0].write_bytes(data[: len(data) // 2])
    with pytest.raises(UserError, match="not a readable safetensors"):
        SafetensorsReader(path, src.config)
    shards[0].unlink()
    with pytest.raises(UserError, match="missing"):
        SafetensorsReader(path, src.config)


def test_device_choice():
    from mha2mla.conversion.pipeline import compute_device

    assert compute_device("cpu") == torch.device("cpu")
    assert compute_device(None) == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(UserError, match="--device"):
        compute_device("tpu:x")
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="no CUDA GPU"):
            compute_device("cuda")
