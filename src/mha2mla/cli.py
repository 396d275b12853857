"""The `mha2mla` command. It only parses arguments and calls the Python API.

User errors (UserError) print one line `error: …` on stderr and exit 2; `--json` prints exactly one
JSON object on the last line of stdout, progress goes to stderr. Only this module, the recipes and the
error type are imported to parse arguments: each command imports what it runs, so `--help` and
argument errors answer without loading torch.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter

from .errors import UserError
from .recipes import ALLOCATIONS, RECIPES, recipe_of


def _emit(result: dict, as_json: bool, human) -> None:
    if as_json:
        print(json.dumps(result))
    else:
        human(result)


def _print_kv(r: dict) -> None:
    print(f"KV cache per token per layer: {r['kv_elements_per_token_per_layer']} values, "
          f"{r['kv_bytes_per_token']} bytes (source {r['source_kv_bytes_per_token']} bytes), "
          f"reduction {r['reduction_pct']:.2f} %" + (f" (the paper's d_kv={r['d_kv']})" if "d_kv" in r else ""))
    if "per_layer" in r:
        p = r["per_layer"]
        print(f"  per layer: min {p['min']}, mean {p['mean']:g}, max {p['max']} values")
    if "reduction_vs_original_pct" in r:
        print(f"reduction against the original (un-expanded) model: {r['reduction_vs_original_pct']:.2f} %")
    for bits, q in r.get("quantized", {}).items():
        print(f"  int{bits} latent: {q['kv_bytes_per_token']:.1f} bytes per token per layer, "
              f"reduction {q['reduction_pct']:.2f} %")


def cmd_convert(args) -> None:
    from .conversion.pipeline import convert_checkpoint

    recipe = recipe_of(args.recipe, allocate=args.allocate, latent_norm="near_linear" if args.latent_norm else None,
                       **({"reconstruct": args.reconstruct} if args.reconstruct is not None else {}))
    samples, seq_len = args.calib_size
    config, _ = convert_checkpoint(
        args.source, args.out, recipe=recipe, d_kv=args.d_kv, rope_pairs=args.rope_pairs, kv_budget=args.kv_budget,
        kv_reduction=args.kv_reduction, as_mha=args.as_mha, calib_data=args.calib_data, calib_samples=samples,
        calib_seq_len=seq_len, dtype=args.dtype, device=args.device, overwrite=args.overwrite)
    report = dict(config.conversion)
    report["out"] = str(args.out)
    _emit(report, args.json, lambda r: (print(f"wrote {r['out']}"), _print_kv(r["kv"]),
                                        print(f"conversion took {r['seconds']:.1f} s, peak resident memory "
                                              f"{r['process_peak_rss_mb']:.0f} MB")))


def cmd_export(args) -> None:
    from .exports import export

    options = {name: value for name, value in (("tensor_type", args.tensor_type), ("pad_for", args.pad_for),
                                               ("drop_query_bias", args.drop_query_bias or None))
               if value is not None}
    report = export(args.model, args.out, format=args.format, source=args.source, overwrite=args.overwrite,
                    latent_norm=args.latent_norm, calib_data=args.calib_data, **options)
    _emit(report, args.json, _print_export)


def _print_export(r: dict) -> None:
    gap = r["logits_gap"]
    if r["format"] == "gguf":
        types = ", ".join(f"{n} {t}" for t, n in sorted(r["tensor_types"].items(), key=lambda kv: -kv[1]))
        print(f"wrote {r['out']} (llama.cpp deepseek2, {r['file_bytes'] / 1e6:.1f} MB; tensors: {types}; "
              f"kv_lora_rank {r['kv_lora_rank']}, rope dims {r['qk_rope_head_dim']}; tokenizer of {r['source_gguf']})")
        if r["f16_fallback"]:
            kinds = Counter(re.sub(r"^blk\.\d+\.", "", name) for name in r["f16_fallback"])
            print(f"  F16 instead of {r['tensor_type']} (rows not whole blocks): "
                  + ", ".join(f"{kind} ({n})" for kind, n in kinds.items()))
    else:
        print(f"wrote {r['out']} ({r['format']}: kv_lora_rank {r['kv_lora_rank']}, qk_rope_head_dim "
              f"{r['qk_rope_head_dim']}, qk_nope_head_dim {r['qk_nope_head_dim']}, latent norm {r['latent_norm']})")
    print(f"KV cache per token per layer: {r['kv_values_per_token_per_layer']} values (MLA model "
          f"{r['mla_kv_values_per_token_per_layer']}, source {r['source_kv_values_per_token_per_layer']})")
    print(f"logits gap to the MLA model{' (its DeepSeek-V3 mapping)' if r['format'] == 'gguf' else ''}: max "
          f"{gap['max_abs']:.3g}, mean {gap['mean_abs']:.3g} (largest logit {gap['max_abs_logit']:.3g}), top-1 "
          f"agreement {100 * gap['top1_agreement']:.2f} %" + (" (query biases dropped)" if r["query_bias_dropped"] else ""))


def cmd_eval_ppl(args) -> None:
    from .evaluate.perplexity import perplexity_of

    result = perplexity_of(args.model, args.data, seq_len=args.seq_len, windows=args.windows)
    _emit(result, args.json, lambda r: print(f"perplexity {r['ppl']:.3f} over {r['tokens']} tokens "
                                             f"({r['windows']} windows of {r['seq_len']})"))


def _print_scores(r: dict) -> None:
    for task, m in r["results"].items():
        norm = f"  acc_norm {m['acc_norm']:.4f}" if m["acc_norm"] is not None else ""
        print(f"{task:<14} acc {m['acc']:.4f}{norm}  (n={m['n']})")
    print(f"average {r['average']:.4f} (acc_norm where reported, else acc)")


def _tasks(args) -> tuple:
    """The --tasks list, or nothing (every task, the evaluation's default)."""
    return (args.tasks.split(","),) if args.tasks else ()


def cmd_eval_tasks(args) -> None:
    from .evaluate.tasks import evaluate_tasks

    result = evaluate_tasks(args.model, *_tasks(args), limit=args.limit, data_dir=args.data_dir,
                            batch_size=args.batch_size, dtype=args.dtype)
    _emit(result, args.json, _print_scores)


def cmd_eval_compare(args) -> None:
    from .evaluate.tasks import compare_models, markdown_table

    suite = _ruler_suite(args)
    result = compare_models(args.models, *_tasks(args), limit=args.limit, data_dir=args.data_dir,
                            batch_size=args.batch_size, dtype=args.dtype, suite=suite)
    _emit(result, args.json, lambda r: print(markdown_table(r)))


def _ruler_suite(args):
    """The `ruler` task group of `eval compare` (`ruler`: all its tasks, or some of them by name), None without
    it: --limit samples per task and length, at --context lengths."""
    from .evaluate.ruler import TASKS, ruler_suite

    names = args.tasks.split(",") if args.tasks else []
    picked = [name for name in names if name == "ruler" or name in TASKS]
    if not picked:
        return None
    if len(picked) < len(names):
        raise UserError(f"ruler is a task group of its own: compare it (or its tasks) without lm-eval tasks "
                        f"(got --tasks {args.tasks})")
    return ruler_suite(_int_list(args.context, "--context"), tuple(TASKS) if "ruler" in picked else picked,
                       samples=args.limit, haystack=args.haystack)


def _float_list(text: str, option: str) -> list[float]:
    try:
        return [float(v) for v in text.split(",")]
    except ValueError:
        raise UserError(f"{option} takes comma-separated numbers such as 0,25,50,75,100, got '{text}'") from None


def cmd_eval_ruler(args) -> None:
    from .evaluate.ruler import evaluate_ruler, ruler_table

    result = evaluate_ruler(args.model, _int_list(args.context, "--context"), samples=args.samples, seed=args.seed,
                            kv_bits=args.kv_bits, haystack=args.haystack, dtype=args.dtype, resume=args.resume,
                            **({"tasks": args.tasks} if args.tasks else {}))
    _emit(result, args.json, lambda r: print(ruler_table(r)))


def cmd_eval_niah(args) -> None:
    from .evaluate.ruler import niah_grid, niah_table

    result = niah_grid(args.model, _int_list(args.context, "--context"), _float_list(args.depths, "--depths"),
                       samples=args.samples, seed=args.seed, kv_bits=args.kv_bits, haystack=args.haystack,
                       dtype=args.dtype, resume=args.resume)
    if args.plot:
        from .apps.plot import niah_figure, save_figure

        result["png"], result["svg"] = map(str, save_figure(niah_figure(result), args.plot))
    wrote = f"\nwrote {result['png']} and {result['svg']}" if args.plot else ""
    _emit(result, args.json, lambda r: print(niah_table(r) + wrote))


def cmd_eval_passkey(args) -> None:
    from .evaluate.passkey import passkey_accuracy

    result = passkey_accuracy(args.model, _int_list(args.context, "--context"), seeds=args.seeds, dtype=args.dtype)
    _emit(result, args.json, _print_passkey)


def _print_passkey(r: dict) -> None:
    for context, m in r["results"].items():
        print(f"{context:>6} tokens: passkey accuracy {m['accuracy']:.2f} (n={m['n']})")


def cmd_kv_size(args) -> None:
    from .evaluate.kv_memory import kv_size_of

    _emit(kv_size_of(args.model, args.source), args.json, _print_kv)


def cmd_train(args) -> None:
    from accelerate import PartialState

    from .apps.distill import Distillation
    from .apps.train import train

    if not args.distill and (args.teacher or args.distill_targets or args.distill_alpha is not None
                             or args.distill_temperature is not None):
        raise UserError("--teacher, --distill-targets, --distill-alpha and --distill-temperature set distillation: "
                        "add --distill")
    given = {k: v for k, v in (("alpha", args.distill_alpha), ("temperature", args.distill_temperature)) if v is not None}
    distill = Distillation(args.teacher, targets=args.distill_targets, **given) if args.distill else None
    result = train(args.model, args.out, args.data, args.steps, seq_len=args.seq_len, batch_size=args.batch_size,
                   grad_accum=args.grad_accum, lr=args.lr, freeze_non_attention=args.freeze_non_attention,
                   bf16=args.bf16, resume=args.resume, save_every=args.save_every, seed=args.seed, distill=distill)
    if PartialState().is_main_process:  # under accelerate launch / torchrun every process runs this
        _emit(result, args.json, lambda r: print(f"trained {r['steps']} steps ({r['tokens']} tokens), "
                                                 f"final loss {r['final_loss']:.4f}; wrote {r['out']}"))


def cmd_distill_targets(args) -> None:
    from .apps.distill_targets import write_targets

    result = write_targets(args.teacher, args.out, args.data, args.steps, seq_len=args.seq_len,
                           batch_size=args.batch_size, grad_accum=args.grad_accum, processes=args.processes,
                           top_k=args.top_k, device=args.device)
    _emit(result, args.json, lambda r: print(f"wrote the top-{r['top_k']} targets of {r['blocks']} blocks of "
                                             f"{r['seq_len']} tokens to {args.out}"))


def cmd_plot(args) -> None:
    from .apps.plot import loss_figure, save_figure

    paths = save_figure(loss_figure(args.runs, smooth=args.smooth), args.out)
    _emit({"png": str(paths[0]), "svg": str(paths[1])}, args.json, lambda r: print(f"wrote {r['png']} and {r['svg']}"))


def cmd_demo(args) -> None:
    from .apps.demo import demo, print_summary

    report = demo(args.out, steps=args.steps, model=args.model, data=args.data, eval_data=args.eval_data,
                  fast=args.fast, d_kvs=args.d_kv, distill=args.distill)
    _emit(report, args.json, print_summary)


def cmd_generate(args) -> None:
    from .apps.generate import generate_text
    from .evaluate.inputs import check_kv_bits
    from .io.sources import load_model

    check_kv_bits(args.kv_bits)
    model, tokenizer = load_model(args.model)
    generate_text(model, tokenizer, args.prompt, max_new_tokens=args.max_new_tokens, kv_bits=args.kv_bits)


def _calib_size(text: str) -> tuple[int, int]:
    """`--calib-size NxT` → (N, T)."""
    try:
        samples, seq_len = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"give blocks x tokens, such as 16x512 (got '{text}')") from None
    return samples, seq_len


def _int_list(text: str, option: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",")]
    except ValueError:
        raise UserError(f"{option} takes comma-separated integers such as 1024,4096, got '{text}'") from None


def cmd_bench_decode(args) -> None:
    from .evaluate.speed import bench_decode, format_rows

    result = bench_decode(args.model, args.source, _int_list(args.context, "--context"),
                          _int_list(args.batch, "--batch"), new_tokens=args.new_tokens, kv_bits=args.kv_bits,
                          chunk=args.chunk, log=lambda msg: print(msg, file=sys.stderr, flush=True))
    _emit(result, args.json, lambda r: print(format_rows(r["rows"])))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mha2mla", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("convert", help="convert an MHA/GQA model to MLA")
    p.add_argument("source", help="HF directory, .gguf file, hub id, or smollm2-135m")
    p.add_argument("out", help="output directory (written atomically)")
    p.add_argument("--recipe", default="default", choices=list(RECIPES),
                   help="default: RoPE concentration (one shared RoPE key) + query-aware low rank + v/o refit, the "
                        "best measured; paper: MHA2MLA's 2-norm partial RoPE + weight-only SVD (mha2mla.Recipe "
                        "reaches every other setting from Python)")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--d-kv", type=int, default=None,
                      help="the paper's cache size: latent n_kv·d_kv with d_h/16 RoPE pairs per KV head, or as many "
                           "values n_kv·(d_kv + 2·d_h/16) with the shared RoPE key (default 16)")
    size.add_argument("--kv-budget", type=int, default=None,
                      help="cached values per token per layer; the RoPE/latent split is searched on held-out text")
    size.add_argument("--kv-reduction", type=float, default=None,
                      help="KV-cache reduction in %% below the source (a budget)")
    p.add_argument("--rope-pairs", type=int, default=None,
                   help="fix the RoPE frequency pairs (per KV head, or in the shared key) instead of the default "
                        "or the search")
    p.add_argument("--allocate", default="uniform", choices=ALLOCATIONS,
                   help="how the cache is spread over the layers: uniform (every layer the same split), per-layer "
                        "(each picks among a budget's splits by its attention-output error) or global (RoPE dims "
                        "and latent width per layer from measured error curves, same total)")
    p.add_argument("--latent-norm", action="store_true",
                   help="give the model DeepSeek's RMSNorm on the latent (kv_a_layernorm) without changing its "
                        "function, so fine-tuning happens with it and the DeepSeek-V3 export is exact")
    p.add_argument("--reconstruct", type=int, default=None, metavar="STEPS",
                   help="train each converted attention layer for STEPS Adam steps to reproduce the source's output "
                        "on the calibration inputs (default: the recipe's)")
    p.add_argument("--as-mha", action="store_true", help="expand a GQA source to MHA first")
    p.add_argument("--calib-data", nargs="+", default=None, help="calibration text files or directories")
    p.add_argument("--calib-size", type=_calib_size, default=(16, 512), metavar="NxT",
                   help="calibration blocks × tokens per block (default 16x512)")
    p.add_argument("--dtype", default="float32",
                   help="float32, bfloat16 or float16: precision of the forward passes (statistics and "
                        "factorisations are float64; the checkpoint keeps the source's dtype)")
    p.add_argument("--device", default=None,
                   help="cpu, cuda or cuda:N: where layers are calibrated and factored (default: a GPU if any)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("export", help="write an MLA model in another model format for serving engines: DeepSeek-V3 "
                                      "(transformers, vLLM, SGLang) or GGUF (llama.cpp)")
    p.add_argument("model", help="MLA checkpoint directory")
    p.add_argument("out", help="output directory (deepseek-v3) or .gguf file (gguf), written atomically")
    p.add_argument("--format", default="deepseek-v3", help="deepseek-v3 (default) or gguf")
    p.add_argument("--tensor-type", "--type", dest="tensor_type", default=None, choices=["f16", "bf16", "q8_0"],
                   help="gguf: tensor type of the matrices (default f16; norms and attn_kv_a_mqa stay F32)")
    p.add_argument("--pad-for", default=None, metavar="ENGINE",
                   help="zero-pad the latent and RoPE key to the narrowest kernel shape of ENGINE: vllm (512 + 64, "
                        "every vLLM MLA backend, CPU included), vllm-gpu (256/448/512 + 64), llama.cpp-cuda "
                        "(gguf: 128/256/512 + 64), or the shape L+R itself (e.g. 96+32)")
    p.add_argument("--latent-norm", default="near_linear", choices=["near_linear", "rms"],
                   help="how a model converted without a latent norm gets DeepSeek's kv_a_layernorm (default "
                        "near_linear: the norm kept in its near-linear range, the smaller gap measured)")
    p.add_argument("--drop-query-bias", action="store_true",
                   help="export a model with query biases (Qwen2) without them; the logits gap is printed")
    p.add_argument("--source", default=None,
                   help="the original model: read for its RoPE scaling parameters; gguf: its GGUF file, whose "
                        "tokenizer is carried over (default: the MLA config's source_model)")
    p.add_argument("--calib-data", nargs="+", default=None,
                   help="text for the latent norm's statistics and the gap (default: Wikipedia shards)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUT")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("kv-size", help="KV-cache bytes per token per layer, against the source")
    p.add_argument("model")
    p.add_argument("--source", default=None, help="the model to compare against (default: the MLA model's source)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_kv_size)

    ev = sub.add_parser("eval", help="evaluate a model").add_subparsers(dest="eval_command", required=True)
    p = ev.add_parser("ppl", help="perplexity on a text file")
    p.add_argument("model")
    p.add_argument("--data", default=None, help="text file (default: WikiText-2 raw test)")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--windows", type=int, default=None, help="number of windows (default: all)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_eval_ppl)

    def task_options(p) -> None:
        p.add_argument("--tasks", default=None, help="comma-separated task names (default: all of them)")
        p.add_argument("--limit", type=int, default=None, help="first N documents per task (default: all)")
        p.add_argument("--data-dir", default=None, help="folder holding benchmarks/ (default ../shared/data "
                       "or $MHA2MLA_DATA_DIR)")
        p.add_argument("--batch-size", type=int, default=8)
        p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                       help="run in this dtype (default: the model's own; bfloat16 is fast on AMX/AVX512-BF16 CPUs)")
        p.add_argument("--json", action="store_true")

    p = ev.add_parser("tasks", help="zero-shot lm-eval tasks (ARC, PIQA, HellaSwag, OBQA, WinoGrande, MMLU)")
    p.add_argument("model")
    task_options(p)
    p.set_defaults(func=cmd_eval_tasks)

    p = ev.add_parser("compare", help="the paper's Table 1: task scores and KV reduction, one row per model")
    p.add_argument("models", nargs="+", metavar="MODEL", help="the source first, then its MLA conversions")
    task_options(p)
    p.add_argument("--context", default="1024,2048,4096", help="--tasks ruler (or RULER task names): comma-separated "
                   "lengths in tokens; --limit is then the samples per task and length (default 20)")
    p.add_argument("--haystack", default=None, help="--tasks ruler: folder of prose (default: the Wikipedia shards)")
    p.set_defaults(func=cmd_eval_compare)

    p = ev.add_parser("passkey", help="synthetic passkey retrieval accuracy per context length")
    p.add_argument("model")
    p.add_argument("--context", default="1024,2048,4096", help="comma-separated lengths in tokens")
    p.add_argument("--seeds", type=int, default=5, help="prompts per length (default 5)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_eval_passkey)

    def long_context_options(p, samples: int, per: str) -> None:
        p.add_argument("model")
        p.add_argument("--context", default="1024,2048,4096", help="comma-separated lengths in tokens")
        p.add_argument("--samples", type=int, default=samples, help=f"prompts per {per} and length (default {samples})")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--kv-bits", type=int, default=None, help="latent cache storage of an MLA model: 16, 4 or 2")
        p.add_argument("--haystack", default=None, help="folder of prose (default: the Wikipedia shards)")
        p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
        p.add_argument("--resume", default=None, metavar="FILE",
                       help="record each scored sample in FILE (JSON lines); run again with it to skip them")
        p.add_argument("--json", action="store_true")

    p = ev.add_parser("ruler", help="RULER's synthetic long-context tasks (retrieval, tracking, aggregation) "
                                    "per context length, generated offline")
    long_context_options(p, 20, "task")
    p.add_argument("--tasks", default=None, help="comma-separated (default: all: niah_single_1..3, niah_multikey_1..3, "
                   "niah_multivalue, niah_multiquery, vt, cwe, fwe)")
    p.set_defaults(func=cmd_eval_ruler)

    p = ev.add_parser("niah", help="needle-in-a-haystack grid: retrieval per needle depth × context length")
    long_context_options(p, 5, "depth")
    p.add_argument("--depths", default="0,25,50,75,100", help="needle depths in %% of the haystack")
    p.add_argument("--plot", default=None, metavar="FIG", help="write the heat map as FIG .png and .svg")
    p.set_defaults(func=cmd_eval_niah)

    p = sub.add_parser("train", help="fine-tune a source or MLA model on packed text (accelerate/torchrun ready)")
    p.add_argument("model", help="HF directory, MLA checkpoint, .gguf file, hub id, or smollm2-135m")
    p.add_argument("out", help="run directory: loss.jsonl, run.json, checkpoints, final model")
    p.add_argument("--data", nargs="+", default=None, help="text files or directories (default: Wikipedia shards)")
    p.add_argument("--steps", type=int, required=True, help="optimizer steps")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per packed block (default 512)")
    p.add_argument("--batch-size", type=int, default=4, help="blocks per device per micro-step (default 4)")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-steps per optimizer step (default 1)")
    p.add_argument("--lr", type=float, default=1e-4, help="peak learning rate of the WSD schedule (default 1e-4)")
    p.add_argument("--freeze-non-attention", action="store_true", help="train only the attention projections")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast (fp32 master weights)")
    p.add_argument("--distill", action="store_true",
                   help="distil from a frozen teacher: α·KL(teacher ‖ model) at temperature T + (1 − α)·LM loss")
    p.add_argument("--teacher", default=None, help="the teacher (default: the source the MLA model was converted from)")
    p.add_argument("--distill-alpha", type=float, default=None, help="α, the KL's weight in [0, 1] (default 1: the KL alone)")
    p.add_argument("--distill-temperature", type=float, default=None, help="T > 0 (default 1)")
    p.add_argument("--distill-targets", default=None, metavar="DIR",
                   help="distil from the teacher's top-k targets written by `mha2mla distill-targets` (no teacher "
                        "in memory)")
    p.add_argument("--resume", action="store_true", help="continue the run in OUT from its last checkpoint")
    p.add_argument("--save-every", type=int, default=100, help="checkpoint every K steps (0: none; default 100)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("distill-targets", help="write a teacher's top-k log-probabilities over the blocks of a "
                                               "training run, for `train --distill --distill-targets`")
    p.add_argument("teacher", help="the teacher: the source the MLA model was converted from")
    p.add_argument("out", help="new directory for the targets")
    p.add_argument("--top-k", type=int, default=64, help="tokens kept per position (default 64)")
    p.add_argument("--data", nargs="+", default=None, help="the run's --data (default: Wikipedia shards)")
    p.add_argument("--steps", type=int, required=True, help="the run's --steps")
    p.add_argument("--seq-len", type=int, default=512, help="the run's --seq-len (default 512)")
    p.add_argument("--batch-size", type=int, default=4, help="the run's --batch-size (default 4)")
    p.add_argument("--grad-accum", type=int, default=1, help="the run's --grad-accum (default 1)")
    p.add_argument("--processes", type=int, default=1, help="the run's process count (default 1)")
    p.add_argument("--device", default="cpu", help="where the teacher runs (default cpu)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_distill_targets)

    p = sub.add_parser("plot", help="the loss-curve figure of training runs (PNG and SVG)")
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories written by `mha2mla train`")
    p.add_argument("--out", required=True, help="figure path; written as .png and .svg")
    p.add_argument("--smooth", type=float, default=0.0, help="EMA smoothing factor in [0, 1) (default 0: none)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_plot)

    p = sub.add_parser("demo", help="convert, fine-tune and evaluate MHA2MLA/GQA2MLA end to end; figure, report")
    p.add_argument("--out", default="demo-out", help="output directory (default demo-out; reruns skip finished runs)")
    p.add_argument("--steps", type=int, default=None, help="fine-tuning steps per run")
    p.add_argument("--model", default="smollm2-135m", help="GQA or MHA source (default smollm2-135m)")
    p.add_argument("--data", nargs="+", default=None, help="training/calibration text (default: Wikipedia shards)")
    p.add_argument("--eval-data", default=None, help="perplexity text file (default: WikiText-2 raw test)")
    p.add_argument("--d-kv", type=int, nargs="+", default=[8, 16, 32], help="latent widths (default 8 16 32)")
    p.add_argument("--distill", action="store_true",
                   help="fine-tune the MLA models by distillation from the source instead of the LM loss alone")
    p.add_argument("--fast", action="store_true", help="tiny blocks and evaluation windows (for tests)")
    p.add_argument("--json", action="store_true", help="print report.json's object")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("generate", help="stream a greedy continuation of a prompt (MLA models use LatentCache)")
    p.add_argument("model", help="MLA checkpoint, HF directory, .gguf file, hub id, or smollm2-135m")
    p.add_argument("prompt")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--kv-bits", type=int, default=None, help="latent cache storage of an MLA model: 16, 4 or 2 "
                   "(default: the model's kv_bits)")
    p.set_defaults(func=cmd_generate)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench_command", required=True)
    p = bench.add_parser("decode", help="prefill time, decode tok/s, peak memory and KV bytes: MLA vs source")
    p.add_argument("model", help="the MLA checkpoint (measured with LatentCache)")
    p.add_argument("--source", required=True, help="the model it was converted from (measured with its default cache)")
    p.add_argument("--context", default="1024,4096", help="comma-separated prompt lengths (default 1024,4096)")
    p.add_argument("--batch", default="1,8", help="comma-separated batch sizes (default 1,8)")
    p.add_argument("--new-tokens", type=int, default=32, help="timed decode steps (default 32)")
    p.add_argument("--kv-bits", type=int, default=16, help="latent cache storage: 16, 4 or 2 (default 16)")
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk in tokens (default 512)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_bench_decode)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
