"""k3nvfp4-cast's worker pool under failure (``--workers 2``: the main process and one spawned
worker): a bad shard in the spawned worker, a worker killed mid-shard, Ctrl-C and SIGKILL of the
whole process group in the middle of a cast, each followed by a resume.

The CLI runs as a subprocess in its own process group through tests/cast_pool_harness.py, which
steers which process gets which shard and holds chosen shards half-written; every step waits on
the harness's marker files, never on a clock. Each resumed output is compared byte for byte with
an uninterrupted cast, and the source is hashed before and after every run.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from k3nvfp4.checkpoint.cli import main
from k3nvfp4.checkpoint.synthetic import write_synthetic_checkpoint

HARNESS = Path(__file__).with_name("cast_pool_harness.py")
# Four shards, the last three with routed experts, so both processes get expert work.
SHAPE = dict(num_layers=3, num_experts=2, hidden_size=64, intermediate_size=32, num_shards=4, model_hidden_size=64)
FINAL_FILES = ("config.json", "model.safetensors.index.json", "hf_quant_config.json", "cast_report.json")
HANG_GUARD_S = 300  # only ends a hung run; no assertion depends on time


def _tree_hash(d: Path, skip: tuple[str, ...] = ()) -> dict[str, str]:
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(d.rglob("*")) if p.is_file() and p.name not in skip}


def _shards(ckpt: Path) -> list[str]:
    return sorted(set(json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"].values()))


def _partials(out: Path) -> list[str]:
    return sorted(p.name for p in out.rglob("*.partial"))


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("pool") / "src", **SHAPE)


@pytest.fixture(scope="module")
def reference(pristine, tmp_path_factory) -> dict[str, str]:
    """Hashes of an uninterrupted cast (the report, which holds times and paths, left out)."""
    out = tmp_path_factory.mktemp("ref") / "out"
    assert main(["--source-ckpt", str(pristine), "--output-ckpt", str(out), "--workers", "1", "--no-progress"]) == 0
    return _tree_hash(out, skip=("cast_report.json",))


@pytest.fixture
def src(pristine, tmp_path) -> Path:
    d = tmp_path / "src"
    shutil.copytree(pristine, d)
    return d


# The status lines of the cast and verify passes (common/progress.py), written without a terminal.
PROGRESS_LINE = re.compile(r"^(cast|verify): .*\n", re.M)


class HarnessRun:
    """One ``k3nvfp4-cast --workers 2`` subprocess (own process group) steered by ``plan``."""

    def __init__(self, tmp_path: Path, src: Path, out: Path, plan: dict):
        self.ctl = tmp_path / f"ctl-{len(list(tmp_path.glob('ctl-*')))}"
        self.ctl.mkdir()
        (self.ctl / "plan.json").write_text(json.dumps(plan))
        self.args = ["--source-ckpt", str(src), "--output-ckpt", str(out), "--workers", "2", "--no-progress"]
        self._err = open(self.ctl / "stderr.txt", "w")
        self.proc = subprocess.Popen([sys.executable, "-P", str(HARNESS), str(self.ctl), "--", *self.args],
                                     stdout=subprocess.DEVNULL, stderr=self._err, start_new_session=True)

    def markers(self, prefix: str) -> dict[str, tuple[str, int]]:
        """{shard: (role, pid)} of the ``<prefix>-<shard>`` markers so far."""
        out = {}
        for m in self.ctl.glob(f"{prefix}-*"):
            role, pid = m.read_text().split()
            out[m.name[len(prefix) + 1:]] = (role, int(pid))
        return out

    def wait_for_holds(self, n: int) -> dict[str, tuple[str, int]]:
        deadline = time.monotonic() + HANG_GUARD_S
        while len(held := self.markers("held")) < n:
            if self.proc.poll() is not None:
                pytest.fail(f"the cast ended (rc {self.proc.returncode}) before {n} shards were held:\n{self.stderr()}")
            if time.monotonic() > deadline:
                self.kill()
                pytest.fail(f"no {n} held shards: {held}\n{self.stderr()}")
            time.sleep(0.02)
        return held

    def finish(self) -> tuple[int, str]:
        """(exit status, stderr without the progress lines: the messages the tests check)."""
        try:
            rc = self.proc.wait(timeout=HANG_GUARD_S)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"the cast hung:\n{self.stderr()}")
        return rc, PROGRESS_LINE.sub("", self.stderr())

    def stderr(self) -> str:
        self._err.flush()
        return (self.ctl / "stderr.txt").read_text()

    def signal_group(self, sig: int) -> None:
        os.killpg(self.proc.pid, sig)  # as a terminal's Ctrl-C (SIGINT) or a job killer does

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


def _resume_in_process(src: Path, out: Path, capsys) -> tuple[int, str]:
    capsys.readouterr()
    rc = main(["--source-ckpt", str(src), "--output-ckpt", str(out), "--workers", "2", "--no-progress"])
    return rc, capsys.readouterr().err


def _assert_unfinished_and_clean(out: Path, reference: dict[str, str]) -> None:
    """A stopped cast: no final config/index/report, no temporary file, and every shard under
    its final name complete and equal to the uninterrupted cast's."""
    for f in FINAL_FILES:
        assert not (out / f).exists(), f
    assert _partials(out) == []
    for f in out.glob("*.safetensors"):
        assert hashlib.sha256(f.read_bytes()).hexdigest() == reference[f.name], f.name


def test_bad_shard_in_the_spawned_worker(src, tmp_path, reference):
    """A NaN E8M0 scale byte in the second shard, which only the spawned worker casts: the
    worker's CheckpointError reaches the parent as a one-line error naming the file and tensor."""
    shards = _shards(src)
    wm = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    # A w2 matrix (its own group) with both tensors in the second shard: no other shard reads it.
    base = next(n[: -len(".weight_scale")] for n, s in sorted(wm.items())
                if s == shards[1] and n.endswith(".w2.weight_scale") and wm[n.replace("weight_scale", "weight_packed")] == s)
    path = src / shards[1]
    tensors = load_file(str(path))
    tensors[f"{base}.weight_scale"][0, 0] = 255
    save_file(tensors, str(path), metadata={"format": "pt"})
    before = _tree_hash(src)
    out = tmp_path / "out"
    run = HarnessRun(tmp_path, src, out, {"main_waits_for_pool": True})
    rc, err = run.finish()
    assert run.markers("started")[shards[1]][0] == "pool"  # the bad shard was the spawned worker's
    assert rc == 1, err
    assert err.startswith("k3nvfp4-cast: error: ") and "Traceback" not in err, err
    assert str(path) in err and base in err and "255" in err and "NaN" in err, err
    assert _tree_hash(src) == before
    assert not (out / shards[1]).exists()
    _assert_unfinished_and_clean(out, reference)


def _assert_lost_worker_named_then_resume(finished: tuple[int, str], names: str, src: Path, out: Path,
                                          before: dict[str, str], reference: dict[str, str], capsys) -> None:
    """A cast whose pool worker died: exit 1 with a one-line error starting with ``names`` (the
    shard and its worker), nothing left half-written; then the same command resumes it to the
    uninterrupted cast's bytes, the source untouched."""
    rc, err = finished
    assert rc == 1, err
    assert names in err and "ended without a result" in err, err
    assert "Traceback" not in err, err
    _assert_unfinished_and_clean(out, reference)
    rc, err = _resume_in_process(src, out, capsys)
    assert rc == 0, err
    assert _tree_hash(out, skip=("cast_report.json",)) == reference
    assert _tree_hash(src) == before


def test_worker_killed_mid_shard_is_an_error_then_resumes(src, tmp_path, reference, capsys):
    """The spawned worker dies (SIGKILL, as the OOM killer does) half-way through writing a shard:
    the run stops with an error naming the shard instead of waiting forever for its result,
    removes the temporary file, and the same command then finishes the cast byte-identically."""
    shards = _shards(src)
    before = _tree_hash(src)
    out = tmp_path / "out"
    run = HarnessRun(tmp_path, src, out, {"main_waits_for_pool": True, "hold": [shards[1]]})
    role, pid = run.wait_for_holds(1)[shards[1]]
    assert role == "pool" and (out / f".{shards[1]}.partial").is_file()
    os.kill(pid, signal.SIGKILL)
    _assert_lost_worker_named_then_resume(run.finish(), f"{out / shards[1]}: the worker process (pid {pid})",
                                          src, out, before, reference, capsys)


def test_worker_killed_as_it_takes_a_shard_is_an_error(src, tmp_path, reference, capsys):
    """The spawned worker dies the moment it has its shard, before its process ran anything but
    the task's own thread: the task's start must already be known to the main process (a queue
    whose writes a background thread makes later loses it, and the cast waited forever)."""
    shards = _shards(src)
    before = _tree_hash(src)
    out = tmp_path / "out"
    run = HarnessRun(tmp_path, src, out, {"main_waits_for_pool": True, "die_at_start": [shards[1]]})
    finished = run.finish()
    assert (run.ctl / "died").read_bytes().rstrip(b"\0") == shards[1].encode()  # it did die there
    _assert_lost_worker_named_then_resume(finished, f"{out / shards[1]}: the worker process (pid ",
                                          src, out, before, reference, capsys)


def _interrupted_mid_cast(tmp_path: Path, src: Path, out: Path, sig: int) -> tuple[int, str]:
    """Start a cast whose shards after the first are held half-written, wait until the main
    process and the spawned worker each hold one (the first shard is finished by then), and
    send ``sig`` to the whole process group."""
    shards = _shards(src)
    run = HarnessRun(tmp_path, src, out, {"hold": shards[1:]})
    held = run.wait_for_holds(2)
    assert sorted(role for role, _ in held.values()) == ["main", "pool"]
    assert (out / shards[0]).is_file()  # finished and renamed before the main process took another
    assert _partials(out) == sorted(f".{s}.partial" for s in held)  # both mid-write
    run.signal_group(sig)
    return run.finish()


def test_ctrl_c_mid_cast_then_resume_is_byte_identical(src, tmp_path, reference, capsys):
    before = _tree_hash(src)
    out = tmp_path / "out"
    rc, err = _interrupted_mid_cast(tmp_path, src, out, signal.SIGINT)
    assert rc == 130, err
    # One line from the main process; the workers ignore SIGINT (no KeyboardInterrupt tracebacks).
    assert err.strip() == "k3nvfp4-cast: interrupted; run the same command again to resume", err
    _assert_unfinished_and_clean(out, reference)
    first = _shards(src)[0]
    assert (out / first).is_file() and (out / ".k3nvfp4-cast" / f"{first}.json").is_file()
    # The unfinished cast, resumed with other options: refused, naming the option; nothing touched.
    stopped = _tree_hash(out)
    capsys.readouterr()
    assert main(["--source-ckpt", str(src), "--output-ckpt", str(out), "--workers", "2", "--no-progress", "--w4a4"]) == 1
    err = capsys.readouterr().err
    assert f"--output-ckpt {out}: an unfinished cast of other inputs (option --w4a4 was off, now on)" in err, err
    assert "--overwrite" in err
    assert _tree_hash(out) == stopped
    # The same command: the finished shard is kept, the rest cast, the result byte-identical.
    rc, err = _resume_in_process(src, out, capsys)
    assert rc == 0, err
    report = json.loads((out / "cast_report.json").read_text())
    assert report["shards"] == {"total": 4, "cast_now": 3, "resumed": 1}
    assert _tree_hash(out, skip=("cast_report.json",)) == reference
    assert _tree_hash(src) == before


def test_sigkill_of_the_process_group_then_resume_cleans_up(src, tmp_path, reference, capsys):
    before = _tree_hash(src)
    out = tmp_path / "out"
    rc, _ = _interrupted_mid_cast(tmp_path, src, out, signal.SIGKILL)
    assert rc == -signal.SIGKILL
    leftovers = _partials(out)
    assert len(leftovers) == 2  # nothing could clean up: both half-written temporaries remain
    for f in FINAL_FILES:
        assert not (out / f).exists(), f
    rc, err = _resume_in_process(src, out, capsys)
    assert rc == 0, err
    assert _partials(out) == []
    report = json.loads((out / "cast_report.json").read_text())
    assert report["shards"] == {"total": 4, "cast_now": 3, "resumed": 1}
    assert _tree_hash(out, skip=("cast_report.json",)) == reference
    assert _tree_hash(src) == before
