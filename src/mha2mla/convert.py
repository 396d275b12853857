"""MHA/GQA source → MLA model: the MHA2MLA conversion as a pipeline of stages, one layer at a time.

For each layer, from calibration statistics of its inputs (calibration):
  1. RoPE layout (rope_layout): which part of the keys keeps RoPE — the paper's partial RoPE (r pairs
     per KV head) or RoPE concentration (one shared RoPE key) — fills q_proj and k_rope_proj and
     leaves the position-free key rows;
  2. factorisation (lowrank): those rows and all of W_v are factored into kv_down, k_up, v_up
     (`factorise`), weighted by the calibration activations unless `init` is "weight";
  3. refit (refit, optional): v_up and then o_proj re-fit by least squares to the source layer's
     attention output on the calibration inputs;
  4. latent norm (latent_norm, optional): DeepSeek's RMSNorm on the cached latent, given without
     changing the layer's function (for an exact DeepSeek-V3 export).
Everything else (embeddings, norms, MLP, biases) is copied. With nothing dropped and full rank the
MLA model computes exactly what the source does.

The conversion streams (convert_once): it reads one source layer at a time through a tensor reader
(weights), converts it on the calibration hidden states, writes it into safetensors shards and lets
it go, so memory follows the size of a layer and the embeddings, not of the model. Which cache
split(s) to convert, and the held-in search among several, is the budget module's.
"""

from __future__ import annotations

import math
import resource
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from .allocate import allocate, attention_error, error_curves
from .atomic import save_atomically
from .budget import HELD_IN_BLOCKS, Candidate, budget_splits, candidates_for, d_kv_split, kv_balances, search
from .calibration import layer_stats, source_layer_step, source_pass
from .checkpoint import write_checkpoint_files
from .data import calibration_blocks, default_train_text
from .errors import UserError
from .evaluate.kv_memory import kv_report, source_elements_per_token_per_layer
from .expand import expanded_source
from .latent_norm import METHODS as LATENT_NORMS
from .latent_norm import add_latent_norm
from .lowrank import cholesky_factor, joint_factors, row_weights
from .modeling import MLAConfig, MLAForCausalLM
from .modeling.modeling_mla import MLAAttention, MLADecoderLayer
from .refit import REFITS, refit_outputs
from .rope_layout import PositionFree, layout_for
from .sources import head_dim_of, open_source
from .weights import ShardWriter, load_module

INITS = ("weight", "activation", "output", "query")
# Named settings: `default` is the best measured on SmolLM2-135M and Qwen2.5-0.5B (README;
# docs/experiments.md keeps the measurements behind each choice); `paper` is the MHA2MLA paper's recipe.
RECIPES = {
    "default": dict(rope_strategy="pca", freq_fold=4, init="query", sequential=True, refit="vo"),
    "paper": dict(rope_strategy="2-norm", freq_fold=1, init="weight", sequential=False, refit="none"),
}
CALIB_BATCH = 4  # calibration blocks per forward pass
ALLOCATIONS = ("uniform", "global")  # how the cache budget is spread over the layers


def check_output_dir(out, overwrite: bool) -> None:
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise UserError(f"output {out} exists and is not empty (pass --overwrite or choose another directory)")


def mla_config_for(c, *, rope_pairs: int, latent_dim: int, rope_layout: str, svd: str, kept_pairs, inv_freq,
                   scaling: float, source_name: str) -> MLAConfig:
    family = c.model_type
    sliding = c.sliding_window if family == "mistral" or getattr(c, "use_sliding_window", False) else None
    config = MLAConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=head_dim_of(c), hidden_act=c.hidden_act,
        max_position_embeddings=c.max_position_embeddings, initializer_range=c.initializer_range,
        rms_norm_eps=c.rms_norm_eps, tie_word_embeddings=c.tie_word_embeddings,
        attention_bias=bool(getattr(c, "attention_bias", family == "qwen2")),
        o_proj_bias=bool(getattr(c, "attention_bias", False)) and family != "qwen2",
        mlp_bias=bool(getattr(c, "mlp_bias", False)), sliding_window=sliding,
        rope_theta=(getattr(c, "rope_parameters", None) or {}).get("rope_theta", getattr(c, "rope_theta", None)),
        rope_inv_freq=inv_freq, rope_attention_scaling=scaling,
        latent_dim=latent_dim, rope_pairs=rope_pairs, kept_pairs=kept_pairs, rope_layout=rope_layout,
        svd=svd, source_model=source_name,
        source_family=family, pad_token_id=c.pad_token_id, bos_token_id=c.bos_token_id,
        eos_token_id=c.eos_token_id)
    config._attn_implementation = "sdpa"   # for the layers the conversion builds outside a PreTrainedModel
    config.d_kv = paper_d_kv(config)
    return config


def paper_d_kv(config: MLAConfig) -> int | float:
    """The d_kv that names a converted model's cache in the paper's terms (MLAConfig's docstring)."""
    n_kv, layers = config.num_key_value_heads, range(config.num_hidden_layers)
    if config.rope_layout == "per_head":
        width = sum(config.latent_dim_at(i) for i in layers) / len(layers) / n_kv
    else:
        width = config.kv_elements_per_token_per_layer / n_kv - 2 * max(1, config.head_dim // 16)
    return int(width) if width == int(width) else round(width, 2)


@torch.no_grad()
def factorise(src, dst, position_free: PositionFree, stats, latent: int, svd: str, init: str,
              kv_balance: float) -> None:
    """Stage 2 of a layer: the position-free key rows and W_v factored into kv_down, k_up, v_up;
    o_proj and the biases copied."""
    w_k_nope, b_k_nope, _ = position_free
    chol = cholesky_factor(stats.cov) if init != "weight" else None
    k_weight, v_weight = row_weights(src, position_free, stats, chol, init, kv_balance, dst.n_heads // dst.n_kv,
                                     dst.head_dim)
    down, k_up, v_up = joint_factors(w_k_nope, src.v_proj.weight, latent, svd, chol, k_weight, v_weight)
    dst.kv_down.weight.copy_(down)
    dst.k_up.weight.copy_(k_up)
    dst.v_up.weight.copy_(v_up)
    dst.o_proj.weight.copy_(src.o_proj.weight)
    if b_k_nope is not None:
        dst.k_up.bias.copy_(b_k_nope)
        dst.v_up.bias.copy_(src.v_proj.bias)
    if src.o_proj.bias is not None:
        dst.o_proj.bias.copy_(src.o_proj.bias)


def conversion_config(src, layout, split: tuple[int, int], svd: str, run) -> MLAConfig:
    """The MLA config a conversion fills layer by layer: `split` (r, latent) in every layer until a
    layer is converted (convert_attention sets its own), RoPE frequencies to be set per layer."""
    config, n_layers = src.config, src.config.num_hidden_layers
    rope_pairs, latent = split
    half = head_dim_of(config) // 2
    placeholder = [[[i % half for i in range(rope_pairs)]] * layout.n_rope_keys] * n_layers
    mla_config = mla_config_for(
        config, rope_pairs=rope_pairs, latent_dim=latent, rope_layout=layout.name, svd=svd, kept_pairs=placeholder,
        inv_freq=run.inv_freq, scaling=float(getattr(run.rotary, "attention_scaling", 1.0)), source_name=src.name)
    mla_config.dtype = src.reader.dtype
    mla_config.layer_rope_pairs, mla_config.layer_latent_dims = [rope_pairs] * n_layers, [latent] * n_layers
    return mla_config


def convert_attention(mla_config, idx: int, src_attn, stats, measured, split: tuple[int, int], *, layout,
                      inv_freq: list[float], seq: int, svd: str, init: str, kv_balance: float, dtype):
    """Stages 1 and 2 of layer idx at split (r, width) → (MLA attention, RoPE frequencies kept)."""
    r, width = split
    mla_config.layer_rope_pairs[idx], mla_config.layer_latent_dims[idx] = r, width
    attn = MLAAttention(mla_config, idx).to(dtype)
    choice = layout.choose(measured, r, inv_freq, seq)
    kept = layout.frequencies(choice)
    attn.set_rope_pairs(kept, inv_freq)
    layout.fill(src_attn, attn, choice)
    factorise(src_attn, attn, layout.position_free(src_attn, choice), stats, width, svd, init, kv_balance)
    return attn, kept


def copy_layer_rest(src_layer, mla_layer) -> None:
    """A decoder layer's norms and MLP: same names in both models."""
    for name in ("input_layernorm", "post_attention_layernorm", "mlp"):
        getattr(mla_layer, name).load_state_dict(getattr(src_layer, name).state_dict())


def validate(config, layout, latent: int, rope_pairs: int, svd: str, init: str, refit: str) -> None:
    n_kv = config.num_key_value_heads
    layout.check(rope_pairs)
    if init not in INITS:
        raise UserError(f"unknown --init {init}: use one of {', '.join(INITS)}")
    if refit not in REFITS:
        raise UserError(f"unknown --refit {refit}: use one of {', '.join(REFITS)}")
    if svd not in ("joint", "split"):
        raise UserError(f"unknown --svd {svd}: use joint or split")
    limit = layout.max_latent(rope_pairs)
    if not 1 <= latent <= limit:
        raise UserError(f"--d-kv {latent / n_kv:g} is out of range: use 1 … {limit // n_kv} (the rank available "
                        f"with {n_kv} KV heads and r={rope_pairs})")
    if svd == "split" and latent % 2:
        raise UserError("--svd split needs an even latent width n_kv·d_kv: choose an even --d-kv")


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def compute_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise UserError(f"unknown --dtype {dtype}: use one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


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


def convert_model(source, out=None, **settings):
    """Convert `source` (path/alias or a (model, tokenizer) tuple) to MLA → (MLAForCausalLM, tokenizer).

    The checkpoint is written (convert_checkpoint) to `out`, or to a temporary directory when `out`
    is None, and loaded from there; see convert_checkpoint for the settings.
    """
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(out) if out is not None else Path(scratch) / "mla"
        config, tokenizer = convert_checkpoint(source, path, **settings)
        model = MLAForCausalLM.from_pretrained(path, dtype=config.dtype).eval()
    return model, tokenizer


def convert_checkpoint(source, out, *, d_kv: int | None = 16, rope_pairs: int | None = None,
                       rope_strategy: str = "pca", svd: str = "joint", init: str = "query",
                       kv_budget: int | None = None, kv_reduction: float | None = None, freq_fold: int = 4,
                       kv_balance: float | str = 1.0, sequential: bool = True, refit: str = "vo",
                       per_layer_split: bool = False, allocate: str = "uniform", latent_norm: str | None = None,
                       as_mha: bool = False, calib_data=None,
                       calib_samples: int = 16, calib_seq_len: int = 512, dtype="float32", device=None,
                       overwrite: bool = False, progress: bool = True):
    """Convert `source` (path/alias/hub id or a (model, tokenizer) tuple) to an MLA checkpoint at `out`
    → (its MLAConfig, tokenizer). The source is streamed layer by layer (sources.open_source) and the
    checkpoint written shard by shard into a temporary directory renamed to `out` at the end
    (refusing a non-empty `out` unless `overwrite`).

    `rope_strategy` picks the RoPE layout (rope_layout.layout_for; `freq_fold` is RoPE
    concentration's). The cache size is set either by `d_kv` (latent per KV head) and `rope_pairs`,
    or by a budget (budget):
    `kv_budget` values per token per layer, or `kv_reduction` percent below the source (the split
    between RoPE dims and latent is then searched: every candidate is converted in a streaming pass
    of its own and scored on held-in text as it goes; the best one's files are kept). With `pca` and
    no `rope_pairs`, `d_kv` means the paper's cache size n_kv·(d_kv + 2·d_h/16), split with a
    budget.ROPE_SHARE of it for RoPE. `sequential` calibrates each layer on the outputs of the already
    converted layers before it (so it compensates their error); False follows the source model's
    activations. `kv_balance` β weights value errors against key errors in the joint factorisation;
    "auto" tries budget.AUTO_BALANCES and keeps the best by held-in loss (with the split search when there
    is one). `refit`: "v" re-fits v_up, "vo" v_up then o_proj, to the source's attention output
    (refit); "none" keeps the factorisation's own. `per_layer_split` (with a budget): every layer
    picks its own split among the budget's candidates, by the error of its attention output on the
    calibration inputs (convert_once), instead of one split for all layers. `allocate`: "uniform"
    gives every layer the split; "global" spreads the same total over the layers, each its own RoPE
    dims (among the budget's splits) and latent width, by their measured attention-output error
    curves (allocate). `latent_norm` ("near_linear" or "rms", latent_norm.METHODS):
    every layer gets DeepSeek's RMSNorm on the latent, keeping its function by that method, so that
    fine-tuning happens with it and the DeepSeek-V3 export is exact. `dtype`: the precision
    of the forward passes (statistics and factorisations are float64 whatever it is); the checkpoint
    keeps the source's storage dtype. `device`: where the layer being converted, the calibration
    hidden states and the factorisations live (default: a GPU when there is one, else the CPU).
    """
    start = time.perf_counter()
    out = Path(out)
    check_output_dir(out, overwrite)
    dtype = compute_dtype(dtype)
    device = compute_device(device)
    src = open_source(source)
    original_config = src.config
    if as_mha:
        src = expanded_source(src)
    config = src.config
    layout = layout_for(rope_strategy, config, freq_fold)
    if calib_samples < 1:
        raise UserError("--calib-samples must be at least 1")
    if d_kv is not None and d_kv < 1:
        raise UserError(f"--d-kv must be at least 1 (got {d_kv})")
    if rope_pairs is not None and rope_pairs < 1:
        raise UserError(f"--rope-pairs must be at least 1 (got {rope_pairs})")
    if kv_reduction is not None:
        if not 0 < kv_reduction < 100:
            raise UserError(f"--kv-reduction {kv_reduction} must be between 0 and 100 (percent)")
        kv_budget = math.floor(source_elements_per_token_per_layer(config) * (1 - kv_reduction / 100))
    splits = (budget_splits(config, kv_budget, layout) if kv_budget is not None
              else [d_kv_split(config, layout, d_kv, rope_pairs)])
    for r, latent in splits:
        validate(config, layout, latent, r, svd, init, refit)
    if per_layer_split and kv_budget is None:
        raise UserError("--per-layer-split needs a budget to split: add --kv-budget N or --kv-reduction P")
    if latent_norm is not None and latent_norm not in LATENT_NORMS:
        raise UserError(f"unknown --latent-norm {latent_norm}: use one of {', '.join(LATENT_NORMS)}")
    if allocate not in ALLOCATIONS:
        raise UserError(f"unknown --allocate {allocate}: use one of {', '.join(ALLOCATIONS)}")
    if allocate == "global" and (per_layer_split or svd == "split"):
        raise UserError("--allocate global sets each layer's split itself: drop --per-layer-split and "
                        "--svd split")
    candidates = candidates_for(splits, kv_balances(kv_balance), per_layer_split)
    n_held_in = HELD_IN_BLOCKS if len(candidates) > 1 else 0
    calib, held_in = calibration_blocks(src.tokenizer, calib_data or [default_train_text()], calib_seq_len,
                                        calib_samples, n_held_in)
    if len(held_in) < n_held_in:
        raise UserError(f"the budget search needs {n_held_in} more documents of at least {calib_seq_len} tokens "
                        f"after the calibration samples: add text or lower --calib-samples/--calib-seq-len")
    if allocate == "global":
        with torch.device(device):
            candidates = globally_allocated(src, calib, layout, candidates, svd=svd, init=init, dtype=dtype)
    settings = dict(layout=layout, svd=svd, init=init, sequential=sequential, refit=refit, latent_norm=latent_norm,
                    dtype=dtype, progress=progress)

    def convert(candidate: Candidate, directory: Path):
        with torch.device(device):  # every tensor the conversion makes, unless it says otherwise
            return convert_once(src, calib, held_in if n_held_in else None, candidate, directory, **settings)

    def write(tmp: Path) -> None:
        mla_config, chosen, tried = search(candidates, convert, tmp)
        mla_config.conversion = {
            "rope_strategy": rope_strategy, "init": init, "svd": svd, "freq_fold": freq_fold, "as_mha": as_mha,
            "sequential": sequential, "refit": refit, "kv_balance": chosen.kv_balance, "allocate": allocate,
            "latent_norm": latent_norm,
            "per_layer_split": per_layer_split, "calib_samples": len(calib), "calib_seq_len": calib_seq_len,
            "dtype": str(dtype).removeprefix("torch."), "device": str(device),
            "budget_candidates": tried, "seconds": time.perf_counter() - start,
            "process_peak_rss_mb": peak_rss_mb(),
            "kv": kv_report(mla_config, dtype_bytes=src.reader.dtype.itemsize,
                            original_config=original_config if as_mha else None),
        }
        write_checkpoint_files(mla_config, src.tokenizer, src.generation_config, tmp)
        result.append(mla_config)

    result = []
    save_atomically(out, write)
    return result[0], src.tokenizer


def globally_allocated(src, calib: torch.Tensor, layout, candidates: list[Candidate], *, svd: str, init: str,
                       dtype) -> list[Candidate]:
    """One candidate per K/V balance, each layer's split (r among the candidates', latent width) allocated
    from the layers' measured error curves (allocate), the total that of the uniform splits."""
    n_layers, splits = src.config.num_hidden_layers, sorted({split for c in candidates for split in c.splits})
    rope_values = {r: layout.n_rope_keys * 2 * r for r, _ in splits}
    total = n_layers * (rope_values[splits[0][0]] + splits[0][1])
    run = source_pass(src.config, calib.shape[1], dtype)
    allocated = []
    for balance in dict.fromkeys(c.kv_balance for c in candidates):
        mla_config = conversion_config(src, layout, splits[0], svd, run)

        def build(idx, src_attn, stats, measured, split):
            return convert_attention(mla_config, idx, src_attn, stats, measured, split, layout=layout,
                                     inv_freq=run.inv_freq, seq=calib.shape[1], svd=svd, init=init,
                                     kv_balance=balance, dtype=dtype)[0]

        curves = error_curves(src, calib, layout, splits, build, dtype, CALIB_BATCH)
        allocated.append(Candidate(tuple(splits), balance, layer_splits=tuple(allocate(curves, rope_values, total))))
    return allocated


def next_token_loss(hidden: torch.Tensor, norm, lm_head: torch.Tensor, blocks: torch.Tensor) -> float:
    """Mean over blocks of each block's mean next-token loss, from the last layer's hidden states
    (the logits of one block at a time: [T, vocab] is large for large vocabularies)."""
    losses = [F.cross_entropy(F.linear(norm(h[:-1]), lm_head).float(), b[1:]).item() for h, b in zip(hidden, blocks)]
    return sum(losses) / len(losses)


@torch.no_grad()
def convert_once(src, blocks, held_in, candidate: Candidate, directory: Path, *, layout, svd: str, init: str,
                 sequential: bool, refit: str, latent_norm: str | None, dtype: torch.dtype, progress: bool):
    """One streaming conversion of `src` into `directory`'s weight shards → (MLAConfig, held-in loss).

    Layer by layer: read the source layer, measure its calibration statistics, run the stages (RoPE
    layout → factorisation → refit → latent norm, when asked), write it, let it go; the calibration hidden states (and the
    held-in blocks', when given, through the converted layers: the loss the budget search compares)
    move on to the next layer. Each layer takes the candidate's split for it (budget.Candidate.options);
    where it may choose among several, the one whose attention output is closest to the source's on
    its calibration inputs (attention_error, before any refit). Where layers may differ, the config
    lists the split of every layer. Runs on the default device (torch.device context); the weights are written
    from the CPU."""
    config, reader = src.config, src.reader
    device = torch.get_default_device()
    blocks, held_in = blocks.to(device), held_in.to(device) if held_in is not None else None
    n_layers = config.num_hidden_layers
    seq = blocks.shape[1]
    run = source_pass(config, seq, dtype)
    skeleton, inv_freq = run.skeleton, run.inv_freq
    position_ids, causal, rope = run.position_ids, run.causal, run.rope
    mla_config = conversion_config(src, layout, candidate.splits[0], svd, run)
    kept_all, norm_eps = [], []
    # the embeddings stay in the storage dtype (for a bf16 source, half the float32 table): only the
    # looked-up rows are cast to the forward passes' dtype, exactly
    embed = load_module(reader, skeleton.model.embed_tokens, "model.embed_tokens.", reader.dtype)
    hidden = [embed(blocks[i:i + CALIB_BATCH]).to(dtype) for i in range(0, len(blocks), CALIB_BATCH)]
    held = embed(held_in).to(dtype) if held_in is not None else None
    writer = ShardWriter(directory)
    out_dtype = reader.dtype

    def attention(idx, src_attn, stats, measured, split):
        return convert_attention(mla_config, idx, src_attn, stats, measured, split, layout=layout,
                                 inv_freq=inv_freq, seq=seq, svd=svd, init=init, kv_balance=candidate.kv_balance,
                                 dtype=dtype)

    for idx in tqdm(range(n_layers), desc="converting layers", disable=not progress):
        src_layer = load_module(reader, skeleton.model.layers[idx], f"model.layers.{idx}.", dtype)
        src_attn = src_layer.self_attn
        stats = layer_stats(src_layer, hidden, config)
        measured = layout.measure(src_attn, stats)
        layer = MLADecoderLayer(mla_config, idx).to(dtype).eval()
        options = candidate.options(idx)
        if len(options) == 1:
            layer.self_attn, kept = attention(idx, src_attn, stats, measured, options[0])
        else:
            targets = [src_attn(x, position_embeddings=rope, attention_mask=causal)[0] for x in stats.inputs]
            tried = [(split, *attention(idx, src_attn, stats, measured, split)) for split in options]
            errors = [attention_error(attn, stats.inputs, targets, causal, position_ids) for _, attn, _ in tried]
            split, layer.self_attn, kept = tried[errors.index(min(errors))]
            mla_config.layer_rope_pairs[idx], mla_config.layer_latent_dims[idx] = split
            del tried, targets
        kept_all.append(kept)
        attn_out = None
        if refit != "none":
            attn_out = refit_outputs(src_attn, layer.self_attn, stats.inputs, rope, causal, position_ids,
                                     o_proj=refit == "vo")
        if latent_norm is not None:  # last: the refit reads kv_down x as the latent
            norm_eps.append(add_latent_norm(layer.self_attn, torch.cat(stats.inputs), latent_norm))
            attn_out = None
        copy_layer_rest(src_layer, layer)
        if not sequential:
            step = source_layer_step(src_layer, causal, position_ids, rope)
            hidden = [step(h) for h in stats.hidden]
        else:
            if attn_out is None:
                attn_out = [layer.self_attn(x, position_ids.expand(x.shape[0], -1), causal) for x in stats.inputs]
            hidden = [layer.after_attention(h, a) for h, a in zip(stats.hidden, attn_out)]
        if held is not None:
            held = layer(held, position_ids.expand(held.shape[0], -1), causal)
        writer.add_module(f"model.layers.{idx}.", layer, out_dtype)
        del src_layer, src_attn, layer, stats

    norm = load_module(reader, skeleton.model.norm, "model.norm.", dtype)
    writer.add_module("model.norm.", norm, out_dtype)
    writer.add_module("model.embed_tokens.", embed, out_dtype)
    lm_head = embed if config.tie_word_embeddings else load_module(reader, skeleton.lm_head, "lm_head.", out_dtype)
    if not config.tie_word_embeddings:
        writer.add_module("lm_head.", lm_head, out_dtype)
    writer.close()
    loss = None
    if held is not None:
        loss = next_token_loss(held, norm, lm_head.weight.to(dtype), held_in)
    mla_config.kept_pairs = kept_all
    if latent_norm is not None:  # every layer has its kv_norm now
        mla_config.latent_norm, mla_config.latent_norm_eps = True, norm_eps
    if not candidate.per_layer:
        mla_config.layer_rope_pairs = mla_config.layer_latent_dims = None
    else:  # the scalars name the most common split
        counts = Counter(zip(mla_config.layer_rope_pairs, mla_config.layer_latent_dims))
        mla_config.rope_pairs, mla_config.latent_dim = counts.most_common(1)[0][0]
        mla_config.d_kv = paper_d_kv(mla_config)
    return mla_config, loss
