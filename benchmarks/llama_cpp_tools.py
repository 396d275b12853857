"""The GGUF export in llama.cpp's own tools against the source: decode speed, where a decode step's time
goes op by op, perplexity, and llama-server's greedy tokens against the MLA model's.

    make setup-llama-cpp-tools      # once: llama-bench, llama-batched-bench, … in .llama.cpp/build/bin
    python benchmarks/llama_cpp_tools.py [--mla out/llama-cpp/smollm2-b72] [--out out/llama-cpp]
        [--context 1024,4096,16384,32768] [--flash-attn 0,1] [--pad 64+16] [--parallel 1,4,8]
        [--parallel-prompt 1024] [--profile-context 4096] [--new-tokens 32] [--repetitions 1] [--threads 2]
        [--poll 50] [--repack 0|1] [--skip bench,…]

The models: the MLA model at `--mla` (SmolLM2-135M converted by the default recipe at 72 values when
absent), exported F16 by `mha2mla export --format gguf`, also padded to each `--pad` shape L+R (zero
latent rows and RoPE slots: the same function in a wider cache); the source is the packaged SmolLM2 GGUF
copied to F16 by `llama-quantize --allow-requantize` (the Q4_1 values the MLA model was converted from).
Every row runs in llama.cpp's tools from the same build (CPU, `--threads` threads):

* `bench`: `llama-bench -p 0 -n N -d C`: the cache filled with C tokens, then N single-token decode steps,
  tok/s as llama-bench reports it (mean ± sd of `--repetitions`); flash attention off and on; the models
  take turns at each context. Contexts past SmolLM2's 8,192 trained positions are speed rows only
  (llama.cpp warns and runs; the tokens there are noise to the model, not to the timing).
* `parallel`: `llama-batched-bench -npp P -ntg 32 -npl n`: n sequences, each with its own P-token prompt
  in its own cache stream, decoded together: total decode tok/s over the n sequences.
* `profile`: per-op time of a decode step at `--profile-context`, through the Python binding loaded on the
  same build: a ggml scheduler eval callback that asks for every node makes the scheduler compute the
  graph one node at a time, and the time from the callback's question to its answer is that node's. Rows
  group nodes by op and by llama.cpp's tensor name without the layer suffix (kq, kq_soft_max, v_cont,
  kqv, …), summed over layers, in ms per step; node-at-a-time costs a thread-pool dispatch per node, so
  the step's unprofiled time is printed beside the sum.
* `perplexity`: `llama-perplexity -f wiki.test.raw -c 1024 --chunks 8` (llama.cpp's windows: each chunk's
  second half scored, so not mha2mla's figure, but the same for both models).
* `server`: `llama-server` on localhost serving the export; `/completion` with the first 64 tokens of
  WikiText-2 test (token ids), 32 greedy tokens, against the MLA model's own `generate()` (float32).

`--repack 0` turns off llama.cpp's weight repacking (extra CPU buffer types), which this build needs for an
export whose latent width is a multiple of 32: with it on, loading aborts in the scheduler
(`GGML_ASSERT(*cur_backend_id != -1)`; measured for 64+16, 64+32 and 128+64).

Prints, never asserts.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np

SOURCE = "smollm2-135m"
STEPS = ("bench", "parallel", "profile", "perplexity", "server")


def load_avg() -> list[str]:
    return open("/proc/loadavg").read().split()[:3]


def fail(message: str) -> None:
    print(f"llama_cpp_tools: {message}", file=sys.stderr)
    sys.exit(2)


def run_tool(tools: Path, name: str, *args) -> str:
    result = subprocess.run([str(tools / name), *map(str, args)], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{name} {' '.join(map(str, args))} exited {result.returncode}: {result.stderr[-2000:]}")
    return result.stdout


def source_f16(tools: Path, out: Path) -> Path:
    from mha2mla.io.sources import bundled_gguf

    path = out / "smollm2-135m-source-f16.gguf"
    if not path.is_file():
        run_tool(tools, "llama-quantize", "--allow-requantize", bundled_gguf(SOURCE), path, "F16")
    return path


def mla_exports(mla: Path, out: Path, pads: list[str]) -> dict[str, Path]:
    """{label: GGUF file} of the MLA model at its own shape and at each padded one (made once)."""
    from mha2mla import convert
    from mha2mla.exports.gguf import export_gguf

    if not (mla / "config.json").is_file():
        start = time.perf_counter()
        convert(SOURCE, mla, kv_budget=72)
        print(f"converted {SOURCE} at 72 values to {mla} in {time.perf_counter() - start:.0f} s")
    files = {}
    for pad in [None, *pads]:
        path = out / f"{mla.name}{'' if pad is None else '-pad' + pad}-f16.gguf"
        if not path.is_file():
            report = export_gguf(mla, path, tensor_type="f16", pad_for=pad)
            print(f"exported {path}: kv_lora_rank {report['kv_lora_rank']} + rope {report['qk_rope_head_dim']}")
        files["MLA export" + ("" if pad is None else f" padded {pad}")] = path
    return files


def bench(tools: Path, models: dict[str, Path], contexts: list[int], flash: list[str], new_tokens: int,
          threads: int, repetitions: int, repack: str, poll: int) -> None:
    print(f"\n## llama-bench: decode tok/s after the context ({new_tokens} steps, {repetitions} repetition(s))")
    names = list(models)
    print("| context | flash attention | " + " | ".join(names) + " | " +
          " | ".join(f"{n} / source" for n in names[1:]) + " |")
    print("|---:|---|" + "---:|" * (2 * len(names) - 1))
    for context in contexts:
        for fa in flash:
            speed = {}
            for name, path in models.items():
                line = run_tool(tools, "llama-bench", "-m", path, "-p", 0, "-n", new_tokens, "-d", context,
                                "-fa", fa, "-t", threads, "-r", repetitions, "--repack", repack,
                                "--poll", poll, "-o", "jsonl").strip().splitlines()[-1]
                row = json.loads(line)
                speed[name] = (row["avg_ts"], row["stddev_ts"])
                print(f"<!-- {name}, context {context}, flash attention {fa}: tok/s {row['samples_ts']} -->")
            base = speed[names[0]][0]
            print(f"| {context} | {'on' if fa == '1' else 'off'} | "
                  + " | ".join(f"{m:.1f} ± {s:.1f}" for m, s in speed.values()) + " | "
                  + " | ".join(f"{speed[n][0] / base:.2f}" for n in names[1:]) + " |", flush=True)


def parallel(tools: Path, models: dict[str, Path], prompt: int, sequences: list[int], flash: list[str],
             threads: int, repack: str) -> None:
    print(f"\n## llama-batched-bench: n sequences × {prompt}-token prompts, 32 tokens each, total decode tok/s")
    names = list(models)
    print("| sequences | flash attention | " + " | ".join(names) + " | " +
          " | ".join(f"{n} / source" for n in names[1:]) + " |")
    print("|---:|---|" + "---:|" * (2 * len(names) - 1))
    speed = {}
    for fa in flash:
        for name, path in models.items():
            text = run_tool(tools, "llama-batched-bench", "-m", path, "-c", max(sequences) * (prompt + 32),
                            "-b", 2048, "-ub", 512, "-npp", prompt, "-ntg", 32, "-npl", ",".join(map(str, sequences)),
                            "-fa", "on" if fa == "1" else "off", "-t", threads, *([] if repack == "1" else ["--no-repack"]),
                            "--output-format", "jsonl")
            for line in text.splitlines():
                if line.startswith("{"):
                    row = json.loads(line)
                    speed[fa, name, row["pl"]] = row["speed_tg"]
        for n in sequences:
            base = speed[fa, names[0], n]
            print(f"| {n} | {'on' if fa == '1' else 'off'} | "
                  + " | ".join(f"{speed[fa, name, n]:.1f}" for name in names) + " | "
                  + " | ".join(f"{speed[fa, name, n] / base:.2f}" for name in names[1:]) + " |", flush=True)


class OpProfile:
    """A ggml scheduler eval callback that times every node of the graphs computed while `on`."""

    def __init__(self, llama_cpp, tools: Path):
        ggml = ctypes.CDLL(str(tools / "libggml-base.so"))
        for fn in (ggml.ggml_op_desc, ggml.ggml_get_name):
            fn.argtypes, fn.restype = [ctypes.c_void_p], ctypes.c_char_p
        self.ggml, self.on, self.start = ggml, False, 0
        self.totals: collections.Counter = collections.Counter()
        self.callback = llama_cpp.ggml_backend_sched_eval_callback(self.__call__)

    def __call__(self, tensor, ask, _user_data) -> bool:
        if not self.on:
            return False
        now = time.perf_counter_ns()
        if ask:
            self.start = now
            return True
        name = re.sub(r"-\d+\b", "", self.ggml.ggml_get_name(tensor).decode())  # kq-7 → kq: layers summed
        name = re.sub(r"^node_\d+", "(unnamed)", name)
        self.totals[self.ggml.ggml_op_desc(tensor).decode(), name] += now - self.start
        return True


def profile(models: dict[str, Path], tools: Path, context: int, flash: list[str], new_tokens: int,
            threads: int, repack: str) -> None:
    os.environ["LLAMA_CPP_LIB_PATH"] = str(tools)  # the binding runs the tools' own build
    try:
        import llama_cpp
    except ImportError:
        fail("the profile needs llama.cpp's Python binding: pip install llama-cpp-python==0.3.36 (make "
             "test-llama-cpp installs it), or pass --skip profile")

    quiet = llama_cpp.llama_log_callback(lambda *_: None)  # referenced until the end: llama.cpp calls it
    llama_cpp.llama_log_set(quiet, ctypes.c_void_p(0))
    llama_cpp.llama_backend_init()
    print(f"\n## Per-op profile of a decode step at context {context} (ms per step, mean of {new_tokens} steps; "
          f"one node at a time)")
    rng = np.random.default_rng(0)
    for fa in flash:
        columns = {}
        for name, path in models.items():
            ops = OpProfile(llama_cpp, tools)
            model_params = llama_cpp.llama_model_default_params()
            model_params.use_extra_bufts = repack == "1"
            model = llama_cpp.llama_model_load_from_file(str(path).encode(), model_params)
            params = llama_cpp.llama_context_default_params()
            params.n_ctx, params.n_batch, params.n_ubatch = context + 2 * new_tokens, 512, 512
            params.n_threads = params.n_threads_batch = threads
            params.flash_attn_type = (llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if fa == "1"
                                      else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED)
            params.cb_eval, params.cb_eval_user_data = ops.callback, None
            ctx = llama_cpp.llama_init_from_model(model, params)
            vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
            tokens = rng.integers(0, vocab, context + 2 * new_tokens).astype(np.int32)

            def decode(chunk: np.ndarray) -> None:
                array = (llama_cpp.llama_token * len(chunk))(*chunk.tolist())
                assert llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(array, len(chunk))) == 0

            for i in range(0, context, 512):
                decode(tokens[i:min(i + 512, context)])
            plain = []
            for t in tokens[context:context + new_tokens]:
                start = time.perf_counter()
                decode(t[None])
                plain.append(time.perf_counter() - start)
            ops.on = True
            for t in tokens[context + new_tokens:]:
                decode(t[None])
            llama_cpp.llama_free(ctx)
            llama_cpp.llama_model_free(model)
            columns[name] = ({key: ns / new_tokens / 1e6 for key, ns in ops.totals.items()},
                             1e3 * float(np.median(plain)))
        keys = sorted({k for per_op, _ in columns.values() for k in per_op},
                      key=lambda k: -max(per_op.get(k, 0.0) for per_op, _ in columns.values()))
        print(f"\nflash attention {'on' if fa == '1' else 'off'}")
        print("| op | tensor | " + " | ".join(columns) + " |")
        print("|---|---|" + "---:|" * len(columns))
        shown = [k for k in keys if max(per_op.get(k, 0.0) for per_op, _ in columns.values()) >= 0.05]
        for op, tensor in shown:
            print(f"| {op} | {tensor} | " + " | ".join(f"{per_op.get((op, tensor), 0.0):.2f}"
                                                    for per_op, _ in columns.values()) + " |")
        print("| all ops | (sum, profiled) | " + " | ".join(f"{sum(per_op.values()):.2f}"
                                                       for per_op, _ in columns.values()) + " |")
        print("| step | (unprofiled, median) | " + " | ".join(f"{step:.2f}" for _, step in columns.values()) + " |",
              flush=True)


def llama_perplexity(tools: Path, models: dict[str, Path], threads: int) -> None:
    from mha2mla.io.text import default_eval_text

    print("\n## llama-perplexity, WikiText-2 raw test, 8 chunks of 1024 tokens")
    for name, path in models.items():
        result = subprocess.run([str(tools / "llama-perplexity"), "-m", str(path), "-f", str(default_eval_text()),
                                 "-c", "1024", "--chunks", "8", "-t", str(threads)], capture_output=True, text=True)
        found = re.search(r"Final estimate: PPL = ([\d.]+) \+/- ([\d.]+)", result.stdout + result.stderr)
        print(f"- {name}: " + (f"PPL {found[1]} ± {found[2]}" if found else f"failed (exit {result.returncode})"),
              flush=True)


def llama_server(tools: Path, mla: Path, export: Path, threads: int, port: int = 8391) -> None:
    """32 greedy tokens from llama-server against the MLA model's generate() on the same 64 prompt tokens."""
    import torch

    from mha2mla import load_model
    from mha2mla.evaluate.perplexity import eval_windows
    from mha2mla.io.text import default_eval_text

    model, tokenizer = load_model(mla)
    prompt = eval_windows(tokenizer, default_eval_text(), 1024, 1)[0, :64]
    with torch.no_grad():
        want = model.generate(prompt[None], max_new_tokens=32, do_sample=False)[0, 64:].tolist()
    server = subprocess.Popen([str(tools / "llama-server"), "-m", str(export), "--port", str(port), "-t", str(threads),
                               "-c", "1024", "--no-ui"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health") as reply:
                    if json.load(reply).get("status") == "ok":
                        break
            except (urllib.error.URLError, ConnectionError):
                pass
            if time.time() > deadline or server.poll() is not None:
                print(f"\n## llama-server: not ready (exit {server.poll()})")
                return
            time.sleep(1)
        body = json.dumps({"prompt": prompt.tolist(), "n_predict": 32, "temperature": 0, "top_k": 1,
                           "return_tokens": True, "cache_prompt": False}).encode()
        request = urllib.request.Request(f"{url}/completion", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request) as reply:
            got = json.load(reply)["tokens"]
    finally:
        server.terminate()
        server.wait()
    same = sum(a == b for a, b in zip(got, want))
    first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    print(f"\n## llama-server /completion on {export.name}: 32 greedy tokens after 64 WikiText-2 tokens: {same}/32 equal "
          f"to the MLA model's generate() (float32), first differing {first if first is not None else 'none'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mla", default="out/llama-cpp/smollm2-b72")
    parser.add_argument("--out", default="out/llama-cpp")
    parser.add_argument("--tools", default=".llama.cpp/build/bin", help="llama.cpp's build (make setup-llama-cpp-tools)")
    parser.add_argument("--context", default="1024,4096,16384,32768")
    parser.add_argument("--flash-attn", default="0,1")
    parser.add_argument("--pad", default="", help="comma-separated shapes L+R the export is also padded to")
    parser.add_argument("--parallel", default="1,4,8", help="numbers of sequences decoded together")
    parser.add_argument("--parallel-prompt", type=int, default=1024)
    parser.add_argument("--profile-context", type=int, default=4096)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repetitions", type=int, default=1)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--poll", type=int, default=50,
                        help="llama-bench's --poll, how hard idle threads spin for work, 0-100 (its default 50)")
    parser.add_argument("--repack", default="1", choices=["0", "1"],
                        help="llama.cpp's weight repacking (extra CPU buffer types; its default 1)")
    parser.add_argument("--skip", default="", help=f"comma-separated steps not to run ({', '.join(STEPS)})")
    args = parser.parse_args()
    tools, out = Path(args.tools), Path(args.out)
    if not (tools / "llama-bench").is_file():
        fail(f"llama.cpp's tools are not in {tools}: run `make setup-llama-cpp-tools` (or pass --tools DIR)")
    skip = {s for s in args.skip.split(",") if s}
    if skip - set(STEPS):
        fail(f"unknown step(s) {', '.join(sorted(skip - set(STEPS)))} for --skip (steps: {', '.join(STEPS)})")
    out.mkdir(parents=True, exist_ok=True)
    flash = args.flash_attn.split(",")
    models = {"source": source_f16(tools, out), **mla_exports(Path(args.mla), out, [p for p in args.pad.split(",") if p])}
    version = subprocess.run([str(tools / "llama-bench"), "--version"], capture_output=True, text=True)
    print(f"llama.cpp {(version.stdout + version.stderr).strip().splitlines()[0]} (llama-cpp-python's vendored "
          f"source) in {tools}; {args.threads} threads; repack {args.repack}; llama-bench poll {args.poll}; load at start {load_avg()}")
    for name, path in models.items():
        print(f"- {name}: {path} ({path.stat().st_size / 1e6:.1f} MB)")
    if "bench" not in skip:
        bench(tools, models, [int(c) for c in args.context.split(",")], flash, args.new_tokens, args.threads,
              args.repetitions, args.repack, args.poll)
    if "parallel" not in skip:
        parallel(tools, models, args.parallel_prompt, [int(n) for n in args.parallel.split(",")], flash, args.threads,
                 args.repack)
    if "profile" not in skip:
        profile(models, tools, args.profile_context, flash, args.new_tokens, args.threads, args.repack)
    if "perplexity" not in skip:
        llama_perplexity(tools, models, args.threads)
    if "server" not in skip:
        llama_server(tools, Path(args.mla), models["MLA export"], args.threads)
    print(f"\nload at the end {load_avg()}")


if __name__ == "__main__":
    main()
