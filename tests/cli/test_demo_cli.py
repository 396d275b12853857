"""`mha2mla demo --fast` end to end (`main(argv)` in-process) on a tiny random GQA model with the tiny
tokenizer, and its resumability."""

from __future__ import annotations

import json

import pytest

import mha2mla.apps.demo
from mha2mla.cli import main
from tiny import write_text


@pytest.fixture(scope="module")
def demo_run(tiny_model, text_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    eval_text = write_text(out.parent / "eval" / "eval.txt", docs=20, seed=1)
    args = ["demo", "--out", str(out), "--model", str(tiny_model), "--data", str(text_dir), "--eval-data",
            str(eval_text), "--fast", "--steps", "2"]
    return out, args


def test_demo_writes_figure_report_and_sample(demo_run, capsys):
    out, args = demo_run
    assert main(args + ["--json"]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    report = json.loads((out / "report.json").read_text())
    assert printed == report
    runs = report["runs"]
    assert [(r["panel"], r["variant"]) for r in runs] == [
        (p, v) for p in ("MHA2MLA", "GQA2MLA") for v in ("base", "d_kv=8", "d_kv=16", "d_kv=32", "paper d_kv=16")]
    for r in runs:
        assert set(r) >= {"panel", "variant", "kv_bytes_per_token", "reduction_pct", "ppl_before", "ppl_after",
                          "final_loss", "run_dir"}
        assert r["ppl_before"] > 1 and r["ppl_after"] > 1 and r["final_loss"] > 0
        assert len((out / "runs").joinpath(r["run_dir"].split("/")[-1], "loss.jsonl").read_text().splitlines()) == 2
        assert (r["reduction_pct"] == 0) == (r["variant"] == "base")
    gqa16 = next(r for r in runs if (r["panel"], r["variant"]) == ("GQA2MLA", "d_kv=16"))
    # tiny model: 2 KV heads, head_dim 32, r = 2 pairs; fp32 → (2·16 + 2·2·2) · 4 bytes vs 2·2·32 · 4
    assert gqa16["kv_bytes_per_token"] == 160 and gqa16["reduction_pct"] == pytest.approx(100 * (1 - 40 / 128))
    assert (out / "figure.png").stat().st_size > 0 and (out / "figure.svg").exists()
    assert "| GQA2MLA | d_kv=16 |" in (out / "report.md").read_text()
    assert report["sample"]["variant"] == "d_kv=16" and isinstance(report["sample"]["text"], str)


def test_rerun_skips_finished_runs(demo_run, monkeypatch, capsys):
    out, args = demo_run
    if not (out / "report.json").exists():
        pytest.skip("needs the first demo run")

    def no_work(*a, **k):
        raise AssertionError("a finished run was redone")

    monkeypatch.setattr(mha2mla.apps.demo, "train", no_work)
    monkeypatch.setattr(mha2mla.apps.demo, "convert", no_work)
    monkeypatch.setattr(mha2mla.apps.demo, "perplexity", no_work)
    assert main(args) == 0
    assert "GQA2MLA" in capsys.readouterr().out


def test_bad_input(demo_run, capsys):
    _, args = demo_run
    assert main(args[:-2] + ["--steps", "0"]) == 2
    assert capsys.readouterr().err.startswith("error: ")
