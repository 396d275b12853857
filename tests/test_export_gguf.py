"""`mha2mla export --format gguf`: a llama.cpp `deepseek2` GGUF file.

CI reads the file back with gguf's reader: every tensor is the DeepSeek-V3 export's tensor in
llama.cpp's name and layout (exact for F32, the type's own rounding for F16/BF16/Q8_0), kv_b_proj
split into attn_k_b / attn_v_b so that the absorbed scores and values equal DeepSeek's, the metadata
llama.cpp's loader reads, and the tokenizer fields equal to the source GGUF's. transformers (5.25)
cannot load a deepseek2 GGUF (its GGUF loader has no such architecture), so no logits comparison runs
there. What llama.cpp cannot compute is refused in one line (exit 2).

Opt-in (`make test-llama-cpp`, marker llama_cpp): SmolLM2-135M converted at 72 values runs in
llama.cpp through llama-cpp-python, with the MLA model's greedy continuation and logits.
"""

from __future__ import annotations

import json
from collections import Counter

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from mha2mla.cli import main
from mha2mla.errors import UserError
from mha2mla.exports.deepseek_v3 import export_checkpoint
from mha2mla.exports.gguf import TENSOR_TYPES, export_gguf, source_gguf, write_gguf
from mha2mla.modeling import MLAConfig
from test_export import convert_tiny

T = gguf.GGMLQuantizationType
# llama.cpp's largest logit difference to the float32 MLA model, relative to the largest logit: F16 weights and
# KV cache (measured on SmolLM2 at 72 values: 1.4e-3)
LLAMA_CPP_GAP = 5e-3
# largest error of one stored value relative to the largest |value| of its row (F16/BF16) or 32-block (Q8_0)
ROUNDING = {T.F32: 0.0, T.F16: 2**-11, T.BF16: 2**-8, T.Q8_0: 1 / 127}


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    return smollm2[1]


@pytest.fixture(scope="module")
def source():
    """The bundled SmolLM2 GGUF (its tokenizer is the tiny models' too)."""
    return source_gguf("smollm2-135m")[1]


@pytest.fixture(scope="module")
def mla_dir(tokenizer, wiki_dir, tmp_path_factory):
    """A tiny GQA Llama converted by the default recipe (shared RoPE key), saved."""
    out = tmp_path_factory.mktemp("gguf") / "mla"
    convert_tiny(tokenizer, wiki_dir, out=out)
    return out


@pytest.fixture(scope="module")
def ds_dir(mla_dir, wiki_dir, tmp_path_factory):
    """Its DeepSeek-V3 export, the checkpoint the GGUF file is mapped from."""
    out = tmp_path_factory.mktemp("gguf") / "ds"
    export_checkpoint(mla_dir, out, calib_data=[wiki_dir], calib_seq_len=64)
    return out


@pytest.fixture(scope="module")
def written(ds_dir, source, tmp_path_factory) -> dict[str, tuple]:
    """The DeepSeek-V3 export written as GGUF in every tensor type: type → (write_gguf's report, gguf's
    reader of the file; it parses the 150 K tokenizer strings in seconds, so once per file)."""
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


def test_cli_export_refuses_an_existing_file_then_replaces_it_and_reports(mla_dir, wiki_dir, tmp_path, capsys):
    from mha2mla.cli import _print_export

    out = tmp_path / "out" / "smol.gguf"
    out.parent.mkdir()
    out.write_bytes(b"")
    args = ["export", str(mla_dir), str(out), "--format", "gguf", "--type", "q8_0", "--source", "smollm2-135m",
            "--calib-data", str(wiki_dir), "--json"]
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


def refusal(tmp_path, capsys, config_dir, *extra) -> str:
    """The one-line error of exporting `config_dir` to GGUF through the CLI (exit 2, nothing written)."""
    capsys.readouterr()
    assert main(["export", str(config_dir), str(tmp_path / "m.gguf"), "--format", "gguf",
                 "--source", "smollm2-135m", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error:")
    assert [p.name for p in tmp_path.iterdir()] == [config_dir.name]
    return err


def mla_config_dir(tmp_path, **fields):
    """A directory holding only an MLA config: every refusal is read from the config."""
    config = MLAConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, d_kv=8, rope_pairs=2, rope_layout="shared",
                       **fields)
    config.save_pretrained(tmp_path / "mla")
    return tmp_path / "mla"


def test_attention_biases_are_refused(tmp_path, capsys):
    err = refusal(tmp_path, capsys, mla_config_dir(tmp_path, attention_bias=True))
    assert "attention biases" in err and "--format deepseek-v3" in err


def test_scaled_rope_is_refused(tmp_path, capsys):
    default = MLAConfig(hidden_size=64, num_attention_heads=4).rope_inv_freq
    err = refusal(tmp_path, capsys, mla_config_dir(tmp_path, rope_inv_freq=[f / 8 for f in default]))
    assert "RoPE is scaled" in err


def test_per_head_rope_is_refused_by_the_deepseek_export(tmp_path, capsys):
    config_dir = mla_config_dir(tmp_path)
    config = json.loads((config_dir / "config.json").read_text())
    config.update(rope_layout="per_head", kept_pairs=[[[0, 1], [0, 1]]] * 2)
    (config_dir / "config.json").write_text(json.dumps(config))
    assert "--rope-strategy pca" in refusal(tmp_path, capsys, config_dir)


def test_a_source_that_is_not_gguf_is_refused(tmp_path, capsys):
    config_dir = mla_config_dir(tmp_path)
    err = refusal(tmp_path, capsys, config_dir, "--source", str(config_dir))
    assert "--source" in err and "GGUF file" in err


def test_unknown_tensor_type_and_deepseek_options_are_refused(tmp_path, capsys):
    import mha2mla

    with pytest.raises(UserError, match="q8_0"):                 # mha2mla.export(format="gguf") is export_gguf
        mha2mla.export(mla_config_dir(tmp_path), tmp_path / "m.gguf", format="gguf", tensor_type="q4_0")
    assert "--pad-for" in refusal(tmp_path, capsys, tmp_path / "mla", "--pad-for", "vllm")


# --- opt-in: llama.cpp itself (make test-llama-cpp) ----------------------------------------------------------

@pytest.fixture(scope="module")
def llama_cpp(request):
    if "llama_cpp" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("opt-in: make test-llama-cpp (pytest -m llama_cpp)")
    return pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (make test-llama-cpp)")


@pytest.fixture(scope="module")
def smollm2_b72_gguf(llama_cpp, tmp_path_factory):
    """SmolLM2-135M converted by the default recipe at 72 values, and its f16 GGUF export."""
    from mha2mla.convert import convert_model

    out = tmp_path_factory.mktemp("llama-cpp")
    model, tokenizer = convert_model("smollm2-135m", out / "mla", kv_budget=72)
    export_gguf(out / "mla", out / "mla.gguf")
    return model.eval(), tokenizer, out / "mla.gguf"


@pytest.mark.llama_cpp
@torch.no_grad()
def test_llama_cpp_runs_the_export_as_the_mla_model(llama_cpp, smollm2_b72_gguf):
    """Token ids in (not text): llama.cpp's logits on a short sequence are the MLA model's within the F16
    weights' and F16 KV cache's rounding, and its greedy continuation is the MLA model's."""
    model, tokenizer, path = smollm2_b72_gguf
    ids = tokenizer("The capital of France is Paris. The capital of Germany is", add_special_tokens=False)["input_ids"]
    llm = llama_cpp.Llama(str(path), n_ctx=128, n_threads=2, logits_all=True, verbose=False)
    llm.eval(ids)
    logits = torch.from_numpy(np.array(llm.scores[:len(ids)], dtype=np.float64))
    want = model(torch.tensor([ids])).logits[0].double()
    assert (logits - want).abs().max() < LLAMA_CPP_GAP * want.abs().max()
    assert (logits.argmax(-1) == want.argmax(-1)).all()
    greedy = model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids):].tolist()
    for token in greedy:
        assert int(np.argmax(llm.scores[llm.n_tokens - 1])) == token
        llm.eval([token])
    llm.close()
