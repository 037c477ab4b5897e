"""The ranks of a cast across nodes: who this process is, and which shards each rank casts.

A rank learns its place from the launcher that started it, in this order:

1. ``--rank R --world-size N --dist-init HOST:PORT`` on the command line (any other launcher);
2. torchrun (or anything else that sets torch's env:// variables): ``RANK``, ``WORLD_SIZE``,
   ``MASTER_ADDR``, ``MASTER_PORT``;
3. an ``srun`` task of SLURM: ``SLURM_PROCID`` and ``SLURM_STEP_NUM_TASKS`` (set for the tasks of
   a job step, not in the batch script itself, so a batch script that runs the tool without srun
   stays one process). The rendezvous is ``MASTER_ADDR:MASTER_PORT`` where the job exports them;
   otherwise the first host of the step's node list (``SLURM_STEP_NODELIST``, else
   ``SLURM_JOB_NODELIST``), which is where task 0 runs under SLURM's block and cyclic
   distributions, expanded by ``scontrol show hostnames`` like the usual
   ``MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)``, or, without
   scontrol on PATH, by reading the first name of the list (``node[07-09,12]`` -> ``node07``);
   and port 29500 + ``SLURM_JOB_ID`` mod 1000, so two jobs sharing a node do not collide.
4. none of these: one process, world size 1. torch.distributed is then never initialised.

A world of size 1 from any launcher is the single-process cast. The shard assignment is a
pure function of the plan and the world size (:func:`assign_shards`), the same on every rank.
This module imports neither torch nor the rest of the package: the CLI reads the launch before
anything heavy loads.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

SLURM_DEFAULT_PORT_BASE = 29500  # torch's own default MASTER_PORT


class LaunchError(ValueError):
    """A launch that cannot work (missing or contradictory rank settings): exit status 2."""


class Terminated(KeyboardInterrupt):
    """SIGTERM (a launcher stopping its ranks, SLURM's scancel or time limit), raised in the main
    thread of a rank so that the same clean-up as Ctrl-C runs; exit status 143."""


@dataclass(frozen=True)
class RankSpec:
    """This process's place in the cast: ``rank`` of ``world_size``.

    launcher: where it came from ("none", "torchrun", "slurm", "command line");
    init_method: torch.distributed's init_method ("env://", "tcp://HOST:PORT"), None when single;
    address: HOST:PORT of the rendezvous (rank 0 listens there), for messages; None when single."""

    rank: int = 0
    world_size: int = 1
    launcher: str = "none"
    init_method: str | None = None
    address: str | None = None

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def _int(value: str, what: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise LaunchError(f"{what}={value!r} is not an integer") from None


def _check(rank: int, world_size: int, what: str) -> None:
    if world_size < 1:
        raise LaunchError(f"{what}: world size {world_size} must be >= 1")
    if not 0 <= rank < world_size:
        raise LaunchError(f"{what}: rank {rank} is not in 0..{world_size - 1}")


def parse_address(text: str, what: str = "--dist-init") -> tuple[str, int]:
    """'HOST:PORT', 'tcp://HOST:PORT' or '[IPv6]:PORT' -> (host, port)."""
    raw = text[len("tcp://"):] if text.startswith("tcp://") else text
    m = re.fullmatch(r"(\[[0-9A-Fa-f:.]+\]|[^:\[\]/\s]+):(\d+)", raw)
    if m is None:
        raise LaunchError(f"{what} {text!r}: expected HOST:PORT (rank 0's address, e.g. node01:29500)")
    port = int(m[2])
    if not 0 < port < 65536:
        raise LaunchError(f"{what} {text!r}: port {port} is not in 1..65535")
    return m[1], port


def first_host(nodelist: str) -> str:
    """The first host name of a SLURM host list, read without scontrol: the first entry at
    bracket depth 0, each bracket replaced by its first value ('gpu[07-09,12]' -> 'gpu07',
    'a1,b[2-3]' -> 'a1', 'r[1-2]n[3-4]' -> 'r1n3'; zero padding kept as written)."""
    depth, end = 0, len(nodelist)
    for i, ch in enumerate(nodelist):
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            end = i
            break
    entry = nodelist[:end].strip()
    host = re.sub(r"\[([^\]]*)\]", lambda m: re.split(r"[,-]", m[1])[0], entry)
    if not host or "[" in host or "]" in host:
        raise LaunchError(f"SLURM node list {nodelist!r}: cannot read its first host; export MASTER_ADDR")
    return host


def slurm_master_host(nodelist: str, which: Callable[[str], str | None] = shutil.which,
                      run: Callable[..., subprocess.CompletedProcess] = subprocess.run) -> str:
    """The first host of ``nodelist``: ``scontrol show hostnames`` where scontrol is on PATH
    (it knows every form of SLURM's host lists), else :func:`first_host`."""
    exe = which("scontrol")
    if exe:
        try:
            out = run([exe, "show", "hostnames", nodelist], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.SubprocessError):
            out = None
        if out is not None and out.returncode == 0 and out.stdout.split():
            return out.stdout.split()[0]
    return first_host(nodelist)


def rank_spec(rank: int | None = None, world_size: int | None = None, dist_init: str | None = None,
              env: Mapping[str, str] | None = None, *, which: Callable[[str], str | None] = shutil.which,
              run: Callable[..., subprocess.CompletedProcess] = subprocess.run) -> RankSpec:
    """This process's RankSpec from the command line's --rank/--world-size/--dist-init (any of
    them given) or the launcher's environment (see the module docstring). Raises LaunchError."""
    env = os.environ if env is None else env
    if rank is not None or world_size is not None or dist_init is not None:
        what = "--rank/--world-size/--dist-init"
        if world_size is None or rank is None:
            raise LaunchError(f"{what}: give --rank and --world-size together (and --dist-init when the world size is > 1)")
        _check(rank, world_size, what)
        if world_size == 1:
            return RankSpec(launcher="command line")
        if dist_init is None:
            raise LaunchError(f"{what}: --world-size {world_size} needs --dist-init HOST:PORT (rank 0's address)")
        host, port = parse_address(dist_init)
        return RankSpec(rank, world_size, "command line", f"tcp://{host}:{port}", f"{host}:{port}")
    if "RANK" in env and "WORLD_SIZE" in env:
        r, n = _int(env["RANK"], "RANK"), _int(env["WORLD_SIZE"], "WORLD_SIZE")
        _check(r, n, "RANK / WORLD_SIZE")
        if n == 1:
            return RankSpec(launcher="torchrun")
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if not env.get(k)]
        if missing:
            raise LaunchError(f"RANK={r} WORLD_SIZE={n} but {' and '.join(missing)} not set (torchrun sets all four)")
        return RankSpec(r, n, "torchrun", "env://", f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}")
    if "SLURM_PROCID" in env and "SLURM_STEP_NUM_TASKS" in env:
        r, n = _int(env["SLURM_PROCID"], "SLURM_PROCID"), _int(env["SLURM_STEP_NUM_TASKS"], "SLURM_STEP_NUM_TASKS")
        _check(r, n, "SLURM_PROCID / SLURM_STEP_NUM_TASKS")
        if n == 1:
            return RankSpec(launcher="slurm")
        host = env.get("MASTER_ADDR")
        if not host:
            nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
            if not nodes:
                raise LaunchError("SLURM task without SLURM_STEP_NODELIST / SLURM_JOB_NODELIST: export MASTER_ADDR")
            host = slurm_master_host(nodes, which=which, run=run)
        if env.get("MASTER_PORT"):
            port = _int(env["MASTER_PORT"], "MASTER_PORT")
        else:
            port = SLURM_DEFAULT_PORT_BASE + _int(env.get("SLURM_JOB_ID", "0"), "SLURM_JOB_ID") % 1000
        host, port = parse_address(f"{host}:{port}", "MASTER_ADDR:MASTER_PORT")
        return RankSpec(r, n, "slurm", f"tcp://{host}:{port}", f"{host}:{port}")
    return RankSpec()


def assign_shards(sizes: Mapping[str, int], world_size: int) -> list[list[str]]:
    """Shards per rank, balanced by bytes: largest first (ties by name) onto the least-loaded rank
    (ties: the lowest rank), the greedy 'longest processing time' rule, whose largest load is at
    most 4/3 - 1/(3 * world_size) times the best possible. Deterministic in the shard sizes and
    names alone, so every rank computes the same assignment whatever order it lists them in.

    sizes: shard name -> bytes (the source shard's size). Returns world_size lists of names,
    each in name order (the order the rank casts them); a rank may get none."""
    if world_size < 1:
        raise ValueError(f"world_size {world_size} must be >= 1")
    loads = [0] * world_size
    out: list[list[str]] = [[] for _ in range(world_size)]
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        r = min(range(world_size), key=lambda i: (loads[i], i))
        loads[r] += sizes[name]
        out[r].append(name)
    return [sorted(names) for names in out]


def rank_of_shards(assignment: Sequence[Sequence[str]]) -> dict[str, int]:
    """shard name -> the rank that casts it."""
    return {name: r for r, names in enumerate(assignment) for name in names}
