"""Run ``k3nvfp4-cast`` with its worker pool steered into a known state, for
tests/test_checkpoint_pool.py. Not a test module: a script, run as

    python -P tests/cast_pool_harness.py CONTROL_DIR -- <k3nvfp4-cast arguments>

A tiny checkpoint is cast by the main process before a spawned worker has even imported
torch, so without steering the pool would never get work and an interruption would land at
no known point. ``CONTROL_DIR/plan.json`` says what to do; every event is announced by a
marker file in CONTROL_DIR (the tests wait on files, never on a clock):

- ``started-<shard>``: a process began casting the shard (content: "main"/"pool" and its pid);
- ``hold``: shard names; the process casting one writes half of its tensors to the real
  temporary file, announces ``held-<shard>`` and then waits until a signal ends it;
- ``main_waits_for_pool``: the main process casts its first shard only once a pool process
  has started one, so the pool's first shard is the second in order;
- ``truncate``: {shard: bytes}; the source shard is cut to that size just before it is cast
  (a file that shrank after the plan read its header);
- ``die_at_start``: shard names; the pool process given one kills itself (SIGKILL) as soon as
  it has it, before it writes a byte or lets another of its threads run. It leaves the shard's
  name in ``died`` (a shared memory map, written without a system call, which would let the
  process's other threads run), and ``main_waits_for_pool`` also ends there.

Spawned workers re-run this file's top level (as ``__mp_main__``), so the same steering
applies inside them; the cast itself is the real code.
"""

from __future__ import annotations

import json
import mmap
import multiprocessing as mp
import os
import signal
import sys
import time
from pathlib import Path

from k3nvfp4.checkpoint import convert, safetensors_io

# Python's own Ctrl-C handler, whatever this process inherited: a shell runs a background job
# (`make test &` in a script) with SIGINT ignored and its children inherit that, so the Ctrl-C
# test's SIGINT would reach a cast that ignores it (seen: the test's 300 s guard, rc -9). Under a
# terminal or CI this is already the handler. (The same as cast_ranks_harness.py.)
signal.signal(signal.SIGINT, signal.default_int_handler)

_CTL_ENV = "K3NVFP4_CAST_HARNESS_CTL"
CTL = Path(os.environ[_CTL_ENV]) if _CTL_ENV in os.environ else Path(sys.argv[1])
os.environ[_CTL_ENV] = str(CTL)  # the spawned workers' argv is not ours
PLAN = json.loads((CTL / "plan.json").read_text())


def _role() -> str:
    return "main" if mp.parent_process() is None else "pool"


# The ``died`` map: created by the main process, mapped by every process as it starts.
if _role() == "main":
    (CTL / "died").write_bytes(bytes(256))
with open(CTL / "died", "r+b") as _f:
    DIED = mmap.mmap(_f.fileno(), 256)

_real_cast_shard = convert.cast_shard
_real_expect = safetensors_io.StreamingWriter._expect


def _announce(name: str) -> None:
    tmp = CTL / f".{name}.tmp"
    tmp.write_text(f"{_role()} {os.getpid()}\n")
    os.replace(tmp, CTL / name)  # a marker appears complete


def _wait_forever() -> None:
    while True:  # ended by SIGINT (KeyboardInterrupt), SIGTERM or SIGKILL
        time.sleep(3600)


def _expect(self, name: str, nbytes: int) -> None:
    if self.path.name in PLAN.get("hold", ()) and self._next == len(self.specs) // 2:
        _announce(f"held-{self.path.name}")  # the first half is in the temporary file now
        _wait_forever()
    _real_expect(self, name, nbytes)


def harness_cast_shard(task):
    shard = task.shard.name
    if _role() == "main" and PLAN.get("main_waits_for_pool"):
        while not DIED[0] and not any(m.read_text().startswith("pool") for m in CTL.glob("started-*")):
            time.sleep(0.01)
    if _role() == "pool" and shard in PLAN.get("die_at_start", ()):
        DIED[: len(shard)] = shard.encode()
        os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer would, at the worst moment
    _announce(f"started-{shard}")
    cut = PLAN.get("truncate", {}).get(shard)
    if cut is not None:
        os.truncate(task.source / shard, cut)
    return _real_cast_shard(task)


convert.cast_shard = harness_cast_shard
safetensors_io.StreamingWriter._expect = _expect

if __name__ == "__main__":
    from k3nvfp4.checkpoint.cli import main

    argv = sys.argv[sys.argv.index("--") + 1:]
    raise SystemExit(main(argv))
