"""`mha2mla plot`: two panels (MHA2MLA, GQA2MLA), four labelled lines each, PNG and SVG (the CLI:
tests/cli/test_plot_cli.py)."""

from __future__ import annotations

import pytest
from matplotlib.colors import to_hex

from mha2mla.apps.plot import ema, loss_figure
from tiny import fake_run

VARIANTS = ("base", "d_kv=8", "d_kv=16", "d_kv=32")


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
