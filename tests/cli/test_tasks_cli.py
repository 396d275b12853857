"""`mha2mla eval tasks|compare|passkey` bad input through `main(argv)` in-process: one `error:` line, exit 2,
nothing on stdout (each is checked before a model would be loaded, so the SmolLM2 alias is never read)."""

from __future__ import annotations


def _assert_user_error(proc, fragment: str):
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and fragment in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_cli_unknown_task(cli):
    proc = cli("eval", "tasks", "smollm2-135m", "--tasks", "arc_easy,squad", "--json")
    _assert_user_error(proc, "unknown task squad: known tasks are arc_easy, arc_challenge, piqa")


def test_cli_limit_below_one(cli):
    _assert_user_error(cli("eval", "tasks", "smollm2-135m", "--limit", "0"), "--limit")


def test_cli_missing_data_dir(cli, tmp_path, monkeypatch):
    monkeypatch.setenv("MHA2MLA_DATA_DIR", str(tmp_path / "absent"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    proc = cli("eval", "tasks", "smollm2-135m", "--tasks", "piqa")
    _assert_user_error(proc, "$MHA2MLA_DATA_DIR/benchmarks")
    monkeypatch.delenv("MHA2MLA_DATA_DIR")
    _assert_user_error(cli("eval", "tasks", "smollm2-135m", "--data-dir", str(tmp_path / "absent")),
                       "data directory not found")


def test_cli_compare_and_passkey_bad_input(cli):
    _assert_user_error(cli("eval", "compare", "smollm2-135m", "--tasks", "nope"), "unknown task nope")
    _assert_user_error(cli("eval", "passkey", "smollm2-135m", "--seeds", "0"), "--seeds")
