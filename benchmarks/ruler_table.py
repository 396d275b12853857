"""The RULER table of several models side by side, read from the resume files of their `eval ruler` runs.

Each `mha2mla eval ruler MODEL --resume FILE` run records every scored sample in FILE (score_log.py);
this script lays those files out as one markdown table: a row per task, a column per (model, context
length) that holds all `--samples` samples of every task, the average per column last. Columns a run
has not finished are left out and named on stderr. Prints, never asserts.

    python benchmarks/ruler_table.py LABEL=FILE [LABEL=FILE ...] [--samples 20] [--contexts 1024,2048]
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

from mha2mla.evaluate.ruler import TASKS, grid_table
from mha2mla.evaluate.score_log import read_scores


def scores(path: Path) -> dict[tuple[str, int], list[float]]:
    """{(task, context): [score per sample]} of one resume file."""
    per = collections.defaultdict(list)
    for (task, context, _), score in read_scores(path)[1].items():
        per[(task, context)].append(score)
    return per


def length(context: int) -> str:
    return f"{context // 1024}K" if context % 1024 == 0 else str(context)


def table(runs: dict[str, dict], samples: int, contexts: list[int] | None) -> str:
    columns = []
    for label, per in runs.items():
        for context in sorted({c for _, c in per}):
            if contexts and context not in contexts:
                continue
            if all(len(per.get((task, context), [])) >= samples for task in TASKS):
                columns.append((label, context))
            else:
                print(f"left out {label} @ {context}: not every task has {samples} samples", file=sys.stderr)
    columns.sort(key=lambda lc: (lc[1], list(runs).index(lc[0])))
    names = [f"{label} @ {length(context)}" for label, context in columns]
    rows = {task: {name: sum(runs[label][(task, c)][:samples]) / samples for name, (label, c) in zip(names, columns)}
            for task in TASKS}
    average = {name: sum(row[name] for row in rows.values()) / len(rows) for name in names}
    return grid_table(rows, "task (%)", average)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", metavar="LABEL=FILE", help="a column label and an `eval ruler --resume` file")
    p.add_argument("--samples", type=int, default=20, help="samples per task and length a column needs (default 20)")
    p.add_argument("--contexts", default=None, help="comma-separated context lengths to show (default: all)")
    args = p.parse_args()
    runs = {}
    for item in args.runs:
        label, sep, path = item.partition("=")
        if not sep or not Path(path).is_file():
            p.error(f"give LABEL=FILE with an existing resume file (got {item!r})")
        runs[label] = scores(Path(path))
    contexts = [int(c) for c in args.contexts.split(",")] if args.contexts else None
    print(table(runs, args.samples, contexts))


if __name__ == "__main__":
    main()
