"""MHA/GQA source → MLA model: the MHA2MLA conversion, one layer at a time.

For each layer, from calibration statistics of its inputs:
  1. the RoPE part: either the paper's partial RoPE — r kept frequency pairs per KV head
     (partial_rope), q_proj rows of each head reordered to [NoPE dims | RoPE dims], k_rope_proj the
     kept rows of W_k — or RoPE concentration (`pca`, rope_pca) — one RoPE key of 2r dims shared by
     all heads, the position-free key being W_k minus its projection on the kept components;
  2. the position-free key rows and all of W_v are factored into kv_down, k_up, v_up (lowrank);
  3. optionally (`refit`), v_up and then o_proj are re-fit by least squares to the source layer's
     attention output on the calibration inputs (refit).
Everything else (embeddings, norms, MLP, o_proj, biases) is copied. With nothing dropped and full
rank the MLA model computes exactly what the source does.

The conversion streams (convert_once): it reads one source layer at a time through a tensor reader
(weights), converts it on the calibration hidden states, writes it into safetensors shards and lets
it go, so memory follows the size of a layer and the embeddings, not of the model.

The cache budget per token and layer is latent_dim + n_rope·2r values. Given only a budget
(`kv_budget`), `convert_model` tries several splits between RoPE dims and latent rank, scores each
by its loss on held-in text (the first tokens of the calibration corpus's next documents after
those of the calibration samples: other text, so the score rewards generalising, not fitting),
logs them, and keeps the best.
"""

from __future__ import annotations

import copy
import math
import resource
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM

from .atomic import save_atomically
from .calibration import layer_stats, source_layer_step
from .checkpoint import write_checkpoint_files
from .data import calibration_blocks, default_train_text
from .errors import UserError
from .evaluate.kv_memory import kv_report, source_elements_per_token_per_layer
from .expand import expanded_source
from .lowrank import cholesky_factor, joint_factors, key_row_weight, second_moment, value_row_weight
from .modeling import MLAConfig, MLAForCausalLM
from .modeling.modeling_mla import MLAAttention, MLADecoderLayer
from .partial_rope import STRATEGIES, check_rope_pairs, select_pairs, split_dims
from .refit import REFITS, refit_outputs
from .rope_pca import pca_basis, query_rows
from .sources import head_dim_of, open_source
from .weights import ShardWriter

INITS = ("weight", "activation", "output")
# Named settings: `default` is the best measured on SmolLM2-135M (README; docs/experiments.md keeps
# the measurements behind each choice); `paper` is the MHA2MLA paper's recipe.
RECIPES = {
    "default": dict(rope_strategy="pca", freq_fold=4, init="activation", sequential=True, refit="vo"),
    "paper": dict(rope_strategy="2-norm", freq_fold=1, init="weight", sequential=False, refit="none"),
}
ROPE_SHARE = 1 / 4                  # share of a pca budget for the shared RoPE key, without a search
ROPE_SHARES = (1 / 5, 1 / 4, 1 / 3)  # shares the budget search tries (few: it converts once per share)
HELD_IN_BLOCKS = 4  # held-in documents (one block each) that score the budget search's candidates
AUTO_BALANCES = (0.25, 1.0, 4.0)  # K/V balances β tried by --kv-balance auto
CALIB_BATCH = 4  # calibration blocks per forward pass


def max_latent(config, rope_pairs: int, strategy: str) -> int:
    """The rank available to the latent: min(rows of [W_k_nope; W_v], hidden)."""
    d_h, n_kv = head_dim_of(config), config.num_key_value_heads
    k_rows = n_kv * d_h - 2 * rope_pairs if strategy == "pca" else n_kv * (d_h - 2 * rope_pairs)
    return min(k_rows + n_kv * d_h, config.hidden_size)


def max_d_kv(config, rope_pairs: int) -> int:
    """The largest d_kv for per-head partial RoPE (latent = n_kv·d_kv)."""
    return max_latent(config, rope_pairs, "2-norm") // config.num_key_value_heads


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


def rows(weight: torch.Tensor, heads: int, dims_per_head: list[list[int]]) -> torch.Tensor:
    """Select, head by head, the given dims (rows) of a [heads·d_h, …] projection."""
    per_head = weight.view(heads, -1, *weight.shape[1:])
    return torch.cat([per_head[h, dims] for h, dims in enumerate(dims_per_head)])


def rope_per_head(src, dst, kept: list[list[int]]):
    """Partial RoPE: fill q_proj and k_rope_proj; return the NoPE key (weight, bias, dims per group)."""
    n_heads, n_kv, d_h = dst.n_heads, dst.n_kv, dst.head_dim
    groups = n_heads // n_kv
    nope, rope = (list(x) for x in zip(*(split_dims(k, d_h) for k in kept)))
    q_dims = [nope[h // groups] + rope[h // groups] for h in range(n_heads)]
    dst.q_proj.weight.copy_(rows(src.q_proj.weight, n_heads, q_dims))
    dst.k_rope_proj.weight.copy_(rows(src.k_proj.weight, n_kv, rope))
    b_k = src.k_proj.bias
    if b_k is not None:
        dst.q_proj.bias.copy_(rows(src.q_proj.bias, n_heads, q_dims))
        dst.k_rope_proj.bias.copy_(rows(b_k, n_kv, rope))
    return rows(src.k_proj.weight, n_kv, nope), None if b_k is None else rows(b_k, n_kv, nope), nope


def rope_shared(src, dst, basis):
    """RoPE concentration: fill q_proj ([q_h | R q_h] per head) and the shared k_rope_proj."""
    n_heads, n_kv, d_h = dst.n_heads, dst.n_kv, dst.head_dim
    groups = n_heads // n_kv
    w_q = src.q_proj.weight.view(n_heads, d_h, -1)
    w_k, b_k = src.k_proj.weight.double(), src.k_proj.bias
    dst.q_proj.weight.copy_(torch.cat([torch.cat([w_q[h].double(), query_rows(basis, w_q[h], h // groups, d_h)])
                                       for h in range(n_heads)]))
    dst.k_rope_proj.weight.copy_(torch.cat([basis.r_re @ w_k, basis.r_im @ w_k]))
    keep_out = torch.eye(n_kv * d_h, dtype=torch.float64) - basis.projection()
    if b_k is not None:
        b_q = src.q_proj.bias.view(n_heads, d_h, 1)
        dst.q_proj.bias.copy_(torch.cat([torch.cat([b_q[h, :, 0].double(),
                                                    query_rows(basis, b_q[h], h // groups, d_h)[:, 0]])
                                         for h in range(n_heads)]))
        dst.k_rope_proj.bias.copy_(torch.cat([basis.r_re @ b_k.double(), basis.r_im @ b_k.double()]))
        b_k = keep_out @ b_k.double()
    return keep_out @ w_k, b_k, [list(range(d_h))] * n_kv


def output_weights(src_attn, nope, stats, groups: int, d_h: int, kv_balance: float):
    """Block-diagonal output-side weights (S_k, S_v) of the key and value rows (see lowrank)."""
    w_q = src_attn.q_proj.weight.view(-1, d_h, src_attn.q_proj.weight.shape[-1])
    b_q = src_attn.q_proj.bias.view(-1, d_h) if src_attn.q_proj.bias is not None else None
    w_o = src_attn.o_proj.weight.view(src_attn.o_proj.weight.shape[0], -1, d_h)
    s_k, s_v = [], []
    for g, dims in enumerate(nope):
        heads = range(g * groups, (g + 1) * groups)
        s_k.append(key_row_weight([w_q[h, dims] for h in heads],
                                  [b_q[h, dims] if b_q is not None else None for h in heads],
                                  stats.cov, stats.mean, d_h))
        s_v.append(value_row_weight([w_o[:, h] for h in heads]) * kv_balance**0.5)
    return torch.block_diag(*s_k), torch.block_diag(*s_v)


@torch.no_grad()
def convert_layer(src, dst, rope_choice, stats, latent: int, svd: str, init: str, kv_balance: float,
                  shared: bool = False) -> None:
    """Fill one MLA attention layer from the source attention layer (`shared`: RoPE concentration)."""
    if shared:
        w_k_nope, b_k_nope, nope = rope_shared(src, dst, rope_choice)
    else:
        w_k_nope, b_k_nope, nope = rope_per_head(src, dst, rope_choice)
    chol = cholesky_factor(stats.cov) if init != "weight" else None
    k_weight = v_weight = None
    if init == "output":
        k_weight, v_weight = output_weights(src, nope, stats, dst.n_heads // dst.n_kv, dst.head_dim, kv_balance)
    elif kv_balance != 1.0:  # value rows weighted √β against the key rows in the joint factorisation
        k_weight = torch.eye(w_k_nope.shape[0], dtype=torch.float64)
        v_weight = torch.eye(src.v_proj.weight.shape[0], dtype=torch.float64) * kv_balance**0.5
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


def copy_layer_rest(src_layer, mla_layer) -> None:
    """A decoder layer's norms and MLP: same names in both models."""
    for name in ("input_layernorm", "post_attention_layernorm", "mlp"):
        getattr(mla_layer, name).load_state_dict(getattr(src_layer, name).state_dict())


def validate(config, latent: int, rope_pairs: int, rope_strategy: str, svd: str, init: str, refit: str) -> None:
    d_h, n_kv = head_dim_of(config), config.num_key_value_heads
    if rope_strategy == "pca":
        if not 1 <= rope_pairs <= n_kv * d_h // 2:
            raise UserError(f"--rope-pairs {rope_pairs} is out of range for pca: use 1 … {n_kv * d_h // 2}")
    else:
        check_rope_pairs(rope_pairs, d_h, rope_strategy)
    if init not in INITS:
        raise UserError(f"unknown --init {init}: use one of {', '.join(INITS)}")
    if refit not in REFITS:
        raise UserError(f"unknown --refit {refit}: use one of {', '.join(REFITS)}")
    if svd not in ("joint", "split"):
        raise UserError(f"unknown --svd {svd}: use joint or split")
    limit = max_latent(config, rope_pairs, rope_strategy)
    if not 1 <= latent <= limit:
        raise UserError(f"--d-kv {latent / n_kv:g} is out of range: use 1 … {limit // n_kv} (the rank available "
                        f"with {n_kv} KV heads and r={rope_pairs})")
    if svd == "split" and latent % 2:
        raise UserError("--svd split needs an even latent width n_kv·d_kv: choose an even --d-kv")


def rope_pairs_for(config, budget: int, share: float, strategy: str, fold: int) -> int:
    """RoPE pairs for a `share` of the budget; with pca rounded to whole rounds over the frequency groups,
    so every group keeps as many components as the others (rope_pca)."""
    n_rope = 1 if strategy == "pca" else config.num_key_value_heads
    pairs = budget * share / (2 * n_rope)
    if strategy != "pca":
        return min(max(1, round(pairs)), head_dim_of(config) // 2)
    groups = -(-(head_dim_of(config) // 2) // fold)  # frequency groups, ⌈(d_h/2) / F⌉
    return max(1, round(pairs / groups)) * groups if 2 * groups < budget else max(1, round(pairs))


def budget_candidates(config, budget: int, strategy: str, fold: int = 1) -> list[tuple[int, int]]:
    """(rope_pairs, latent_dim) splits of a cache budget worth trying: ROPE_SHARES of it for RoPE."""
    n_kv = config.num_key_value_heads
    source = source_elements_per_token_per_layer(config)
    n_rope = 1 if strategy == "pca" else n_kv
    smallest = n_rope * 2 + 1
    if not smallest <= budget < source:
        raise UserError(f"--kv-budget {budget} is out of range: use {smallest} … {source - 1} values per token "
                        f"per layer (the source caches {source})")
    options = []
    for share in ROPE_SHARES:
        r = rope_pairs_for(config, budget, share, strategy, fold)
        latent = budget - n_rope * 2 * r
        if 1 <= latent <= max_latent(config, r, strategy) and (r, latent) not in options:
            options.append((r, latent))
    if not options:
        raise UserError(f"--kv-budget {budget} cannot be split into RoPE dims and a latent for this model")
    return options


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
                       rope_strategy: str = "pca", svd: str = "joint", init: str = "activation",
                       kv_budget: int | None = None, kv_reduction: float | None = None, freq_fold: int = 4,
                       kv_balance: float | str = 1.0, sequential: bool = True, refit: str = "vo",
                       per_layer_split: bool = False, as_mha: bool = False, calib_data=None,
                       calib_samples: int = 16, calib_seq_len: int = 512, dtype="float32", device=None,
                       overwrite: bool = False, progress: bool = True):
    """Convert `source` (path/alias/hub id or a (model, tokenizer) tuple) to an MLA checkpoint at `out`
    → (its MLAConfig, tokenizer). The source is streamed layer by layer (sources.open_source) and the
    checkpoint written shard by shard into a temporary directory renamed to `out` at the end
    (refusing a non-empty `out` unless `overwrite`).

    The cache size is set either by `d_kv` (latent per KV head) and `rope_pairs`, or by a budget:
    `kv_budget` values per token per layer, or `kv_reduction` percent below the source (the split
    between RoPE dims and latent is then searched: every candidate is converted in a streaming pass
    of its own and scored on held-in text as it goes; the best one's files are kept). With `pca` and
    no `rope_pairs`, `d_kv` means the paper's cache size n_kv·(d_kv + 2·d_h/16), split with a
    ROPE_SHARE of it for RoPE. `sequential` calibrates each layer on the outputs of the already
    converted layers before it (so it compensates their error); False follows the source model's
    activations. `kv_balance` β weights value errors against key errors in the joint factorisation;
    "auto" tries AUTO_BALANCES and keeps the best by held-in loss (with the split search when there
    is one). `refit`: "v" re-fits v_up, "vo" v_up then o_proj, to the source's attention output
    (refit); "none" keeps the factorisation's own. `per_layer_split` (with a budget): every layer
    picks its own split among the budget's candidates, by the error of its attention output on the
    calibration inputs (convert_once), instead of one split for all layers. `dtype`: the precision
    of the forward passes (statistics and factorisations are float64 whatever it is); the checkpoint
    keeps the source's storage dtype. `device`: where the layer being converted, the calibration
    hidden states and the factorisations live (default: a GPU when there is one, else the CPU).
    """
    start = time.perf_counter()
    out = Path(out)
    check_output_dir(out, overwrite)
    if rope_strategy not in STRATEGIES + ("pca",):
        raise UserError(f"unknown --rope-strategy {rope_strategy}: use one of {', '.join(STRATEGIES + ('pca',))}")
    dtype = compute_dtype(dtype)
    device = compute_device(device)
    src = open_source(source)
    original_config = src.config
    if as_mha:
        src = expanded_source(src)
    config = src.config
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
    if kv_budget is not None:
        candidates = budget_candidates(config, kv_budget, rope_strategy, freq_fold)
    elif rope_strategy == "pca" and rope_pairs is None:
        budget = config.num_key_value_heads * (d_kv + 2 * max(1, head_dim_of(config) // 16))
        pairs = rope_pairs_for(config, budget, ROPE_SHARE, rope_strategy, freq_fold)
        candidates = [(pairs, budget - 2 * pairs)]
    else:
        r = rope_pairs if rope_pairs is not None else max(1, head_dim_of(config) // 16)
        candidates = [(r, config.num_key_value_heads * d_kv)]
    for r, latent in candidates:
        validate(config, latent, r, rope_strategy, svd, init, refit)
    if kv_balance == "auto":
        balances = AUTO_BALANCES
    else:
        try:
            balances = (float(kv_balance),)
        except ValueError:
            raise UserError(f"--kv-balance {kv_balance} is not a number or 'auto'") from None
        if balances[0] <= 0:
            raise UserError(f"--kv-balance must be positive (got {kv_balance})")
    if per_layer_split and kv_budget is None:
        raise UserError("--per-layer-split needs a budget to split: add --kv-budget N or --kv-reduction P")
    plans = [tuple(candidates)] if per_layer_split else [((r, latent),) for r, latent in candidates]
    candidates = [(plan, b) for plan in plans for b in balances]
    n_held_in = HELD_IN_BLOCKS if len(candidates) > 1 else 0
    calib, held_in = calibration_blocks(src.tokenizer, calib_data or [default_train_text()], calib_seq_len,
                                        calib_samples, n_held_in)
    if len(held_in) < n_held_in:
        raise UserError(f"the budget search needs {n_held_in} more documents of at least {calib_seq_len} tokens "
                        f"after the calibration samples: add text or lower --calib-samples/--calib-seq-len")
    settings = dict(rope_strategy=rope_strategy, svd=svd, init=init, freq_fold=freq_fold, sequential=sequential,
                    refit=refit, dtype=dtype, progress=progress)
    tried = []

    def write(tmp: Path) -> None:
        nonlocal kv_balance
        best = None
        for i, (plan, balance) in enumerate(candidates):
            directory = tmp / f"candidate-{i}"
            directory.mkdir()
            with torch.device(device):  # every tensor the conversion makes, unless it says otherwise
                mla_config, loss = convert_once(src, calib, held_in if n_held_in else None, list(plan), directory,
                                                kv_balance=balance, **settings)
            if n_held_in:
                c = mla_config
                split = ({"rope_pairs": c.layer_rope_pairs, "latent_dim": c.layer_latent_dims} if len(plan) > 1
                         else {"rope_pairs": c.rope_pairs, "latent_dim": c.latent_dim})
                tried.append({**split, "kv_balance": balance, "held_in_loss": loss})
                what = ("per layer" if len(plan) > 1
                        else f"rope dims {c.n_rope_heads * 2 * c.rope_pairs}, latent {c.latent_dim}")
                print(f"  candidate: {what}, K/V balance {balance:g} → held-in loss {loss:.4f}", file=sys.stderr)
            if best is None or loss < best[0]:
                if best is not None:
                    shutil.rmtree(best[2])
                best = (loss, mla_config, directory, balance)
            else:
                shutil.rmtree(directory)
        _, mla_config, directory, kv_balance = best
        for file in directory.iterdir():
            file.rename(tmp / file.name)
        directory.rmdir()
        mla_config.conversion = {
            "rope_strategy": rope_strategy, "init": init, "svd": svd, "freq_fold": freq_fold, "as_mha": as_mha,
            "sequential": sequential, "refit": refit, "kv_balance": kv_balance, "per_layer_split": per_layer_split,
            "calib_samples": len(calib), "calib_seq_len": calib_seq_len, "dtype": str(dtype).removeprefix("torch."),
            "device": str(device),
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


@torch.no_grad()
def attention_error(mla_attn, inputs: list[torch.Tensor], targets: list[torch.Tensor], causal: torch.Tensor,
                    position_ids: torch.Tensor) -> float:
    """Relative squared error Σ‖o_mla − o_src‖² / Σ‖o_src‖² of the MLA attention block's output against
    the source's (`targets`) on the layer's calibration inputs: the per-layer split's objective."""
    err = total = 0.0
    for x, target in zip(inputs, targets):
        got = mla_attn(x, position_ids.expand(x.shape[0], -1), causal)
        err += (got - target).double().pow(2).sum().item()
        total += target.double().pow(2).sum().item()
    return err / total


def load_module(reader, meta_module: torch.nn.Module, prefix: str, dtype: torch.dtype) -> torch.nn.Module:
    """A copy of a module of the meta-device skeleton, on the default device, with its tensors `prefix…`
    read from the checkpoint."""
    module = copy.deepcopy(meta_module).to_empty(device=torch.get_default_device()).to(dtype)
    wanted, present = [prefix + n for n in module.state_dict()], reader.names()
    missing = [n for n in wanted if n not in present]
    if missing:
        raise UserError(f"the source checkpoint lacks {missing[0]} (incomplete or not a {reader.config.model_type} "
                        f"checkpoint)")
    module.load_state_dict({n.removeprefix(prefix): reader.get(n) for n in wanted})
    return module.eval()


def next_token_loss(hidden: torch.Tensor, norm, lm_head: torch.Tensor, blocks: torch.Tensor) -> float:
    """Mean over blocks of each block's mean next-token loss, from the last layer's hidden states
    (the logits of one block at a time: [T, vocab] is large for large vocabularies)."""
    losses = [F.cross_entropy(F.linear(norm(h[:-1]), lm_head).float(), b[1:]).item() for h, b in zip(hidden, blocks)]
    return sum(losses) / len(losses)


@torch.no_grad()
def convert_once(src, blocks, held_in, splits: list[tuple[int, int]], directory: Path, *, rope_strategy: str,
                 svd: str, init: str, freq_fold: int, kv_balance: float, sequential: bool, refit: str,
                 dtype: torch.dtype, progress: bool):
    """One streaming conversion of `src` into `directory`'s weight shards → (MLAConfig, held-in loss).

    Layer by layer: read the source layer, measure its calibration statistics, convert it, write
    it, let it go; the calibration hidden states (and the held-in blocks', when given, through the
    converted layers: the loss the budget search compares) move on to the next layer. With one
    (rope_pairs, latent_dim) split every layer uses it; with several, each layer takes the split
    whose attention output is closest to the source's on its calibration inputs (attention_error,
    before any refit), and the config lists the split of every layer. Runs on the default device
    (torch.device context); the weights are written from the CPU."""
    config, reader = src.config, src.reader
    device = torch.get_default_device()
    blocks, held_in = blocks.to(device), held_in.to(device) if held_in is not None else None
    n_heads, n_kv, d_h = config.num_attention_heads, config.num_key_value_heads, head_dim_of(config)
    n_layers = config.num_hidden_layers
    shared = rope_strategy == "pca"
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    rotary = type(skeleton.model.rotary_emb)(config=config)
    inv_freq = rotary.inv_freq.tolist()
    rope_pairs, latent = splits[0]
    placeholder = [[[i % (d_h // 2) for i in range(rope_pairs)]] * (1 if shared else n_kv)] * n_layers
    mla_config = mla_config_for(
        config, rope_pairs=rope_pairs, latent_dim=latent, rope_layout="shared" if shared else "per_head", svd=svd,
        kept_pairs=placeholder, inv_freq=inv_freq, scaling=float(getattr(rotary, "attention_scaling", 1.0)),
        source_name=src.name)
    mla_config.dtype = reader.dtype
    if len(splits) > 1:
        mla_config.layer_rope_pairs, mla_config.layer_latent_dims = [rope_pairs] * n_layers, [latent] * n_layers
    kept_all = []
    seq = blocks.shape[1]
    position_ids = torch.arange(seq)[None]
    causal = torch.full((seq, seq), torch.finfo(dtype).min, dtype=dtype).triu(1)[None, None]
    rope = rotary(torch.zeros(1, dtype=dtype), position_ids)
    # the embeddings stay in the storage dtype (for a bf16 source, half the float32 table): only the
    # looked-up rows are cast to the forward passes' dtype, exactly
    embed = load_module(reader, skeleton.model.embed_tokens, "model.embed_tokens.", reader.dtype)
    hidden = [embed(blocks[i:i + CALIB_BATCH]).to(dtype) for i in range(0, len(blocks), CALIB_BATCH)]
    held = embed(held_in).to(dtype) if held_in is not None else None
    writer = ShardWriter(directory)
    out_dtype = reader.dtype

    def build(idx, src_layer, stats, moments, r, width):
        """A fresh MLA attention for layer idx at split (r, width), converted from the source's."""
        if len(splits) > 1:
            mla_config.layer_rope_pairs[idx], mla_config.layer_latent_dims[idx] = r, width
        attn = MLAAttention(mla_config, idx).to(dtype)
        if shared:
            choice = pca_basis(*moments, n_heads, n_kv, d_h, r, freq_fold, inv_freq, seq)
            kept = [choice.freq_index]
        else:
            choice = kept = select_pairs(rope_strategy, r, d_h, n_kv, stats.q_norm, stats.k_norm)
        attn.set_rope_pairs(kept, inv_freq)
        convert_layer(src_layer.self_attn, attn, choice, stats, width, svd, init, kv_balance, shared)
        return attn, kept

    for idx in tqdm(range(n_layers), desc="converting layers", disable=not progress):
        src_layer = load_module(reader, skeleton.model.layers[idx], f"model.layers.{idx}.", dtype)
        stats = layer_stats(src_layer, hidden, config)
        layer = MLADecoderLayer(mla_config, idx).to(dtype).eval()
        tried, moments = [], None
        if shared:  # E[k kᵀ], E[q qᵀ] of the source on this layer's inputs, for every split's PCA
            moments = tuple(second_moment(proj.weight, proj.bias, stats.cov, stats.mean)
                            for proj in (src_layer.self_attn.k_proj, src_layer.self_attn.q_proj))
        if len(splits) > 1:
            targets = [src_layer.self_attn(x, position_embeddings=rope, attention_mask=causal)[0]
                       for x in stats.inputs]
        for r, width in splits:
            attn, kept = build(idx, src_layer, stats, moments, r, width)
            error = attention_error(attn, stats.inputs, targets, causal, position_ids) if len(splits) > 1 else 0.0
            tried.append((error, r, width, attn, kept))
        _, r, width, layer.self_attn, kept = min(tried, key=lambda t: t[0])
        if len(splits) > 1:
            mla_config.layer_rope_pairs[idx], mla_config.layer_latent_dims[idx] = r, width
        kept_all.append(kept)
        if refit != "none":
            attn_out = refit_outputs(src_layer.self_attn, layer.self_attn, stats.inputs, rope, causal, position_ids,
                                     o_proj=refit == "vo")
        copy_layer_rest(src_layer, layer)
        if not sequential:
            step = source_layer_step(src_layer, causal, position_ids, rope)
            hidden = [step(h) for h in stats.hidden]
        else:
            if refit == "none":
                attn_out = [layer.self_attn(x, position_ids.expand(x.shape[0], -1), causal) for x in stats.inputs]
            hidden = [layer.after_attention(h, a) for h, a in zip(stats.hidden, attn_out)]
        if held is not None:
            held = layer(held, position_ids.expand(held.shape[0], -1), causal)
        writer.add_module(f"model.layers.{idx}.", layer, out_dtype)
        del src_layer, layer, stats, tried

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
    if len(splits) > 1:  # the scalars name the most common split
        counts = Counter(zip(mla_config.layer_rope_pairs, mla_config.layer_latent_dims))
        mla_config.rope_pairs, mla_config.latent_dim = counts.most_common(1)[0][0]
        mla_config.d_kv = paper_d_kv(mla_config)
    return mla_config, loss
