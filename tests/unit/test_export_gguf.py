"""`mha2mla export --format gguf` (the Python API): a llama.cpp `deepseek2` GGUF file.

CI reads the file back with gguf's reader: every tensor is the DeepSeek-V3 export's tensor in
llama.cpp's name and layout (exact for F32, the type's own rounding for F16/BF16/Q8_0), kv_b_proj
split into attn_k_b / attn_v_b so that the absorbed scores and values equal DeepSeek's, the metadata
llama.cpp's loader reads, and the tokenizer fields equal to the source GGUF's. transformers (5.25)
cannot load a deepseek2 GGUF (its GGUF loader has no such architecture), so no logits comparison runs
there. The source GGUF whose tokenizer is carried over is a tiny one written in the test.

The CLI and its refusals: tests/cli/test_export_cli.py. Opt-in (`make test-llama-cpp`, marker llama_cpp):
SmolLM2-135M in llama.cpp, tests/integration/test_llama_cpp.py.
"""

from __future__ import annotations

import json
from collections import Counter

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from mha2mla.exports.gguf import TENSOR_TYPES, write_gguf

T = gguf.GGMLQuantizationType
# largest error of one stored value relative to the largest |value| of its row (F16/BF16) or 32-block (Q8_0)
ROUNDING = {T.F32: 0.0, T.F16: 2**-11, T.BF16: 2**-8, T.Q8_0: 1 / 127}


@pytest.fixture(scope="module")
def source(tiny_gguf):
    """gguf's reader of the tiny source GGUF (a Llama with the tiny tokenizer, the tiny models' vocabulary)."""
    return gguf.GGUFReader(tiny_gguf)


@pytest.fixture(scope="module")
def written(ds_dir, source, tmp_path_factory) -> dict[str, tuple]:
    """The DeepSeek-V3 export (of conftest's mla_dir) written as GGUF in every tensor type: type →
    (write_gguf's report, gguf's reader of the file, read once per file)."""
    out = tmp_path_factory.mktemp("gguf")
    return {kind: (write_gguf(ds_dir, out / f"{kind}.gguf", source, kind), gguf.GGUFReader(out / f"{kind}.gguf"))
            for kind in TENSOR_TYPES}


def ds_tensors(ds_dir) -> tuple[dict, dict[str, torch.Tensor]]:
    return json.loads((ds_dir / "config.json").read_text()), load_file(ds_dir / "model.safetensors")


def expected_tensors(ds: dict, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The GGUF tensors (PyTorch order) written independently of the module: llama.cpp's names, and
    kv_b_proj's rows per head [k_nope rows; v rows] as attn_k_b (transposed) and attn_v_b."""
    H, Dn, dv = ds["num_attention_heads"], ds["qk_nope_head_dim"], ds["v_head_dim"]
    names = {"self_attn.q_proj": "attn_q", "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
             "self_attn.kv_a_layernorm": "attn_kv_a_norm", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
             "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    out = {"token_embd.weight": tensors["model.embed_tokens.weight"], "output_norm.weight": tensors["model.norm.weight"]}
    if "lm_head.weight" in tensors:                      # untied (tied: llama.cpp reads token_embd)
        out["output.weight"] = tensors["lm_head.weight"]
    for i in range(ds["num_hidden_layers"]):
        for hf, name in names.items():
            out[f"blk.{i}.{name}.weight"] = tensors[f"model.layers.{i}.{hf}.weight"]
        kv_b = tensors[f"model.layers.{i}.self_attn.kv_b_proj.weight"]
        rows = [kv_b[h * (Dn + dv):(h + 1) * (Dn + dv)] for h in range(H)]
        out[f"blk.{i}.attn_k_b.weight"] = torch.stack([r[:Dn].T for r in rows])          # [H, L, D_n]
        out[f"blk.{i}.attn_v_b.weight"] = torch.stack([r[Dn:] for r in rows])            # [H, d_v, L]
    return out


def read_back(reader) -> dict[str, tuple[T, np.ndarray]]:
    """Every tensor of a GGUF file: (type, values as float32 in PyTorch order)."""
    return {t.name: (t.tensor_type, gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape))))
            for t in reader.tensors}


@pytest.mark.parametrize("kind", list(TENSOR_TYPES))
def test_every_tensor_is_the_deepseek_export_in_llama_cpp_layout(ds_dir, written, kind):
    report, reader = written[kind]
    ds, tensors = ds_tensors(ds_dir)
    want = expected_tensors(ds, tensors)
    got = read_back(reader)
    assert set(got) == set(want)
    wanted = TENSOR_TYPES[kind]
    for name, (qtype, values) in got.items():
        ref = want[name].float().numpy()
        assert values.shape == ref.shape, name
        block = 32 if qtype == T.Q8_0 else ref.shape[-1]
        if ref.ndim == 1 or "norm" in name or ".attn_kv_a_mqa." in name:
            assert qtype == T.F32, name
        else:
            assert qtype == (wanted if ref.shape[-1] % gguf.GGML_QUANT_SIZES[wanted][0] == 0 else T.F16), name
        scale = np.abs(ref.reshape(-1, block)).max(-1, keepdims=True)
        err = np.abs((values - ref).reshape(-1, block))
        assert (err <= ROUNDING[qtype] * scale + 1e-30).all(), (name, qtype.name, float(err.max()))
    assert report["tensor_types"] == dict(Counter(q.name for q, _ in got.values()))
    if kind == "q8_0":   # the tiny model's 16-wide attn_k_b rows and 24-wide latent rows are no whole blocks
        assert set(report["f16_fallback"]) == {n for n, (q, _) in got.items() if q == T.F16} != set()


@torch.no_grad()
def test_split_kv_b_gives_deepseeks_absorbed_scores_and_values(ds_dir, written):
    """What llama.cpp computes with attn_k_b / attn_v_b (MLA absorbed into the query and the output) equals
    DeepSeek's scores q_nope · k_nope and values v = kv_b_proj ĉ, for a random latent and query."""
    ds, tensors = ds_tensors(ds_dir)
    H, Dn, dv, L = ds["num_attention_heads"], ds["qk_nope_head_dim"], ds["v_head_dim"], ds["kv_lora_rank"]
    got = read_back(written["f16"][1])
    k_b, v_b = (torch.from_numpy(got[f"blk.0.attn_{p}_b.weight"][1]).double() for p in "kv")
    kv = (tensors["model.layers.0.self_attn.kv_b_proj.weight"].double().half().double()
          .view(H, Dn + dv, L))                          # the F16 values the file holds
    c, q_nope = torch.randn(5, L, dtype=torch.double), torch.randn(H, Dn, dtype=torch.double)
    k_nope = torch.einsum("hdl,tl->htd", kv[:, :Dn], c)
    assert torch.allclose(torch.einsum("hd,htd->ht", q_nope, k_nope),
                          torch.einsum("hld,hd,tl->ht", k_b, q_nope, c))
    assert torch.allclose(torch.einsum("hvl,tl->htv", kv[:, Dn:], c), torch.einsum("hvl,tl->htv", v_b, c))


def test_metadata_is_what_llama_cpp_reads_and_the_tokenizer_is_the_sources(ds_dir, source, written):
    ds, _ = ds_tensors(ds_dir)
    fields = written["q8_0"][1].fields
    value = {k: f.contents() for k, f in fields.items()}
    L, rope, layers = ds["kv_lora_rank"], ds["qk_rope_head_dim"], ds["num_hidden_layers"]
    assert value["general.architecture"] == "deepseek2"
    assert value["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q8_0
    want = {"block_count": layers, "leading_dense_block_count": layers, "context_length": ds["max_position_embeddings"],
            "embedding_length": ds["hidden_size"], "feed_forward_length": ds["intermediate_size"],
            "expert_feed_forward_length": ds["intermediate_size"], "expert_shared_count": 0,
            "vocab_size": ds["vocab_size"], "attention.head_count": ds["num_attention_heads"],
            "attention.head_count_kv": 1, "attention.q_lora_rank": 0, "attention.kv_lora_rank": L,
            "attention.key_length": L + rope, "attention.value_length": L,
            "attention.key_length_mla": ds["qk_nope_head_dim"] + rope, "attention.value_length_mla": ds["v_head_dim"],
            "rope.dimension_count": rope}
    assert {k: value[f"deepseek2.{k}"] for k in want} == want
    assert value["deepseek2.rope.freq_base"] == pytest.approx(ds["rope_parameters"]["rope_theta"])
    assert value["deepseek2.attention.layer_norm_rms_epsilon"] == pytest.approx(ds["rms_norm_eps"])
    assert not any("expert_count" in k or "rope.scaling" in k for k in value)
    tokenizer_keys = [k for k in source.fields if k.startswith("tokenizer.")]
    assert len(tokenizer_keys) >= 9
    for key in tokenizer_keys:
        assert fields[key].types == source.fields[key].types, key
        assert fields[key].contents() == source.fields[key].contents(), key
    assert value["general.name"] == source.fields["general.name"].contents() + " (MLA)"




def test_padding_for_llama_cpp_cuda_writes_one_of_its_flash_attention_shapes(mla_dir, tiny_gguf, calib_text, tmp_path):
    """--pad-for llama.cpp-cuda: K/V head sizes 192/128 for a latent of at most 128 (the cached [ĉ | k_pe], ĉ);
    an engine of another library is refused."""
    from mha2mla.errors import UserError
    from mha2mla.exports.gguf import export_gguf

    report = export_gguf(mla_dir, tmp_path / "m.gguf", source=tiny_gguf, calib_data=[calib_text],
                         pad_for="llama.cpp-cuda")
    value = {k: f.contents() for k, f in gguf.GGUFReader(tmp_path / "m.gguf").fields.items()}
    assert (report["kv_lora_rank"], report["qk_rope_head_dim"]) == (128, 64)
    assert (value["deepseek2.attention.key_length"], value["deepseek2.attention.value_length"]) == (192, 128)
    with pytest.raises(UserError, match="not a llama.cpp engine"):
        export_gguf(mla_dir, tmp_path / "v.gguf", source=tiny_gguf, pad_for="vllm")
