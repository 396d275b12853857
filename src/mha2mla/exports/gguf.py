"""Export an MLA model as a llama.cpp GGUF file of the `deepseek2` architecture.

The model is first written as a DeepSeek-V3 checkpoint (exports/deepseek_v3.py: the weight mapping,
the latent norm on DeepSeek's fixed eps, the interleaved RoPE key, the residual-stream scale) into a
temporary directory beside the output, then mapped onto llama.cpp's names and layouts exactly as
llama.cpp's own converter maps a `DeepseekV3ForCausalLM` (convert_hf_to_gguf.py, `DeepseekV2Model`),
streamed tensor by tensor: the tensor infos come from the safetensors headers, then each tensor is
read, converted to the chosen type and appended, so memory holds about one tensor.

llama.cpp's deepseek2 graph (src/models/deepseek2.cpp) for query head h, without a query low-rank
(`q_lora_rank` 0: one `attn_q`):

    [q_nope,h | q_pe,h] = attn_q x,     [c | k_pe] = attn_kv_a_mqa x,     ĉ = attn_kv_a_norm(c)
    cached per token and layer: [ĉ (L) | RoPE(k_pe) (D_r)], one "KV head"
    score = (W_kb,h q_nope,h) · ĉ + RoPE(q_pe,h) · RoPE(k_pe),  scaled by (D_n + D_r)^-½
    out_h = W_vb,h (Σ_j p_j ĉ_j),        attn_output [out_1 … out_H]

— the absorbed form of DeepSeek-V3's attention, so kv_b_proj, viewed per head as [k_b (D_n × L);
v_b (d_v × L)], is split into `attn_k_b` = k_bᵀ (per head L × D_n) and `attn_v_b` = v_b. The softmax
scale (D_n + D_r)^-½ is transformers' DeepseekV3 one, which the DeepSeek-V3 export already folds the
MLA scale into, and RoPE type NORM rotates adjacent pairs as `rope_interleave` does: q passes through
unchanged. One `layer_norm_rms_epsilon` serves every norm, the latent norm included: the DeepSeek-V3
export uses one eps (1e-6) everywhere already.

What the graph cannot express is refused: attention biases (it adds none), RoPE scaling (it only
computes DeepSeek's yarn), and whatever the DeepSeek-V3 export refuses (its errors propagate).

Tensor types. Norm vectors stay F32 (as llama.cpp writes them); `attn_kv_a_mqa` stays F32 whatever the
type: with the near-linear latent norm its latent rows are ~1e-7..1e-6 in size, below float16's normal
range (6e-5), where q8_0's float16 block scale underflows too (the normed latent ĉ, which the cache
holds, has its natural size). q8_0 takes rows of whole 32-value blocks; a tensor whose rows are not
falls back to F16, as in llama.cpp's converter. The tokenizer is carried over verbatim from the
source's GGUF file (every `tokenizer.*` key), so llama.cpp tokenizes as it did for the source.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from safetensors import safe_open

from ..errors import UserError
from ..io.atomic import save_file_atomically
from ..io.readers import SAFE_INDEX, SAFE_WEIGHTS, open_gguf
from ..io.sources import read_config, resolve
from .deepseek_v3 import ENGINE_SHAPES, export_checkpoint, pad_shapes

ARCH = gguf.MODEL_ARCH.DEEPSEEK2
T = gguf.GGMLQuantizationType
TENSOR_TYPES = {"f16": T.F16, "bf16": T.BF16, "q8_0": T.Q8_0}
FILE_TYPES = {"f16": gguf.LlamaFileType.MOSTLY_F16, "bf16": gguf.LlamaFileType.MOSTLY_BF16,
              "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}
KEPT_F32 = ".attn_kv_a_mqa."        # its latent rows are far below float16's normal range (see above)
# descriptive fields of the source file carried over (the architecture, file type and tokenizer differ or
# are copied apart)
GENERAL_FIELDS = ("general.organization", "general.basename", "general.finetune", "general.size_label",
                  "general.license", "general.languages")


@dataclass
class Entry:
    """One GGUF tensor: its name and shape (PyTorch order, rows last), its type, and where its data is."""
    name: str
    shape: tuple[int, ...]
    qtype: T
    file: Path               # the DeepSeek-V3 shard
    hf_name: str             # the DeepSeek-V3 tensor it is made from
    part: str | None = None  # "k_b" / "v_b" of kv_b_proj

    @property
    def nbytes(self) -> int:
        block, size = gguf.GGML_QUANT_SIZES[self.qtype]
        return math.prod(self.shape) // block * size


def check_graph(config) -> None:
    """What llama.cpp's deepseek2 graph cannot compute, read from the MLA config: a one-line UserError."""
    if getattr(config, "attention_bias", False) or getattr(config, "o_proj_bias", False):
        raise UserError("the model has attention biases (as Qwen2's q/k/v biases), which llama.cpp's deepseek2 "
                        "graph does not add: it cannot be exported to GGUF (--format deepseek-v3 serves it in "
                        "transformers)")
    half = config.head_dim // 2
    default = [config.rope_theta ** (-i / half) for i in range(half)]
    scaled = any(abs(f - d) > 1e-5 * d for f, d in zip(config.rope_inv_freq, default))
    if scaled or abs(config.rope_attention_scaling - 1.0) > 1e-6:
        raise UserError("the model's RoPE is scaled (its frequencies are not rope_theta's default ladder), and "
                        "llama.cpp's deepseek2 graph only computes DeepSeek's own yarn scaling: it cannot be "
                        "exported to GGUF (--format deepseek-v3 carries the scaling)")


def source_gguf(source) -> tuple[Path, gguf.GGUFReader]:
    """The source model's GGUF file (a path or a packaged alias) and gguf's reader of it, or a UserError."""
    if not source:
        raise UserError("the MLA config names no source model to take the tokenizer from: pass the source as a "
                        "GGUF file with --source")
    kind, where = resolve(str(source))
    if kind != "gguf":
        raise UserError(f"the tokenizer is carried over from the source's GGUF file, and {source} is not one: pass "
                        f"the source as a GGUF file with --source (e.g. made by llama.cpp's convert_hf_to_gguf.py)")
    return where, open_gguf(where)


def tensor_type(name: str, shape: tuple[int, ...], wanted: T) -> T:
    """The type a tensor is stored in: F32 for vectors and attn_kv_a_mqa, F16 where q8_0 blocks do not fit."""
    if len(shape) == 1 or name.endswith("_norm.weight") or KEPT_F32 in name:
        return T.F32
    block, _ = gguf.GGML_QUANT_SIZES[wanted]
    return wanted if shape[-1] % block == 0 else T.F16


def safetensors_files(directory: Path) -> dict[str, Path]:
    """Tensor name → the shard holding it, in a checkpoint written by ShardWriter."""
    index = directory / SAFE_INDEX
    if index.is_file():
        return {name: directory / file for name, file in json.loads(index.read_text())["weight_map"].items()}
    with safe_open(str(directory / SAFE_WEIGHTS), framework="pt") as f:
        return dict.fromkeys(f.keys(), directory / SAFE_WEIGHTS)


def layer_order(name: str) -> list:
    """Sort key putting model.layers.2 before model.layers.10."""
    return [int(part) if part.isdigit() else part for part in name.split(".")]


def plan(ds_dir: Path, ds: dict, wanted: T) -> list[Entry]:
    """Every GGUF tensor, from the DeepSeek-V3 checkpoint's headers alone (no tensor is read)."""
    names = gguf.get_tensor_name_map(ARCH, ds["num_hidden_layers"])

    def gguf_name(hf_name: str) -> str:
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise RuntimeError(f"no deepseek2 GGUF name for {hf_name}")
        return name

    H, Dn, dv, L = ds["num_attention_heads"], ds["qk_nope_head_dim"], ds["v_head_dim"], ds["kv_lora_rank"]
    entries = []
    for hf_name, file in sorted(safetensors_files(ds_dir).items(), key=lambda item: layer_order(item[0])):
        if hf_name.endswith("kv_b_proj.weight"):
            for part, shape in (("k_b", (H, L, Dn)), ("v_b", (H, dv, L))):
                name = gguf_name(hf_name.replace("kv_b_proj", f"{part}_proj"))
                entries.append(Entry(name, shape, tensor_type(name, shape, wanted), file, hf_name, part))
            continue
        name = gguf_name(hf_name)
        with safe_open(str(file), framework="pt") as f:
            shape = tuple(f.get_slice(hf_name).get_shape())
        entries.append(Entry(name, shape, tensor_type(name, shape, wanted), file, hf_name))
    return entries


def tensor_data(entry: Entry, ds: dict) -> np.ndarray:
    """The tensor of `entry` as stored: float32/float16 values, or bf16/q8_0 bytes (gguf.quants)."""
    with safe_open(str(entry.file), framework="pt") as f:
        t = f.get_tensor(entry.hf_name).float()
    if entry.part is not None:  # kv_b_proj [H·(D_n + d_v), L] → per head [k_b; v_b]
        kv_b = t.view(ds["num_attention_heads"], ds["qk_nope_head_dim"] + ds["v_head_dim"], ds["kv_lora_rank"])
        k_b, v_b = kv_b.split([ds["qk_nope_head_dim"], ds["v_head_dim"]], dim=1)
        t = k_b.transpose(1, 2) if entry.part == "k_b" else v_b
    return gguf.quants.quantize(t.contiguous().numpy(), entry.qtype)


def copy_field(writer: gguf.GGUFWriter, field, key: str | None = None) -> None:
    """Re-add a GGUF metadata field read by gguf's reader with its own value type (strings as raw bytes)."""
    main, key = field.types[0], key or field.name
    if main == gguf.GGUFValueType.ARRAY:
        sub = field.types[-1]
        values = ([bytes(field.parts[i]) for i in field.data] if sub == gguf.GGUFValueType.STRING
                  else field.contents())
        writer.add_key_value(key, values, main, sub_type=sub)
    elif main == gguf.GGUFValueType.STRING:
        writer.add_key_value(key, bytes(field.parts[-1]), main)
    else:
        writer.add_key_value(key, field.contents(), main)


def add_metadata(writer: gguf.GGUFWriter, ds: dict, source: gguf.GGUFReader, tensor_type_name: str) -> None:
    """The keys llama.cpp's converter writes for a dense DeepseekV3ForCausalLM without a query low-rank,
    and the source file's tokenizer and descriptive fields."""
    layers, L, rope = ds["num_hidden_layers"], ds["kv_lora_rank"], ds["qk_rope_head_dim"]
    writer.add_type(gguf.GGUFType.MODEL)
    name = source.fields.get("general.name")
    writer.add_name(f"{name.contents() if name else 'model'} (MLA)")
    writer.add_description("converted to Multi-head Latent Attention by mha2mla")
    for key in GENERAL_FIELDS:
        if key in source.fields:
            copy_field(writer, source.fields[key])
    writer.add_block_count(layers)
    writer.add_context_length(ds["max_position_embeddings"])
    writer.add_embedding_length(ds["hidden_size"])
    writer.add_feed_forward_length(ds["intermediate_size"])
    writer.add_head_count(ds["num_attention_heads"])
    writer.add_head_count_kv(1)                       # MLA runs as MQA over the cached [ĉ | k_pe]
    writer.add_rope_freq_base(ds["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(ds["rms_norm_eps"])
    writer.add_file_type(FILE_TYPES[tensor_type_name])
    writer.add_leading_dense_block_count(layers)      # every layer's MLP is dense
    writer.add_vocab_size(ds["vocab_size"])
    writer.add_q_lora_rank(0)                         # the loader requires the key; 0 = one attn_q
    writer.add_kv_lora_rank(L)
    writer.add_key_length(L + rope)
    writer.add_value_length(L)
    writer.add_key_length_mla(ds["qk_nope_head_dim"] + rope)
    writer.add_value_length_mla(ds["v_head_dim"])
    writer.add_expert_feed_forward_length(ds["intermediate_size"])
    writer.add_expert_shared_count(0)
    writer.add_rope_dimension_count(rope)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for key, field in source.fields.items():
        if key.startswith("tokenizer."):
            copy_field(writer, field)


def check_vocabulary(source: gguf.GGUFReader, vocab_size: int) -> None:
    tokens = source.fields.get("tokenizer.ggml.tokens")
    if tokens is None or len(tokens.data) != vocab_size:
        n = "no" if tokens is None else len(tokens.data)
        raise UserError(f"the source GGUF has {n} tokens, the model {vocab_size}: pass the model's own source "
                        f"as a GGUF file with --source")


def write_gguf(ds_dir: Path, out: Path, source: gguf.GGUFReader, tensor_type_name: str = "f16") -> dict:
    """Write the DeepSeek-V3 checkpoint in `ds_dir` as a deepseek2 GGUF file `out`, tensor by tensor
    → what was written: tensor types, the tensors that fell back to F16, the file size."""
    ds = json.loads((Path(ds_dir) / "config.json").read_text())
    check_vocabulary(source, ds["vocab_size"])
    entries = plan(Path(ds_dir), ds, TENSOR_TYPES[tensor_type_name])
    writer = gguf.GGUFWriter(None, gguf.MODEL_ARCH_NAMES[ARCH])
    add_metadata(writer, ds, source, tensor_type_name)
    for e in entries:
        writer.add_tensor_info(e.name, e.shape, np.dtype(np.float32), e.nbytes, raw_dtype=e.qtype)
    writer.write_header_to_file(path=Path(out))
    try:
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for e in entries:                             # in the order of the tensor infos
            writer.write_tensor_data(tensor_data(e, ds))
    finally:
        writer.close()
    wanted = TENSOR_TYPES[tensor_type_name]
    return {"tensor_types": dict(Counter(e.qtype.name for e in entries)),
            "f16_fallback": [e.name for e in entries if e.qtype == T.F16 and wanted != T.F16],
            "file_bytes": Path(out).stat().st_size}


def export_gguf(model_or_path, out, *, tensor_type: str = "f16", source=None, overwrite: bool = False,
                latent_norm: str = "near_linear", calib_data=None, pad_for: str | None = None) -> dict:
    """Write the MLA model (a checkpoint path or an (MLAForCausalLM, tokenizer) pair) to the file `out` as a
    llama.cpp deepseek2 GGUF → a report: tensor types, KV cache per token per layer (exported, MLA model,
    source), the DeepSeek-V3 export's logits gap to the MLA model, the file size.

    `tensor_type`: f16, bf16 or q8_0 for the matrices. `source`: the source model's GGUF file (or alias),
    whose tokenizer is carried over (default: the MLA config's source_model). `latent_norm` and
    `calib_data` go to the DeepSeek-V3 export; so does `pad_for`, a llama.cpp engine of ENGINE_SHAPES
    (llama.cpp-cuda: the latent and RoPE key padded to a shape of its CUDA flash-attention kernels) or a
    shape `L+R`.
    """
    if pad_for is not None:
        pad_shapes(pad_for)  # an unknown engine or shape is refused before anything is read
        if pad_for.startswith("vllm"):
            raise UserError(f"--pad-for {pad_for} is not a llama.cpp engine: a GGUF export pads for "
                            f"{', '.join(e for e in ENGINE_SHAPES if e.startswith('llama.cpp'))} or a shape L+R")
    if tensor_type not in TENSOR_TYPES:
        raise UserError(f"unknown GGUF tensor type '{tensor_type}' (supported: {', '.join(TENSOR_TYPES)})")
    out = Path(out)
    if out.is_dir():
        raise UserError(f"{out} is a directory: the GGUF export writes one file (give a path such as model.gguf)")
    if out.exists() and not overwrite:
        raise UserError(f"{out} exists: pass --overwrite to replace it")
    config = model_or_path[0].config if isinstance(model_or_path, tuple) else read_config(Path(model_or_path))
    if config.model_type != "mla":
        raise UserError(f"not an MLA model (model_type {config.model_type}): convert it first, then export")
    check_graph(config)
    source_path, reader = source_gguf(source or config.source_model)

    def write(tmp: Path) -> dict:
        # no `source` for RoPE parameters: check_graph admitted the default ladder only
        report = export_checkpoint(model_or_path, tmp / "deepseek-v3", latent_norm=latent_norm, calib_data=calib_data,
                                   pad_for=pad_for)
        report.update(write_gguf(tmp / "deepseek-v3", tmp / out.name, reader, tensor_type))
        return report

    report = save_file_atomically(out, write)
    report.update(out=str(out), format="gguf", tensor_type=tensor_type, source_gguf=str(source_path))
    return report
