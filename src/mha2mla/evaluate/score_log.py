"""A resumable record of scored samples: a long evaluation killed part-way picks up where it stopped.

The file is JSON lines. The first names the run — what every score depends on besides the sample
(evaluation, model, seed, KV bits, haystack, dtype) — and each further line is one scored sample,
{"task", "context", "index", "score"}, appended and flushed as its batch finishes. Samples are a
function of (seed, task, context, index), so a run given the file again skips every sample it holds
and scores only the rest; more samples, tasks or lengths extend it. A line cut short by the kill is
dropped; a file whose first line names another run is refused.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import UserError
from ..io.atomic import write_file_atomically

Key = tuple[str, int, int]  # (task or grid column, context length, sample index)


def read_scores(path: str | Path) -> tuple[dict | None, dict[Key, float]]:
    """(the run the file names, {key: score}) of a score file, without a line cut short by a kill;
    (None, {}) for a missing or empty file."""
    path = Path(path)
    lines = path.read_text(encoding="utf-8").splitlines() if path.is_file() else []
    done = {}
    for line in lines[1:]:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            break  # the line being written when the run was killed
        done[(row["task"], row["context"], row["index"])] = row["score"]
    return (json.loads(lines[0]) if lines else None), done


def _line(key: Key, score: float) -> str:
    task, context, index = key
    return json.dumps({"task": task, "context": context, "index": index, "score": score})


class ScoreLog:
    """The scored samples of `run` in the file `path` (made, or read back and cleaned of a cut line)."""

    def __init__(self, path: str | Path, run: dict):
        self.path = Path(path)
        named, self.done = read_scores(self.path)
        if named is not None and named != run:
            raise UserError(f"{self.path} holds the scores of another run ({json.dumps(named)}): "
                            "give another --resume file")
        lines = [json.dumps(run), *(_line(key, score) for key, score in self.done.items())]
        write_file_atomically(self.path, lambda f: f.write("".join(f"{line}\n" for line in lines)))

    def add(self, key: Key, score: float) -> None:
        with self.path.open("a", encoding="utf-8") as f:
            f.write(_line(key, score) + "\n")
        self.done[key] = score
