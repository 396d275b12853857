"""MHA/GQA source → MLA checkpoint: plan → search(stream(stages)) → write.

The plan (plan.py) fixes, before any weight is read, the RoPE layout, the candidate conversions and
the calibration sizes. Each candidate is converted in one streaming pass (convert_candidate): the
source is read a layer at a time (stream.py), and each layer, on its calibration hidden states, goes
through the stages

    1. RoPE layout and 2. low rank (attention.py: the layout's choice, then kv_down, k_up, v_up);
    3. refit (stages/refit, optional): v_up and then o_proj re-fit by least squares to the source
       layer's attention output on the calibration inputs;
    4. reconstruction (stages/reconstruct, optional): the attention's parameters trained by Adam to
       reproduce that output, from the closed-form solution;
    5. latent norm (stages/latent_norm, optional): DeepSeek's RMSNorm on the cached latent, given
       without changing the layer's function (for an exact DeepSeek-V3 export);

its norms and MLP are copied, it is written into safetensors shards and let go, and the hidden states
move on — through the converted layer (`sequential`, so later layers compensate earlier error) or
the source's. With nothing dropped and full rank the MLA model computes exactly what the source does.
The search (search.py) keeps the candidate with the lowest held-out loss — scored without the
reconstruction, which costs far more than the closed-form stages and then runs once, on the kept
candidate, in a pass of its own (`search_then_reconstruct`); its MLA config is built
once, from the plan and what the stages chose, and written with the checkpoint's other files into a
temporary directory renamed to `out` at the end.
"""

from __future__ import annotations

import dataclasses
import resource
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from ..errors import UserError
from ..io.atomic import check_output_dir, save_atomically
from ..io.checkpoint import write_checkpoint_files
from ..io.readers import ShardWriter
from ..io.sources import open_source, torch_dtype
from ..modeling import MLAConfig, MLAForCausalLM
from ..modeling.configuration_mla import kv_report
from ..modeling.modeling_mla import MLADecoderLayer
from ..recipes import Recipe, recipe_of
from .allocate import allocated_candidates
from .attention import convert_attention, source_outputs
from .plan import CALIB_BATCH, Candidate, Plan, Split, plan_conversion
from .search import search
from .stages.calibration import attention_error, calibrate
from .stages.expand import expanded_source
from .stages.latent_norm import add_latent_norm
from .stages.reconstruct import reconstruct
from .stages.refit import refit_outputs
from .stream import LayerStream


@dataclass
class LayerChoice:
    """What the stages chose for one layer."""
    split: Split                 # (rope_pairs, latent width)
    rope_dims: int               # cached RoPE values: n_rope_keys · 2r
    kept: list[list[int]]        # per RoPE head, the source frequency of each kept component
    norm_eps: float | None       # the latent norm's eps, with one
    reconstructed: tuple[float, float] | None  # the attention-output error before and after reconstruction


@dataclass
class Converted:
    """One candidate converted: its layers' choices and its held-out loss (None without a search)."""
    candidate: Candidate
    layers: list[LayerChoice]
    loss: float | None


def convert(source, out=None, *, recipe: str | Recipe = "default", **settings):
    """Convert `source` (path/alias/hub id or a (model, tokenizer) pair) to MLA → (MLAForCausalLM, tokenizer).

    The checkpoint is written (convert_checkpoint, which takes the same settings) to `out`, or to a
    temporary directory when `out` is None, and loaded from there."""
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(out) if out is not None else Path(scratch) / "mla"
        config, tokenizer = convert_checkpoint(source, path, recipe=recipe, **settings)
        model = MLAForCausalLM.from_pretrained(path, dtype=config.dtype).eval()
    return model, tokenizer


def convert_checkpoint(source, out, *, recipe: str | Recipe = "default", d_kv: int | None = None,
                       rope_pairs: int | None = None, kv_budget: int | None = None, kv_reduction: float | None = None,
                       as_mha: bool = False, calib_data=None, calib_samples: int = 16, calib_seq_len: int = 512,
                       dtype="float32", device=None, overwrite: bool = False, progress: bool = True, **changes):
    """Convert `source` to an MLA checkpoint at `out` → (its MLAConfig, tokenizer).

    `recipe`: a name of recipes.RECIPES or a Recipe; `changes` replace its fields (e.g. refit="none").
    The size is one of `d_kv` (default 16; with `rope_pairs`), `kv_budget` values per token per layer or
    `kv_reduction` percent below the source (plan.py). `as_mha`: expand a GQA source to MHA first.
    Calibration: `calib_samples` blocks of `calib_seq_len` tokens of `calib_data` (default: the
    Wikipedia shards). `dtype`: the forward passes' precision (statistics and factorisations are float64;
    the checkpoint keeps the source's storage dtype). `device`: where layers are calibrated and factored
    (default: a GPU when there is one). A non-empty `out` is refused unless `overwrite`.
    """
    start = time.perf_counter()
    check_output_dir(out, overwrite)
    recipe, dtype, device = recipe_of(recipe, **changes), torch_dtype(dtype), compute_device(device)
    src = open_source(source)
    original = src.config
    if as_mha:
        src = expanded_source(src)
    plan = plan_conversion(src.config, recipe, source_name=src.name, dtype=src.reader.dtype, d_kv=d_kv,
                           rope_pairs=rope_pairs, kv_budget=kv_budget, kv_reduction=kv_reduction,
                           calib_samples=calib_samples, calib_seq_len=calib_seq_len)
    calib, held_out = plan.texts(src.tokenizer, calib_data)
    with torch.device(device):  # every tensor the conversion makes, unless it says otherwise
        candidates = (allocated_candidates(src, plan, calib, dtype) if recipe.allocate == "global"
                      else plan.candidates)
    convert_one = partial(convert_candidate, src, calib=calib, held_out=held_out, dtype=dtype, device=device,
                          progress=progress)

    def write(tmp: Path) -> MLAConfig:
        converted, tried = search_then_reconstruct(plan, candidates, convert_one, tmp)
        record = dict(dataclasses.asdict(recipe), kv_balance=converted.candidate.kv_balance, as_mha=as_mha,
                      reconstruction=[layer.reconstructed for layer in converted.layers] if recipe.reconstruct else None,
                      calib_samples=len(calib), calib_seq_len=calib_seq_len, dtype=str(dtype).removeprefix("torch."),
                      device=str(device), budget_candidates=tried)
        config = checkpoint_config(plan, converted)
        config.conversion = dict(record, seconds=time.perf_counter() - start, process_peak_rss_mb=peak_rss_mb(),
                                 kv=kv_report(config, dtype_bytes=src.reader.dtype.itemsize,
                                              original_config=original if as_mha else None))
        write_checkpoint_files(config, src.tokenizer, src.generation_config, tmp)
        return config

    return save_atomically(out, write), src.tokenizer


def search_then_reconstruct(plan: Plan, candidates, convert_one, directory: Path):
    """search() over the candidates converted by `convert_one(plan, candidate, directory)`; with a
    reconstruction and several candidates the search runs without it, and the kept candidate is
    converted again, reconstructed, over the search's files."""
    if not plan.recipe.reconstruct or len(candidates) == 1:
        return search(candidates, partial(convert_one, plan), directory)
    closed_form = dataclasses.replace(plan, recipe=dataclasses.replace(plan.recipe, reconstruct=0))
    converted, tried = search(candidates, partial(convert_one, closed_form), directory)
    for file in directory.iterdir():
        file.unlink()
    return convert_one(plan, converted.candidate, directory), tried


def checkpoint_config(plan: Plan, converted: Converted) -> MLAConfig:
    """The converted model's config, from the plan and the layers' choices: per-layer widths where layers
    may differ (the scalars then name the most common split)."""
    splits = [layer.split for layer in converted.layers]
    widths = {}
    if converted.candidate.per_layer:
        widths = dict(layer_rope_pairs=[r for r, _ in splits], layer_latent_dims=[w for _, w in splits])
    r, latent = Counter(splits).most_common(1)[0][0] if converted.candidate.per_layer else splits[0]
    if plan.recipe.latent_norm is not None:
        widths.update(latent_norm=True, latent_norm_eps=[layer.norm_eps for layer in converted.layers])
    return plan.mla_config(rope_pairs=r, latent_dim=latent, kept_pairs=[layer.kept for layer in converted.layers],
                           **widths)


@torch.no_grad()
def convert_candidate(src, plan: Plan, candidate: Candidate, directory: Path, *, calib: torch.Tensor,
                      held_out: torch.Tensor | None, dtype: torch.dtype, device: torch.device,
                      progress: bool) -> Converted:
    """One streaming conversion of `src` into `directory`'s weight shards. The held-out blocks, when
    given, advance through the converted layers: their next-token loss is the candidate's score."""
    calib, held_out = calib.to(device), held_out.to(device) if held_out is not None else None
    with torch.device(device):
        stream = LayerStream.open(src.reader, calib.shape[1], dtype)
        rope = stream.source_rope()
        embed = stream.load("model.embed_tokens", src.reader.dtype)
        hidden = stream.embed(embed, calib, CALIB_BATCH)
        held = embed(held_out).to(dtype) if held_out is not None else None
        writer, layers = ShardWriter(directory), []
        for idx, src_layer in stream.layers("converting layers", progress):
            calibration = calibrate(src_layer, hidden, src.config)
            layer, choice, attn_out = convert_layer(plan, stream, idx, src_layer, calibration, candidate, rope, dtype)
            hidden = next_hidden(plan.recipe, stream, src_layer, layer, calibration, attn_out, rope)
            if held is not None:
                held = stream.forward(layer, held)
            writer.add_module(f"model.layers.{idx}.", layer, src.reader.dtype)
            layers.append(choice)
        loss = write_ends(stream, writer, embed, held, held_out)
    return Converted(candidate, layers, loss)


def convert_layer(plan: Plan, stream: LayerStream, idx: int, src_layer, calibration, candidate: Candidate, rope,
                  dtype: torch.dtype):
    """Layer idx through the stages → (MLA decoder layer, LayerChoice, the attention's outputs on the
    calibration inputs where the refit computed them, else None). Where the candidate offers the layer
    several splits, it takes the one whose attention output is closest to the source's (before any refit)."""
    recipe, src_attn = plan.recipe, src_layer.self_attn
    measured = plan.layout.measure(src_attn, calibration)
    options = candidate.options(idx)
    if len(options) == 1:
        split = options[0]
        attn, kept = convert_attention(plan, idx, src_attn, calibration, measured, split, candidate.kv_balance, dtype)
    else:
        targets = source_outputs(src_attn, calibration, rope, stream.causal)
        tried = [(split, *convert_attention(plan, idx, src_attn, calibration, measured, split, candidate.kv_balance,
                                            dtype)) for split in options]
        errors = [attention_error(attn, calibration.inputs, targets, stream.causal, stream.position_ids)
                  for _, attn, _ in tried]
        split, attn, kept = tried[errors.index(min(errors))]
    layer = MLADecoderLayer(plan.layer_config(split), idx).to(dtype).eval()
    layer.self_attn = attn
    attn_out = norm_eps = reconstructed = None
    if recipe.refit != "none":
        attn_out = refit_outputs(src_attn, attn, calibration.inputs, rope, stream.causal, stream.position_ids,
                                 o_proj=recipe.refit == "vo")
    if recipe.reconstruct:
        targets = source_outputs(src_attn, calibration, rope, stream.causal)
        reconstructed = reconstruct(attn, calibration.inputs, targets, stream.position_ids, stream.causal,
                                    recipe.reconstruct, recipe.reconstruct_lr)
        attn_out = None
    if recipe.latent_norm is not None:  # last: the refit reads kv_down x as the latent
        norm_eps = add_latent_norm(attn, torch.cat(calibration.inputs), recipe.latent_norm)
        attn_out = None
    for name in ("input_layernorm", "post_attention_layernorm", "mlp"):  # the same names in both models
        getattr(layer, name).load_state_dict(getattr(src_layer, name).state_dict())
    choice = LayerChoice(split, plan.layout.n_rope_keys * 2 * split[0], kept, norm_eps, reconstructed)
    return layer, choice, attn_out


def next_hidden(recipe: Recipe, stream: LayerStream, src_layer, layer, calibration, attn_out, rope) -> list[torch.Tensor]:
    """The next layer's calibration hidden states: through the converted layer (sequential; its attention
    outputs reused where known), or through the source layer."""
    if not recipe.sequential:
        return [stream.forward(src_layer, h, position_embeddings=rope) for h in calibration.hidden]
    if attn_out is None:
        attn_out = [layer.self_attn(x, stream.positions(x.shape[0]), stream.causal) for x in calibration.inputs]
    hidden = [h + a for h, a in zip(calibration.hidden, attn_out)]
    return [h + layer.mlp(layer.post_attention_layernorm(h)) for h in hidden]


def write_ends(stream: LayerStream, writer: ShardWriter, embed, held: torch.Tensor | None,
               held_out: torch.Tensor | None) -> float | None:
    """Write the final norm, the embeddings and an untied LM head, close the shards → the held-out
    blocks' mean next-token loss (None without them)."""
    config, out_dtype = stream.reader.config, stream.reader.dtype
    norm = stream.load("model.norm")
    writer.add_module("model.norm.", norm, out_dtype)
    writer.add_module("model.embed_tokens.", embed, out_dtype)
    lm_head = embed if config.tie_word_embeddings else stream.load("lm_head", out_dtype)
    if not config.tie_word_embeddings:
        writer.add_module("lm_head.", lm_head, out_dtype)
    writer.close()
    if held is None:
        return None
    weight = lm_head.weight.to(stream.dtype)  # one block's logits at a time: [T, vocab] is large
    losses = [F.cross_entropy(F.linear(norm(h[:-1]), weight).float(), b[1:]).item() for h, b in zip(held, held_out)]
    return sum(losses) / len(losses)


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, in MB (the conversion's own, when run by the CLI)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def compute_device(device) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except RuntimeError:
        raise UserError(f"unknown --device {device}: use cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {device}: no CUDA GPU is available here (use --device cpu)")
    return device
