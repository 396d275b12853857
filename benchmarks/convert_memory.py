"""Peak resident memory and time of `convert` as the source grows (prints, asserts nothing).

    python benchmarks/convert_memory.py [--sizes 1.5,3] [--real smollm2-135m,qwen2.5-0.5b] [--scratch DIR]
                                        [--export]

Every conversion runs in a process of its own and reports that process's peak resident set size
(getrusage ru_maxrss), so one measurement never inherits another's peak. Settings: a fixed split
(default recipe, --d-kv 16: no budget search), 4 calibration samples × 256 tokens. Sources:

* the real models (streamed from their GGUF files), and the same conversion on the model loaded
  whole (`load_source` → `mha2mla.conversion.pipeline.convert_checkpoint`: the in-memory path, the
  converter before streaming);
* random-initialised Llama-shaped checkpoints of ≈ 1.5B and ≈ 3B parameters (hidden 2048 × 22 layers
  and 3072 × 28, GQA 16/8 and 24/8 heads, d_h 128, MLP 8192, SmolLM2's vocabulary), written tensor by
  tensor as bf16 safetensors shards (written through the converter's own `io.readers.ShardWriter`, so
  making them needs no more memory than one tensor).

For each it prints the bound the streaming converter aims at: embeddings + two layers (in the
forward passes' float32) + calibration activations + 1 GB.

`--export` also exports a random-initialised MLA checkpoint of each random size's shape (a shared RoPE
key of 16 dims, a 56-wide latent, bf16, written tensor by tensor) to DeepSeek-V3 (`mha2mla export`,
which reads it a layer at a time), in a process of its own, against the checkpoint's size.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

SHAPES = {  # billions → (hidden, layers, heads, kv heads, intermediate)
    1.5: (2048, 22, 16, 8, 8192),
    3.0: (3072, 28, 24, 8, 8192),
}
TARGETS = {  # shapes of the sizes users convert: (hidden, layers, heads, kv heads, intermediate, vocab)
    "Llama-2-7B": (4096, 32, 32, 32, 11008, 32000),
    "Llama-3-8B": (4096, 32, 32, 8, 14336, 128256),
    "Llama-3-70B": (8192, 80, 64, 8, 28672, 128256),
}
CONVERT = ["--d-kv", "16", "--calib-size", "4x256"]


def llama_config(hidden: int, layers: int, heads: int, kv: int, inter: int, vocab: int = 49152):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv, head_dim=hidden // heads,
                       max_position_embeddings=4096, tie_word_embeddings=False, dtype="bfloat16")


def write_random_llama(path: Path, config, tokenizer) -> int:
    """A random bf16 Llama checkpoint written one tensor at a time → its parameter count."""
    from transformers import AutoModelForCausalLM

    from mha2mla.io.readers import ShardWriter

    path.mkdir(parents=True)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    writer = ShardWriter(path)
    count = 0
    for name, p in skeleton.state_dict().items():
        tensor = torch.ones(p.shape) if name.endswith("norm.weight") else torch.randn(p.shape) * 0.02
        writer.add(name, tensor.to(torch.bfloat16))
        count += p.numel()
    writer.close()
    config.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return count


def write_random_mla(path: Path, source_config, tokenizer, rope_pairs: int = 8, latent_dim: int = 56) -> int:
    """A random bf16 MLA checkpoint of the source's shape (a shared RoPE key of 2·rope_pairs dims, evenly
    spread frequencies, and a latent of latent_dim) written one tensor at a time → its size in bytes."""
    from mha2mla.io.readers import ShardWriter
    from mha2mla.modeling import MLAConfig, MLAForCausalLM

    c = source_config
    half = c.head_dim // 2
    config = MLAConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                       num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                       num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, rope_layout="shared",
                       rope_pairs=rope_pairs, latent_dim=latent_dim,
                       kept_pairs=[[list(range(0, half, half // rope_pairs))]] * c.num_hidden_layers,
                       tie_word_embeddings=False, source_model="random")
    config.dtype = torch.bfloat16
    path.mkdir(parents=True)
    with torch.device("meta"):
        skeleton = MLAForCausalLM(config)
    writer = ShardWriter(path)
    for name, p in skeleton.state_dict().items():
        tensor = torch.ones(p.shape) if name.endswith("norm.weight") else torch.randn(p.shape) * 0.02
        writer.add(name, tensor.to(torch.bfloat16))
    writer.close()
    config.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def bound_gb(config) -> float:
    """Embeddings + two layers (float32) + calibration activations + 1 GB, in GB."""
    d, inter = config.hidden_size, config.intermediate_size
    kv = config.num_key_value_heads * (config.hidden_size // config.num_attention_heads)
    layer = 2 * d * d + 2 * d * kv + 3 * d * inter
    embeddings = config.vocab_size * d * (1 if config.tie_word_embeddings else 2)
    activations = 4 * 256 * d * 6  # hidden + normed inputs + next hidden, and attention outputs, per block
    return (4 * (embeddings + 2 * layer + activations)) / 1e9 + 1.0


def one(args) -> None:
    """Child process: one conversion, then a JSON line with its time and peak RSS."""
    from mha2mla.cli import main

    start = time.perf_counter()
    if args.export:
        main(["export", args.source, args.out, "--format", "deepseek-v3"])
    elif args.in_memory:
        from mha2mla import load_source
        from mha2mla.conversion.pipeline import convert_checkpoint

        convert_checkpoint(load_source(args.source), args.out, d_kv=16, calib_samples=4, calib_seq_len=256,
                           progress=False)
    else:
        main(["convert", args.source, args.out, *CONVERT])
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"seconds": time.perf_counter() - start, "peak_bytes": peak}))


def measure(source: str, out: Path, in_memory: bool = False, export: bool = False) -> dict:
    cmd = ([sys.executable, __file__, "--one", source, "--out", str(out)] + (["--in-memory"] if in_memory else [])
           + (["--export"] if export else []))
    run = subprocess.run(cmd, capture_output=True, text=True)
    shutil.rmtree(out, ignore_errors=True)
    if run.returncode != 0:
        return {"error": run.stderr.strip().splitlines()[-1] if run.stderr.strip() else f"exit {run.returncode}"}
    return json.loads(run.stdout.strip().splitlines()[-1])


def row(name: str, params: float, how: str, result: dict, bound: float) -> None:
    if "error" in result:
        print(f"| {name} | {params / 1e9:.2f} | {how} | failed: {result['error']} | | |")
        return
    print(f"| {name} | {params / 1e9:.2f} | {how} | {result['peak_bytes'] / 1e9:.2f} | {bound:.2f} | "
          f"{result['seconds']:.0f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1.5,3", help="random Llama-shaped sources, billions of parameters")
    parser.add_argument("--real", default="smollm2-135m,qwen2.5-0.5b")
    parser.add_argument("--scratch", default=None, help="where the random checkpoints go (default: a temp dir)")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--in-memory", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--export", action="store_true", help="also export a random MLA model of each size")
    parser.add_argument("--skip-convert", action="store_true", help="with --export: only the export rows")
    args = parser.parse_args()
    if args.one:
        args.source = args.one
        return one(args)

    from mha2mla import load_source
    from mha2mla.io.sources import open_source

    scratch = Path(args.scratch or tempfile.mkdtemp(prefix="convert-memory-"))
    print("| source | params (B) | path | peak RSS (GB) | bound (GB) | time (s) |")
    print("|---|---|---|---|---|---|")
    growth = []  # (bound, peak) in GB of the random Llama rows
    for alias in filter(None, args.real.split(",")):
        config = open_source(alias).config
        params = sum(t.numel() for t in load_source(alias)[0].state_dict().values())
        for in_memory in (False, True):
            result = measure(alias, scratch / "out", in_memory)
            row(alias, params, "in memory" if in_memory else "streaming", result, bound_gb(config))
    tokenizer = load_source("smollm2-135m")[1]
    for size in (float(s) for s in args.sizes.split(",") if s):
        config = llama_config(*SHAPES[size], len(tokenizer))
        path = scratch / f"llama-{size}b"
        shutil.rmtree(path, ignore_errors=True)
        params = write_random_llama(path, config, tokenizer)
        result = {} if args.skip_convert else measure(str(path), scratch / "out")
        if result:
            row(f"random Llama {size}B (bf16)", params, "streaming", result, bound_gb(config))
        shutil.rmtree(path)
        if "peak_bytes" in result:
            growth.append((bound_gb(config), result["peak_bytes"] / 1e9))
        if args.export:
            mla = scratch / f"mla-{size}b"
            shutil.rmtree(mla, ignore_errors=True)
            size_gb = write_random_mla(mla, config, tokenizer) / 1e9
            exported = measure(str(mla), scratch / "ds", export=True)
            shutil.rmtree(mla)
            row(f"random MLA of its shape ({size_gb:.2f} GB) → DeepSeek-V3", params, "export", exported,
                bound_gb(config))
    if len(growth) >= 2:  # peak against the bound over the random Llama rows: peak ≈ a·bound + b
        (b0, m0), (b1, m1) = growth[-2], growth[-1]
        a = (m1 - m0) / (b1 - b0)
        print(f"\nstreaming peak against the bound (random Llama rows): peak ≈ {a:.2f} × bound "
              f"{m0 - a * b0:+.2f} GB")
        for name, shape in TARGETS.items():
            bound = bound_gb(llama_config(*shape))
            print(f"{name}: bound {bound:.1f} GB → estimated peak {a * bound + m0 - a * b0:.1f} GB")

if __name__ == "__main__":
    main()
