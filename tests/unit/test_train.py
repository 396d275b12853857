"""`mha2mla train` through the Python API: the recipe, the loss log, resuming a finished run, a non-finite loss.

A tiny random Llama (GQA, 4 heads / 2 KV heads, head_dim 32, 2 layers; conftest's tiny_model) with the
tiny tokenizer trains on a small generated text; every test takes seconds. Exact resume after a kill,
DDP on CPU and the CLI's bad input: tests/cli/test_train_cli.py.
"""

from __future__ import annotations

import json
import math

import pytest

from tiny import read_log, small_run
from mha2mla.errors import UserError


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


def test_resuming_a_finished_run_returns_it(tiny_model, text_dir, tmp_path, one_thread):
    first = small_run(tiny_model, tmp_path / "run", text_dir, 2)
    assert small_run(tiny_model, tmp_path / "run", text_dir, 2, resume=True) == first


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
