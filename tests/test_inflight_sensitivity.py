"""bench/inflight_sensitivity.py: the issue-38 target points under both readings of the model's
open in-flight question (perf_model.Assumptions.stores_in_flight), from the committed static report.
Under the report's reading it must reproduce the report's times and targets (it raises otherwise),
and its committed result must be the one the current report gives."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

import inflight_sensitivity as sens  # noqa: E402


@pytest.fixture(scope="module")
def report():
    return json.loads((REPO / "bench" / "results" / "perf-model.json").read_text())


@pytest.fixture(scope="module")
def points(report):
    return sens.points(report, marlin=False)  # no nvcc build of SGLang's marlin in the suite


def test_the_report_reading_reproduces_the_reports_targets(report, points):
    targets = {(t["checkpoint"], t["table"], t["shard"], t["M"]): t for t in report["e4m3"]["targets"]}
    assert len(points) == len(targets) == 48
    for p in points:
        t, r = targets[(p["checkpoint"], p["table"], p["shard"], p["M"])], p["readings"]["stores count"]
        assert r["e4m3_over_w4a16"] == pytest.approx(t["e4m3_over_w4a16"], abs=2e-3), p
        for sec, ratio in t["e4m3_over_peers"].items():
            if isinstance(r["e4m3_over_peers"].get(sec), float):  # marlin: not built here
                assert r["e4m3_over_peers"][sec] == pytest.approx(ratio, abs=2e-3), (p, sec)
        if all(isinstance(v, float) for v in r["e4m3_over_peers"].values()):
            assert r["met"] == t["met"], p


def test_a_stale_report_is_an_error_not_a_figure(report):
    stale = json.loads(json.dumps(report))
    row = next(r for r in stale["e4m3"]["rows"] if r["shard"] == "tp16" and r["M"] == 16384)
    row["time_us"] *= 1.1
    with pytest.raises(RuntimeError, match=r"e4m3 .* tp16 M=16384: .* rerun bench/sass_report.py"):
        sens.points(stale, marlin=False)


def test_committed_result_is_current(points):
    committed = json.loads(sens.RESULT.read_text())
    key = lambda p: (p["checkpoint"], p["table"], p["shard"], p["M"])  # noqa: E731
    now = {key(p): p for p in points}
    assert len(committed["points"]) == len(now)
    for c in committed["points"]:
        for reading in sens.READINGS:
            a, b = c["readings"][reading], now[key(c)]["readings"][reading]
            assert (a["e4m3_us"], a["w4a16_us"]) == (b["e4m3_us"], b["w4a16_us"]), (key(c), reading)
