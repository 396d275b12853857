"""Streaming weights: readers (safetensors shards, GGUF, in memory), the shard writer, and the
streaming conversion against the in-memory one (same weights, exactly)."""

from __future__ import annotations

import errno
import json

import pytest
import torch
from conftest import tiny_source
from safetensors.torch import load_file

from mha2mla.convert import convert_checkpoint, convert_model
from mha2mla.errors import UserError
from mha2mla.lowrank import cholesky_factor
from mha2mla.weights import SAFE_INDEX, SAFE_WEIGHTS, GGUFTensorReader, SafetensorsReader, ShardWriter, open_gguf

SETTINGS = dict(calib_samples=4, calib_seq_len=32, progress=False)


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    return smollm2[1]


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
def test_streaming_from_shards_equals_in_memory(family, kw, tokenizer, wiki_dir, tmp_path):
    """A source saved in several shards converts, streamed, to exactly the weights of the in-memory path."""
    src = tiny_source(family, vocab=49152, **kw)
    path = tmp_path / "src"
    src.save_pretrained(path, max_shard_size="1MB")
    tokenizer.save_pretrained(path)
    assert len(json.loads((path / SAFE_INDEX).read_text())["weight_map"]) > 1
    assert len(list(path.glob("*.safetensors"))) > 2
    streamed, saved_tokenizer = convert_model(path, tmp_path / "mla", calib_data=[wiki_dir], kv_budget=40,
                                              **SETTINGS)
    # the directory's tokenizer (transformers picks its class by the config's model type)
    in_memory, _ = convert_model((src, saved_tokenizer), calib_data=[wiki_dir], kv_budget=40, **SETTINGS)
    a, b = streamed.state_dict(), in_memory.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert streamed.config.kept_pairs == in_memory.config.kept_pairs
    assert streamed.config.conversion["budget_candidates"] == in_memory.config.conversion["budget_candidates"]


def test_gguf_reader_gives_the_tensors_of_transformers_gguf_loader(smollm2):
    """Every tensor read (and dequantized, un-permuted) one at a time equals transformers' whole-file load."""
    from mha2mla.sources import bundled_gguf

    model = smollm2[0]
    reader = GGUFTensorReader(open_gguf(bundled_gguf("smollm2-135m")), model.config)
    state = model.state_dict()
    expected = {n for n in state if n != "lm_head.weight"}  # tied to the embeddings: not in the file
    assert reader.names() == expected
    for name in sorted(expected):
        assert torch.equal(reader.get(name), state[name]), name


def write_llama_gguf(model, path, tokenizer_gguf) -> None:
    """`model` (a Llama) as llama.cpp's converter writes it: GGUF names, q/k rows permuted, float32
    tensors, the metadata transformers reads, and the tokenizer of another GGUF file."""
    import gguf

    config = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_vocab_size(config.vocab_size)
    for name, field in gguf.GGUFReader(tokenizer_gguf).fields.items():
        if name.startswith("tokenizer."):
            sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(name, field.contents(), field.types[0], sub_type=sub)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)

    def permute(w, heads):  # llama.cpp's rotary layout: interleaved pairs per head
        return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        base, suffix = name.rsplit(".", 1)
        w = tensor.float().numpy()
        if ".q_proj." in name:
            w = permute(w, config.num_attention_heads)
        elif ".k_proj." in name:
            w = permute(w, config.num_key_value_heads)
        writer.add_tensor(f"{names.get_name(base)}.{suffix}", w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_streaming_from_gguf_equals_in_memory(smollm2, wiki_dir, tmp_path):
    """A tiny random Llama written as GGUF converts, streamed from the file, to exactly the weights of
    converting the same model in memory."""
    from transformers import AutoTokenizer

    from mha2mla.sources import bundled_gguf

    src = tiny_source("llama", vocab=49152, n_kv=2, tie_word_embeddings=False)
    path = tmp_path / "tiny.gguf"
    write_llama_gguf(src, path, bundled_gguf("smollm2-135m"))
    tokenizer = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    streamed, _ = convert_model(path, tmp_path / "mla", calib_data=[wiki_dir], kv_budget=40, **SETTINGS)
    in_memory, _ = convert_model((src, tokenizer), calib_data=[wiki_dir], kv_budget=40, **SETTINGS)
    a, b = streamed.state_dict(), in_memory.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_bf16_source_with_few_calibration_tokens_converts_like_fp32(tokenizer, wiki_dir, tmp_path):
    """Statistics do not depend on the storage dtype: a bf16 checkpoint is computed in float32 (fewer
    calibration tokens (64) than hidden dims (256): the damping makes the second moment definite)."""
    src = tiny_source("llama", n_heads=8, head_dim=32, n_kv=4, vocab=49152)
    for dtype in (torch.bfloat16, torch.float32):
        path = tmp_path / str(dtype)
        src.to(dtype).save_pretrained(path)
        tokenizer.save_pretrained(path)
    settings = dict(calib_data=[wiki_dir], calib_samples=2, calib_seq_len=32, progress=False, d_kv=8)
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


def test_full_disk_is_a_user_error_and_leaves_nothing(tokenizer, wiki_dir, tmp_path, monkeypatch):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("mha2mla.weights.save_file", full)
    out = tmp_path / "mla"
    with pytest.raises(UserError, match="disk is full"):
        convert_checkpoint((tiny_source("llama", vocab=49152), tokenizer), out, calib_data=[wiki_dir], d_kv=4,
                           **SETTINGS)
    assert list(tmp_path.iterdir()) == []


def test_missing_shard_and_truncated_file_are_user_errors(tokenizer, tmp_path):
    src = tiny_source("llama", vocab=49152)
    path = tmp_path / "src"
    src.save_pretrained(path, max_shard_size="1MB")
    shards = sorted(path.glob("*.safetensors"))
    data = shards[0].read_bytes()
    shards[0].write_bytes(data[: len(data) // 2])
    with pytest.raises(UserError, match="not a readable safetensors"):
        SafetensorsReader(path, src.config)
    shards[0].unlink()
    with pytest.raises(UserError, match="missing"):
        SafetensorsReader(path, src.config)


def test_device_choice():
    from mha2mla.convert import compute_device

    assert compute_device("cpu") == torch.device("cpu")
    assert compute_device(None) == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(UserError, match="--device"):
        compute_device("tpu:x")
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="no CUDA GPU"):
            compute_device("cuda")
