"""results.md and results.json of the GPU check, from the parts' JSON lines (DIR/logs/<part>.jsonl).

Every step becomes one line: measured (a row of values), passed / FAILED (a check), skipped (with its
reason), error (the exception's first line; the traceback is in DIR/logs/<part>.log) or stopped (the
part's share ran out while the step ran). A part that could not start gets a line saying why.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

RESULT = {"row": "measured", "skip": "skipped", "error": "error", "stopped": "stopped"}


def read_steps(log: Path, outcome: str) -> list[dict]:
    """The part's finished steps, plus a 'stopped' step for one that started and never finished."""
    if not log.is_file():
        return []
    records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    steps, open_step = [], None
    for r in records:
        if r["kind"] == "start":
            open_step = r["step"]
            continue
        if r["step"] == open_step:
            open_step = None
        steps.append(r)
    if open_step is not None:
        steps.append({"kind": "stopped", "step": open_step, "reason": outcome})
    return steps


def label(step: dict) -> str:
    if step["kind"] == "check":
        return "passed" if step["values"]["passed"] else "FAILED"
    return RESULT[step["kind"]]


def fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {fmt(v)}" for k, v in value.items()) + "}"
    return str(value)


def details(step: dict) -> str:
    if "values" in step:
        return "; ".join(f"{k} {fmt(v)}" for k, v in step["values"].items() if k != "passed")
    return step.get("reason") or step.get("error") or ""


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def part_section(part: dict) -> list[str]:
    head = f"## {part['name']}"
    if part.get("share_s") is not None:
        head += f" — share {part['share_s']:.0f} s, ran {part['seconds']:.1f} s, {part['outcome']}"
    lines = [head, "", "| step | result | values | s |", "|---|---|---|---|"]
    if not part["steps"]:
        lines.append(f"| (whole part) | skipped | {cell(part['outcome'])} | |")
    for s in part["steps"]:
        seconds = f"{s['seconds']:.1f}" if "seconds" in s else ""
        lines.append(f"| {cell(s['step'])} | {label(s)} | {cell(details(s))} | {seconds} |")
    return lines + [""]


def totals(parts: list[dict]) -> dict:
    counts = {}
    for part in parts:
        for s in part["steps"] or [{"kind": "skip"}]:
            name = label(s) if s.get("step") else "skipped"
            counts[name] = counts.get(name, 0) + 1
    return counts


def machine(parts: list[dict]) -> str:
    for part in parts:
        for s in part["steps"]:
            if s["step"] == "device" and "values" in s:
                v = s["values"]
                return v["device"] + (f", {v['memory_gib']} GiB" if "memory_gib" in v else "")
    return "unknown (the environment part did not report)"


def write_results(out: Path, meta: dict, parts: list[dict]) -> dict:
    """Write DIR/results.md and DIR/results.json → the totals."""
    counts = totals(parts)
    meta = {**meta, "machine": machine(parts), "totals": counts,
            "written": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    lines = ["# GPU check results", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {cell(fmt(v))} |" for k, v in meta.items()]
    lines += ["", "Raw output of each part: `logs/<part>.log`; its results as JSON lines: `logs/<part>.jsonl`.", ""]
    for part in parts:
        lines += part_section(part)
    (out / "results.md").write_text("\n".join(lines))
    (out / "results.json").write_text(json.dumps({"meta": meta, "parts": parts}, indent=1, default=str) + "\n")
    return counts
