"""How the ranks of a cast across nodes agree: torch.distributed with the gloo backend (CPU).

:class:`Solo` is the single-process cast (world size 1): every exchange returns this process's
own payload and torch.distributed is never touched. :class:`GlooCoordinator` is a rank of a
larger world. Its main thread never blocks inside a collective; a heartbeat thread does all the
talking, one *round* at most every ``heartbeat_s`` seconds (sooner when this rank has something
new to say):

every rank sends its status (as JSON: the step it waits at with its payload, a record of
records.py in its ``to_json`` form, see
:meth:`GlooCoordinator.exchange`, or its one-line error, :meth:`GlooCoordinator.fail`) to every
other rank and receives theirs: an all-gather made of gloo ``isend`` / ``irecv`` pairs, each
wait bounded by ``rank_timeout_s``. A rank that was killed closes its connections and every
survivor's receive from it fails at once; a rank that stopped answering (a frozen or unplugged
node) fails it after ``rank_timeout_s``. Either way each survivor knows *which* rank is gone,
from its own failed transfer (gloo's ``all_gather_object`` would only say that some connection
broke, and ``monitored_barrier`` names the rank on rank 0 alone).

An exchange completes in the round in which every rank waits at that step; all ranks see the
same gathered list, so they move on together. A failure stops every rank: the heartbeat thread
of a rank that learns of it interrupts its main thread (SIGUSR1, whose handler raises
:class:`RankFailure`), which then runs the same clean-up as for its own errors; not while that
thread is inside :meth:`GlooCoordinator.exchange` or :meth:`GlooCoordinator.fail` (they see the
failure themselves) or already stopping on Ctrl-C (its exit status stays 130). Bound: a rank
that fails or vanishes stops every other rank within ``heartbeat_s + rank_timeout_s`` plus the
clean-up (terminating a worker pool), unless the main thread is inside a single C call (a read
of the source) that does not return.

Why not the barrier's own timeout for everything: the ranks finish their shards at different
times (one slow disk, one rank with the largest shard), so a barrier at the end of a step must
wait as long as the other ranks are alive and working, and only then give up; the heartbeat
tells "working" from "gone".
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Protocol

from .ranks import RankSpec
from .safetensors_io import CheckpointError

HEARTBEAT_MAX_S = 1.0  # the longest gap between two heartbeat rounds


class RankFailure(CheckpointError):
    """Another rank failed (its message is in this one) or vanished: this rank stopped too."""


class RankMismatch(CheckpointError):
    """The ranks were not started alike (source, options, output): refused at start, exit 2."""


@dataclass(frozen=True)
class _Status:
    """What a rank says in one heartbeat round."""

    rank: int
    host: str
    pid: int
    step: str | None = None  # the exchange it waits at (None: working)
    payload: Any = None  # JSON-able (a record's to_json()): ranks exchange JSON, never pickles
    error: str | None = None  # its one-line error, once it failed


class Coordinator(Protocol):
    """What the cast asks of its rank's coordinator (Solo or GlooCoordinator)."""

    rank: int
    world_size: int
    distributed: bool
    is_root: bool

    def label(self) -> str: ...

    def who(self, rank: int) -> str: ...

    def exchange(self, step: str, payload: Any, *, last: bool = False) -> list: ...

    def fail(self, message: str, *, wait_s: float | None = None) -> None: ...

    def log(self, message: str) -> None: ...

    def close(self) -> None: ...


class Solo:
    """World size 1: no torch.distributed at all."""

    rank = 0
    world_size = 1
    distributed = False
    is_root = True

    def label(self) -> str:
        return ""

    def who(self, rank: int) -> str:
        return f"rank {rank}"

    def exchange(self, step: str, payload: Any, *, last: bool = False) -> list:
        return [payload]

    def fail(self, message: str, *, wait_s: float | None = None) -> None:
        pass

    def log(self, message: str) -> None:
        pass

    def close(self) -> None:
        pass


def _first_line(exc: BaseException) -> str:
    """A gloo error's first line without its '[.../pair.cc:561] ' source prefix."""
    line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    if line.startswith("[") and "] " in line:
        line = line.split("] ", 1)[1]
    return line.split(". This is typically")[0]


class GlooCoordinator:
    """One rank of a world of ``spec.world_size`` > 1 (see the module docstring)."""

    def __init__(self, spec: RankSpec, *, rank_timeout_s: float = 60.0, join_timeout_s: float = 600.0):
        if not spec.distributed:
            raise ValueError("GlooCoordinator needs a world size > 1; use Solo")
        self.spec = spec
        self.rank, self.world_size = spec.rank, spec.world_size
        self.is_root = spec.rank == 0
        self.distributed = True
        self.rank_timeout_s = rank_timeout_s
        self.join_timeout_s = join_timeout_s
        self.heartbeat_s = min(HEARTBEAT_MAX_S, rank_timeout_s / 10)
        self.hosts: list[str] = []  # per rank, from the first round
        self._group = None
        self._lock = threading.Lock()
        self._kick = threading.Event()  # this rank has something new to say: a round now
        self._delivered = threading.Event()  # the awaited exchange completed, or a failure ended it
        self._told = threading.Event()  # our error reached every rank (or the heartbeat ended)
        self._status = _Status(spec.rank, socket.gethostname(), os.getpid())
        self._result: list | None = None
        self._last = False
        self._failure: RankFailure | None = None
        self._main_knows = False  # the main thread has been given the failure (raise it once)
        self._main_inside = 0  # > 0 while the main thread runs exchange() or fail(); main thread only
        self._stopped = threading.Event()  # no more rounds
        self._thread: threading.Thread | None = None
        self._saved_handler = None

    # -- start and stop ---------------------------------------------------------------------

    def start(self) -> None:
        """Join the world (every rank must arrive within join_timeout_s), then say hello in one
        round on this thread (names every rank's host), then start the heartbeat thread."""
        import torch.distributed as dist

        where = f"rendezvous {self.spec.address} ({self.spec.launcher})"
        try:
            dist.init_process_group("gloo", init_method=self.spec.init_method, rank=self.rank,
                                    world_size=self.world_size,
                                    timeout=datetime.timedelta(seconds=self.join_timeout_s))
            self._group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=self.rank_timeout_s))
        except (RuntimeError, ValueError, OSError) as exc:  # DistStoreError / DistNetworkError are RuntimeErrors
            raise CheckpointError(f"{where}: the {self.world_size} ranks did not all join within --join-timeout "
                                  f"{self.join_timeout_s:g} s: {_first_line(exc)}") from None
        try:
            statuses = self._round(self._status)
        except RankFailure as exc:
            raise CheckpointError(f"{where}: {exc}") from None
        self.hosts = [s.host for s in statuses]
        self._saved_handler = signal.signal(signal.SIGUSR1, self._on_signal)
        self._thread = threading.Thread(target=self._watch, name="k3nvfp4-cast-heartbeat", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Leave the world: after the last exchange, or after a failure once the heartbeat
        thread has stopped (the process group must be destroyed before the interpreter exits;
        left to the exit, gloo's threads abort the process)."""
        import torch.distributed as dist

        if self._saved_handler is not None:
            signal.signal(signal.SIGUSR1, self._saved_handler)
            self._saved_handler = None
        if self._thread is not None:
            self._stopped.set()
            self._kick.set()
            self._thread.join(timeout=self.heartbeat_s + self.rank_timeout_s)
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except (RuntimeError, ValueError):  # leaving anyway; the exit status says what happened
                pass

    # -- what the main thread calls ---------------------------------------------------------

    def label(self) -> str:
        return f"rank {self.rank} of {self.world_size}"

    def who(self, rank: int) -> str:
        host = self.hosts[rank] if rank < len(self.hosts) else "?"
        return f"rank {rank} ({host})"

    def log(self, message: str) -> None:
        import sys

        print(f"k3nvfp4-cast: {self.label()}: {message}", file=sys.stderr, flush=True)

    def exchange(self, step: str, payload: Any, *, last: bool = False) -> list:
        """Wait until every rank has reached ``step``; returns their payloads by rank (each as
        JSON gives it back: ``payload`` must be JSON-able, the caller reads it with a record's
        from_json). Raises
        RankFailure when a rank fails or vanishes first. ``last``: the final exchange, after
        which the heartbeat stops."""
        with self._main_busy():
            return self._exchange(step, payload, last)

    @contextlib.contextmanager
    def _main_busy(self):
        """The main thread is inside the coordinator (exchange, fail): _on_signal stays quiet."""
        self._main_inside += 1
        try:
            yield
        finally:
            self._main_inside -= 1

    def _exchange(self, step: str, payload: Any, last: bool) -> list:
        with self._lock:
            if self._failure is not None:
                self._main_knows = True
                raise self._failure
            if self._stopped.is_set():
                raise RuntimeError(f"exchange {step!r} after the last one")
            self._delivered.clear()
            self._result = None
            self._last = last
            self._status = replace(self._status, step=step, payload=payload)
        self._kick.set()
        while not self._delivered.wait(0.5):
            pass
        with self._lock:
            if self._failure is not None:
                self._main_knows = True
                raise self._failure
            return self._result

    def fail(self, message: str, *, wait_s: float | None = None) -> None:
        """Tell every rank that this one failed with ``message``; returns once they have it (or
        after ``wait_s``, default heartbeat_s + 2 x rank_timeout_s). The caller then exits."""
        with self._main_busy():
            with self._lock:
                if self._stopped.is_set() or self._thread is None:
                    return
                self._main_knows = True  # the main thread is on its way out: no signal any more
                self._status = replace(self._status, error=message, step=None, payload=None)
            self._kick.set()
            self._told.wait(self.heartbeat_s + 2 * self.rank_timeout_s if wait_s is None else wait_s)

    # -- the heartbeat thread ---------------------------------------------------------------

    def _exchange_p2p(self, send, recv: dict) -> list[tuple[int, RuntimeError]]:
        """``send`` to every other rank and ``recv[p]`` from each rank p, all at once (gloo
        isend / irecv), every wait bounded by rank_timeout_s in all; returns the ranks whose
        transfer failed, with the error."""
        import torch.distributed as dist

        works, lost = [], []
        for p, buf in recv.items():
            # Posting fails too, not only the wait: gloo's isend to a rank whose connection has
            # already closed raises at once ("Connection closed by peer"); that names p just as well.
            try:
                works.append((p, dist.irecv(buf, src=p, group=self._group),
                              dist.isend(send, dst=p, group=self._group)))
            except RuntimeError as exc:
                lost.append((p, exc))
        deadline = time.monotonic() + self.rank_timeout_s
        for p, r, w in works:
            for work in (r, w):
                try:
                    work.wait(datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
                except RuntimeError as exc:
                    lost.append((p, exc))
                    break
        return lost

    def _round(self, status: _Status) -> list[_Status]:
        """One heartbeat round: every rank's status to every rank, peer to peer (an all-gather
        made of point-to-point transfers, so that a transfer that fails names its rank: gloo's
        all_gather would only say that *some* connection broke). Raises RankFailure naming a
        lost rank."""
        import torch

        peers = [p for p in range(self.world_size) if p != self.rank]
        data = json.dumps(dataclasses.asdict(status)).encode()
        sizes = {p: torch.zeros(1, dtype=torch.int64) for p in peers}
        lost = self._exchange_p2p(torch.tensor([len(data)], dtype=torch.int64), sizes)
        if not lost:
            bufs = {p: torch.empty(int(sizes[p]), dtype=torch.uint8) for p in peers}
            lost = self._exchange_p2p(torch.frombuffer(bytearray(data), dtype=torch.uint8), bufs)
        if lost:
            p, exc = lost[0]
            msg = _first_line(exc)
            why = (f"it did not answer for {self.rank_timeout_s:g} s (--rank-timeout; frozen, or its node is down?)"
                   if "Timed out" in msg else f"its connection closed (killed or crashed?): {msg}")
            more = f" (also lost: {', '.join(self.who(q) for q, _ in lost[1:])})" if len(lost) > 1 else ""
            raise RankFailure(f"{self.who(p)} vanished: {why}{more}")
        # This rank's own payload goes through JSON too, so every rank reads the same values.
        return [_Status(**json.loads(bufs[p].numpy().tobytes() if p != self.rank else data))
                for p in range(self.world_size)]

    def _watch(self) -> None:
        try:
            while not self._stopped.is_set():
                self._kick.wait(self.heartbeat_s)
                self._kick.clear()
                with self._lock:
                    mine = self._status
                statuses = self._round(mine)
                self._after_round(mine, statuses)
        except RankFailure as exc:
            self._abort(exc)
        except BaseException as exc:  # noqa: BLE001 - a heartbeat that breaks must still stop the rank
            self._abort(RankFailure(f"the heartbeat between ranks failed: {type(exc).__name__}: {exc}"))
        finally:
            self._stopped.set()
            self._told.set()
            self._delivered.set()

    def _after_round(self, mine: _Status, statuses: list[_Status]) -> None:
        failed = [s for s in statuses if s.error is not None]
        if failed:
            others = [s for s in failed if s.rank != self.rank]
            if others:
                first = others[0]
                also = "".join(f"; also {self.who(s.rank)}: {s.error}" for s in others[1:])
                self._abort(RankFailure(f"{self.who(first.rank)} failed: {first.error}{also}"))
            self._stopped.set()  # every rank saw the failures in this same round: no more rounds
            return
        steps = {s.step for s in statuses}
        if len(steps - {None}) > 1:
            where = ", ".join(f"rank {s.rank} at {s.step or 'work'}" for s in statuses)
            self._abort(RankFailure(f"the ranks are at different steps ({where}): were they started alike?"))
            self._stopped.set()
            return
        if steps == {mine.step} and mine.step is not None:
            with self._lock:
                self._result = [s.payload for s in statuses]
                self._status = replace(self._status, step=None, payload=None)
                if self._last:
                    self._stopped.set()
            self._delivered.set()

    def _abort(self, failure: RankFailure) -> None:
        """A rank failed or vanished: wake the main thread with ``failure``."""
        with self._lock:
            if self._failure is not None:
                return
            self._failure = failure
            interrupt = not self._main_knows
        self._stopped.set()
        self._delivered.set()  # an exchange waiting for it raises
        if interrupt:
            signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1)

    def _on_signal(self, signum, frame) -> None:  # in the main thread
        # Not inside exchange() / fail(): an exception raised there can land in the middle of a
        # lock's acquire or release (a Ctrl-C's KeyboardInterrupt, then this signal during
        # Condition.wait's clean-up, left its lock half released: "release unlocked lock", exit 1),
        # and the interrupted frame may hold self._lock (taking it here would never return). Both
        # see the failure themselves: _abort set _delivered first. Nor while a KeyboardInterrupt
        # (Ctrl-C, SIGTERM) is being handled: the rank is stopping already, with that status.
        if self._main_inside or isinstance(sys.exc_info()[1], KeyboardInterrupt):
            return
        with self._lock:
            if self._failure is None or self._main_knows:
                return
            self._main_knows = True
            failure = self._failure
        raise failure
