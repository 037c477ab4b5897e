"""bench/peers/nvcc_cache.build_all with a stand-in compiler (no nvcc here): at most
$K3NVFP4_NVCC_JOBS builds at a time (six CUTLASS builds at once were killed by the OOM killer on a
24 GiB machine), every cubin built, then reused from the cache; a killed build is named with the
hint; a bad setting of the variable is refused by name."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from peers import nvcc_cache  # noqa: E402

# Marks itself running, notes how many builds run now, sleeps, writes the cubin (or dies).
FAKE = r"""
import os, sys, time, signal
cu, cubin, state = sys.argv[1:4]
me = os.path.join(state, f"running-{os.getpid()}")
open(me, "w").close()
n = sum(1 for f in os.listdir(state) if f.startswith("running-"))
open(os.path.join(state, f"seen-{os.getpid()}"), "w").write(str(n))
time.sleep(0.4)
os.remove(me)
if "die" in open(cu).read():
    os.kill(os.getpid(), signal.SIGKILL)
open(cubin, "wb").write(b"cubin of " + open(cu, "rb").read())
"""


def _setup(tmp_path):
    fake = tmp_path / "fake_nvcc.py"
    fake.write_text(FAKE)
    state = tmp_path / "state"
    state.mkdir()

    def command(cu, cubin):
        return [sys.executable, str(fake), str(cu), str(cubin), str(state)]

    return state, command


def _max_seen(state: Path) -> int:
    return max(int(f.read_text()) for f in state.glob("seen-*"))


def test_at_most_jobs_builds_at_a_time_then_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(nvcc_cache.NVCC_JOBS_ENV, "2")
    state, command = _setup(tmp_path)
    tus = {f"tu{i}": f"source {i}" for i in range(5)}
    out = tmp_path / "out"
    builds = nvcc_cache.build_all(tus, out, {"v": 1}, command)
    assert {n: b.cubin for n, b in builds.items()} == {n: f"cubin of source {n[2:]}".encode() for n in tus}
    assert not any(b.cached for b in builds.values())
    assert len(list(state.glob("seen-*"))) == 5 and _max_seen(state) == 2
    again = nvcc_cache.build_all(tus, out, {"v": 1}, command)
    assert all(b.cached and b.seconds == 0.0 for b in again.values())
    assert len(list(state.glob("seen-*"))) == 5  # nothing compiled the second time
    assert again["tu3"].command == command(out / "tu3.cu", out / "tu3.cubin")
    rebuilt = nvcc_cache.build_all(tus, out, {"v": 2}, command)  # another key: all rebuilt
    assert not any(b.cached for b in rebuilt.values())


def test_a_killed_build_is_named_with_the_hint(tmp_path, monkeypatch):
    monkeypatch.setenv(nvcc_cache.NVCC_JOBS_ENV, "1")
    state, command = _setup(tmp_path)
    tus = {"good": "fine", "bad": "die here"}
    builds = nvcc_cache.build_all(tus, tmp_path / "out", {}, command, raise_on_error=False)
    assert builds["good"].cubin == b"cubin of fine"
    assert isinstance(builds["bad"], str) and "nvcc failed (-9)" in builds["bad"], builds["bad"]
    assert f"{nvcc_cache.NVCC_JOBS_ENV}=1" in builds["bad"] and "bad.cu" in builds["bad"]
    assert _max_seen(state) == 1
    with pytest.raises(RuntimeError, match="out of memory"):
        nvcc_cache.build_all({"bad": "die again"}, tmp_path / "out", {}, command)


def test_a_bad_jobs_setting_is_refused_by_name(monkeypatch):
    for raw in ("0", "two", "-1"):
        monkeypatch.setenv(nvcc_cache.NVCC_JOBS_ENV, raw)
        with pytest.raises(RuntimeError, match=r"\$K3NVFP4_NVCC_JOBS"):
            nvcc_cache.nvcc_jobs()
    monkeypatch.delenv(nvcc_cache.NVCC_JOBS_ENV)
    assert nvcc_cache.nvcc_jobs() >= 1
