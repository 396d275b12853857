"""`mha2mla plot`: two panels (MHA2MLA, GQA2MLA), four labelled lines each, PNG and SVG."""

from __future__ import annotations

import json

import pytest
from matplotlib.colors import to_hex

from mha2mla.cli import main
from mha2mla.errors import UserError
from mha2mla.plot import ema, loss_figure

VARIANTS = ("base", "d_kv=8", "d_kv=16", "d_kv=32")


def fake_run(folder, panel, variant, steps=10, start=3.0):
    folder.mkdir(parents=True)
    (folder / "run.json").write_text(json.dumps({"panel": panel, "variant": variant, "finished": True}))
    (folder / "loss.jsonl").write_text("".join(json.dumps({"step": s, "loss": start - 0.1 * s}) + "\n"
                                               for s in range(1, steps + 1)))
    return folder


@pytest.fixture
def runs(tmp_path):
    return [fake_run(tmp_path / f"{p}-{v}", p, v, start=3 + i) for p in ("GQA2MLA", "MHA2MLA")
            for i, v in enumerate(VARIANTS)]


def test_two_panels_four_labelled_lines(runs, tmp_path):
    fig = loss_figure(runs, tmp_path / "fig" / "loss.png")
    axes = fig.get_axes()
    assert [ax.get_title() for ax in axes] == ["MHA2MLA", "GQA2MLA"]
    for ax in axes:
        assert (ax.get_xlabel(), ax.get_ylabel()) == ("#Step", "Loss")
        lines = {line.get_label(): line for line in ax.get_lines()}
        assert set(lines) == set(VARIANTS)
        assert {v: to_hex(line.get_color()) for v, line in lines.items()} == {
            "d_kv=8": "#f08cc0", "d_kv=16": "#9b5fc0", "d_kv=32": "#4b1c6e", "base": "#000000"}  # pink → dark purple, black
        assert list(lines["d_kv=8"].get_xdata()) == list(range(1, 11))
        assert [t.get_text() for t in ax.get_legend().get_texts()] == ["d_kv=8", "d_kv=16", "d_kv=32", "base"]
    assert (tmp_path / "fig" / "loss.png").stat().st_size > 0 and (tmp_path / "fig" / "loss.svg").stat().st_size > 0


def test_smoothing_is_a_bias_corrected_ema(runs):
    assert ema([2.0, 2.0, 2.0], 0.9) == pytest.approx([2.0, 2.0, 2.0])
    assert ema([1.0, 3.0], 0.5) == pytest.approx([1.0, 1.75 / 0.75])  # (0.5·0.5 + 0.5·3) / (1 − 0.5²)
    assert ema([1.0, 5.0], 0.0) == [1.0, 5.0]
    smoothed = loss_figure(runs[:1], smooth=0.9).get_axes()[0].get_lines()[0].get_ydata()
    assert smoothed[0] == pytest.approx(3.0 - 0.1)


def test_cli_writes_png_and_svg(runs, tmp_path, capsys):
    assert main(["plot", *map(str, runs), "--out", str(tmp_path / "curves.svg"), "--smooth", "0.5", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out == {"png": str(tmp_path / "curves.png"), "svg": str(tmp_path / "curves.svg")}
    assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"


def test_bad_input(tmp_path, runs, capsys):
    (tmp_path / "not-a-run").mkdir()
    assert main(["plot", str(tmp_path / "not-a-run"), "--out", str(tmp_path / "x.png")]) == 2
    assert capsys.readouterr().err.startswith("error: ")
    with pytest.raises(UserError, match="smooth"):
        loss_figure(runs, smooth=1.0)
