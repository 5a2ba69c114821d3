"""lrdsl check SPEC --plot FILE: the picture's numbers (eigenvalues per head, decay horizons, the
replayed growth witness) and the files it writes. No kernels: fast."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

import lrdsl
from lrdsl import checkplot, cli

ROOT = Path(__file__).resolve().parent.parent
PNG = b"\x89PNG\r\n\x1a\n"


def load(name):
    return lrdsl.compile(ROOT / "examples" / f"{name}.lr", load_kernels=False)


def test_half_life_and_horizon():
    assert checkplot.half_life(0.5) == pytest.approx(1.0)
    assert checkplot.half_life(1.0) == math.inf and checkplot.half_life(0.0) == 0.0
    assert checkplot.half_life(-0.5) == pytest.approx(1.0)  # a sign flip halves it all the same
    assert checkplot.horizon((-0.5, 0.25)) == (0.0, pytest.approx(1.0))  # 0 is inside: a reset
    assert checkplot.horizon((0.25, 1.0)) == (pytest.approx(0.5), math.inf)


def test_retnet_is_drawn_per_head():
    rows = checkplot.per_head(load("retnet").ir)
    assert [r[0] for r in rows] == [f"h={h}" for h in range(checkplot.HEADS)]
    for h, (_, eig, proved, D) in enumerate(rows):
        gamma = 1 - 2.0 ** (-5 - h)
        assert proved and eig == pytest.approx((gamma, gamma)) and D == pytest.approx((gamma, gamma))
    assert checkplot.horizon(rows[0][3])[0] == pytest.approx(math.log(0.5) / math.log(1 - 1 / 32))  # 21.8
    assert [r[0] for r in checkplot.per_head(load("gated_deltanet").ir)] == ["every head"]


def test_growth_replays_the_witness():
    m = load("gdn2")
    w = m.check()["witnesses"]["bounded_state"]
    norms, pre = checkplot.growth(m.ir, w)
    assert norms[-1] / norms[pre] >= 1e4 > norms[len(norms) // 4] / norms[pre]  # grows, geometrically


@pytest.mark.parametrize("name", ["gdn2", "retnet", "linear_attention", "precond_deltanet"])
def test_check_plot_writes_a_png(tmp_path, capsys, name):
    pytest.importorskip("matplotlib")
    png = tmp_path / f"{name}.png"
    assert cli.main(["check", str(ROOT / "examples" / f"{name}.lr"), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == PNG
    assert f"plot: {png}" in capsys.readouterr().err


def test_check_plot_with_json_keeps_stdout_json(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    svg = tmp_path / "gla.svg"
    assert cli.main(["check", str(ROOT / "examples" / "gla.lr"), "--json", "--plot", str(svg)]) == 0
    assert json.loads(capsys.readouterr().out)["stable"] is True
    assert svg.read_text().lstrip().startswith("<?xml")


def test_check_plot_errors(tmp_path, capsys, monkeypatch):
    spec = str(ROOT / "examples" / "gla.lr")
    assert cli.main(["check", spec, "--plot", str(tmp_path / "missing" / "x.png")]) == 1
    err = capsys.readouterr().err
    assert "cannot write the plot" in err and "Traceback" not in err
    monkeypatch.setattr(checkplot, "available", lambda: False)
    assert cli.main(["check", spec, "--plot", str(tmp_path / "x.png")]) == 1
    err = capsys.readouterr().err
    assert "needs matplotlib" in err and "Traceback" not in err
