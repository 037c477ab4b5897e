"""Progress of long runs: a live bar on a terminal, plain status lines in a log.

A bar redraws itself with carriage returns and (nested bars) cursor-movement escape codes: on a
terminal that is what a user wants, in a log file or a CI console it is one unreadable line. So
:func:`progress_bar` gives a tqdm bar only where the stream is a terminal and bars are wanted;
anywhere else (a pipe, a file, ``--no-progress``) a :class:`LogProgress`, which writes one plain
line every ``interval_s`` seconds (done, total, rate, ETA) and one when the run ends, so an
hours-long cast keeps saying where it is. Both take tqdm's ``update`` / ``close`` calls, from any
thread.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import IO, Callable, Protocol

INTERVAL_ENV = "K3NVFP4_PROGRESS_INTERVAL"
DEFAULT_INTERVAL_S = 30.0


class Progress(Protocol):
    """What callers use of a bar: tqdm's own names."""

    n: float

    def update(self, n: float = 1) -> object: ...

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None: ...

    def close(self) -> None: ...


def interval_from_env(default: float = DEFAULT_INTERVAL_S) -> float:
    """Seconds between log lines: $K3NVFP4_PROGRESS_INTERVAL, else ``default``; 0 = only the final line."""
    raw = os.environ.get(INTERVAL_ENV)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value >= 0:  # progress is not worth failing an hours-long run for, but it must not go quiet
        print(f"warning: ${INTERVAL_ENV}={raw!r} is not a number of seconds >= 0; using {default:g}", file=sys.stderr)
        return default
    return value


def is_terminal(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or file-like object without isatty
        return False


def significant(x: float) -> str:
    """``x`` with three significant digits, whole numbers from 100 on (``0.0312``, ``0.11``, ``12.5``,
    ``1,250``, ``0``): a slow rate never reads 0."""
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def format_rate(rate: float, unit: str) -> str:
    """``0.0312 req/s``, ``12.5 tok/s``: a rate per second of ``unit`` with three significant digits."""
    return f"{significant(rate)} {unit}/s"


class LogProgress:
    """tqdm's update / close / set_postfix_str / n, written as one plain line per interval.

    Line: ``cast: 12.3GB of 45.6GB (27%), 1.20GB/s, ETA 04:05 | <postfix>`` (units with
    ``unit_scale``), or ``requests: 3 of 8 req (38%), 0.11 req/s, ...`` (a count). Rates keep
    three significant digits, so a slow run never reads "0 req/s". No carriage return, no escape
    code. Thread-safe."""

    def __init__(self, total: float | None, desc: str, *, unit: str = "it", unit_scale: bool = False,
                 interval_s: float | None = None, stream: IO[str] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.total = total
        self.desc = desc
        self.unit = unit
        self.unit_scale = unit_scale
        self.interval_s = interval_from_env() if interval_s is None else interval_s
        self.stream = sys.stderr if stream is None else stream
        self.n: float = 0
        self.postfix = ""
        self._clock = clock
        self._t0 = clock()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None
        if self.interval_s > 0:
            # A timer, not a check in update(): a stalled run (a shard that takes an hour) keeps
            # printing lines that show the stall.
            self._thread = threading.Thread(target=self._tick, name=f"progress-{desc}", daemon=True)
            self._thread.start()

    def update(self, n: float = 1) -> None:
        with self._lock:
            self.n += n

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        with self._lock:
            self.postfix = s

    def _done(self, n: float) -> str:
        """``12.3GB of 45.6GB`` / ``3 of 8 req``; without a total ``12.3GB`` / ``3 req``."""
        from tqdm import tqdm

        if self.unit_scale:
            text = tqdm.format_sizeof(n, self.unit, 1000)
            return text + (f" of {tqdm.format_sizeof(self.total, self.unit, 1000)}" if self.total else "")
        return f"{n:,.0f}" + (f" of {self.total:,.0f}" if self.total else "") + f" {self.unit}"

    def _rate(self, rate: float) -> str:
        """Three significant digits (``0.11 req/s``, ``12.3 req/s``, ``1,234 req/s``, ``1.20GB/s``)."""
        from tqdm import tqdm

        if self.unit_scale and rate >= 1:
            return f"{tqdm.format_sizeof(rate, self.unit, 1000)}/s"
        if self.unit_scale:
            return f"{significant(rate)}{self.unit}/s"
        return format_rate(rate, self.unit)

    def line(self) -> str:
        """The status line as of now."""
        from tqdm import tqdm

        with self._lock:
            n, postfix = self.n, self.postfix
        elapsed = self._clock() - self._t0
        rate = n / elapsed if elapsed > 0 else 0.0
        parts = [self._done(n)]
        if self.total:
            parts[0] += f" ({100.0 * n / self.total:.0f}%)"
        parts.append(self._rate(rate))
        parts.append(f"elapsed {tqdm.format_interval(elapsed)}")
        if self.total and rate > 0 and n < self.total:
            parts.append(f"ETA {tqdm.format_interval((self.total - n) / rate)}")
        return f"{self.desc}: " + ", ".join(parts) + (f" | {postfix}" if postfix else "")

    def _write(self, text: str) -> None:
        try:
            print(text, file=self.stream, flush=True)
        except (OSError, ValueError):  # the log went away (closed pipe): progress is not worth a failure
            pass

    def _tick(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._write(self.line())

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        # A run that failed or was interrupted short of its total says so: "(done)" would read as success.
        finished = self.total is None or self.n >= self.total
        self._write(self.line() + (" (done)" if finished else " (stopped)"))

    def __enter__(self) -> "LogProgress":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def progress_bar(total: float | None, desc: str, *, bars: bool = True, unit: str = "it", unit_scale: bool = False,
             stream: IO[str] | None = None, interval_s: float | None = None, leave: bool = True) -> Progress:
    """A tqdm bar when ``bars`` and ``stream`` (default stderr) is a terminal, else a :class:`LogProgress`.

    total: the amount of work (bytes with ``unit="B", unit_scale=True``), None if unknown.
    interval_s: seconds between log lines (default $K3NVFP4_PROGRESS_INTERVAL, else 30; 0 = final line only).
    leave: a bar stays on screen when closed (tqdm's ``leave``); log lines always stay."""
    stream = sys.stderr if stream is None else stream
    if bars and is_terminal(stream):
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, unit=unit, unit_scale=unit_scale, file=stream, dynamic_ncols=True,
                    leave=leave)
    return LogProgress(total, desc, unit=unit, unit_scale=unit_scale, interval_s=interval_s, stream=stream)
