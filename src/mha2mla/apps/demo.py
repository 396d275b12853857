"""The end-to-end main job (`mha2mla demo`, `make demo`): convert, fine-tune, evaluate, plot, report.

Default: SmolLM2-135M (GQA: 9 query heads, 3 KV heads) is the GQA2MLA source and its exact MHA
expansion (9 KV heads, `--as-mha`) the MHA2MLA source. Each source is converted to MLA at d_kv 8, 16
and 32 with the default recipe, and at the middle cache size once more with the paper's recipe
(`--recipe paper`), so the figure shows both curves at the same budget; those eight models and the
two un-converted base models are fine-tuned with the same recipe
(mha2mla.train), for the same steps, on the same packed Wikipedia text in the same order. Held-out
perplexity (WikiText-2 raw test, the same few windows for every model) is measured before and after
fine-tuning. The defaults are sized to finish in about 12–15 minutes on 2 CPU cores. With `--distill`
the MLA models are fine-tuned by distillation from the source instead (same runs, same figure).

DIR/
  runs/<panel>-<variant>/   the training runs (loss.jsonl, run.json, final model)
  measurements.json         KV bytes and perplexities measured so far
  figure.png, figure.svg    loss against step, one panel per source kind (mha2mla.plot)
  report.md, report.json    per run: KV bytes per token per layer, reduction, ppl before/after, final loss
Resumable: a rerun skips every finished run and every measured number.
"""

from __future__ import annotations

import copy
import json
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from tqdm.auto import tqdm

from ..conversion.pipeline import convert
from ..conversion.stages.expand import expand_to_mha
from ..errors import UserError
from ..evaluate.perplexity import perplexity
from ..io.sources import load_model, load_source
from ..io.text import default_eval_text, default_train_text
from ..modeling.configuration_mla import kv_report
from .distill import Distillation
from .plot import loss_figure
from .train import read_run, train

PROMPT = "The history of the city"


@dataclass(frozen=True)
class Settings:
    """How much work each run does; DEFAULT is sized for ~15 min on 2 CPU cores, FAST for tests."""
    steps: int = 20
    seq_len: int = 256
    batch_size: int = 2
    lr: float = 1e-4
    calib_samples: int = 8
    calib_seq_len: int = 256
    eval_seq_len: int = 256
    eval_windows: int = 4
    sample_tokens: int = 24


DEFAULT = Settings()
FAST = Settings(steps=4, seq_len=32, batch_size=1, calib_samples=2, calib_seq_len=32, eval_seq_len=32,
                eval_windows=1, sample_tokens=8)


@dataclass(frozen=True)
class Run:
    """One line of the figure: a panel's base model or one of its MLA conversions."""
    panel: str          # "MHA2MLA" or "GQA2MLA"
    d_kv: int | None    # None: the base model
    as_mha: bool        # the panel's source is the MHA expansion of a GQA model
    recipe: str = "default"  # a conversion recipe of mha2mla.recipes.RECIPES

    @property
    def variant(self) -> str:
        if self.d_kv is None:
            return "base"
        return f"d_kv={self.d_kv}" if self.recipe == "default" else f"{self.recipe} d_kv={self.d_kv}"

    @property
    def name(self) -> str:
        return f"{self.panel.lower()}-{self.variant.replace('=', '').replace(' ', '-')}"


def plan(config, d_kvs) -> list[Run]:
    """The runs: a GQA source gives both panels (itself and its MHA expansion), an MHA source one."""
    gqa = config.num_key_value_heads < config.num_attention_heads
    panels = [("MHA2MLA", gqa), ("GQA2MLA", False)] if gqa else [("MHA2MLA", False)]
    middle = sorted(d_kvs)[len(d_kvs) // 2]
    return [run for panel, as_mha in panels for run in
            [Run(panel, d_kv, as_mha) for d_kv in (None, *d_kvs)] + [Run(panel, middle, as_mha, "paper")]]


# ---- the entry point ----------------------------------------------------------------------------

def demo(out="demo-out", *, steps: int | None = None, model: str = "smollm2-135m", data=None, eval_data=None,
         fast: bool = False, d_kvs=(8, 16, 32), distill: bool = False) -> dict:
    """Run (or finish) the whole demo in `out`; returns the report (also written to out/report.json).
    `distill`: the MLA models are fine-tuned by distillation from the source (apps/distill.py) instead of
    the LM loss alone; the base models as before."""
    start = time.perf_counter()
    settings = replace(FAST if fast else DEFAULT, **({"steps": steps} if steps is not None else {}))
    if settings.steps <= 0:
        raise UserError(f"--steps must be positive (got {settings.steps})")
    if not d_kvs or min(d_kvs) < 1 or len(set(d_kvs)) != len(d_kvs):
        raise UserError(f"--d-kv needs distinct positive widths (got {list(d_kvs)})")
    out = Path(out)
    data = [str(p) for p in (data or [default_train_text()])]
    eval_data = str(eval_data or default_eval_text())
    source, tokenizer = load_source(model)
    measured = Measurements(out / "measurements.json")

    rows = []
    runs = plan(source.config, d_kvs)
    for run in tqdm(runs, desc="demo runs", unit="run"):
        teacher = Distillation(teacher=source) if distill and run.d_kv is not None else None
        rows.append(do_run(run, source, tokenizer, out / "runs" / run.name, data, eval_data, settings, measured,
                           teacher))

    figure = out / "figure.png"
    loss_figure([row["run_dir"] for row in rows], figure, smooth=0.0 if fast else 0.6)
    sample = generate_sample(rows, settings)
    report = {"source": model, "runs": rows, "figure": str(figure), "sample": sample,
              "settings": {**asdict(settings), "d_kvs": list(d_kvs), "data": data, "eval_data": eval_data,
                           "distill": distill},
              "seconds": time.perf_counter() - start}
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "report.md").write_text(markdown(report))
    return report


def do_run(run: Run, source, tokenizer, run_dir: Path, data, eval_data, settings: Settings, measured,
           distill: Distillation | None = None) -> dict:
    """Build, measure, fine-tune (by `distill` when given) and measure again one run; finished parts are
    skipped."""
    m = measured.get(run.name)
    if "ppl_after" not in m:
        finished = (read_run(run_dir) or {}).get("finished", False)
        if finished:
            model = load_model(run_dir)[0]
        else:
            model = build_model(run, source, tokenizer, data, settings)
            if "ppl_before" not in m:
                measured.put(run.name, ppl_before=ppl(model, tokenizer, eval_data, settings))
        measured.put(run.name, **kv_numbers(model))
        if not finished:
            train((model, tokenizer), run_dir, data, settings.steps, seq_len=settings.seq_len,
                  batch_size=settings.batch_size, lr=settings.lr, save_every=0, resume=True, distill=distill,
                  panel=run.panel, variant=run.variant)
        measured.put(run.name, ppl_after=ppl(model.eval(), tokenizer, eval_data, settings))
    m = measured.get(run.name)
    return {"panel": run.panel, "variant": run.variant, "kv_bytes_per_token": m["kv_bytes_per_token"],
            "reduction_pct": m["reduction_pct"], "ppl_before": m.get("ppl_before"), "ppl_after": m["ppl_after"],
            "final_loss": read_run(run_dir)["result"]["final_loss"], "run_dir": str(run_dir)}


def build_model(run: Run, source, tokenizer, data, settings: Settings):
    """The model a run starts from; the shared source itself is never trained."""
    if run.d_kv is None:
        return expand_to_mha(source) if run.as_mha else copy.deepcopy(source)
    mla, _ = convert((source, tokenizer), recipe=run.recipe, d_kv=run.d_kv, as_mha=run.as_mha, calib_data=data,
                     calib_samples=settings.calib_samples, calib_seq_len=settings.calib_seq_len)
    return mla


def ppl(model, tokenizer, eval_data, settings: Settings) -> float:
    return perplexity(model, tokenizer, eval_data, seq_len=settings.eval_seq_len, windows=settings.eval_windows)["ppl"]


def kv_numbers(model) -> dict:
    """KV-cache bytes per token per layer at the model's dtype, and the reduction against its source."""
    kv = kv_report(model.config, dtype_bytes=model.dtype.itemsize)
    return {"kv_bytes_per_token": kv["kv_bytes_per_token"], "reduction_pct": kv["reduction_pct"]}


class Measurements:
    """measurements.json: {run name: {kv_bytes_per_token, reduction_pct, ppl_before, ppl_after}}."""

    def __init__(self, path: Path):
        self.path = path
        self.data = json.loads(path.read_text()) if path.is_file() else {}

    def get(self, name: str) -> dict:
        return dict(self.data.get(name, {}))

    def put(self, name: str, **values) -> None:
        self.data.setdefault(name, {}).update(values)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(json.dumps(self.data, indent=1) + "\n")
        tmp.replace(self.path)


# ---- sample and report --------------------------------------------------------------------------

def generate_sample(rows: list[dict], settings: Settings) -> dict:
    """Greedy continuation of PROMPT by one fine-tuned MLA model (d_kv=16 of the last panel if there)."""
    mla_rows = [r for r in rows if r["variant"] != "base"]
    row = next((r for r in reversed(mla_rows) if r["variant"] == "d_kv=16"), mla_rows[-1])
    model, tokenizer = load_model(row["run_dir"])
    inputs = tokenizer(PROMPT, return_tensors="pt")
    ids = model.generate(**inputs, max_new_tokens=settings.sample_tokens, do_sample=False,
                         pad_token_id=tokenizer.pad_token_id)
    text = tokenizer.decode(ids[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    return {"panel": row["panel"], "variant": row["variant"], "prompt": PROMPT, "text": text}


def _num(value, fmt: str) -> str:
    return "–" if value is None else format(value, fmt)


def markdown(report: dict) -> str:
    s = report["settings"]
    lines = [
        "# MHA2MLA demo", "",
        f"Source: `{report['source']}`. Every run: {s['steps']} steps × {s['batch_size']} blocks × {s['seq_len']} "
        f"tokens, peak lr {s['lr']}, same text in the same order. Perplexity: {s['eval_windows']} windows × "
        f"{s['eval_seq_len']} tokens of `{Path(s['eval_data']).name}`. KV bytes are per token per layer at the "
        f"model's dtype; the reduction is against the panel's source (MHA2MLA: the MHA expansion).", "",
        "| panel | variant | KV bytes/token/layer | KV reduction | ppl before | ppl after | final loss |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in report["runs"]:
        lines.append(f"| {r['panel']} | {r['variant']} | {r['kv_bytes_per_token']} | {r['reduction_pct']:.2f} % | "
                     f"{_num(r['ppl_before'], '.2f')} | {_num(r['ppl_after'], '.2f')} | "
                     f"{_num(r['final_loss'], '.4f')} |")
    sample = report["sample"]
    lines += ["", "![loss curves](figure.png)", "",
              f"Sample ({sample['panel']} {sample['variant']}, fine-tuned, greedy): "
              f"**{sample['prompt']}**{sample['text']}", "",
              f"Wall time of this invocation: {report['seconds']:.0f} s (a rerun skips finished runs).", ""]
    return "\n".join(lines)


def print_summary(report: dict) -> None:
    """The human-readable CLI output: the table, the sample and where the files are."""
    print(f"{'panel':<9}{'variant':<9}{'KV B/tok/layer':>15}{'reduction':>11}{'ppl before':>12}{'ppl after':>11}"
          f"{'final loss':>12}")
    for r in report["runs"]:
        print(f"{r['panel']:<9}{r['variant']:<9}{r['kv_bytes_per_token']:>15}{r['reduction_pct']:>10.2f}%"
              f"{_num(r['ppl_before'], '.2f'):>12}{_num(r['ppl_after'], '.2f'):>11}{_num(r['final_loss'], '.4f'):>12}")
    sample = report["sample"]
    print(f"\nsample ({sample['panel']} {sample['variant']}): {sample['prompt']}{sample['text']}")
    out = Path(report["figure"]).parent
    print(f"wrote {out / 'figure.png'}, {out / 'report.md'}, {out / 'report.json'} ({report['seconds']:.0f} s)")
