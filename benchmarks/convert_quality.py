"""Zero-shot quality of the conversion on SmolLM2-135M (prints a table; never asserts).

WikiText-2 raw test, 8 windows × 1024 tokens; rows: the source, partial RoPE only (2-norm, r=4,
full-rank latent: exactly the masked-RoPE model), d_kv 8/16/32 × error weighting weight/activation
(Recipe.weighting; 2-norm, r=4: the paper's partial RoPE; no refit, so the weightings are compared
alone), activation with the value refit (refit="v") and with the value and o_proj refit (refit="vo"),
and the default recipe's RoPE concentration + refit vo with activation-aware keys at the same cache
sizes, with conversion wall time (calibration included). `--ablation` instead compares, at the first
d_kv, the paper's other per-head strategies (high, low, uniform) and the split SVD against 2-norm with
the joint one (activation-aware, refit vo). Each row is `mha2mla.convert` with the default Recipe's
fields changed as stated.

    python benchmarks/convert_quality.py [--windows 8] [--weightings weight,activation,output] [--ablation]

(`--weightings` was `--inits` before issue 32; that spelling still works.)
"""

from __future__ import annotations

import argparse
import time

import torch

from mha2mla import convert, load_source
from mha2mla.conversion.stages.rope.layout import layout_for
from mha2mla.evaluate.perplexity import perplexity


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--d-kv", default="8,16,32")
    parser.add_argument("--weightings", "--inits", dest="weightings", default="weight,activation",
                        help="the low-rank step's error weightings (Recipe.weighting) of the 2-norm rows")
    parser.add_argument("--ablation", action="store_true")
    args = parser.parse_args()
    print(f"torch threads: {torch.get_num_threads()}")
    model, tok = load_source("smollm2-135m")
    rows = [("source", "-", "-", perplexity(model, tok, windows=args.windows, progress=False)["ppl"], 0.0)]

    def run(label, d_kv, weighting, **changes):
        """One conversion at d_kv: the default Recipe with `weighting` and `changes` (default: 2-norm r=4, no refit)."""
        start = time.perf_counter()
        changes = changes or dict(rope_pairs=4, rope="2-norm", refit="none")
        mla, _ = convert((model, tok), d_kv=d_kv, weighting=weighting, progress=False, **changes)
        seconds = time.perf_counter() - start
        rows.append((label, d_kv, weighting, perplexity(mla, tok, windows=args.windows, progress=False)["ppl"],
                     seconds))
        print(f"{label:>22} d_kv={d_kv:<4} {weighting:<10} ppl {rows[-1][3]:>10.1f}  {seconds:6.1f} s", flush=True)

    if args.ablation:
        d_kv = int(args.d_kv.split(",")[0])
        for strategy in ("2-norm", "high", "low", "uniform"):
            run(f"MLA {strategy} + vo refit", d_kv, "activation", rope_pairs=4, rope=strategy, refit="vo")
        run("MLA 2-norm + vo, svd split", d_kv, "activation", rope_pairs=4, rope="2-norm", refit="vo", svd="split")
        run("MLA default, svd split", d_kv, "activation", rope="pca", svd="split")
    else:
        full_rank = layout_for("2-norm", model.config).max_latent(4) // model.config.num_key_value_heads
        run("partial RoPE only", full_rank, "activation")
        for d_kv in map(int, args.d_kv.split(",")):
            for weighting in args.weightings.split(","):
                run("MLA 2-norm", d_kv, weighting)
            run("MLA 2-norm + v refit", d_kv, "activation", rope_pairs=4, rope="2-norm", refit="v")
            run("MLA 2-norm + vo refit", d_kv, "activation", rope_pairs=4, rope="2-norm", refit="vo")
            run("MLA default recipe, activation keys", d_kv, "activation", rope="pca", freq_fold=4)
    print("\n| model | d_kv | weighting | ppl | conversion s |\n|---|---|---|---|---|")
    for label, d_kv, weighting, ppl, seconds in rows:
        print(f"| {label} | {d_kv} | {weighting} | {ppl:,.1f} | {seconds:.1f} |")


if __name__ == "__main__":
    main()
