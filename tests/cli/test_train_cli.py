"""`mha2mla train` as a user runs it: exact resume after a kill (a subprocess that SIGKILLs itself), DDP on
CPU (two processes under accelerate launch), and bad input through `main(argv)` in-process.

A tiny random Llama (conftest's tiny_model) with the tiny tokenizer trains on generated text.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tiny import read_log, save_tiny_model, small_run, write_text
from mha2mla.cli import main

REPO = Path(__file__).resolve().parents[2]


def test_killed_run_resumes_with_the_same_loss_log(tiny_model, text_dir, tmp_path, one_thread):
    small_run(tiny_model, tmp_path / "straight", text_dir, 10)
    # a second process trains the same run and SIGKILLs itself right after logging step 5
    script = f"""
import os, signal
from pathlib import Path
import mha2mla.apps.train as T
logged = T.LossLog.on_log
def on_log(self, args, state, control, logs=None, **kw):
    logged(self, args, state, control, logs=logs, **kw)
    if state.global_step == 5:
        os.kill(os.getpid(), signal.SIGKILL)
T.LossLog.on_log = on_log
T.train({str(tiny_model)!r}, {str(tmp_path / 'killed')!r}, [{str(text_dir)!r}], 10, seq_len=32, batch_size=2,
        lr=1e-3, save_every=3)
"""
    proc = subprocess.run([sys.executable, "-c", script], env={**os.environ, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr[-2000:]
    killed = tmp_path / "killed"
    assert [p.name for p in (killed / "checkpoints").glob("checkpoint-*")] == ["checkpoint-3"]
    assert len(read_log(killed)) == 5

    small_run(tiny_model, killed, text_dir, 10, resume=True)
    straight, resumed = read_log(tmp_path / "straight"), read_log(killed)
    assert [r["step"] for r in resumed] == list(range(1, 11))
    for a, b in zip(straight, resumed):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-6) and (a["lr"], a["tokens"]) == (b["lr"], b["tokens"])


def test_two_process_ddp_on_cpu(tiny_model, text_dir, tmp_path):
    out = tmp_path / "ddp"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(REPO / "accelerate_configs" / "ddp.yaml"), "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "mha2mla.cli", "train", str(tiny_model),
           str(out), "--data", str(text_dir), "--steps", "4", "--seq-len", "32", "--batch-size", "2",
           "--save-every", "2", "--json"]
    proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(proc.stdout.strip().splitlines()) == 1  # only the first process prints
    log = read_log(out)
    assert [r["step"] for r in log] == [1, 2, 3, 4]
    assert [r["tokens"] for r in log] == [128, 256, 384, 512]  # 2 processes × 2 blocks × 32 tokens
    assert result["tokens"] == 512
    assert json.loads((out / "run.json").read_text())["settings"]["processes"] == 2


def error_of(args, capsys) -> str:
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and "Traceback" not in "\n".join(err)
    return err[-1]


def test_bad_input_is_one_error_line(tiny_model, text_dir, tmp_path, capsys, one_thread):
    base = ["train", str(tiny_model)]
    assert "not found" in error_of(base + [str(tmp_path / "a"), "--data", str(tmp_path / "nope"), "--steps", "2"],
                                   capsys)
    (tmp_path / "empty").mkdir()
    assert "no text files" in error_of(base + [str(tmp_path / "b"), "--data", str(tmp_path / "empty"),
                                               "--steps", "2"], capsys)
    write_text(tmp_path / "short" / "s.txt", docs=1)
    assert "too short" in error_of(base + [str(tmp_path / "c"), "--data", str(tmp_path / "short"), "--steps", "2",
                                           "--seq-len", "4096"], capsys)
    assert "--steps must be positive" in error_of(base + [str(tmp_path / "d"), "--data", str(text_dir),
                                                          "--steps", "0"], capsys)


def test_resume_refuses_another_model_and_a_non_empty_out(tiny_model, text_dir, tmp_path, capsys, one_thread):
    small_run(tiny_model, tmp_path / "run", text_dir, 2)
    other = save_tiny_model(tmp_path / "other", head_dim=16)
    args = ["--data", str(text_dir), "--steps", "2", "--seq-len", "32", "--batch-size", "2", "--lr", "1e-3"]
    assert "cannot resume" in error_of(["train", str(other), str(tmp_path / "run"), *args, "--resume"], capsys)
    assert "is not empty" in error_of(["train", str(tiny_model), str(tmp_path / "run"), *args], capsys)


def test_distilling_from_offline_targets_end_to_end(tiny_model, text_dir, tmp_path, cli, one_thread):
    """`distill-targets` writes the teacher's top-k over the run's blocks; `train --distill --distill-targets`
    reads them (no teacher loaded); other run settings, or --distill-targets without --distill, are one line."""
    run = ["--data", str(text_dir), "--steps", "2", "--seq-len", "32", "--batch-size", "2"]
    done = cli("distill-targets", tiny_model, tmp_path / "targets", *run, "--top-k", "8", "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1])["blocks"] == 4
    trained = cli("train", tiny_model, tmp_path / "run", *run, "--distill", "--distill-targets", tmp_path / "targets",
                  "--json")
    assert trained.returncode == 0, trained.stderr[-2000:]
    assert json.loads(trained.stdout.strip().splitlines()[-1])["teacher_bytes"] == 0
    assert all(r["kl"] > 0 for r in read_log(tmp_path / "run"))  # the top-8 KL of a student equal to its teacher
    other = cli("train", tiny_model, tmp_path / "other", *run[:-1], "4", "--distill", "--distill-targets",
                tmp_path / "targets")
    assert other.returncode == 2 and other.stderr.strip().splitlines()[-1].startswith("error: the targets")
    alone = cli("train", tiny_model, tmp_path / "alone", *run, "--distill-targets", tmp_path / "targets")
    assert alone.returncode == 2 and "add --distill" in alone.stderr
    assert not (tmp_path / "other").exists() or not (tmp_path / "other" / "model.safetensors").exists()
    bad = cli("distill-targets", tiny_model, tmp_path / "bad", *run, "--top-k", "0")
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith("error: --top-k")
    assert not (tmp_path / "bad").exists() and not (tmp_path / ".bad.partial").exists()
