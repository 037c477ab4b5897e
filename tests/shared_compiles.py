"""The offline compiles of every shipped kernel, made once per test session and shared.

tests/test_launch_configs.py (launch, registers, spills, no I2F/F2F) and
tests/test_memory_ordering.py (the release / acquire dataflow of every last-arrival sum) read the
same compiles: one run of bench/sass_report.py (no TRITON_INTERPRET: kernels cannot be compiled
under the interpreter) over every device and shard the static report lists at M in powers of two
1 .. 16384, with --ptx-dir for the last-arrival kernels' PTX. Under pytest-xdist the workers share
one run: the first to ask runs it under a file lock in the session's shared temporary folder, the
others wait for it and read its files (one compile per distinct kernel per test session).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
from dataclasses import dataclass

from filelock import FileLock

REPO = pathlib.Path(__file__).resolve().parent.parent
M_LIST = [2**i for i in range(15)]  # 1 .. 16384
TIMEOUT_S = 2400


@dataclass(frozen=True)
class StaticReport:
    """The report's JSON, its --ptx-dir (index.json + <hash>.ptx) and how the run ended."""

    result: dict | None
    ptx_dir: pathlib.Path
    returncode: int
    stderr_tail: str

    def index(self) -> dict:
        return json.loads((self.ptx_dir / "index.json").read_text())


def _session_folder(tmp_path_factory) -> pathlib.Path:
    base = tmp_path_factory.getbasetemp()
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    # xdist: every worker's basetemp lies in one folder of this session (keyed by the run's id too).
    return base.parent / f"static-report-{run}" if run and os.environ.get("PYTEST_XDIST_WORKER") else base / "static-report"


def static_report(tmp_path_factory) -> StaticReport:
    """Run bench/sass_report.py once for this session (see the module docstring) and return it."""
    folder = _session_folder(tmp_path_factory)
    folder.mkdir(parents=True, exist_ok=True)
    out, ptx_dir, done = folder / "perf-model.json", folder / "ptx", folder / "done.json"
    with FileLock(str(folder) + ".lock"):
        if not done.is_file():
            env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
            cmd = [sys.executable, "-P", str(REPO / "bench" / "sass_report.py"), "--no-peers", "--m-list",
                   ",".join(map(str, M_LIST)), "--out", str(out), "--ptx-dir", str(ptx_dir)]
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=TIMEOUT_S)
                status = {"returncode": proc.returncode, "stderr_tail": proc.stderr[-4000:]}
            except subprocess.TimeoutExpired as exc:
                # Recorded like any failure: the workers waiting on the lock must not run it again.
                tail = (exc.stderr or b"")[-4000:]
                status = {"returncode": -1, "stderr_tail": f"timed out after {TIMEOUT_S} s\n"
                          + (tail.decode(errors="replace") if isinstance(tail, bytes) else tail)}
            done.write_text(json.dumps(status))
    status = json.loads(done.read_text())
    result = json.loads(out.read_text()) if out.is_file() else None
    return StaticReport(result, ptx_dir, status["returncode"], status["stderr_tail"])
