"""Progress of long runs in a log (issue 29, item 3): plain status lines at a fixed interval,
no carriage returns, no escape codes; the cast and the tuner use them whenever stderr is not a
terminal or --no-progress is given."""

from __future__ import annotations

import io
import re
import threading
import time

import pytest

from k3nvfp4.checkpoint import convert
from k3nvfp4.checkpoint.cli import main as cast_main
from k3nvfp4.checkpoint.synthetic import write_synthetic_checkpoint
from k3nvfp4.common.progress import INTERVAL_ENV, LogProgress, format_rate, interval_from_env, progress_bar

ESCAPES = re.compile(r"[\r\x1b]")


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_status_line_reads_done_total_rate_and_eta():
    clock, out = _Clock(), io.StringIO()
    p = LogProgress(4e9, "cast", unit="B", unit_scale=True, interval_s=0, stream=out, clock=clock)
    p.update(1e9)
    clock.t += 2.0  # 1 GB in 2 s: 0.5 GB/s, 3 GB left -> 6 s
    assert p.line() == "cast: 1.00GB of 4.00GB (25%), 500MB/s, elapsed 00:02, ETA 00:06"
    p.set_postfix_str("M=64")
    p.update(3e9)
    clock.t += 2.0
    assert p.line() == "cast: 4.00GB of 4.00GB (100%), 1.00GB/s, elapsed 00:04 | M=64"
    p.close()
    p.close()  # idempotent: one final line
    assert out.getvalue() == "cast: 4.00GB of 4.00GB (100%), 1.00GB/s, elapsed 00:04 | M=64 (done)\n"


def test_counts_without_unit_scale_and_unknown_total():
    clock, out = _Clock(), io.StringIO()
    p = LogProgress(None, "tuning", unit="batch sizes", interval_s=0, stream=out, clock=clock)
    p.update(3)
    clock.t += 3.0
    assert p.line() == "tuning: 3 batch sizes, 1 batch sizes/s, elapsed 00:03"


@pytest.mark.parametrize("n, seconds, rate", [(8, 72.7, "0.11"), (2, 64.0, "0.0312"), (50, 4.0, "12.5"),
                                              (5000, 4.0, "1,250"), (0, 5.0, "0")])
def test_slow_rates_keep_three_significant_digits(n, seconds, rate):
    """Issue 40: 8 requests in 73 s read "0 req/s" (rates were rounded to whole units)."""
    clock = _Clock()
    p = LogProgress(max(n, 1), "requests", unit="req", interval_s=0, stream=io.StringIO(), clock=clock)
    p.update(n)
    clock.t += seconds
    assert p.line().startswith(f"requests: {n:,} of {max(n, 1):,} req ({100 * n // max(n, 1)}%), {rate} req/s, ")
    p.close()


@pytest.mark.parametrize("rate, unit, text", [(0.0444, "tok", "0.0444 tok/s"), (0.0222, "req", "0.0222 req/s"),
                                              (12.5, "tok", "12.5 tok/s"), (1250.4, "tok", "1,250 tok/s"),
                                              (0.0, "req", "0 req/s")])
def test_format_rate_three_significant_digits(rate, unit, text):
    """The helper the A/B's per-arm rates use (the bar's own rate goes through it too)."""
    assert format_rate(rate, unit) == text


def test_slow_byte_rate():
    clock = _Clock()
    p = LogProgress(1e6, "verify", unit="B", unit_scale=True, interval_s=0, stream=io.StringIO(), clock=clock)
    p.update(3)
    clock.t += 4.0
    assert p.line().startswith("verify: 3.00B of 1.00MB (0%), 0.75B/s, ")
    p.close()


def test_lines_come_at_the_interval_while_nothing_moves():
    """A stalled run keeps printing: the timer writes lines although update() is never called."""
    out = io.StringIO()
    p = LogProgress(10, "verify", interval_s=0.02, stream=out)
    deadline = time.monotonic() + 20
    while out.getvalue().count("\n") < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    p.close()
    lines = out.getvalue().splitlines()
    assert len(lines) >= 4, lines  # three periodic lines and the final one
    assert all(ln.startswith("verify: 0 of 10 it (0%)") for ln in lines), lines
    # Closed short of its total (a failed or interrupted run): the last line says stopped, not done.
    assert re.search(r"\(0%\), 0 it/s, elapsed \d\d:\d\d \(stopped\)$", lines[-1]), lines[-1]
    assert not any(ln.endswith(")") for ln in lines[:-1]), lines


def test_interval_from_the_environment(monkeypatch, capsys):
    monkeypatch.setenv(INTERVAL_ENV, "2.5")
    assert interval_from_env() == 2.5
    monkeypatch.setenv(INTERVAL_ENV, "soon")
    assert interval_from_env() == 30.0
    assert f"${INTERVAL_ENV}='soon' is not a number of seconds >= 0; using 30" in capsys.readouterr().err
    monkeypatch.delenv(INTERVAL_ENV)
    assert interval_from_env() == 30.0


def test_a_bar_only_on_a_terminal():
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    from tqdm import tqdm

    bar = progress_bar(10, "x", stream=Tty())
    assert isinstance(bar, tqdm)
    bar.close()
    for stream, bars in ((Tty(), False), (io.StringIO(), True)):
        p = progress_bar(10, "x", bars=bars, stream=stream, interval_s=0)
        assert isinstance(p, LogProgress)
        p.close()


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("src") / "k3", num_layers=3, num_experts=4,
                                      hidden_size=64, intermediate_size=32, num_shards=3, seed=5)


@pytest.mark.parametrize("flag", [[], ["--no-progress"]])
def test_a_long_cast_logs_periodic_lines(source, tmp_path, monkeypatch, capsys, flag):
    """Stderr captured (not a terminal), shards made slow: the cast and verify write status lines
    every interval, each plain, the last of each at 100%."""
    monkeypatch.setenv(INTERVAL_ENV, "0.05")
    slow_cast, slow_verify = convert.cast_shard, convert.verify_full

    def slowly(fn):
        def run(task):
            time.sleep(0.3)
            return fn(task)
        return run

    monkeypatch.setattr(convert, "cast_shard", slowly(slow_cast))
    monkeypatch.setattr(convert, "verify_full", slowly(slow_verify))
    out = tmp_path / "out"
    assert cast_main(["--source-ckpt", str(source), "--output-ckpt", str(out), "--workers", "1", *flag]) == 0
    err = capsys.readouterr().err
    assert not ESCAPES.search(err), repr(err[-500:])
    cast_lines = [ln for ln in err.splitlines() if ln.startswith("cast: ")]
    assert len(cast_lines) >= 5, err  # 3 shards x 0.3 s at 0.05 s: well over five
    assert re.fullmatch(r"cast: \S+B of \S+B \(\d+%\), \S+B/s, elapsed \d\d:\d\d(, ETA \d\d:\d\d)?", cast_lines[0])
    assert cast_lines[-1].endswith("(done)") and "(100%)" in cast_lines[-1]
    # A re-run with --verify on the finished cast verifies every shard again: the verify lines.
    assert cast_main(["--source-ckpt", str(source), "--output-ckpt", str(out), "--workers", "1", "--verify", *flag]) == 0
    err = capsys.readouterr().err
    verify_lines = [ln for ln in err.splitlines() if ln.startswith("verify: ")]
    assert len(verify_lines) >= 3 and verify_lines[-1].endswith("(done)") and "(100%)" in verify_lines[-1], err
    assert not ESCAPES.search(err)


def test_resumed_verify_ends_at_its_total(source, tmp_path, monkeypatch, capsys):
    """Issue 40: a resumed --verify printed '259MB of 258MB (100%)': the bar's total was the shards'
    file sizes while the workers report the tensors they verify (a group anchored in a shard may
    have members in another). Cast interrupted after the first shard, then resumed with --verify:
    every verify line's done amount equals its total (within the bar's three digits)."""
    monkeypatch.setenv(INTERVAL_ENV, "0")
    real, calls = convert.cast_shard, []

    def stop_after_one(task):
        calls.append(task.shard.name)
        if len(calls) > 1:
            raise KeyboardInterrupt
        return real(task)

    monkeypatch.setattr(convert, "cast_shard", stop_after_one)
    out = tmp_path / "out"
    assert cast_main(["--source-ckpt", str(source), "--output-ckpt", str(out), "--workers", "1", "--no-progress"]) == 130
    monkeypatch.setattr(convert, "cast_shard", real)
    capsys.readouterr()
    # The byte counts of the verify passes, by the same rule as the workers' reports.
    from k3nvfp4.checkpoint.verify import progress_bytes

    totals = []
    real_run = convert._Executor.run

    def run(self, fn, tasks, total, desc, on_result):
        if desc == "verify":
            totals.append(total)
        return real_run(self, fn, tasks, total, desc, on_result)

    monkeypatch.setattr(convert._Executor, "run", run)
    assert cast_main(["--source-ckpt", str(source), "--output-ckpt", str(out), "--workers", "1", "--verify",
                      "--no-progress"]) == 0
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("verify: ")]
    assert lines and len(lines) == len(totals) == 2, lines  # the cross-shard groups of the new shards, the old shard whole
    for ln in lines:
        done, total = re.match(r"verify: (\S+) of (\S+) \(100%\)", ln).groups()
        assert done == total, ln
    assert totals[1] == sum(progress_bytes(t) for t in [convert._shard_task(convert.plan_cast(source), _opts(source, out),
                                                                              sp) for sp in convert.plan_cast(source).shards[:1]])


def _opts(source, out):
    return convert.CastOptions(source=source, output=out, verify=True, workers=1, strict=False, w4a4=False,
                               overwrite=False, trim_a_log=False, progress=False)


@pytest.mark.parametrize("kind", ["full", "nonlocal"])
def test_verify_bar_totals_are_what_the_workers_report(source, tmp_path, kind):
    """The invariant behind a verify bar that ends at its total: progress_bytes(task) is exactly
    the sum of the byte reports verify_full / verify_nonlocal send for that shard (a shard's file
    size is not: the header is not reported, and a group anchored in one shard reports its
    members in others)."""
    from k3nvfp4.checkpoint import _progress
    from k3nvfp4.checkpoint.verify import progress_bytes, verify_full, verify_nonlocal

    out = tmp_path / "out"
    assert cast_main(["--source-ckpt", str(source), "--output-ckpt", str(out), "--workers", "1", "--no-progress"]) == 0
    plan = convert.plan_cast(source)
    fn, kw = (verify_full, {}) if kind == "full" else (verify_nonlocal, {"groups": "nonlocal", "check_shard": False})
    for sp in plan.shards:
        task = convert._shard_task(plan, _opts(source, out), sp)
        got: list[int] = []
        saved = _progress.set_sink(got.append)
        try:
            fn(task)
        finally:
            _progress.set_sink(saved)
        reported = sum(got)
        assert reported == progress_bytes(task, **kw), sp.name
        assert kind == "nonlocal" or reported != sp.source_bytes  # the file size was the wrong total
