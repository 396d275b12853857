"""Part 7 of the GPU check, run with the time that remains: `mha2mla demo --steps 500` on SmolLM2-135M.

The demo (convert at d_kv 8/16/32 and with the paper's recipe, fine-tune every model, measure
perplexity before and after, plot) runs through the CLI in this process, its runs in the scratch
folder; its figure and report are copied to DIR/demo/ when it finishes. It is skipped when less than
two minutes are left or SmolLM2 is not on the machine; stopped at the deadline, its line says so.
Dry run: `demo --fast --steps 2 --d-kv 8` on a toy MHA source (one panel, three runs).
"""

from __future__ import annotations

import json
import shutil
import time

from mha2mla.cli import main as cli

from .models import byte_tokenizer, random_source, save_model, smollm2, toy_eval_text, train_text
from .record import Context, Skip

KEPT = ("figure.png", "figure.svg", "report.md", "report.json")


def run(ctx: Context) -> None:
    ctx.step("mha2mla demo" + (" --fast --steps 2 --d-kv 8 (toy source)" if ctx.dry else " --steps 500"),
             lambda: demo(ctx), needs=ctx.size(120, 3))


def demo_args(ctx: Context) -> list[str]:
    if not ctx.dry:
        source = smollm2(ctx.scratch)
        if source is None:
            raise Skip("SmolLM2-135M is not on this machine (docs/gpu.md)")
        return ["--steps", "500", "--model", source]
    toy = save_model(random_source("Llama-2-7B", True), byte_tokenizer(), ctx.scratch / "demo-source")
    return ["--fast", "--steps", "2", "--d-kv", "8", "--model", str(toy), "--data", *map(str, train_text()),
            "--eval-data", str(toy_eval_text())]


def demo(ctx: Context) -> dict:
    runs = ctx.scratch / "demo"
    shutil.rmtree(runs, ignore_errors=True)
    start = time.perf_counter()
    status = cli(["demo", "--out", str(runs), *demo_args(ctx)])
    if status != 0:
        raise RuntimeError(f"mha2mla demo exited with status {status} (its message is in the log)")
    kept = ctx.out / "demo"
    kept.mkdir(exist_ok=True)
    for name in KEPT:
        if (runs / name).is_file():
            shutil.copy2(runs / name, kept / name)
    report = json.loads((runs / "report.json").read_text())
    return {"seconds": round(time.perf_counter() - start, 1), "runs": len(report["runs"]),
            "figure": "demo/figure.png", "ppl_after": {f"{r['panel']} {r['variant']}": round(r["ppl_after"], 2)
                                                       for r in report["runs"]}}
