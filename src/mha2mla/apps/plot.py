"""The MHA2MLA loss-curve figure: fine-tuning loss against step, one panel per source kind.

Each run folder (written by `mha2mla.train`) holds run.json (panel, variant) and loss.jsonl (one
line per step). Runs of an MHA source go to the "MHA2MLA" panel, runs of a GQA source to
"GQA2MLA"; within a panel every variant is one line: pink d_kv=8, purple d_kv=16, dark purple
d_kv=32, black the un-converted base model; a variant of another recipe ("paper d_kv=16") is dashed
in its d_kv's colour. Optional smoothing is an exponential moving average,
y_t = α·y_{t−1} + (1 − α)·x_t, bias-corrected by 1 − α^t so the curve starts at the first loss.

`niah_figure` draws the needle-in-a-haystack heat map of `mha2mla eval niah` in the same palette.
"""

from __future__ import annotations

import json
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from ..errors import UserError

PANELS = ("MHA2MLA", "GQA2MLA")
COLORS = {"d_kv=8": "#f08cc0", "d_kv=16": "#9b5fc0", "d_kv=32": "#4b1c6e", "base": "#000000"}
VARIANT_ORDER = ("d_kv=8", "d_kv=16", "d_kv=32", "base")


def read_curve(run_dir: Path) -> tuple[dict, list[int], list[float]]:
    """(run.json, steps, losses) of one run folder."""
    run_dir = Path(run_dir)
    meta_path, log_path = run_dir / "run.json", run_dir / "loss.jsonl"
    if not meta_path.is_file() or not log_path.is_file():
        raise UserError(f"{run_dir} is not a training run (no run.json/loss.jsonl); give folders written by "
                        f"`mha2mla train`")
    rows = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
    return json.loads(meta_path.read_text()), [r["step"] for r in rows], [r["loss"] for r in rows]


def ema(values: list[float], alpha: float) -> list[float]:
    """Bias-corrected exponential moving average (alpha = 0: no smoothing)."""
    out, avg = [], 0.0
    for t, v in enumerate(values, start=1):
        avg = alpha * avg + (1 - alpha) * v
        out.append(avg / (1 - alpha ** t) if alpha else v)
    return out


def _variant_key(variant: str):
    return (VARIANT_ORDER.index(variant), "") if variant in VARIANT_ORDER else (len(VARIANT_ORDER), variant)


def loss_figure(run_dirs, out=None, smooth: float = 0.0):
    """The figure for `run_dirs` (a Figure, one Axes per panel); with `out`, written as PNG and SVG."""
    if not 0 <= smooth < 1:
        raise UserError(f"--smooth must be in [0, 1) (got {smooth})")
    if not run_dirs:
        raise UserError("give at least one run folder")
    panels: dict[str, list] = {}
    for run_dir in run_dirs:
        meta, steps, losses = read_curve(run_dir)
        panels.setdefault(meta.get("panel") or "runs", []).append((meta.get("variant") or Path(run_dir).name,
                                                                   steps, losses))
    names = [p for p in PANELS if p in panels] + sorted(p for p in panels if p not in PANELS)
    fig = Figure(figsize=(5.2 * len(names), 4))
    FigureCanvasAgg(fig)  # drawn by Agg, outside pyplot: no global figure state, no display needed
    for ax, name in zip(fig.subplots(1, len(names), squeeze=False)[0], names):
        for variant, steps, losses in sorted(panels[name], key=lambda r: _variant_key(r[0])):
            recipe, _, d_kv = variant.rpartition(" ")
            ax.plot(steps, ema(losses, smooth), label=variant, color=COLORS.get(d_kv), linewidth=1.6,
                    linestyle="--" if recipe else "-")
        ax.set_title(name)
        ax.set_xlabel("#Step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel("Loss")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    if out is not None:
        save_figure(fig, out)
    return fig


def save_figure(fig, out) -> list[Path]:
    """Write `out` as .png and .svg (whatever suffix it was given); returns both paths."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    paths = [out.with_suffix(".png"), out.with_suffix(".svg")]
    fig.savefig(paths[0], dpi=150)
    fig.savefig(paths[1])
    return paths


def niah_figure(result: dict):
    """The needle-in-a-haystack map of an `eval niah` result: the mean score (%) of each needle depth (rows,
    0 % = the start of the haystack, at the top) × context length (columns), white (0) to the dark purple
    of the loss figure (100), each cell labelled."""
    from matplotlib.colors import LinearSegmentedColormap

    contexts = list(result["results"])
    depths = list(result["results"][contexts[0]])
    scores = [[100 * result["results"][c][d] for c in contexts] for d in depths]
    cmap = LinearSegmentedColormap.from_list("retrieval", ["#ffffff", COLORS["d_kv=8"], COLORS["d_kv=16"],
                                                           COLORS["d_kv=32"]])
    fig = Figure(figsize=(1.6 + 0.9 * len(contexts), 1.4 + 0.42 * len(depths)))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    image = ax.imshow(scores, cmap=cmap, vmin=0, vmax=100, aspect="auto")
    for i, row in enumerate(scores):
        for j, value in enumerate(row):
            ax.text(j, i, f"{value:.0f}", ha="center", va="center", fontsize=8,
                    color="white" if value > 55 else "black")
    ax.set_xticks(range(len(contexts)), contexts)
    ax.set_yticks(range(len(depths)), depths)
    ax.set_xlabel("Context length (tokens)")
    ax.set_ylabel("Needle depth (%)")
    ax.set_title(f"{Path(str(result.get('model', ''))).name} — {result.get('task', 'niah')}, "
                 f"{result.get('samples', '?')} samples per cell", fontsize=9)
    fig.colorbar(image, ax=ax, label="Score (%)")
    fig.tight_layout()
    return fig
