"""The GPU check's dry run: `benchmarks/gpu_check.py --dry-run` runs every part on the CPU at toy sizes.

So the script is known to work before a GPU is ever seen: each part reports a measured or a skip line
in results.md, the exactness checks pass (fp32 and bf16), and no step raises or is stopped. One
subprocess, one thread (about 40 s on a shared 2-core machine).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PARTS = ("environment", "exactness", "conversion", "decode", "training", "serving", "demo")


def sections(markdown: str) -> dict[str, list[str]]:
    """Part name → the result column of its table's lines."""
    found, current = {}, None
    for line in markdown.splitlines():
        if line.startswith("## "):
            current = found.setdefault(line[3:].split(" — ")[0].strip(), [])
        elif current is not None and line.startswith("| ") and not line.startswith("| step "):
            current.append(line.split(" | ")[1].strip())
    return found


@pytest.mark.integration
def test_dry_run_reports_every_part_and_exactness_passes(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    script = REPO / "benchmarks" / "gpu_check.py"
    run = subprocess.run([sys.executable, str(script), "--dry-run", "--out", str(tmp_path)], capture_output=True,
                         text=True, env=env, timeout=600)
    assert (tmp_path / "results.md").is_file(), run.stdout[-3000:] + run.stderr[-3000:]
    results = sections((tmp_path / "results.md").read_text())
    assert set(results) == set(PARTS), results
    for part in PARTS:
        assert {"measured", "passed", "skipped"} & set(results[part]), (part, results[part])
        assert not {"error", "stopped", "FAILED"} & set(results[part]), (part, results[part], run.stdout[-3000:])
    assert results["exactness"].count("passed") >= 12, results["exactness"]
    checks = [s for p in json.loads((tmp_path / "results.json").read_text())["parts"] for s in p["steps"]
              if s["kind"] == "check"]
    assert checks and all(s["values"]["passed"] for s in checks)
    assert (tmp_path / "logs" / "exactness.log").is_file() and (tmp_path / "demo" / "figure.png").is_file()
    assert run.returncode == 0, run.stdout[-3000:]
