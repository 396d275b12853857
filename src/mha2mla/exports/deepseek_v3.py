"""Export an MLA model as a DeepSeek-V3 checkpoint: stock `DeepseekV3ForCausalLM`, vLLM, SGLang.

DeepSeek-V3 attention without a query low-rank (q_lora_rank null), for query head h:

    [q_nope,h (D_n) | q_pe,h (D_r)] = q_proj x
    [c (L) | k_pe (D_r)] = kv_a_proj_with_mqa x,   ĉ = kv_a_layernorm(c)      cached: ĉ and RoPE(k_pe)
    [k_nope,h (D_n) | v_h (d_v)] = kv_b_proj ĉ
    score = s_DS · (q_nope,h · k_nope,h + RoPE(q_pe,h) · RoPE(k_pe)),   s_DS = (D_n + D_r)^-½ (× mscale² for yarn)

RoPE there is one frequency ladder, slot i rotating by θ'^(−2i/D_r) (scaled as `rope_parameters` say),
over interleaved pairs (`rope_interleave`: dims 2i, 2i+1), the layout vLLM's DeepSeek model hard-codes
(`is_neox_style=False`). The MLA layer (modeling_mla) maps onto it as follows:

* kv_a_proj_with_mqa = [kv_down, zero rows up to L; k_rope_proj's rows at their slots];
* kv_b_proj, for query head h of KV group g: rows [k_up_g, zero rows up to D_n; v_up_g], on the latent
  columns each reads; every query head gets its group's rows, so GQA costs nothing in the cache;
* q_proj, per head: [q_nope, zero rows up to D_n; q_rope's rows at their slots], times s_MLA/s_DS
  (and (a_MLA/a_DS)² on the RoPE rows, a being RoPE's attention factor) so every score is the MLA one;
* v_up's bias passes through attention (probabilities sum to one) into o_proj's bias, o.bias + W_o·b_v;
  k_up's bias adds a per-query constant to the scores, which softmax ignores; k_rope_proj's bias goes
  to kv_a_proj_with_mqa's. DeepSeek's q_proj has no bias: a query bias is refused unless dropped on request.

RoPE slots. Component j of RoPE head ρ rotates with source frequency k = kept_pairs[layer][ρ][j], i.e.
θ^(−2k/d_h). With D_r = d_h/m and θ' = θ, slot i has the source frequency i·m, so component j goes
to slot k/m whenever m divides every kept k: m = gcd(kept k's, d_h/2) gives the narrowest exact key.
A fixed D_r (an engine's 64) uses m = d_h/D_r if that divides every k, else an m that does, with
θ' = θ^(D_r·m/d_h). transformers' own DeepseekV3RotaryEmbedding then computes the exported
frequencies, and they must equal the MLA model's (a RoPE scaling that is not a function of each
frequency alone is refused). Two components at one frequency — a per_head layout whose KV heads each
keep their own RoPE key — cannot share DeepSeek's one key: refused.

Latent norm. A model with config.latent_norm maps exactly: its norm of eps ε becomes DeepSeek's of eps
1e-6 (transformers' kv_a_layernorm) on α·kv_down, α = sqrt(1e-6/ε) (latent_norm.py), and zero padding
from L_i to L lowers mean(c²) by L_i/L, undone by β = sqrt(L/L_i) on kv_down and 1/β on the weight.
`rms_norm_eps` is set to 1e-6 too, since vLLM reads the latent norm's eps there; the hidden norms keep
the source's eps through the residual stream's scale (residual_scale). A model without a latent norm
gets one by latent_norm.norm_parameters from calibration text ("near_linear" keeps the function to
latent_norm.TOLERANCE), and the export measures what that costs.

Streaming. The export reads the MLA checkpoint a module at a time (weights.py readers, memory-mapped
safetensors) and writes shard by shard (ShardWriter). Its one pass over the layers also makes each
layer's latent norm from that layer's attention inputs on calibration text, and measures the gap: a few
held-out blocks advance through the MLA layer and through transformers' own DeepseekV3DecoderLayer
loaded with the written tensors, so memory holds one layer and those blocks' hidden states.
"""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoTokenizer, DeepseekV3Config, GenerationConfig
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (DeepseekV3Attention, DeepseekV3DecoderLayer,
                                                                  DeepseekV3RMSNorm, DeepseekV3RotaryEmbedding)

from ..conversion.stages.latent_norm import EPS, latent_mean_squares, norm_parameters
from ..conversion.stream import LayerStream
from ..errors import UserError
from ..io.atomic import check_output_dir, save_atomically
from ..io.checkpoint import TOKENIZER_SUBFOLDER
from ..io.readers import SafetensorsReader, ShardWriter, StateDictReader
from ..io.sources import open_source, read_config, with_pad_token
from ..io.text import calibration_blocks, default_train_text, text_files
from ..modeling import MLAForCausalLM
from ..modeling.configuration_mla import source_kv_values
from ..recipes import LATENT_NORMS

# Engine shapes (--pad-for), as the engines' code declares them: the (kv_lora_rank, qk_rope_head_dim) pairs their
# MLA kernels take; the export zero-pads to the narrowest that holds the model's latent (docs/serving.md has the
# table). vllm: every vLLM MLA backend, the CPU ones included (CPU_MLA, AMX_MLA, FlashMLA, FlashAttention MLA:
# get_supported_head_sizes() == [576]). vllm-gpu: MLACommonBackend's [320, 512, 576] (CUTLASS, FlashInfer,
# FlashMLA and Tokenspeed MLA inherit it; TRITON_MLA takes any). llama.cpp-cuda: its flash-attention kernels'
# MLA cases, K/V head sizes 192/128, 320/256, 576/512 (the cached [ĉ | k_pe] and ĉ).
ENGINE_SHAPES = {
    "vllm": ((512, 64),),
    "vllm-gpu": ((256, 64), (448, 64), (512, 64)),
    "llama.cpp-cuda": ((128, 64), (256, 64), (512, 64)),
}
GAP_BLOCKS = 2  # held-out blocks the exported logits are compared on


@dataclass
class ExportShape:
    """The exported attention shape and how the MLA rows land in it."""
    kv_lora_rank: int      # L
    nope: int              # D_n
    rope: int              # D_r
    stride: int            # m: component at source frequency k goes to slot k / m
    theta: float           # θ'


def kept_frequencies(config) -> list[list[int]]:
    """Per layer, every kept source frequency index (all RoPE heads); a repeat is a UserError."""
    layers = []
    for i, heads in enumerate(config.kept_pairs):
        flat = [k for head in heads for k in head]
        if len(set(flat)) < len(flat):
            raise UserError(f"layer {i} keeps RoPE on one frequency in several components ({config.rope_layout} "
                            f"layout), which DeepSeek's single RoPE key cannot hold: convert with "
                            f"the default recipe (one shared RoPE key) to export to DeepSeek-V3")
        layers.append(flat)
    return layers


def rope_stride(kept: list[int], head_dim: int, rope_dim: int | None) -> tuple[int, int, float]:
    """(D_r, m, p): slots k/m of a ladder of D_r dims with θ' = θ^p hold every kept frequency k."""
    g = math.gcd(head_dim // 2, *kept)
    if rope_dim is None:
        return head_dim // g, g, 1.0
    top = max(kept, default=0)
    natural = head_dim // rope_dim
    if head_dim % rope_dim == 0 and g % natural == 0 and top // natural < rope_dim // 2:
        return rope_dim, natural, 1.0
    for m in range(1, g + 1):
        if g % m == 0 and top // m < rope_dim // 2:
            return rope_dim, m, rope_dim * m / head_dim
    raise UserError(f"the kept RoPE frequencies (up to index {top}) do not fit a {rope_dim}-dim DeepSeek RoPE key "
                    f"(head_dim {head_dim}): export without --pad-for")


def export_shape(config, pad_for: str | None) -> ExportShape:
    """The exported widths: the model's own, or the narrowest shape of the engine `pad_for` that holds them."""
    kept = [k for layer in kept_frequencies(config) for k in layer]
    widest = max(config.latent_dim_at(i) for i in range(config.num_hidden_layers))
    lora, rope_dim = engine_shape(pad_for, widest) if pad_for else (widest, None)
    rope, stride, power = rope_stride(kept, config.head_dim, rope_dim)
    nope = max(config.d_nope_at(i) for i in range(config.num_hidden_layers))
    return ExportShape(lora, nope, rope, stride, config.rope_theta**power)


def pad_shapes(pad_for: str) -> tuple[tuple[int, int], ...]:
    """The (kv_lora_rank, qk_rope_head_dim) shapes `--pad-for` names: an engine of ENGINE_SHAPES, or one
    explicit shape `L+R` (padding to widths a kernel may prefer, e.g. multiples of 32 on a CPU)."""
    explicit = re.fullmatch(r"(\d+)\+(\d+)", pad_for)
    if explicit:
        lora, rope = int(explicit[1]), int(explicit[2])
        if lora < 1 or rope < 2 or rope % 2:
            raise UserError(f"--pad-for {pad_for}: the shape L+R needs a latent L ≥ 1 and an even RoPE key R ≥ 2")
        return ((lora, rope),)
    if pad_for not in ENGINE_SHAPES:
        raise UserError(f"unknown engine '{pad_for}' for --pad-for (supported: {', '.join(ENGINE_SHAPES)}, "
                        f"or a shape L+R such as 96+32)")
    return ENGINE_SHAPES[pad_for]


def engine_shape(engine: str, latent: int) -> tuple[int, int]:
    """(kv_lora_rank, qk_rope_head_dim): the narrowest of `engine`'s shapes (pad_shapes) whose latent holds
    `latent`."""
    shapes = pad_shapes(engine)
    fitting = [shape for shape in shapes if shape[0] >= latent]
    if not fitting:
        raise UserError(f"the latent is {latent} wide, more than {engine}'s largest kv_lora_rank "
                        f"{shapes[-1][0]}: export without --pad-for or convert with a smaller --d-kv")
    return fitting[0]


def source_rope_parameters(config, source) -> dict:
    """The source's rope_parameters: the MLA config's own if it keeps them, else `source`'s (a model path or
    alias) when given, else the default ladder of rope_theta (check_rope refuses it if that is wrong)."""
    params = getattr(config, "rope_parameters", None) or (
        getattr(open_source(source).config, "rope_parameters", None) if source is not None else None)
    return dict(params) if params else {"rope_type": "default", "rope_theta": config.rope_theta}


def deepseek_config(config, shape: ExportShape, rope_parameters: dict, attention_bias: bool) -> DeepseekV3Config:
    layers = config.num_hidden_layers
    ds = DeepseekV3Config(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        moe_intermediate_size=config.intermediate_size, num_hidden_layers=layers,
        num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_attention_heads,
        first_k_dense_replace=layers, num_mtp_layers=0,
        kv_lora_rank=shape.kv_lora_rank, q_lora_rank=None, qk_rope_head_dim=shape.rope,
        qk_nope_head_dim=shape.nope, v_head_dim=config.head_dim, hidden_act=config.hidden_act,
        max_position_embeddings=config.max_position_embeddings, initializer_range=config.initializer_range,
        rms_norm_eps=EPS, tie_word_embeddings=False,
        rope_parameters={**rope_parameters, "rope_theta": shape.theta}, rope_interleave=True,
        attention_bias=attention_bias, pad_token_id=config.pad_token_id, bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id)
    ds.architectures = ["DeepseekV3ForCausalLM"]
    return ds


def check_rope(config, ds: DeepseekV3Config, shape: ExportShape) -> None:
    """The exported ladder's frequencies at every used slot equal the MLA model's, or a UserError."""
    rotary = DeepseekV3RotaryEmbedding(ds)
    exported = rotary.inv_freq.double()
    for layer in kept_frequencies(config):
        for k in layer:
            want, got = config.rope_inv_freq[k], float(exported[k // shape.stride])
            if abs(got - want) > 1e-5 * want:
                raise UserError(f"DeepSeek's RoPE ladder ({ds.rope_parameters['rope_type']}, θ={shape.theta:g}) gives "
                                f"frequency {got:.6g} where the MLA model rotates with {want:.6g}: pass --source "
                                f"with the original model, whose rope_parameters the MLA config does not keep")


def score_scales(config, ds: DeepseekV3Config) -> tuple[float, float]:
    """(on every query row, extra on the RoPE rows) so that DeepSeek's scores equal the MLA model's."""
    with torch.device("meta"):
        s_ds = DeepseekV3Attention(ds, 0).scaling
    a_ds = DeepseekV3RotaryEmbedding(ds).attention_scaling
    return config.head_dim**-0.5 / s_ds, (config.rope_attention_scaling / a_ds) ** 2


def slots(kept_pairs: list[list[int]], stride: int) -> list[list[tuple[int, int]]]:
    """Per RoPE head, (component j, slot k/m) of its kept frequencies."""
    return [[(j, k // stride) for j, k in enumerate(head)] for head in kept_pairs]


@torch.no_grad()
def attention_tensors(attn, kept_pairs, shape: ExportShape, kv_down: torch.Tensor, norm_weight: torch.Tensor,
                      q_scale: float, rope_scale: float, keep_biases: bool) -> dict[str, torch.Tensor]:
    """The DeepSeek-V3 attention tensors of one MLA layer (float64), with the latent norm (kv_down, weight)."""
    H, n_kv, n_rope, d_h = attn.n_heads, attn.n_kv, attn.n_rope, attn.head_dim
    d_nope, r = attn.d_nope, attn.d_rope // 2
    L, Dn, Dr = shape.kv_lora_rank, shape.nope, shape.rope
    width, hidden = kv_down.shape
    beta = math.sqrt(L / width)
    place = slots(kept_pairs, shape.stride)

    kv_a = kv_down.new_zeros(L + Dr, hidden, dtype=torch.float64)
    kv_a[:width] = beta * kv_down.double()
    w_kr = attn.k_rope_proj.weight.double().view(n_rope, 2 * r, hidden)
    for rho, pairs in enumerate(place):
        for j, s in pairs:
            kv_a[L + 2 * s], kv_a[L + 2 * s + 1] = w_kr[rho, j], w_kr[rho, r + j]
    norm = kv_a.new_zeros(L)
    norm[:width] = norm_weight.double() / beta

    w_uk = attn.k_up.weight.double().view(n_kv, d_nope, -1)
    w_uv = attn.v_up.weight.double().view(n_kv, d_h, -1)
    k_cols, v_cols = range(width)[attn.k_latent], range(width)[attn.v_latent]
    kv_b = kv_a.new_zeros(H, Dn + d_h, L)
    w_q = attn.q_proj.weight.double().view(H, d_nope + 2 * r, hidden)
    q = kv_a.new_zeros(H, Dn + Dr, hidden)
    q[:, :d_nope] = w_q[:, :d_nope] * q_scale
    for h in range(H):
        g = h // (H // n_kv)
        kv_b[h, :d_nope, k_cols.start:k_cols.stop] = w_uk[g]
        kv_b[h, Dn:, v_cols.start:v_cols.stop] = w_uv[g]
        for j, s in place[h // (H // n_rope)]:
            q[h, Dn + 2 * s] = w_q[h, d_nope + j] * q_scale * rope_scale
            q[h, Dn + 2 * s + 1] = w_q[h, d_nope + r + j] * q_scale * rope_scale

    tensors = {"q_proj.weight": q.view(-1, hidden), "kv_a_proj_with_mqa.weight": kv_a,
               "kv_a_layernorm.weight": norm, "kv_b_proj.weight": kv_b.view(-1, L),
               "o_proj.weight": attn.o_proj.weight.double()}
    if keep_biases:
        kv_a_bias = kv_a.new_zeros(L + Dr)
        if attn.k_rope_proj.bias is not None:
            b_kr = attn.k_rope_proj.bias.double().view(n_rope, 2 * r)
            for rho, pairs in enumerate(place):
                for j, s in pairs:
                    kv_a_bias[L + 2 * s], kv_a_bias[L + 2 * s + 1] = b_kr[rho, j], b_kr[rho, r + j]
        o_bias = (attn.o_proj.bias.double() if attn.o_proj.bias is not None
                  else kv_a.new_zeros(attn.o_proj.out_features))
        if attn.v_up.bias is not None:
            b_v = attn.v_up.bias.double().view(n_kv, d_h).repeat_interleave(H // n_kv, dim=0).reshape(-1)
            o_bias = o_bias + attn.o_proj.weight.double() @ b_v
        tensors.update({"kv_a_proj_with_mqa.bias": kv_a_bias, "o_proj.bias": o_bias})
    return tensors


@dataclass
class MLAWeights:
    """An MLA checkpoint opened for reading a module at a time: its config, a reader of its tensors
    (io/readers), the model on the meta device (what a LayerStream fills) and its tokenizer."""
    config: object
    reader: object
    skeleton: torch.nn.Module
    tokenizer: object
    generation_config: GenerationConfig | None

    @property
    def dtype(self) -> torch.dtype:
        return self.reader.dtype

    def stream(self, seq: int) -> LayerStream:
        """The model's layers a module at a time, run in its dtype on blocks of `seq` tokens."""
        return LayerStream.open(self.reader, seq, self.dtype, self.skeleton)


def open_mla(model_or_path) -> MLAWeights:
    """An (MLAForCausalLM, tokenizer) pair, or an MLA checkpoint directory, read lazily: from a
    directory only the tensors asked for are read (memory-mapped), so the export holds one layer."""
    if isinstance(model_or_path, tuple):
        model, tokenizer = model_or_path
        config, reader, generation = model.config, StateDictReader(model), model.generation_config
    else:
        path = Path(model_or_path)
        config = read_config(path)
        check_exportable(config)
        reader = SafetensorsReader(path, config)
        subfolder = TOKENIZER_SUBFOLDER if (path / TOKENIZER_SUBFOLDER).is_dir() else ""
        tokenizer = with_pad_token(AutoTokenizer.from_pretrained(path, subfolder=subfolder))
        generation = GenerationConfig.from_pretrained(path) if (path / "generation_config.json").is_file() else None
    with torch.device("meta"):
        skeleton = MLAForCausalLM(config)
    return MLAWeights(config, reader, skeleton, tokenizer, generation)


def has_query_bias(mla: MLAWeights) -> bool:
    names = mla.reader.names()
    return any(bool(mla.reader.get(name).any()) for i in range(mla.config.num_hidden_layers)
               if (name := f"model.layers.{i}.self_attn.q_proj.bias") in names)


def check_exportable(config) -> None:
    """What DeepSeek-V3 cannot hold, read from the config alone: a one-line UserError."""
    if config.model_type != "mla":
        raise UserError(f"not an MLA model (model_type {config.model_type}): convert it first, then export")
    if config.sliding_window:
        raise UserError(f"the model uses sliding-window attention ({config.sliding_window} tokens), which "
                        f"DeepSeek-V3 does not have: it cannot be exported to this format")
    if config.mlp_bias:
        raise UserError("the model's MLP has biases, which DeepSeek-V3's MLP does not: it cannot be exported")
    kept_frequencies(config)


def check_engine(ds: DeepseekV3Config, pad_for: str | None) -> None:
    """What the engine padded for cannot run: vLLM's DeepSeek model has no attention biases and reads a
    non-default RoPE type as yarn (deepseek_v2.py), so it would compute another function."""
    if pad_for in ("vllm", "vllm-gpu") and (ds.attention_bias
                                            or ds.rope_parameters["rope_type"] not in ("default", "yarn")):
        raise UserError("vLLM's DeepSeek model has no attention biases and reads RoPE scaling as default or yarn "
                        "only: this model cannot be served there (export without --pad-for for transformers)")


def residual_scale(config) -> float:
    """γ = sqrt(ε_DS/ε): the residual stream scaled by γ makes every hidden RMSNorm with eps ε_DS compute
    what the source's did with ε, since γx / sqrt(γ² ms(x) + ε_DS) = x / sqrt(ms(x) + ε)."""
    return math.sqrt(EPS / config.rms_norm_eps)


def layer_norm(attn, inputs: torch.Tensor | None, method: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(kv_down weight, norm weight) of one layer for a latent norm of DeepSeek's eps: the layer's own
    latent norm, or one made by `method` from its attention `inputs` [..., hidden]; a norm of eps ε
    becomes one of eps EPS on α·kv_down, α = sqrt(EPS/ε)."""
    if attn.kv_norm is not None:
        eps, weight = attn.kv_norm.eps, attn.kv_norm.weight.double()
    else:
        eps, w = norm_parameters(latent_mean_squares(attn.kv_down.weight, inputs), method)
        weight = torch.full((attn.kv_down.out_features,), w, dtype=torch.float64)
    return math.sqrt(EPS / eps) * attn.kv_down.weight.double(), weight


def layer_tensors(layer, kept_pairs, shape: ExportShape, norm, scales: tuple[float, float], keep_biases: bool,
                  gamma: float, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every exported tensor of one decoder layer, named within the layer, in `dtype`: the attention's
    (attention_tensors), the MLP's and the norms; what the layer adds to the residual stream (o_proj and
    down_proj) is scaled by γ (residual_scale)."""
    tensors = {f"self_attn.{name}": tensor for name, tensor in
               attention_tensors(layer.self_attn, kept_pairs, shape, *norm, *scales, keep_biases).items()}
    tensors.update({f"mlp.{name}": tensor for name, tensor in layer.mlp.state_dict().items()})
    tensors.update({f"input_layernorm.{name}": t for name, t in layer.input_layernorm.state_dict().items()})
    tensors.update({f"post_attention_layernorm.{name}": t
                    for name, t in layer.post_attention_layernorm.state_dict().items()})
    residual = ("self_attn.o_proj.", "mlp.down_proj.")
    return {name: (gamma * tensor.double() if name.startswith(residual) else tensor).to(dtype)
            for name, tensor in tensors.items()}


def deepseek_layer(run_config: DeepseekV3Config, i: int, tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    """transformers' DeepSeek-V3 decoder layer i holding `tensors` (layer_tensors), in their dtype."""
    with torch.device("meta"):
        layer = DeepseekV3DecoderLayer(run_config, i)
    layer = layer.to_empty(device=torch.get_default_device()).to(next(iter(tensors.values())).dtype)
    layer.load_state_dict(tensors)
    return layer.eval()


@torch.no_grad()
def write_deepseek(mla: MLAWeights, ds: DeepseekV3Config, shape: ExportShape, method: str, calib: torch.Tensor,
                   held_out: torch.Tensor, out: Path) -> dict:
    """Write the exported checkpoint (config, tokenizer, generation config, weights in the MLA model's
    dtype) a layer at a time → the logits gap to the MLA model on `held_out` [N, T].

    One pass over the layers (a LayerStream): layer i is read, its latent norm made from its attention
    inputs on `calib` (when the model has none), its DeepSeek tensors written and loaded into
    transformers' own DeepseekV3DecoderLayer; the held-out hidden states advance through both the MLA
    layer and the exported one, so the gap compares the MLA model with what stock transformers computes
    from the written weights, while memory holds one layer and a few blocks' hidden states. The residual
    stream is scaled by γ (residual_scale): the embeddings and what o_proj and the MLP add to it. The LM
    head is always written, untied (the source's, or its embeddings where it ties them): vLLM's DeepSeek
    model never ties it."""
    config, dtype = mla.config, mla.dtype
    scales, gamma = score_scales(config, ds), residual_scale(config)
    ds.dtype = dtype
    ds.save_pretrained(out)
    if mla.generation_config is not None:
        mla.generation_config.save_pretrained(out)
    mla.tokenizer.save_pretrained(out)
    run_config = copy.deepcopy(ds)
    run_config._attn_implementation = "sdpa"
    writer = ShardWriter(out)

    stream = mla.stream(held_out.shape[1])
    embed = stream.load("model.embed_tokens")
    embed_ds = (gamma * embed.weight.double()).to(dtype)
    writer.add("model.embed_tokens.weight", embed_ds)
    x_mla, x_ds = embed(held_out), torch.nn.functional.embedding(held_out, embed_ds)
    x_calib = embed(calib) if not config.latent_norm else None
    rope_ds = DeepseekV3RotaryEmbedding(run_config)(x_ds, stream.position_ids)
    for i, layer in stream.layers():
        inputs = layer.input_layernorm(x_calib) if x_calib is not None else None
        tensors = layer_tensors(layer, config.kept_pairs[i], shape, layer_norm(layer.self_attn, inputs, method),
                                scales, ds.attention_bias, gamma, dtype)
        for name, tensor in tensors.items():
            writer.add(f"model.layers.{i}.{name}", tensor)
        x_mla = stream.forward(layer, x_mla)
        x_ds = stream.forward(deepseek_layer(run_config, i, tensors), x_ds, position_embeddings=rope_ds)
        if x_calib is not None:
            x_calib = stream.forward(layer, x_calib)

    norm = stream.load("model.norm")
    writer.add("model.norm.weight", norm.weight)
    head = embed.weight if config.tie_word_embeddings else stream.load("lm_head").weight
    writer.add("lm_head.weight", head)
    writer.close()
    final_ds = DeepseekV3RMSNorm(config.hidden_size, ds.rms_norm_eps).to(dtype)
    final_ds.weight.copy_(norm.weight)
    return logits_gap(torch.nn.functional.linear(norm(x_mla), head),
                      torch.nn.functional.linear(final_ds(x_ds), head))


def logits_gap(mla: torch.Tensor, exported: torch.Tensor) -> dict:
    """How far the exported model's logits are from the MLA model's (both [..., V])."""
    a, b = mla.double().flatten(0, -2), exported.double().flatten(0, -2)
    return {"max_abs": float((a - b).abs().max()), "mean_abs": float((a - b).abs().mean()),
            "max_abs_logit": float(a.abs().max()),
            "top1_agreement": float((a.argmax(-1) == b.argmax(-1)).double().mean())}


def export_checkpoint(model_or_path, out, *, pad_for: str | None = None,
                      latent_norm: str = "near_linear", drop_query_bias: bool = False, source=None,
                      calib_data=None, calib_samples: int = 4, calib_seq_len: int = 256,
                      overwrite: bool = False) -> dict:
    """Write the MLA model (a checkpoint path or an (MLAForCausalLM, tokenizer) pair) to `out` as a
    DeepSeek-V3 checkpoint → a report: shapes, KV cache per token per layer (exported, MLA, source)
    and the logits gap on held-out text.

    `pad_for`: an engine of ENGINE_SHAPES whose kernels need fixed widths. `latent_norm`: how a model
    converted without a latent norm gets DeepSeek's (latent_norm.LATENT_NORMS). `source`: the original
    model, read for its rope_parameters when RoPE is scaled. `calib_data`: text for the latent norm's
    statistics and the gap (default: the Wikipedia shards).
    """
    if pad_for is not None:
        pad_shapes(pad_for)  # an unknown engine or shape is refused before anything is read
    if latent_norm not in LATENT_NORMS:
        raise UserError(f"unknown latent norm method '{latent_norm}' (one of {', '.join(LATENT_NORMS)})")
    check_output_dir(out, overwrite)
    mla = open_mla(model_or_path)
    config = mla.config
    check_exportable(config)
    shape = export_shape(config, pad_for)
    ds = deepseek_config(config, shape, source_rope_parameters(config, source),
                         config.attention_bias or config.o_proj_bias)
    check_rope(config, ds, shape)
    check_engine(ds, pad_for)
    query_bias = has_query_bias(mla)
    if query_bias and not drop_query_bias:
        raise UserError("the model has query biases (q_proj.bias, as Qwen2), which DeepSeek-V3's q_proj lacks: "
                        "pass --drop-query-bias to export without them (the logits gap is measured and printed)")

    paths = text_files(calib_data) if calib_data else [default_train_text()]
    calib, held_out = calibration_blocks(mla.tokenizer, paths, calib_seq_len, calib_samples, GAP_BLOCKS)
    report = {
        "out": str(out), "format": "deepseek-v3", "pad_for": pad_for, "source_model": config.source_model,
        "latent_norm": "the model's own" if config.latent_norm else latent_norm,
        "query_bias_dropped": query_bias,
        "kv_lora_rank": shape.kv_lora_rank, "qk_rope_head_dim": shape.rope, "qk_nope_head_dim": shape.nope,
        "rope_theta": shape.theta,
        "kv_values_per_token_per_layer": shape.kv_lora_rank + shape.rope,
        "mla_kv_values_per_token_per_layer": config.kv_elements_per_token_per_layer,
        "source_kv_values_per_token_per_layer": source_kv_values(config),
    }

    def write(tmp: Path) -> None:
        report["logits_gap"] = write_deepseek(mla, ds, shape, latent_norm, calib,
                                              held_out if len(held_out) else calib[:1], tmp)
        ds.mha2mla_export = {k: v for k, v in report.items() if k != "out"}
        ds.save_pretrained(tmp)

    save_atomically(out, write)
    return report
