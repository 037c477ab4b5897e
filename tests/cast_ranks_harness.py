"""Run ``k3nvfp4-cast`` as one rank of a cast across nodes with a fault planted, for
tests/test_checkpoint_ranks.py. Not a test module: a script, run (under any launcher) as

    python -P tests/cast_ranks_harness.py CONTROL_DIR -- <k3nvfp4-cast arguments>

``CONTROL_DIR/plan.json`` says what to do:

- ``kill``: {"rank": R, "shard": N}: rank R SIGKILLs itself (as the OOM killer or a dying node
  would end it) half-way through writing the N-th shard it casts (1-based), after announcing
  ``killed-<shard>`` in CONTROL_DIR; its temporary file stays behind, as after a real kill;
- ``hold``: {"rank": R, "shard": N}: rank R announces ``held-<shard>`` at the same point and then
  waits until a signal ends it (Ctrl-C, SIGTERM).

The rank is the one the CLI itself derives from the arguments and the environment; the cast is
the real code (``--workers 1``: the rank's own process writes its shards).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")  # as the CLI does before torch loads (see cli.main)

from k3nvfp4.checkpoint import cli, convert, safetensors_io  # noqa: E402
from k3nvfp4.checkpoint.ranks import rank_spec  # noqa: E402

# Python's own Ctrl-C handler, whatever this process inherited: a shell runs a background job
# (`pytest ... &` in a script) with SIGINT ignored, and its children inherit that, so the
# Ctrl-C test's SIGINT would reach ranks that ignore it (seen: both ranks waiting until the
# test's guard). In a terminal, under torchrun or srun, this is already the handler.
signal.signal(signal.SIGINT, signal.default_int_handler)

CTL = Path(sys.argv[1])
ARGV = sys.argv[sys.argv.index("--") + 1:]
PLAN = json.loads((CTL / "plan.json").read_text())
_args = cli.build_parser().parse_args(ARGV)
RANK = rank_spec(_args.rank, _args.world_size, _args.dist_init).rank

_real_cast_shard = convert.cast_shard
_real_expect = safetensors_io.StreamingWriter._expect
_started: list[str] = []


def _announce(name: str) -> None:
    tmp = CTL / f".{name}.tmp"
    tmp.write_text(f"{RANK} {os.getpid()}\n")
    os.replace(tmp, CTL / name)  # a marker appears complete


def harness_cast_shard(task):
    _started.append(task.shard.name)
    return _real_cast_shard(task)


def _here(fault: dict | None, writer) -> bool:
    """At the fault's point: its rank, half-way through writing its N-th shard."""
    return bool(fault and fault["rank"] == RANK and len(_started) == fault["shard"]
                and writer.path.name == _started[-1] and writer._next == len(writer.specs) // 2)


def _expect(self, name: str, nbytes: int) -> None:
    if _here(PLAN.get("kill"), self):
        _announce(f"killed-{self.path.name}")  # the first half is in the temporary file now
        os.kill(os.getpid(), signal.SIGKILL)
    if _here(PLAN.get("hold"), self):
        _announce(f"held-{self.path.name}")
        while True:  # ended by SIGINT (KeyboardInterrupt) or SIGTERM (Terminated)
            time.sleep(3600)
    _real_expect(self, name, nbytes)


convert.cast_shard = harness_cast_shard
safetensors_io.StreamingWriter._expect = _expect

if __name__ == "__main__":
    raise SystemExit(cli.main(ARGV))
