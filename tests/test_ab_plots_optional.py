"""Plots are optional (issue 29, item 1): without matplotlib (the core install) both A/B commands
write complete reports, say in one line which plots were skipped and why, and exit 0; with
--no-plots they draw none; a plot that fails to draw never loses the report (written first)."""

from __future__ import annotations

import json
import sys

import pytest

from k3nvfp4.sglang_ext.ab import cli, plots
from ab_fake_server import PROMPTS, FakeServer, arm_responder

LAYER = ["layer", "--synthetic", "--experts", "4", "--hidden", "64", "--intermediate", "32", "--top-k", "2",
         "--tokens", "3", "--arms", "reference,triton_situ"]


@pytest.fixture
def no_matplotlib(monkeypatch):
    """``import matplotlib`` raises ImportError, as in an install without the [plot] extra."""
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert plots.unavailable() is not None


def test_layer_ab_without_matplotlib_writes_the_report(tmp_path, no_matplotlib, capsys):
    out = tmp_path / "ab"
    assert cli.main([*LAYER, "--out", str(out)]) == 0
    rep = json.loads((out / "report.json").read_text())
    assert (out / "summary.md").is_file() and rep["pairs"]
    assert sorted(p.name for p in out.iterdir()) == ["report.json", "summary.md"]
    line = rep["files"]["plots_skipped"]
    assert line.startswith("plots skipped (error_hist.png, per_expert_error.png): matplotlib is not installed")
    assert "kimi-k3-nvfp4[plot]" in line
    err = capsys.readouterr().err
    assert err.count("plots skipped") == 1


def test_layer_ab_no_plots_and_with_plots(tmp_path):
    pytest.importorskip("matplotlib")  # a test extra: always installed by make test
    assert cli.main([*LAYER, "--no-plots", "--out", str(tmp_path / "a")]) == 0
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["report.json", "summary.md"]
    assert cli.main([*LAYER, "--out", str(tmp_path / "b")]) == 0
    files = json.loads((tmp_path / "b" / "report.json").read_text())["files"]
    assert files["error_hist"] == "error_hist.png" and (tmp_path / "b" / "per_expert_error.png").is_file()
    assert "plots_skipped" not in files


def test_a_failing_plot_keeps_the_report(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")

    def broken(*args, **kwargs):
        raise RuntimeError("no display")

    monkeypatch.setattr(plots, "error_histogram", broken)
    assert cli.main([*LAYER, "--out", str(tmp_path / "c")]) == 0
    files = json.loads((tmp_path / "c" / "report.json").read_text())["files"]
    assert files["per_expert_error"] == "per_expert_error.png" and "error_hist" not in files
    assert files["plots_skipped"] == "plots skipped (error_hist.png): RuntimeError: no display"


def test_serve_ab_without_matplotlib_writes_the_report(tmp_path, no_matplotlib, capsys):
    pfile = tmp_path / "p.jsonl"
    pfile.write_text("\n".join(json.dumps(p) for p in PROMPTS) + "\n")
    out = tmp_path / "out"
    with FakeServer(arm_responder("marlin")) as sa, FakeServer(arm_responder("triton_situ")) as sb:
        rc = cli.main(["serve", "--arm", f"marlin={sa.url}", "--arm", f"triton_situ={sb.url}", "--prompts", str(pfile),
                       "--seeds", "2", "--retries", "0", "--no-progress", "--out", str(out)])
    assert rc == 0
    rep = json.loads((out / "report.json").read_text())
    assert rep["greedy"]["prompts"] == len(PROMPTS) and (out / "summary.md").is_file()
    assert sorted(p.name for p in out.iterdir()) == ["completions.jsonl", "report.json", "summary.md"]
    assert rep["files"]["plots_skipped"].startswith("plots skipped (divergence_hist.png, accuracy.png): matplotlib")
    assert capsys.readouterr().err.count("plots skipped") == 1
