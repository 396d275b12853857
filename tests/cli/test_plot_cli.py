"""`mha2mla plot` through `main(argv)`: PNG and SVG written, bad input one error line."""

from __future__ import annotations

import json

import pytest

from mha2mla.cli import main
from mha2mla.errors import UserError
from mha2mla.apps.plot import loss_figure
from tiny import fake_run

VARIANTS = ("base", "d_kv=8", "d_kv=16", "d_kv=32")


@pytest.fixture
def runs(tmp_path):
    return [fake_run(tmp_path / f"{p}-{v}", p, v, start=3 + i) for p in ("GQA2MLA", "MHA2MLA")
            for i, v in enumerate(VARIANTS)]


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
