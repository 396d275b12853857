"""SmolLM2-135M's MLA conversion exported to GGUF (llama.cpp `deepseek2`) and run in llama.cpp, against
the MLA model in mha2mla and the source GGUF in llama.cpp.

The MLA model is the default recipe at 72 cached values per token per layer (`mha2mla.convert(...,
kv_budget=72)`, with `--weighting W` as Recipe.weighting=W when given (spelt `--init` before issue 32;
that spelling still works); read from `--mla`, converted there first when absent), exported
with `mha2mla export --format gguf` in each of `--types`. The source is the packaged SmolLM2-135M-Instruct GGUF (Q4_1),
copied to the same tensor types by llama.cpp's own `llama_model_quantize` (allow_requantize: the Q4_1
values dequantized, which are the weights the MLA model was converted from). Through llama-cpp-python
(CPU, `--threads` threads, its defaults otherwise: flash attention off, F16 KV cache):

* greedy agreement: the first 64 tokens of WikiText window 1 as the prompt (token ids, not text), 32
  greedy tokens in llama.cpp against the MLA model's `generate()` (float32, LatentCache);
* the logits gap on window 1 (max / mean |Δ|, top-1 agreement) against the float32 MLA model;
* WikiText-2 raw test perplexity over `--windows` windows of 1024 tokens, the windows of
  `mha2mla.evaluate.perplexity` (every token but each window's first predicted);
* llama.cpp's own report of its KV cache at n_ctx 4096 (its `llama_kv_cache` log lines);
* decode speed: the context filled with `C` prompt tokens, then `--new-tokens` single-token decode
  steps (fixed next tokens of the text), tok/s = 1 / median step time; the models take turns over
  `--repeats` rounds and the median round is printed (all rounds in brackets), as other jobs share the CPU.

Prints, never asserts.

    python benchmarks/llama_cpp_check.py [--mla out/llama-cpp/smollm2-b72] [--out out/llama-cpp] [--weighting W]
        [--types f16,q8_0] [--windows 8] [--context 1024,4096] [--new-tokens 32] [--repeats 3] [--build-log FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import os
import re
import statistics
import time
from pathlib import Path

import numpy as np
import torch

import llama_cpp
from mha2mla import convert, load_model
from mha2mla.evaluate.perplexity import eval_windows, perplexity
from mha2mla.exports.gguf import export_gguf
from mha2mla.io.sources import bundled_gguf
from mha2mla.io.text import default_eval_text

SOURCE = "smollm2-135m"
FTYPES = {"f16": llama_cpp.LLAMA_FTYPE_MOSTLY_F16, "bf16": llama_cpp.LLAMA_FTYPE_MOSTLY_BF16,
          "q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0}


def quantized_source(out: Path, kind: str) -> Path:
    """The source GGUF copied to tensor type `kind` by llama.cpp (made once)."""
    path = out / f"smollm2-135m-source-{kind}.gguf"
    if not path.is_file():
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype, params.allow_requantize = FTYPES[kind], True
        rc = llama_cpp.llama_model_quantize(str(bundled_gguf(SOURCE)).encode(), str(path).encode(), params)
        assert rc == 0, f"llama_model_quantize returned {rc}"
    return path


def load(path: Path, n_ctx: int, threads: int, logits_all: bool = False) -> tuple[llama_cpp.Llama, str]:
    """(the model in llama.cpp, its load log)."""
    log = io.StringIO()
    with contextlib.redirect_stderr(log):
        llm = llama_cpp.Llama(str(path), n_ctx=n_ctx, n_batch=512, n_threads=threads, n_threads_batch=threads,
                              logits_all=logits_all, verbose=True)
    return llm, log.getvalue()


def kv_cache_report(path: Path, threads: int, n_ctx: int = 4096) -> str:
    """llama.cpp's own lines about its KV cache at n_ctx."""
    llm, log = load(path, n_ctx, threads)
    llm.close()
    return "; ".join(line.strip() for line in log.splitlines() if re.search(r"llama_kv_cache.*(size|MiB)", line))


def llama_logits(llm: llama_cpp.Llama, ids: list[int]) -> np.ndarray:
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[:len(ids)], dtype=np.float64)


def llama_perplexity(llm: llama_cpp.Llama, windows: torch.Tensor) -> float:
    nll, count = 0.0, 0
    for window in windows:
        logits = torch.from_numpy(llama_logits(llm, window.tolist()))[:-1]
        nll += torch.nn.functional.cross_entropy(logits, window[1:], reduction="sum").item()
        count += len(window) - 1
    return math.exp(nll / count)


def llama_greedy(llm: llama_cpp.Llama, prompt: list[int], new_tokens: int) -> list[int]:
    llm.reset()
    llm.eval(prompt)
    out = []
    for _ in range(new_tokens):
        out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval(out[-1:])
    return out


def decode_tok_s(path: Path, tokens: list[int], context: int, new_tokens: int, threads: int) -> float:
    """1 / median time of a single-token decode step after `context` cached tokens."""
    llm, _ = load(path, context + new_tokens, threads)
    with contextlib.redirect_stderr(io.StringIO()):
        llm.eval(tokens[:context])
        steps = []
        for token in tokens[context:context + new_tokens]:
            start = time.perf_counter()
            llm.eval([token])
            steps.append(time.perf_counter() - start)
    llm.close()
    return 1 / statistics.median(steps)


def gap(reference: np.ndarray, logits: np.ndarray) -> str:
    d = np.abs(reference - logits)
    top1 = float((reference.argmax(-1) == logits.argmax(-1)).mean())
    return f"max {d.max():.3g}, mean {d.mean():.3g}, top-1 {100 * top1:.2f} %"


def build_seconds(log: Path | None) -> str:
    if log is None or not log.is_file():
        return "not measured here"
    found = re.findall(r"rc=(\d+) seconds=(\d+)", log.read_text(errors="replace"))
    return f"{int(found[-1][1])} s (rc {found[-1][0]})" if found else "not finished"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mla", default="out/llama-cpp/smollm2-b72")
    parser.add_argument("--out", default="out/llama-cpp")
    parser.add_argument("--weighting", "--init", dest="weighting", default=None,
                        help="the conversion's low-rank error weighting, Recipe.weighting (default: the recipe's)")
    parser.add_argument("--types", default="f16,q8_0")
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--context", default="1024,4096")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="decode-speed rounds (median printed, all in brackets)")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--build-log", type=Path, default=None, help="pip's log of building llama-cpp-python")
    args = parser.parse_args()
    mla_path, out = Path(args.mla), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    kinds, contexts = args.types.split(","), [int(c) for c in args.context.split(",")]
    torch.set_num_threads(args.threads)
    print(f"llama-cpp-python {llama_cpp.__version__}; build of the sdist: {build_seconds(args.build_log)}; "
          f"{args.threads} threads; load at start {open('/proc/loadavg').read().split()[:3]}")

    if not (mla_path / "config.json").is_file():
        start = time.perf_counter()
        convert(SOURCE, mla_path, kv_budget=72, **({"weighting": args.weighting} if args.weighting else {}))
        print(f"converted {SOURCE} at 72 values to {mla_path} in {time.perf_counter() - start:.0f} s")
    mla, tokenizer = load_model(mla_path)
    text = default_eval_text()
    windows = eval_windows(tokenizer, text, 1024, args.windows)
    stream = windows.reshape(-1).tolist()
    prompt = windows[0, :64]
    with torch.no_grad():
        mla_greedy = mla.generate(prompt[None], max_new_tokens=32, do_sample=False)[0, 64:].tolist()
        mla_logits = mla(windows[:1], use_cache=False).logits[0].double().numpy()
    mla_ppl = perplexity(mla, tokenizer, text, 1024, args.windows, progress=False)["ppl"]
    del mla

    models = {}
    for kind in kinds:
        path = out / f"smollm2-b72-{kind}.gguf"
        start = time.perf_counter()
        report = export_gguf(mla_path, path, tensor_type=kind, overwrite=True)
        print(f"exported {path} ({kind}) in {time.perf_counter() - start:.0f} s: {report['file_bytes'] / 1e6:.1f} MB, "
              f"tensors {report['tensor_types']}, F16 fallback {report['f16_fallback'] or 'none'}; DeepSeek-V3 "
              f"mapping's gap to the MLA model: max {report['logits_gap']['max_abs']:.3g}")
        models[f"MLA export {kind}"] = path
        models[f"source {kind}"] = quantized_source(out, kind)

    rows = []
    for name, path in models.items():
        llm, _ = load(path, 1024, args.threads, logits_all=True)
        with contextlib.redirect_stderr(io.StringIO()):
            ppl = llama_perplexity(llm, windows)
            logits = llama_logits(llm, windows[0].tolist())
            greedy = llama_greedy(llm, prompt.tolist(), 32) if name.startswith("MLA") else None
        llm.close()
        agree = "" if greedy is None else f"{sum(a == b for a, b in zip(greedy, mla_greedy))}/32"
        first_diff = "" if greedy is None else next((str(i) for i, (a, b) in enumerate(zip(greedy, mla_greedy))
                                                     if a != b), "none")
        rows.append((name, ppl, gap(mla_logits, logits) if name.startswith("MLA") else "", agree, first_diff,
                     kv_cache_report(path, args.threads)))
    # decode speed: the models interleaved, --repeats rounds, the median round (other jobs share the CPU)
    runs = {(name, c): [] for name in models for c in contexts}
    for _ in range(args.repeats):
        for name, path in models.items():
            for c in contexts:
                runs[name, c].append(decode_tok_s(path, stream, c, args.new_tokens, args.threads))

    print(f"\nWikiText-2 raw test, {args.windows} windows of 1024 tokens; the MLA model in mha2mla (float32, "
          f"torch): ppl {mla_ppl:.3f}; llama.cpp rows below (load at the end {open('/proc/loadavg').read().split()[:3]})")
    print("| model in llama.cpp | ppl | logits gap to the MLA model (window 1) | greedy tokens = MLA model's | "
          "first differing | KV cache at n_ctx 4096 (llama.cpp's log) | "
          + " | ".join(f"decode tok/s at {c}" for c in contexts) + " |")
    print("|---|---:|---|---|---|---|" + "---:|" * len(contexts))
    for name, ppl, g, agree, first_diff, kv in rows:
        print(f"| {name} | {ppl:.3f} | {g} | {agree} | {first_diff} | {kv} | "
              + " | ".join(f"{statistics.median(runs[name, c]):.1f} ({', '.join(f'{v:.1f}' for v in runs[name, c])})"
                           for c in contexts) + " |")


if __name__ == "__main__":
    main()
