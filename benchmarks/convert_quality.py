"""Zero-shot quality of the conversion on SmolLM2-135M (prints a table; never asserts).

WikiText-2 raw test, 8 windows × 1024 tokens; rows: the source, partial RoPE only (2-norm, r=4,
full-rank latent: exactly the masked-RoPE model), d_kv 8/16/32 × init weight/activation (2-norm,
r=4: the paper's partial RoPE; no refit, so the inits are compared alone), activation with the value
refit (--refit v) and with the value and o_proj refit (--refit vo), and the default recipe (RoPE
concentration + refit vo) at the same cache sizes, with conversion wall time (calibration included).
`--ablation` instead compares, at the first d_kv, the paper's other per-head strategies (high, low,
uniform) and the split SVD against 2-norm with the joint one (activation init, refit vo).

    python benchmarks/convert_quality.py [--windows 8] [--inits weight,activation,output] [--ablation]
"""

from __future__ import annotations

import argparse
import time

import torch

from mha2mla import load_source
from mha2mla.convert import convert_model
from mha2mla.rope_layout import layout_for
from mha2mla.evaluate.perplexity import perplexity


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--d-kv", default="8,16,32")
    parser.add_argument("--inits", default="weight,activation")
    parser.add_argument("--ablation", action="store_true")
    args = parser.parse_args()
    print(f"torch threads: {torch.get_num_threads()}")
    model, tok = load_source("smollm2-135m")
    rows = [("source", "-", "-", perplexity(model, tok, windows=args.windows, progress=False)["ppl"], 0.0)]

    def run(label, d_kv, init, **kw):
        start = time.perf_counter()
        kw = kw or dict(rope_pairs=4, rope_strategy="2-norm", refit="none")
        mla, _ = convert_model((model, tok), d_kv=d_kv, init=init, progress=False, **kw)
        seconds = time.perf_counter() - start
        rows.append((label, d_kv, init, perplexity(mla, tok, windows=args.windows, progress=False)["ppl"], seconds))
        print(f"{label:>22} d_kv={d_kv:<4} {init:<10} ppl {rows[-1][3]:>10.1f}  {seconds:6.1f} s", flush=True)

    if args.ablation:
        d_kv = int(args.d_kv.split(",")[0])
        for strategy in ("2-norm", "high", "low", "uniform"):
            run(f"MLA {strategy} + vo refit", d_kv, "activation", rope_pairs=4, rope_strategy=strategy, refit="vo")
        run("MLA 2-norm + vo, svd split", d_kv, "activation", rope_pairs=4, rope_strategy="2-norm", refit="vo",
            svd="split")
        run("MLA default, svd split", d_kv, "activation", rope_strategy="pca", svd="split")
    else:
        full_rank = layout_for("2-norm", model.config).max_latent(4) // model.config.num_key_value_heads
        run("partial RoPE only", full_rank, "activation")
        for d_kv in map(int, args.d_kv.split(",")):
            for init in args.inits.split(","):
                run("MLA 2-norm", d_kv, init)
            run("MLA 2-norm + v refit", d_kv, "activation", rope_pairs=4, rope_strategy="2-norm", refit="v")
            run("MLA 2-norm + vo refit", d_kv, "activation", rope_pairs=4, rope_strategy="2-norm", refit="vo")
            run("MLA default recipe", d_kv, "activation", rope_strategy="pca", freq_fold=4)
    print("\n| model | d_kv | init | ppl | conversion s |\n|---|---|---|---|---|")
    for label, d_kv, init, ppl, seconds in rows:
        print(f"| {label} | {d_kv} | {init} | {ppl:,.1f} | {seconds:.1f} |")


if __name__ == "__main__":
    main()
