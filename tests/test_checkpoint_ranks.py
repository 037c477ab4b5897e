"""The cast across nodes (issue 31): ranks from torchrun, srun or the command line, coordinated
through torch.distributed's gloo backend, each casting its byte-balanced share of the shards.

Real launches on one machine: ``python -m torch.distributed.run --standalone`` (torchrun), three
processes with SLURM's task variables (srun), and processes started with
--rank/--world-size/--dist-init. Every output is compared file by file (sha256) with a cast by
one process; the fast unit tests check the launcher parsing, the assignment and the start-up
comparison against hand-worked cases and a brute-force optimum.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from k3nvfp4.checkpoint.cli import main
from k3nvfp4.checkpoint.coordinator import HEARTBEAT_MAX_S, GlooCoordinator, RankFailure
from k3nvfp4.checkpoint.rank_checks import PlanTotals, coverage_problems, launch_differences
from k3nvfp4.checkpoint.records import LaunchInfo, VerifySummary
from k3nvfp4.checkpoint.ranks import LaunchError, RankSpec, assign_shards, first_host, rank_spec, slurm_master_host
from k3nvfp4.checkpoint.synthetic import write_synthetic_checkpoint

HARNESS = Path(__file__).with_name("cast_ranks_harness.py")
# Five shards of unequal size: three ranks get 1, 2 and 2 of them; one layer's experts span two shards.
SHAPE = dict(num_layers=4, num_experts=3, hidden_size=64, intermediate_size=64, num_shards=5, model_hidden_size=64)
REPORT = "cast_report.json"
FINAL_FILES = ("config.json", "model.safetensors.index.json", "hf_quant_config.json", REPORT)
HANG_GUARD_S = 300  # only ends a hung run
RANK_TIMEOUT_S = 20.0  # --rank-timeout of these launches (a loaded 2-core CI box must not look frozen)
# The documented bound: a rank that fails or vanishes stops the others within --rank-timeout plus
# one heartbeat plus their clean-up; the slack is for the clean-up on a loaded CI machine.
STOP_BOUND_S = RANK_TIMEOUT_S + HEARTBEAT_MAX_S + 30.0
LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS",
              "SLURM_NTASKS", "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST", "SLURM_JOB_ID")


def _tree_hash(d: Path, skip: tuple[str, ...] = (REPORT,)) -> dict[str, str]:
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(d.rglob("*")) if p.is_file() and p.name not in skip}


def _partials(out: Path) -> list[str]:
    return sorted(p.name for p in out.rglob("*.partial"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    return {**env, "K3NVFP4_PROGRESS_INTERVAL": "0", **extra}


def _cast_args(src: Path, out: Path, *more: str) -> list[str]:
    return ["--source-ckpt", str(src), "--output-ckpt", str(out), "--workers", "1", "--no-progress",
            "--rank-timeout", str(RANK_TIMEOUT_S), *more]


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("ranks") / "src", **SHAPE, zero_exponent_fraction=0.02,
                                      out_of_range_fraction=0.01, seed=3)


@pytest.fixture(scope="module")
def reference(source, tmp_path_factory) -> dict[str, str]:
    """sha256 of every file of a single-process cast (the report, with its times, left out)."""
    out = tmp_path_factory.mktemp("ref") / "out"
    assert main(["--source-ckpt", str(source), "--output-ckpt", str(out), "--workers", "1", "--no-progress"]) == 0
    return _tree_hash(out)


def _sizes(src: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in src.glob("*.safetensors")}


class Ranks:
    """``n`` rank processes started by hand (SLURM variables or --rank flags), each with its own
    stderr file; ``finish()`` returns their exit statuses and messages (progress lines dropped)."""

    def __init__(self, tmp: Path, n: int, argv_of, env_of, plan: dict | None = None):
        self.ctl = tmp / f"ctl-{len(list(tmp.glob('ctl-*')))}"
        self.ctl.mkdir()
        (self.ctl / "plan.json").write_text(json.dumps(plan or {}))
        self.errs = [open(self.ctl / f"rank{r}.txt", "w") for r in range(n)]
        self.procs: list[subprocess.Popen] = []
        for r in range(n):  # one process group, as the ranks of a launcher on a terminal
            group = {"process_group": 0} if r == 0 else {"process_group": self.procs[0].pid}
            self.procs.append(subprocess.Popen([sys.executable, "-P", str(HARNESS), str(self.ctl), "--", *argv_of(r)],
                                               env=env_of(r), stdout=subprocess.DEVNULL, stderr=self.errs[r], **group))

    def wait_for(self, marker: str) -> float:
        deadline = time.monotonic() + HANG_GUARD_S
        while not list(self.ctl.glob(f"{marker}-*")):
            if time.monotonic() > deadline or all(p.poll() is not None for p in self.procs):
                self.kill()
                pytest.fail(f"no {marker} marker:\n{self.stderr()}")
            time.sleep(0.02)
        return time.monotonic()

    def finish(self, ranks=None) -> tuple[list[int], list[str]]:
        ranks = range(len(self.procs)) if ranks is None else ranks
        for r in ranks:
            try:
                self.procs[r].wait(timeout=HANG_GUARD_S)
            except subprocess.TimeoutExpired:
                self.kill()
                pytest.fail(f"rank {r} hung:\n{self.stderr()}")
        return [self.procs[r].returncode for r in ranks], [self._err(r) for r in ranks]

    def _err(self, r: int) -> str:
        self.errs[r].flush()
        return re.sub(r"^(cast|verify) \(rank \d of \d\): .*\n", "", (self.ctl / f"rank{r}.txt").read_text(), flags=re.M)

    def stderr(self) -> str:
        return "\n".join(f"--- rank {r}\n{self._err(r)}" for r in range(len(self.procs)))

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _slurm_launch(tmp: Path, src: Path, out: Path, n: int, plan: dict | None = None) -> Ranks:
    """As ``srun -n N`` on one node: SLURM_PROCID / SLURM_STEP_NUM_TASKS and the step's node list;
    no MASTER_ADDR, so the rendezvous host comes from the node list."""
    port = str(_free_port())
    return Ranks(tmp, n, lambda r: _cast_args(src, out),
                 lambda r: _env(SLURM_PROCID=str(r), SLURM_STEP_NUM_TASKS=str(n), SLURM_NTASKS=str(n),
                                SLURM_STEP_NODELIST="localhost", SLURM_JOB_ID="4242", MASTER_PORT=port), plan)


def _flag_launch(tmp: Path, n: int, argv_of, plan: dict | None = None) -> Ranks:
    addr = f"127.0.0.1:{_free_port()}"
    return Ranks(tmp, n, lambda r: [*argv_of(r), "--rank", str(r), "--world-size", str(n), "--dist-init", addr],
                 lambda r: _env(), plan)


# -- launches --------------------------------------------------------------------------------

def test_torchrun_three_ranks_write_the_single_process_bytes(source, reference, tmp_path):
    """torchrun --standalone --nproc-per-node 3 with --verify: every file (shards, index, configs,
    copied files) has the sha256 of the single-process cast's; the report says who cast what, and
    the shards are those of the byte-balanced assignment."""
    out = tmp_path / "out"
    before = _tree_hash(source, skip=())
    run = subprocess.run([sys.executable, "-P", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
                          "-m", "k3nvfp4.checkpoint", *_cast_args(source, out, "--verify")],
                         env=_env(), capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert run.returncode == 0, run.stderr
    assert _tree_hash(out) == reference
    assert _tree_hash(source, skip=()) == before
    assert not (out / ".k3nvfp4-cast").exists() and _partials(out) == []
    report = json.loads((out / REPORT).read_text())
    want = assign_shards(_sizes(source), 3)
    assert [row["shards"] for row in report["ranks"]["per_rank"]] == want
    assert [row["rank"] for row in report["ranks"]["per_rank"]] == [0, 1, 2] and report["ranks"]["world_size"] == 3
    assert sorted(s for names in want for s in names) == sorted(_sizes(source))
    assert report["shards"] == {"total": 5, "cast_now": 5, "resumed": 0}
    assert report["verify"]["mismatches"] == 0 and report["verify"]["blocks"] == report["stats"]["blocks"]
    # Each rank names itself in its progress and start-up lines; rank 0 alone prints the summary.
    for r in range(3):
        assert f"cast (rank {r} of 3): " in run.stderr and f"k3nvfp4-cast: rank {r} of 3: joined (torchrun" in run.stderr
    assert run.stdout.count("Cast fidelity") == 1 and "rank 1 of 3: cast 2 of its 2 shard(s)" in run.stdout
    # The same launch on the finished output: every rank learns it from rank 0 and verifies its shards again.
    again = subprocess.run([sys.executable, "-P", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
                            "-m", "k3nvfp4.checkpoint", *_cast_args(source, out, "--verify")],
                           env=_env(), capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert again.returncode == 0, again.stderr
    for r in (1, 2):
        assert f"rank {r} of 3: already a finished cast, verified again" in again.stdout, again.stdout
    assert again.stdout.count("PASSED") == 1 and _tree_hash(out) == reference  # nothing cast again


def test_killed_rank_stops_every_rank_then_the_same_launch_resumes(source, reference, tmp_path):
    """srun-style ranks; rank 1 is SIGKILLed half-way through its second shard. The other ranks
    exit 1 within the stated bound naming rank 1; no file under a final name is incomplete;
    the same launch again skips the finished shards and ends byte-identical."""
    out = tmp_path / "out"
    run = _slurm_launch(tmp_path, source, out, 3, {"kill": {"rank": 1, "shard": 2}})
    killed_at = run.wait_for("killed")
    (rc1,), _ = run.finish([1])
    rcs, errs = run.finish([0, 2])
    stopped_after = time.monotonic() - killed_at
    assert rc1 == -9
    assert rcs == [1, 1], run.stderr()
    assert stopped_after < STOP_BOUND_S, f"the other ranks stopped {stopped_after:.1f} s after the kill"
    for r, err in zip((0, 2), errs):
        assert f"k3nvfp4-cast: error: rank {r} of 3: rank 1 (" in err and ") vanished: " in err, err
        assert "Traceback" not in err, err
    for f in FINAL_FILES:
        assert not (out / f).exists(), f
    held = assign_shards(_sizes(source), 3)[1][1]  # rank 1's second shard
    assert _partials(out) == [f".{held}.partial"]  # only the killed rank's, which nothing could remove
    for f in out.glob("*.safetensors"):
        assert hashlib.sha256(f.read_bytes()).hexdigest() == reference[f.name], f.name
    assert not (out / held).exists()

    again = _slurm_launch(tmp_path, source, out, 3)
    rcs, errs = again.finish()
    assert rcs == [0, 0, 0], again.stderr()
    assert _tree_hash(out) == reference and _partials(out) == []
    report = json.loads((out / REPORT).read_text())
    assert report["shards"]["total"] == 5 and report["shards"]["resumed"] >= 1 and report["shards"]["cast_now"] >= 1
    assert report["ranks"]["per_rank"][1]["cast_now"] >= 1  # the killed rank's shard was cast again
    assert "joined (slurm, rendezvous localhost:" in errs[0]


def test_ctrl_c_stops_every_rank_with_one_line_each(source, reference, tmp_path):
    """Ctrl-C (SIGINT to the ranks' process group) while rank 1 is half-way through a shard: every
    rank prints one line and exits 130; no temporary file remains; finished shards are complete."""
    out = tmp_path / "out"
    run = _flag_launch(tmp_path, 2, lambda r: _cast_args(source, out), {"hold": {"rank": 1, "shard": 1}})
    run.wait_for("held")
    os.killpg(run.procs[0].pid, signal.SIGINT)
    rcs, errs = run.finish()
    assert rcs == [130, 130], run.stderr()
    for r, err in enumerate(errs):
        lines = [x for x in err.splitlines() if "joined (" not in x and " casts " not in x]
        assert lines == [f"k3nvfp4-cast: rank {r} of 2: interrupted; run the same launch again to resume"], err
    assert _partials(out) == []
    for f in FINAL_FILES:
        assert not (out / f).exists(), f
    for f in out.glob("*.safetensors"):
        assert hashlib.sha256(f.read_bytes()).hexdigest() == reference[f.name], f.name


def _unstarted_coordinator() -> GlooCoordinator:
    """Rank 0 of 2, never started (no torch.distributed): its main-thread side only."""
    return GlooCoordinator(RankSpec(0, 2, "command line", "tcp://127.0.0.1:1", "127.0.0.1:1"))


def test_failure_signal_is_raised_once_and_never_inside_the_coordinator_or_a_ctrl_c():
    """The SIGUSR1 handler raises another rank's failure in the main thread once, and not while
    that thread is inside exchange() / fail() (a raise there can land inside a lock's release: a
    Ctrl-C run ended "release unlocked lock", exit 1) or handling a KeyboardInterrupt (it stops
    with its own status, 130)."""
    coord = _unstarted_coordinator()
    coord._on_signal(signal.SIGUSR1, None)  # no failure yet: nothing
    failure = RankFailure("rank 1 (vm) failed: interrupted (Ctrl-C)")
    coord._failure = failure
    coord._main_inside = 1
    coord._on_signal(signal.SIGUSR1, None)  # inside exchange() / fail(): they raise it themselves
    coord._main_inside = 0
    try:
        raise KeyboardInterrupt
    except KeyboardInterrupt:
        coord._on_signal(signal.SIGUSR1, None)  # stopping on Ctrl-C already
    with pytest.raises(RankFailure) as exc:
        coord._on_signal(signal.SIGUSR1, None)
    assert exc.value is failure
    coord._on_signal(signal.SIGUSR1, None)  # given once


def test_a_failure_during_an_exchange_is_raised_by_the_exchange_with_the_lock_free():
    """Another rank fails while the main thread waits in exchange(): the heartbeat's _abort
    signals the main thread, and the exchange (not the signal handler) raises the failure; the
    coordinator's lock is free afterwards and the handler stays quiet."""
    import threading

    coord = _unstarted_coordinator()
    saved = signal.signal(signal.SIGUSR1, coord._on_signal)
    failure = RankFailure("rank 1 (vm) failed: boom")
    try:
        timer = threading.Timer(0.2, coord._abort, args=(failure,))
        timer.start()
        with pytest.raises(RankFailure) as exc:
            coord.exchange("cast", {"x": 1})
        timer.join()
        assert exc.value is failure and coord._main_inside == 0
        assert coord._lock.acquire(blocking=False)
        coord._lock.release()
    finally:
        signal.signal(signal.SIGUSR1, saved)


def test_a_peer_whose_connection_closed_before_the_round_is_named(monkeypatch):
    """A round after a rank was killed: gloo's isend to it raises as it is posted ("Connection
    closed by peer", seen in CI) rather than in the wait. The survivor still names that rank as
    vanished, not "the heartbeat between ranks failed"."""
    import torch.distributed as dist

    class Done:
        def wait(self, timeout=None):
            return True

    def isend(tensor, dst, group=None):
        if dst == 1:
            raise RuntimeError("[/x/gloo/transport/tcp/pair.cc:561] Connection closed by peer "
                               "[127.0.0.1]:48845. This is typically caused by a remote worker crashing.")
        return Done()

    monkeypatch.setattr(dist, "irecv", lambda tensor, src, group=None: Done())
    monkeypatch.setattr(dist, "isend", isend)
    coord = GlooCoordinator(RankSpec(2, 3, "command line", "tcp://127.0.0.1:1", "127.0.0.1:1"))
    coord.hosts = ["a", "b", "c"]
    with pytest.raises(RankFailure) as info:
        coord._round(coord._status)
    assert str(info.value) == ("rank 1 (b) vanished: its connection closed (killed or crashed?): "
                               "Connection closed by peer [127.0.0.1]:48845"), str(info.value)


def test_ranks_started_unlike_each_other_are_refused_naming_the_difference(source, tmp_path):
    """Rank 1 gets --w4a4, rank 0 not: both refuse at start (exit 2), naming the option and the
    ranks, before the output is even created."""
    out = tmp_path / "out"
    run = _flag_launch(tmp_path, 2, lambda r: _cast_args(source, out, *(["--w4a4"] if r == 1 else [])))
    rcs, errs = run.finish()
    assert rcs == [2, 2], run.stderr()
    for r, err in enumerate(errs):
        line = next(x for x in err.splitlines() if "error" in x)
        assert line.startswith(f"k3nvfp4-cast: error: rank {r} of 2: the ranks were not started alike: "), line
        assert "--w4a4 is on at rank 1 (" in line and "off at rank 0 (" in line, line
    assert not out.exists()


def test_a_bad_shard_on_one_rank_stops_all_naming_it(source, tmp_path):
    """A NaN E8M0 byte in a shard rank 1 casts: rank 1 says what is wrong (file, tensor); rank 0
    exits 1 too, naming rank 1 and its error; nothing final is written, no temporary remains."""
    src = tmp_path / "src"
    shutil.copytree(source, src)
    wm = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    # A w2 matrix (its own group) with both tensors in a shard of rank 1: no other shard reads it.
    shard, name = next((s, n) for s in assign_shards(_sizes(src), 2)[1] for n, where in sorted(wm.items())
                       if where == s and n.endswith(".w2.weight_scale") and wm[n.replace("weight_scale", "weight_packed")] == s)
    tensors = load_file(str(src / shard))
    tensors[name][0, 0] = 255
    save_file(tensors, str(src / shard), metadata={"format": "pt"})
    out = tmp_path / "out"
    run = _flag_launch(tmp_path, 2, lambda r: _cast_args(src, out))
    rcs, errs = run.finish()
    assert rcs == [1, 1], run.stderr()
    what = f"{src / shard}: {name[: -len('.weight_scale')]}: 1 E8M0 scale byte(s) are 255 (NaN)"
    assert f"k3nvfp4-cast: error: rank 1 of 2: {what}" in errs[1], errs[1]
    assert f"k3nvfp4-cast: error: rank 0 of 2: rank 1 (" in errs[0] and f") failed: {what}" in errs[0], errs[0]
    for f in FINAL_FILES:
        assert not (out / f).exists(), f
    assert _partials(out) == [] and not (out / shard).exists()


def test_an_output_not_shared_by_every_rank_is_refused(source, tmp_path):
    """Rank 1's --output-ckpt is another directory (as a node-local disk under the same path would
    be): it does not see rank 0's launch token, and every rank stops before casting."""
    run = _flag_launch(tmp_path, 2, lambda r: _cast_args(source, tmp_path / f"out{r}"))
    rcs, errs = run.finish()
    assert rcs == [1, 1], run.stderr()
    assert f"--output-ckpt {tmp_path / 'out1'}: not the directory rank 0 prepared ({tmp_path / 'out0'} on rank 0" in errs[1]
    assert "rank 1 (" in errs[0] and "storage that every rank shares" in errs[0], errs[0]
    assert not list((tmp_path / "out0").glob("*.safetensors")) and not (tmp_path / "out1").exists()


# -- the single-process path ----------------------------------------------------------------

def test_one_process_never_initialises_torch_distributed(source, reference, tmp_path, monkeypatch):
    """No launcher, or a launcher's world of size 1: the plain single-process cast. Checked by a
    spy on torch.distributed's initialisation, not by dist.is_initialized(): another test file
    of the same pytest worker (SGLang's model runner) may have initialised a group already."""
    import torch.distributed as dist

    calls = []
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: calls.append((a, k)))
    for env in ({}, {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "localhost", "MASTER_PORT": "1"}):
        for k in LAUNCH_ENV:
            monkeypatch.delenv(k, raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        out = tmp_path / f"out{len(env)}"
        assert main(["--source-ckpt", str(source), "--output-ckpt", str(out), "--workers", "1", "--no-progress"]) == 0
        assert calls == [], f"the cast initialised torch.distributed with {env or 'no launcher'}: {calls}"
        assert _tree_hash(out) == reference
        assert json.loads((out / REPORT).read_text())["ranks"]["world_size"] == 1


# -- unit tests -----------------------------------------------------------------------------

def test_rank_spec_of_each_launcher():
    tr = {"RANK": "2", "WORLD_SIZE": "4", "MASTER_ADDR": "node01", "MASTER_PORT": "29400"}
    assert rank_spec(env=tr) == RankSpec(2, 4, "torchrun", "env://", "node01:29400")
    slurm = {"SLURM_PROCID": "3", "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_NODELIST": "gpu[07-09,12]",
             "SLURM_JOB_NODELIST": "gpu[01-12]", "SLURM_JOB_ID": "123456"}
    no_scontrol = dict(which=lambda name: None)
    assert rank_spec(env=slurm, **no_scontrol) == RankSpec(3, 4, "slurm", "tcp://gpu07:29956", "gpu07:29956")
    assert rank_spec(env={**slurm, "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "1234"}, **no_scontrol).address == "10.0.0.5:1234"
    # torchrun under srun: torchrun's variables win.
    assert rank_spec(env={**slurm, **tr}, **no_scontrol).launcher == "torchrun"
    # The command line wins over both.
    assert rank_spec(1, 2, "tcp://[::1]:5000", env={**slurm, **tr}) == RankSpec(1, 2, "command line", "tcp://[::1]:5000", "[::1]:5000")
    # One process: no launcher; a world of 1; an sbatch script itself (SLURM_PROCID and SLURM_NTASKS, no step).
    for env in ({}, {"RANK": "0", "WORLD_SIZE": "1"}, {"SLURM_PROCID": "0", "SLURM_NTASKS": "4"},
                {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1"}):
        assert not rank_spec(env=env).distributed, env
    assert not rank_spec(0, 1, None, env={}).distributed
    bad = [((1, None, None), {}, "together"), ((3, 3, "h:1"), {}, "rank 3 is not in 0..2"),
           ((0, 2, None), {}, "needs --dist-init"), ((0, 2, "nohost"), {}, "expected HOST:PORT"),
           ((0, 2, "h:70000"), {}, "port 70000"), ((None, None, None), {"RANK": "0", "WORLD_SIZE": "2"}, "MASTER_ADDR and MASTER_PORT"),
           ((None, None, None), {"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' is not an integer")]
    for args, env, words in bad:
        with pytest.raises(LaunchError, match=re.escape(words)):
            rank_spec(*args, env=env)


def test_slurm_first_host_with_and_without_scontrol(tmp_path):
    for nodes, host in (("gpu[07-09,12]", "gpu07"), ("a1,b[2-3]", "a1"), ("r[1-2]n[3-4],x", "r1n3"), ("node-001", "node-001"),
                        ("pre[0012]", "pre0012"), ("h[5,1-3]", "h5")):
        assert first_host(nodes) == host, nodes
    with pytest.raises(LaunchError, match="export MASTER_ADDR"):
        first_host("[oops")
    # With scontrol on PATH its expansion is used (here a stand-in that prints one host per line).
    fake = tmp_path / "scontrol"
    fake.write_text("#!/bin/sh\n[ \"$1 $2\" = 'show hostnames' ] && printf 'alpha\\nbeta\\n'\n")
    fake.chmod(0o755)
    assert slurm_master_host("whatever[1-2]", which=lambda name: str(fake)) == "alpha"
    broken = tmp_path / "scontrol-broken"
    broken.write_text("#!/bin/sh\nexit 1\n")
    broken.chmod(0o755)
    assert slurm_master_host("gpu[07-09]", which=lambda name: str(broken)) == "gpu07"


def test_assign_shards_is_balanced_and_independent_of_order():
    # By hand: 10 -> r0; 9 -> r1; 8 -> r1 (9 < 10); 5 -> r0 (10 < 17); 1 -> r0 (15 < 17); "b" before "c" on the tie.
    sizes = {"a": 10, "b": 9, "c": 8, "d": 5, "e": 1}
    assert assign_shards(sizes, 2) == [["a", "d", "e"], ["b", "c"]]
    assert assign_shards({"x": 3, "y": 3, "z": 3}, 2) == [["x", "z"], ["y"]]
    assert assign_shards(sizes, 7)[5:] == [[], []] and assign_shards(sizes, 1) == [sorted(sizes)]
    rng = random.Random(7)
    for trial in range(40):
        n, w = rng.randint(1, 6), rng.randint(1, 4)
        sizes = {f"s{i:02d}": rng.choice([rng.randint(1, 20), 10]) for i in range(n)}
        got = assign_shards(sizes, w)
        shuffled = dict(rng.sample(list(sizes.items()), len(sizes)))
        assert assign_shards(shuffled, w) == got  # the same for any order the shards are listed in
        assert sorted(s for names in got for s in names) == sorted(sizes)
        best = min(max(sum(sizes[s] for s, r in zip(sizes, rs) if r == k) for k in range(w))
                   for rs in itertools.product(range(w), repeat=n))  # brute-force optimum
        worst = max(sum(sizes[s] for s in names) for names in got)
        assert worst <= (4 / 3 - 1 / (3 * w)) * best + 1e-9, (sizes, w, got, best)  # Graham's bound for LPT


def _info(**over) -> LaunchInfo:
    info = {"tool_version": "0.1.0", "fingerprint": "f0", "source": "/data/src", "output": "/data/out",
            "options": {"verify": True, "strict": False, "w4a4": False, "trim_a_log": False, "overwrite": False,
                        "verify_sample": 1},
            "fingerprint_parts": {"tool_version": "0.1.0", "w4a4": False, "trim_a_log": False,
                                  "files": {"config.json": "aa", "model.safetensors.index.json": "bb"},
                                  "shards": {"m-1.safetensors": "10 bytes, mtime 5", "m-2.safetensors": "20 bytes, mtime 6"}}}
    for k, v in over.items():
        info[k] = v
    return LaunchInfo.from_json(json.loads(json.dumps(info)))  # as another rank's message arrives


def test_launch_differences_name_the_option_the_file_and_the_rank():
    same = _info()
    assert launch_differences([same, _info(), _info(source="/mnt/src", output="/mnt/out")]) == []  # other mounts are fine
    opts = {**same.options, "w4a4": True, "verify": False}
    parts = json.loads(json.dumps(same.fingerprint_parts))
    parts["shards"]["m-2.safetensors"] = "20 bytes, mtime 9"
    del parts["files"]["config.json"]
    diffs = launch_differences([same, _info(), _info(options=opts, fingerprint="f1", fingerprint_parts=parts,
                                                     source="/other", tool_version="0.2.0")])
    assert diffs == [
        "rank 2 runs k3nvfp4-cast 0.2.0, rank 0 0.1.0",
        "--verify is off at rank 2, on at rank 0",
        "--w4a4 is on at rank 2, off at rank 0",
        "source config.json: absent at rank 2, aa at rank 0",
        "source m-2.safetensors: 20 bytes, mtime 9 at rank 2, 20 bytes, mtime 6 at rank 0 (rank 2 reads /other, rank 0 /data/src)",
    ]


def test_coverage_problems_find_every_gap():
    totals = PlanTotals(frozenset({"a", "b", "c"}), matrices=6, blocks=100, carried_tensors=9)
    assert coverage_problems(totals, ["a", "b", "c"], 6, 100) == []
    verify = VerifySummary(matrices=6, blocks=100, carried_tensors=9)
    assert coverage_problems(totals, ["c", "a", "b"], 6, 100, ["b", "c", "a"], verify) == []
    assert coverage_problems(totals, ["a", "a", "b"], 5, 90, ["a", "b", "c", "d"],
                             dataclasses.replace(verify, carried_tensors=7)) == [
        "shard(s) a cast more than once", "shard(s) c cast by no rank", "5 matrices cast, the plan has 6",
        "90 blocks cast, the plan has 100", "shard(s) d verified but not in the plan",
        "verified 7 carried tensors, the plan has 9"]
