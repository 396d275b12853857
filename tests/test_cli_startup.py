"""`mha2mla --help` and argument errors answer without importing torch (a process boundary is the point:
what a fresh interpreter imports)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

PROBE = """
import sys
from mha2mla.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as e:
    code = e.code
heavy = sorted(m for m in ("torch", "transformers", "gguf", "safetensors") if m in sys.modules)
print("HEAVY", ",".join(heavy), file=sys.stderr)
sys.exit(code)
"""


@pytest.mark.parametrize("argv, code", [
    (["--help"], 0),
    (["convert", "--help"], 0),
    (["export", "--help"], 0),
    (["eval", "tasks", "--help"], 0),
    (["convert", "a", "b", "--d-kv", "4", "--kv-budget", "30"], 2),  # the size is one mutually exclusive group
    (["convert", "a"], 2),
    (["no-such-command"], 2),
])
def test_help_and_argument_errors_import_no_torch(argv, code):
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=60)
    seconds = time.perf_counter() - start
    assert done.returncode == code, done.stderr
    assert "HEAVY \n" in done.stderr or done.stderr.rstrip().endswith("HEAVY"), done.stderr[-300:]
    print(f"{' '.join(argv)}: {seconds:.2f} s")


def test_convert_help_lists_at_most_16_options(capsys):
    from mha2mla.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["convert", "--help"])
    options = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  -")]
    assert exit_.value.code == 0 and 0 < len(options) <= 16, options
