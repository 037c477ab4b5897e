"""Stream a Kimi-K3 MXFP4 checkpoint into a ModelOpt NVFP4 one, shard by shard.

One task per source shard, run by a pool of worker processes: a worker holds at most a
few expert groups in memory, copies carried tensors as raw byte ranges and streams its
output shard to a temporary name that is renamed when complete. A finished shard is
recorded in ``<output>/.k3nvfp4-cast/``; a restarted run with the same arguments (same
fingerprint) skips it, and the deterministic writer makes the result byte-identical.
The config, index, side files and ``cast_report.json`` are written last.
A run that fails or is interrupted (Ctrl-C: the main process alone handles it) removes its
temporary files, and a pool process that dies is an error naming its shard.

Across nodes (torchrun, srun, or --rank/--world-size/--dist-init; see ranks.py and
coordinator.py) the same steps run on every rank over its share of the shards, and the ranks
meet at a few exchanges: start (all alike?), prepared (rank 0 made the output ready), cast (every
shard committed), verify, final. Each shard's record is written by the rank that cast it alone.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import json
import mmap
import multiprocessing as mp
import os
import platform
import queue as queue_mod
import shutil
import signal
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from ..common.files import PARTIAL_SUFFIX, copy_file_atomic
from ..common.progress import progress_bar
from ..kernels.cast import CastStats, MXFP4Weight, cast_mxfp4_to_nvfp4
from . import _progress
from .layout import CONFIG_FILE, HF_QUANT_CONFIG_FILE, INDEX_FILE, REPORT_FILE, STATE_DIR
from .coordinator import Coordinator, RankFailure, RankMismatch, Solo
from .plan import CastPlan, ExpertMatrix, ShardPlan, ShardTask, SourceRef, fingerprint_differences, plan_cast
from .rank_checks import (check_launch_token, coverage_problems, launch_differences, launch_info, plan_totals,
                          write_launch_token)
from .records import (ALogCheck, CastMessage, LaunchInfo, Prepared, RankRow, RecordError, ShardRecord, VerifyMessage,
                      VerifyResult, VerifySummary, cast_stats_from_json)
from .ranks import Terminated, assign_shards
from .quant_config import hf_quant_config, output_config
from .safetensors_io import CheckpointError, MappedShards, StreamingWriter, read_tensor, write_atomic_text
from .verify import progress_bytes, verify_full, verify_nonlocal, verify_shard

TOOL_VERSION = "0.1.0"
_METADATA = {"format": "pt"}



@dataclass(frozen=True)
class CastOptions:
    source: Path
    output: Path
    verify: bool = False
    workers: int = 1
    strict: bool = False
    w4a4: bool = False
    overwrite: bool = False
    trim_a_log: bool = False
    progress: bool = True
    verify_sample: int = 1  # matrices per shard fully dequantized and compared
    main_process_works: bool = True  # False: only the pool casts (tests exercise the pool path)


class _Files:
    """Read-only handles on source (or output) shards, opened on first use."""

    def __init__(self, root: Path):
        self.root = root
        self._open: dict[str, object] = {}
        self._maps = MappedShards(root)

    def get(self, shard: str):
        f = self._open.get(shard)
        if f is None:
            try:
                f = self._open[shard] = open(self.root / shard, "rb")
            except OSError as exc:  # removed or replaced since the plan read its header
                raise CheckpointError(f"{self.root / shard}: cannot open: {exc.strerror or exc}") from None
        return f

    def mapped(self, shard: str) -> mmap.mmap:
        """The shard mapped MAP_PRIVATE (see MappedShards)."""
        try:
            return self._maps.get(shard)
        except (OSError, ValueError) as exc:  # gone, or emptied (mmap of 0 bytes) since the plan
            raise CheckpointError(f"{self.root / shard}: cannot map: {getattr(exc, 'strerror', None) or exc}") from None

    def close(self) -> None:
        self._maps.close()
        for f in self._open.values():
            f.close()
        self._open.clear()


def _read(files: _Files, ref) -> torch.Tensor:
    return read_tensor(files.get(ref.shard), ref.entry)


def _read_packed(files: _Files, ref) -> torch.Tensor:
    """The packed nibbles as a view of the mapped source (no copy): the cast reads them only
    at out-of-range blocks, and an untouched matrix is copied file to file (copy_file_range),
    so its bytes are read from disk once, by the kernel."""
    e = ref.entry
    mm = files.mapped(ref.shard)
    if e.nbytes == 0 or e.end > len(mm):  # empty, or the file shrank since its header was read
        return _read(files, ref)
    return torch.frombuffer(mm, dtype=torch.uint8, count=e.nbytes, offset=e.begin).reshape(e.shape)


def _cast_group(files: _Files, task: ShardTask, members: list[ExpertMatrix]) -> tuple[dict[str, torch.Tensor], CastStats, int]:
    weights, nbytes = [], 0
    for m in members:
        packed, scale = _read_packed(files, m.packed), _read(files, m.scale)
        nbytes += m.packed.entry.nbytes + m.scale.entry.nbytes
        weights.append(MXFP4Weight(packed, scale, name=f"{task.source / m.scale.shard}: {m.name.base}"))
    try:
        outs, stats = cast_mxfp4_to_nvfp4(weights)
    except (ValueError, TypeError) as exc:
        raise CheckpointError(str(exc)) from None
    if task.strict and stats.exact_blocks != stats.blocks:
        bases = ", ".join(m.name.base for m in members)
        raise CheckpointError(
            f"--strict: {stats.blocks - stats.exact_blocks} of {stats.blocks} blocks of {bases} are not "
            f"bit-exact ({stats.out_of_range_blocks} out of range, max_abs_err {stats.max_abs_err:g})"
        )
    tensors: dict[str, torch.Tensor | SourceRef] = {}
    for m, w, o in zip(members, weights, outs):
        # Nibbles untouched (the cast hands back the source tensor itself): copy the source
        # bytes in the kernel (copy_file_range) instead of writing them from memory.
        tensors[f"{m.name.base}.weight"] = m.packed if o.packed is w.packed else o.packed
        tensors[f"{m.name.base}.weight_scale"] = o.scale
        tensors[f"{m.name.base}.weight_scale_2"] = o.scale_2.reshape(())
        tensors[f"{m.name.base}.input_scale"] = torch.ones((), dtype=torch.float32)
    return tensors, stats, nbytes


def check_a_log(t: torch.Tensor, name: str, num_heads: int | None) -> ALogCheck:
    """Check one KDA A_log: the elements beyond num_heads must be exactly zero."""
    if num_heads is None or t.dim() != 1 or t.shape[0] < num_heads:
        return ALogCheck(name, list(t.shape), num_heads, note="unexpected shape; carried as is")
    pad = t[num_heads:].float()
    return ALogCheck(name, list(t.shape), num_heads, padding_elements=int(pad.numel()),
                     padding_all_zero=bool((pad == 0).all()),
                     padding_max_abs=float(pad.abs().max()) if pad.numel() else 0.0)


def cast_shard(task: ShardTask) -> ShardRecord:
    """Write one output shard (see module docstring). Returns its record."""
    t0 = time.perf_counter()
    files = _Files(task.source)
    plan = task.shard
    wanted: dict[tuple, set[str]] = defaultdict(set)  # group -> its outputs in this shard
    for it in plan.items:
        if it.group is not None:
            wanted[it.group].add(it.spec.name)
    anchored = set(plan.anchored_groups)
    pending: dict[tuple, dict[str, torch.Tensor]] = {}
    stats, matrices, extra_read, a_logs = CastStats(), 0, 0, []
    writer = StreamingWriter(task.output / plan.name, [it.spec for it in plan.items], _METADATA)
    try:
        with writer:
            for it in plan.items:
                if it.kind == "carry":
                    src = it.src
                    writer.copy_range(it.spec.name, files.get(src.shard), src.entry.begin, src.entry.nbytes)
                    if it.spec.name.endswith(".A_log"):
                        a_logs.append(check_a_log(_read(files, src), it.spec.name, task.num_heads))
                    _progress.report(src.entry.nbytes)
                elif it.kind == "a_log_trim":
                    t = _read(files, it.src)
                    rep = check_a_log(t, it.spec.name, task.num_heads)
                    if not rep.padding_all_zero:
                        raise CheckpointError(
                            f"{task.source / it.src.shard}: tensor {it.spec.name}: elements [{task.num_heads}:] are not "
                            f"all zero (max |x| {rep.padding_max_abs:g}); --trim-a-log would drop trained values"
                        )
                    a_logs.append(dataclasses.replace(rep, trimmed_to=task.num_heads))
                    writer.write_tensor(it.spec.name, t[: task.num_heads].contiguous())
                    _progress.report(it.src.entry.nbytes)
                else:
                    g = it.group
                    if g not in pending:
                        tensors, st, nbytes = _cast_group(files, task, task.groups[g])
                        pending[g] = {k: v for k, v in tensors.items() if k in wanted[g]}
                        if g in anchored:
                            stats, matrices = stats + st, matrices + len(task.groups[g])
                        own = sum(r.entry.nbytes for m in task.groups[g] for r in (m.packed, m.scale) if r.shard == plan.name)
                        extra_read += nbytes - own
                        _progress.report(own)
                    value = pending[g].pop(it.spec.name)
                    if isinstance(value, SourceRef):
                        writer.copy_range(it.spec.name, files.get(value.shard), value.entry.begin, value.entry.nbytes)
                    else:
                        writer.write_tensor(it.spec.name, value)
                    if not pending[g]:
                        del pending[g]
            writer.commit()
    finally:
        files.close()
    out_size = (task.output / plan.name).stat().st_size
    cast_seconds = time.perf_counter() - t0
    # Verify from disk now, while the data is hot and other shards are still being cast;
    # groups that span shards wait for the second pass.
    verify = None
    if task.verify:
        saved = _progress.set_sink(lambda n: None)  # the bar counts cast bytes only
        try:
            verify = verify_shard(task, groups="local")
        finally:
            _progress.set_sink(saved)
    return ShardRecord(shard=plan.name, pid=os.getpid(), cast_seconds=cast_seconds, seconds=time.perf_counter() - t0,
                       source_bytes=plan.source_bytes, extra_bytes_read=extra_read, output_bytes=out_size,
                       matrices=matrices, stats=stats, a_log=a_logs, verify=verify)


def _shard_task(plan: CastPlan, options: CastOptions, shard: ShardPlan) -> ShardTask:
    touched = {it.group for it in shard.items if it.group is not None} | set(shard.anchored_groups)
    return ShardTask(
        source=plan.source,
        output=options.output,
        shard=shard,
        groups={g: plan.groups[g] for g in touched},
        num_heads=plan.num_heads,
        strict=options.strict,
        w4a4=options.w4a4,
        verify_sample=options.verify_sample,
        verify=options.verify,
    )


_READY = -1  # a pool process announces itself on the progress queue
_worker_queue = None  # in a pool process: the progress queue (also carries task start / end)


def _init_worker(queue) -> None:
    global _worker_queue
    # Ctrl-C reaches the whole process group: the main process alone handles it (stops the
    # run, terminates the pool, removes the temporary files); a worker would only print a
    # KeyboardInterrupt traceback each.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)
    _worker_queue = queue
    _progress.set_sink(queue.put)
    queue.put(_READY)


def _in_worker(fn, task: ShardTask):
    """Run ``fn(task)`` in a pool process, announcing start and end with this process's pid,
    so that the main process can tell a task whose process died (killed, out of memory) from
    one still running: multiprocessing.Pool would wait for its result forever. The queue is a
    SimpleQueue, whose ``put`` has written to the pipe when it returns: a Queue hands the write
    to a thread of this process, and a process killed before that thread ran took its "start"
    with it (the main process then waited forever: tests/test_checkpoint_pool.py). Not covered:
    a worker killed between taking the task from the pool and this put returning (microseconds,
    before the task has read a byte; multiprocessing.Pool does not say which process took which
    task), which would still leave the run waiting."""
    _worker_queue.put(("start", os.getpid(), task.shard.name))
    try:
        return fn(task)
    finally:
        _worker_queue.put(("end", os.getpid()))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # a dead worker is reaped at once by the pool's worker handler
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _Executor:
    """Runs shard tasks on ``workers`` processes: the main process itself plus a spawn pool of
    ``workers - 1``, created once and shared by the cast and verify phases. The main process
    starts working at once, so the pool's start-up (importing torch) is off the critical path.
    Inside the ``with`` block the main process runs single-threaded torch like the pool processes
    (_init_worker), or its intra-op threads would contend for the cores the pool is using.
    """

    def __init__(self, workers: int, show: bool, main_works: bool = True):
        self.workers, self.show, self.main_works = workers, show, main_works
        self._pool = None
        self._queue = None
        self._idle = threading.Semaphore(0)  # pool processes that are up and without a task
        self._threads = None

    def __enter__(self) -> "_Executor":
        self._threads = torch.get_num_threads()
        torch.set_num_threads(1)
        return self

    def __exit__(self, *exc) -> None:
        torch.set_num_threads(self._threads)
        if self._pool is not None:
            # Every result is in (or the run failed): a process still importing torch need not finish.
            self._pool.terminate()
            self._pool.join()

    def _get_pool(self):
        if self._pool is None:
            ctx = mp.get_context("spawn")
            self._queue = ctx.SimpleQueue()  # written synchronously (_in_worker)
            self._pool = ctx.Pool(self.workers - 1, initializer=_init_worker, initargs=(self._queue,))
        return self._pool

    def run(self, fn, tasks: list[ShardTask], total: int, desc: str, on_result: Callable[[Any], None]) -> None:
        """Run ``fn`` over tasks with a bytes/s + ETA bar; ``on_result`` sees each result (in
        the main thread) as soon as its task is done. The first error stops the run."""
        todo = collections.deque(tasks)
        use_pool = self.workers > 1 and (len(tasks) > 1 or self._pool is not None)
        pool = self._get_pool() if use_pool else None  # spawns before the bar's monitor thread
        # A bar on a terminal; in a log (or with --no-progress) a status line every interval.
        bar = progress_bar(total, desc, bars=self.show, unit="B", unit_scale=True)
        lock = threading.Lock()
        done: queue_mod.SimpleQueue = queue_mod.SimpleQueue()  # pool results / errors
        in_flight = [0]
        running: dict[int, str] = {}  # pool pid -> the shard it is working on
        threads: list[threading.Thread] = []
        stop = threading.Event()
        if pool is not None:
            idle = self._idle

            def finished(r) -> None:
                done.put(r)
                idle.release()

            def dispatch() -> None:  # hands a task to a pool process only once it is up and idle
                while not stop.is_set():
                    if not idle.acquire(timeout=0.05):
                        continue
                    with lock:
                        if not todo:
                            idle.release()
                            return
                        t = todo.popleft()
                        in_flight[0] += 1
                    pool.apply_async(_in_worker, (fn, t), callback=finished, error_callback=finished)

            def handle(n) -> None:
                if isinstance(n, tuple):
                    with lock:
                        if n[0] == "start":
                            running[n[1]] = n[2]
                        else:
                            running.pop(n[1], None)
                elif n == _READY:
                    idle.release()
                else:
                    bar.update(n)

            def drain() -> None:
                # Ends on ``stop``, not on a message from the main process: a worker killed in
                # the middle of a put leaves the queue's write lock held. What arrives after
                # this run (a restarted worker's _READY) is read by the next run.
                while not stop.is_set():
                    if self._queue.empty():
                        stop.wait(0.01)
                    else:
                        handle(self._queue.get())

            threads = [threading.Thread(target=dispatch, daemon=True), threading.Thread(target=drain, daemon=True)]
            for th in threads:
                th.start()

        def check_workers() -> None:
            with lock:  # a pool task whose process is gone: its result will never come
                lost = [(pid, shard) for pid, shard in running.items() if not _pid_alive(pid)]
            if lost:
                pid, shard = lost[0]
                raise CheckpointError(
                    f"{tasks[0].output / shard}: the worker process (pid {pid}) on this shard ({desc}) "
                    "ended without a result (killed? out of memory? try fewer --workers); run the same command "
                    "again to resume")

        def collect(block: bool) -> None:
            while in_flight[0] and (block or not done.empty()):
                r = done.get()
                with lock:
                    in_flight[0] -= 1
                if isinstance(r, BaseException):
                    raise r
                on_result(r)

        saved = _progress.set_sink(bar.update)
        completed = False
        try:
            while self.main_works or pool is None:
                collect(block=False)
                with lock:
                    t = todo.popleft() if todo else None
                if t is None:
                    break
                on_result(fn(t))
            while True:
                with lock:
                    busy = bool(todo) or in_flight[0] > 0
                if not busy:
                    break
                if done.empty():
                    time.sleep(0.01)
                    check_workers()
                collect(block=False)
            completed = True
        finally:
            with lock:
                todo.clear()  # stop the dispatcher on error
            stop.set()
            _progress.set_sink(saved)
            if pool is not None:
                for th in threads:
                    th.join(timeout=5)
                if completed:  # every task has returned, so its puts are all in the pipe: this
                    while not self._queue.empty():  # run's progress must not reach the next bar
                        handle(self._queue.get())
            if completed and bar.n < total:
                bar.update(total - bar.n)  # all done: a bar in a log ends at 100% (totals are estimates)
            bar.close()


def _is_within(child: Path, parent: Path) -> bool:
    return child == parent or parent in child.parents


def _prepare_output(options: CastOptions, plan: CastPlan) -> tuple[Path, dict | None]:
    """Create/validate the output dir. Returns (state dir, None) for a fresh run or a resume, or
    (state dir, the finished report) when the output already is a finished cast of this source
    with these options (nothing to redo)."""
    src, out = options.source.resolve(), options.output.resolve()
    if _is_within(out, src):
        raise CheckpointError(f"--output-ckpt {options.output} is the source or inside it ({options.source}); refusing")
    if _is_within(src, out):
        raise CheckpointError(f"--output-ckpt {options.output} contains the source {options.source}; refusing")
    state = out / STATE_DIR
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"--output-ckpt {options.output}: exists and is not a directory")
    if out.exists() and any(out.iterdir()):
        complete = (out / REPORT_FILE).exists()
        try:
            previous = json.loads((out / REPORT_FILE if complete else state / "state.json").read_text())
        except (OSError, ValueError):
            previous = {}
        same = previous.get("fingerprint") == plan.fingerprint
        if same and not options.overwrite:
            return state, (previous if complete else None)  # done, or resume
        if not options.overwrite:
            if "fingerprint_parts" in previous:
                why = fingerprint_differences(previous["fingerprint_parts"], plan.fingerprint_parts)
                what = "a finished cast" if complete else "an unfinished cast"
                old = previous.get("source")  # absent from the state of a cast started before it was recorded
                of = f"of {old}, not of this --source-ckpt {src}" if old and old != str(src) else "of other inputs"
                raise CheckpointError(
                    f"--output-ckpt {options.output}: {what} {of} ({_clauses(why)}); "
                    "pass --overwrite to redo it, or choose another --output-ckpt")
            raise CheckpointError(f"--output-ckpt {options.output}: exists and is not empty; pass --overwrite to "
                                  "replace it")
        if not (complete or state.exists() or (out / INDEX_FILE).exists()):
            raise CheckpointError(
                f"--output-ckpt {options.output}: not empty and not a checkpoint this tool wrote; "
                "refusing to delete it even with --overwrite"
            )
        shutil.rmtree(out)
    state.mkdir(parents=True, exist_ok=True)
    write_atomic_text(state / "state.json",
                      json.dumps({"fingerprint": plan.fingerprint, "fingerprint_parts": plan.fingerprint_parts,
                                  "source": str(src)}) + "\n")  # named when a resume is refused
    return state, None


def _clauses(why: list[str], shown: int = 4) -> str:
    """What changed, the first ``shown`` items and a count of the rest: a source of hundreds of
    shards must not give a refusal of hundreds of clauses."""
    if not why:
        return "unknown change"
    more = len(why) - shown
    return "; ".join(why[:shown]) + (f"; and {more} more change(s)" if more > 0 else "")


def _remove_partials(out: Path) -> None:
    """Remove the temporary files (``.<name>.partial``, ``.<name>.<pid>.<random>.partial``) a
    stopped run left in ``out``, subfolders (side files, the state folder) included."""
    for p in out.rglob(f".*{PARTIAL_SUFFIX}"):
        p.unlink(missing_ok=True)


def _write_final_files(plan: CastPlan, options: CastOptions) -> int:
    out = options.output
    weight_map, total = {}, 0
    for sp in plan.shards:
        for it in sp.items:
            weight_map[it.spec.name] = sp.name
            total += it.spec.nbytes
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    write_atomic_text(out / INDEX_FILE, json.dumps(index, indent=2) + "\n")
    cfg = output_config(plan.config, plan.exclude_modules, w4a4=options.w4a4)
    write_atomic_text(out / CONFIG_FILE, json.dumps(cfg, indent=2) + "\n")
    hq = hf_quant_config(plan.exclude_modules, producer_version=TOOL_VERSION)
    write_atomic_text(out / HF_QUANT_CONFIG_FILE, json.dumps(hq, indent=2) + "\n")
    for rel in plan.side_files:
        dst = out / rel
        try:
            copy_file_atomic(plan.source / rel, dst)
        except OSError as exc:
            raise CheckpointError(f"{dst}: copy failed: {exc.strerror or exc}") from exc
    return total


def run_cast(options: CastOptions, coord: Coordinator | None = None) -> dict:
    """Cast ``options.source`` into ``options.output``; returns the report (also written as cast_report.json).

    ``coord``: this process's rank of a cast across nodes (coordinator.GlooCoordinator); None is
    the single-process cast (coordinator.Solo). Every rank plans the whole checkpoint and casts
    its share (ranks.assign_shards); rank 0 prepares the output first and writes the index,
    configs, copied files and the report last, after every rank has finished (and verified) its
    shards. Rank 0 returns the report; another rank returns its own part of it (``"rank"``).

    Raises CheckpointError on bad input, a failed write, --strict violations or a failed --verify;
    RankFailure when another rank failed or vanished; RankMismatch when the ranks were started
    unlike each other. A rank that fails tells the others before it raises.
    """
    coord = Solo() if coord is None else coord
    try:
        return _run_cast(options, coord)
    except (RankFailure, RankMismatch):
        raise  # every rank knows already (a mismatch: each found the same difference)
    except KeyboardInterrupt as exc:
        # Ctrl-C usually reaches every rank of a node at once; do not wait long to tell them.
        coord.fail("terminated (SIGTERM)" if isinstance(exc, Terminated) else "interrupted (Ctrl-C)", wait_s=5.0)
        raise
    except BaseException as exc:
        coord.fail(str(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}")
        raise


def _rank_desc(desc: str, coord: Coordinator) -> str:
    """Progress lines name the rank: 'cast (rank 1 of 3)'."""
    return f"{desc} ({coord.label()})" if coord.distributed else desc


def _remove_own_partials(out: Path, shards: list[str]) -> None:
    """A rank's clean-up after a failure: its own shards' temporary files and its own atomic
    writes' leftovers, never another rank's (those may be being written right now)."""
    for name in shards:
        (out / f".{name}{PARTIAL_SUFFIX}").unlink(missing_ok=True)
    for p in (out / STATE_DIR).glob(f".*.{os.getpid()}.*{PARTIAL_SUFFIX}"):
        p.unlink(missing_ok=True)


@dataclass
class _Share:
    """This rank's part of a cast, as the phases of _run_cast hand it on: the whole plan, this
    rank's shards (``mine``), their finished records (resumed ones first, then each shard as
    it is cast) and those still to cast (``todo``)."""

    plan: CastPlan
    mine: list[ShardPlan]
    records: dict[str, ShardRecord]
    todo: list[ShardPlan]


@dataclass
class _Gathered:
    """What rank 0 gathered at the 'cast' and 'verify' exchanges, and the run's times."""

    cast: list[CastMessage]
    verify: list[VerifyMessage] | None
    cast_seconds: float
    verify_seconds: float


def _run_cast(options: CastOptions, coord: Coordinator) -> dict:
    t_start = time.perf_counter()
    plan, mine = _plan_and_compare(options, coord)
    done, finished = _prepare(options, plan, coord)
    if done:  # rank 0 found a finished cast of this source with these options (its report: rank 0 only)
        return _already_done(options, plan, finished, coord, mine)
    share = _resume(options, plan, mine, coord)
    rank_row = RankRow(rank=coord.rank, host=platform.node(), pid=os.getpid(), workers=options.workers,
                       shards=[sp.name for sp in mine], cast_now=len(share.todo), resumed=len(share.records),
                       bytes_cast_now=sum(sp.source_bytes for sp in share.todo))
    gathered = _cast_and_verify(options, share, coord, rank_row)
    if not coord.is_root:
        coord.exchange("final", None, last=True)
        return {"rank": rank_row.to_json(), "world_size": coord.world_size, "output": str(options.output.resolve())}
    report = _finish(options, plan, coord, gathered, t_start)
    coord.exchange("final", None, last=True)
    return report


def _plan_and_compare(options: CastOptions, coord: Coordinator) -> tuple[CastPlan, list[ShardPlan]]:
    """Phase 1, every rank: plan the whole cast, take this rank's share of the shards, and (across
    nodes) check that every rank planned the same cast with the same options."""
    src = options.source
    if not src.is_dir():
        raise CheckpointError(f"--source-ckpt {src}: not a directory")
    plan = plan_cast(src, w4a4=options.w4a4, trim_a_log=options.trim_a_log, tool_version=TOOL_VERSION)
    assignment = assign_shards({sp.name: sp.source_bytes for sp in plan.shards}, coord.world_size)
    mine_names = set(assignment[coord.rank])
    mine = [sp for sp in plan.shards if sp.name in mine_names]
    if coord.distributed:
        sent = coord.exchange("start", launch_info(options, plan, TOOL_VERSION).to_json())
        diffs = launch_differences([LaunchInfo.from_json(d, f"{coord.who(r)}'s launch info")
                                    for r, d in enumerate(sent)], coord.who)
        if diffs:
            raise RankMismatch(f"the ranks were not started alike: {'; '.join(diffs)}. Start every rank with the same "
                               "--source-ckpt contents, --output-ckpt directory and options")
    return plan, mine


def _prepare(options: CastOptions, plan: CastPlan, coord: Coordinator) -> tuple[bool, dict | None]:
    """Phase 2: rank 0 alone touches the output before the cast (refuse, resume, --overwrite,
    leftovers); the other ranks check that they see the directory it prepared. Returns whether
    the output already is this cast (on every rank) and, on rank 0, its finished report."""
    finished, token = None, None
    if coord.is_root:
        _, finished = _prepare_output(options, plan)
        if finished is None:
            _remove_partials(options.output)  # leftovers of a killed run
        if coord.distributed:
            token = write_launch_token(options.output, coord.world_size)
    mine = Prepared(finished is not None, token, str(options.output.resolve())).to_json() if coord.is_root else None
    prepared = Prepared.from_json(coord.exchange("prepared", mine)[0], f"{coord.who(0)}'s prepared message")
    if coord.distributed:
        if not coord.is_root:
            check_launch_token(options.output, prepared.token, prepared.output)
        coord.exchange("joined", None)
    return prepared.finished, finished


def _read_record(path: Path, shard: str) -> ShardRecord:
    """A resume record (written by this version or an earlier one: the JSON is the same), or a
    CheckpointError naming the file and what to do."""
    try:
        record = ShardRecord.from_json(json.loads(path.read_text()), "record")
    except (OSError, ValueError, RecordError) as exc:  # unreadable, not JSON, or not a record we know
        why = getattr(exc, "strerror", None) or exc
        raise CheckpointError(f"{path}: not a resume record this version reads ({why}); delete it to cast {shard} "
                              "again, or pass --overwrite to redo the whole cast") from None
    if record.shard != shard:
        raise CheckpointError(f"{path}: the record of {record.shard}, not of {shard}; delete it to cast {shard} again")
    return record


def _resume(options: CastOptions, plan: CastPlan, mine: list[ShardPlan], coord: Coordinator) -> _Share:
    """Phase 3: the shards of this rank an earlier run finished (record and shard both there) are
    kept; the others are to cast."""
    state = options.output / STATE_DIR
    records: dict[str, ShardRecord] = {}
    for sp in mine:
        rec = state / f"{sp.name}.json"
        if rec.exists() and (options.output / sp.name).exists():
            records[sp.name] = _read_record(rec, sp.name)
    todo = [sp for sp in mine if sp.name not in records]
    if coord.distributed:
        coord.log(f"casts {len(todo)} of its {len(mine)} shard(s) ({sum(sp.source_bytes for sp in todo) / 1e9:.2f} GB; "
                  f"{len(records)} done by an earlier run); {len(plan.shards)} shard(s) in all")
    return _Share(plan, mine, records, todo)


def _cast_and_verify(options: CastOptions, share: _Share, coord: Coordinator, rank_row: RankRow) -> _Gathered:
    """Phase 4, every rank: cast its shards on the worker pool (each recorded as soon as it is in
    place), meet the other ranks at 'cast', then with --verify verify what the in-line check left
    and meet at 'verify'. On any failure or interruption the rank removes its temporary files."""
    plan, state = share.plan, options.output / STATE_DIR
    t0 = time.perf_counter()
    tasks = [_shard_task(plan, options, sp) for sp in share.todo]

    def record(r: ShardRecord) -> None:
        # Recorded as soon as the shard is renamed into place: an interruption keeps it. One file
        # per shard, written by the rank that cast it alone: concurrent ranks never share a file.
        share.records[r.shard] = r
        write_atomic_text(state / f"{r.shard}.json", json.dumps(r.to_json()) + "\n")

    verify_all = None
    verify_seconds = 0.0
    try:
        with _Executor(min(options.workers, max(1, len(share.mine))), options.progress, options.main_process_works) as ex:
            ex.run(cast_shard, tasks, sum(t.shard.source_bytes for t in tasks), _rank_desc("cast", coord), record)
            rank_row.cast_seconds = time.perf_counter() - t0
            # Every rank's shards are committed before any rank verifies the groups that span shards.
            sent = coord.exchange("cast", CastMessage(share.records, rank_row).to_json())
            cast_all = [CastMessage.from_json(d, f"{coord.who(r)}'s cast message") for r, d in enumerate(sent)]
            cast_seconds = time.perf_counter() - t0
            if options.verify:
                t1 = time.perf_counter()
                mine = _verify_rest(options, share, ex, coord)
                rank_row.verify_seconds = mine.verify_seconds = time.perf_counter() - t1
                sent = coord.exchange("verify", mine.to_json())
                verify_all = [VerifyMessage.from_json(d, f"{coord.who(r)}'s verify message") for r, d in enumerate(sent)]
                verify_seconds = time.perf_counter() - t1
    except BaseException:
        # The pool is terminated and joined by now, so nothing writes any more: the shards being
        # cast when the run failed or was interrupted leave no temporary file behind. Finished
        # shards stay (recorded: a resume keeps them). A rank removes only its own temporaries.
        if coord.distributed:
            _remove_own_partials(options.output, [sp.name for sp in share.mine])
        else:
            _remove_partials(options.output)
        raise
    if verify_all is not None:
        for c, v in zip(cast_all, verify_all):
            c.rank.verify_seconds = v.verify_seconds
    return _Gathered(cast_all, verify_all, cast_seconds, verify_seconds)


def _verify_rest(options: CastOptions, share: _Share, ex: "_Executor", coord: Coordinator) -> VerifyMessage:
    """--verify after every rank's cast: shards cast now were verified in-line except their
    groups that span shards (verified now); shards of an earlier (resumed) run are verified whole."""
    plan = share.plan
    results = [share.records[sp.name].verify for sp in share.todo]
    verified = [sp.name for sp in share.todo]
    by_name = {sp.name: sp for sp in plan.shards}
    nonlocal_tasks = [_shard_task(plan, options, by_name[v.shard]) for v in results if v.deferred_groups]
    cast_now = {sp.name for sp in share.todo}
    full_tasks = [_shard_task(plan, options, sp) for sp in share.mine if sp.name not in cast_now]
    verified += [t.shard.name for t in full_tasks]
    for fn, ts, kw in ((verify_nonlocal, nonlocal_tasks, {"groups": "nonlocal", "check_shard": False}),
                       (verify_full, full_tasks, {})):
        if ts:
            ex.run(fn, ts, sum(progress_bytes(t, **kw) for t in ts), _rank_desc("verify", coord), results.append)
    return VerifyMessage(results, verified)


def _checked_verify(plan: CastPlan, verify_all: list[VerifyMessage], cast_stats: CastStats, cast_shards: list[str],
                    matrices: int) -> VerifySummary:
    """Rank 0: every rank's verify results summed and checked against the cast's own figures and
    the plan; raises CheckpointError ('--verify FAILED: ...') on any mismatch or gap."""
    summary = VerifySummary.merge([r for v in verify_all for r in v.results], cast_stats)
    summary.add_gaps(coverage_problems(plan_totals(plan), cast_shards, matrices, cast_stats.blocks,
                                       [n for v in verify_all for n in v.verified], summary))
    failure = summary.failure()
    if failure:
        raise CheckpointError(failure)
    return summary


def _finish(options: CastOptions, plan: CastPlan, coord: Coordinator, got: _Gathered, t_start: float) -> dict:
    """Phase 5, rank 0 after every rank: check that the ranks' records cover the plan (and the
    verify results the records), write the index, configs, side files and cast_report.json,
    drop the resume state. Returns the report."""
    all_records: dict[str, ShardRecord] = {}
    cast_names: list[str] = []
    for c in got.cast:
        cast_names += list(c.records)
        all_records.update(c.records)
    stats = CastStats()
    for r in all_records.values():
        stats = stats + r.stats
    matrices = sum(r.matrices for r in all_records.values())
    gaps = coverage_problems(plan_totals(plan), cast_names, matrices, stats.blocks)
    if gaps:
        raise CheckpointError("the ranks' results do not cover the plan: " + "; ".join(gaps))
    verify = None if got.verify is None else _checked_verify(plan, got.verify, stats, cast_names, matrices)

    rows = [c.rank for c in got.cast]
    cast_bytes = sum(row.bytes_cast_now for row in rows)
    cast_now = sum(row.cast_now for row in rows)
    output_bytes = _write_final_files(plan, options)
    total_seconds = time.perf_counter() - t_start
    report = _report(options, plan, stats, matrices, all_records, verify, coord, rows,
                     cast_now=cast_now, cast_bytes=cast_bytes, output_bytes=output_bytes,
                     seconds={"cast": got.cast_seconds, "verify": got.verify_seconds, "total": total_seconds})
    write_atomic_text(options.output / REPORT_FILE, json.dumps(report, indent=2) + "\n")
    shutil.rmtree(options.output / STATE_DIR, ignore_errors=True)
    return report


def _report(options: CastOptions, plan: CastPlan, stats: CastStats, matrices: int, records: dict[str, ShardRecord],
            verify: VerifySummary | None, coord: Coordinator, rows: list[RankRow], *, cast_now: int, cast_bytes: int,
            output_bytes: int, seconds: dict) -> dict:
    """cast_report.json (a JSON object; its keys are what format_summary, the CLI and the docs read)."""
    a_logs = [a for r in records.values() for a in r.a_log]
    cast_s, verify_s = seconds["cast"], seconds["verify"]
    return {
        "tool": "k3nvfp4-cast",
        "version": TOOL_VERSION,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        # Absolute: the report outlives the directory it was typed in.
        "source": str(options.source.resolve()),
        "output": str(options.output.resolve()),
        "options": {k: (str(v.resolve()) if isinstance(v, Path) else v) for k, v in options.__dict__.items()},
        "fingerprint": plan.fingerprint,
        "fingerprint_parts": plan.fingerprint_parts,
        "stats": stats.to_dict(),
        "bit_exact_fraction": stats.exact_blocks / stats.blocks if stats.blocks else 1.0,
        "matrices_cast": matrices,
        "shards": {"total": len(plan.shards), "cast_now": cast_now, "resumed": len(plan.shards) - cast_now},
        "bytes": {"source": plan.total_source_bytes, "cast_now": cast_bytes, "output_tensors": output_bytes},
        "seconds": seconds,
        "throughput_gb_per_s": {
            # Of this run only: a resumed run's rate covers the shards it cast, not those an earlier run did.
            "shards_covered": cast_now,
            "cast": cast_bytes / cast_s / 1e9 if cast_s > 0 and cast_bytes else None,
            "cast_plus_verify": cast_bytes / (cast_s + verify_s) / 1e9
            if options.verify and cast_bytes and cast_s + verify_s > 0
            else None,
        },
        "a_log": {
            "tensors": len(a_logs),
            "padding_all_zero": sum(1 for a in a_logs if a.padding_all_zero),
            "trimmed": sum(1 for a in a_logs if a.trimmed_to is not None),
            "details": sorted((a.to_json() for a in a_logs), key=lambda a: a["name"]),
        },
        "exclude_modules": len(plan.exclude_modules),
        "verify": None if verify is None else verify.to_json(),
        # Who cast what (timings per rank); the shards' own times are in per_shard.
        "ranks": {"world_size": coord.world_size, "per_rank": [row.to_json() for row in rows]},
        "per_shard": [records[sp.name].to_json() for sp in plan.shards],
    }


def _already_done(options: CastOptions, plan: CastPlan, report: dict | None, coord: Coordinator,
                  mine: list[ShardPlan]) -> dict:
    """The output is a finished cast of this source with these options: nothing is cast again.
    With --verify every shard is verified again from disk (each rank its own) and the report's
    verify section replaced. Returns the report with ``already_done`` set."""
    if options.verify:
        t0 = time.perf_counter()
        tasks = [_shard_task(plan, options, sp) for sp in mine]
        results: list[VerifyResult] = []
        with _Executor(min(options.workers, max(1, len(tasks))), options.progress, options.main_process_works) as ex:
            ex.run(verify_full, tasks, sum(progress_bytes(t) for t in tasks), _rank_desc("verify", coord),
                   results.append)
        sent = coord.exchange("verify", VerifyMessage(results, [sp.name for sp in mine]).to_json())
        if coord.is_root:
            verify_all = [VerifyMessage.from_json(d, f"{coord.who(r)}'s verify message") for r, d in enumerate(sent)]
            try:  # the figures the finished cast reported, read back from its report
                stats = cast_stats_from_json(report.get("stats"), "its \"stats\"")
            except RecordError as exc:
                raise CheckpointError(f"{options.output / REPORT_FILE}: {exc}; pass --overwrite to cast again") from None
            verify = _checked_verify(plan, verify_all, stats, sorted(plan_totals(plan).shards), report["matrices_cast"])
            report = {**report, "verify": verify.to_json(),
                      "seconds": {**report["seconds"], "verify": time.perf_counter() - t0}}
            write_atomic_text(options.output / REPORT_FILE, json.dumps(report, indent=2) + "\n")
    if coord.is_root and coord.distributed:
        shutil.rmtree(options.output / STATE_DIR, ignore_errors=True)  # only the launch token is in it
    coord.exchange("final", None, last=True)
    if not coord.is_root:
        return {"rank": {"rank": coord.rank, "shards": [sp.name for sp in mine], "cast_now": 0, "resumed": len(mine)},
                "world_size": coord.world_size, "output": str(options.output.resolve()), "already_done": True,
                "verified_now": options.verify}
    return {**report, "already_done": True, "verified_now": options.verify}


def _window_line(s: dict) -> str:
    """Blocks outside the 17-binade window: re-quantized, and how many of them stayed exact
    (all-zero blocks always do) and how many are lossy."""
    lossy = s["blocks"] - s["exact_blocks"]
    n = s["out_of_range_blocks"]
    if n == 0:
        return "none: every block cast in closed form"
    return (f"{n:,} blocks re-quantized: {n - lossy:,} still exact (all-zero blocks, {s['zero_exponent_blocks']:,} "
            f"with exponent 0, are exact in any scale), {lossy:,} lossy")


def _resumed_scope(report: dict) -> str:
    """', this run's 3 of 8 shards (5 cast by an earlier run)' where the run resumed, else ''."""
    shards = report["shards"]
    if not shards["resumed"] or not shards["cast_now"]:
        return ""
    return (f", this run's {shards['cast_now']} of {shards['total']} shards "
            f"({shards['resumed']} cast by an earlier run)")


def format_summary(report: dict) -> str:
    """The human summary table (like the seed model card's)."""
    s = report["stats"]
    pct = 100.0 * report["bit_exact_fraction"]
    tp = report["throughput_gb_per_s"]
    a = report["a_log"]
    # A finished cast found again without --verify: its stored figures are from when it was written.
    stored = " (when the output was written; --verify runs it again)" if (
        report.get("already_done") and not report.get("verified_now")) else ""
    rows = [
        ("Cast fidelity", f"{s['exact_blocks']:,} / {s['blocks']:,} blocks bit-exact ({pct:.4f}%), max_abs_err {s['max_abs_err']:g}"),
        ("Outside the window", _window_line(s)),
        ("Matrices cast", f"{report['matrices_cast']:,} (routed MoE experts)"),
        ("Shards", f"{report['shards']['total']} ({report['shards']['resumed']} resumed)"),
        ("A_log", f"{a['tensors']} checked, padding exactly zero in {a['padding_all_zero']}, trimmed {a['trimmed']}"),
        ("exclude_modules", f"{report['exclude_modules']} globs"),
        ("Time", f"cast {report['seconds']['cast']:.2f} s"
         + (f" (each shard verified in-line), final verify pass {report['seconds']['verify']:.2f} s{stored}"
            if report.get("verify") else "")
         + f", total {report['seconds']['total']:.2f} s"),
        ("Throughput", "n/a (all shards resumed)" if tp["cast"] is None else f"{tp['cast']:.3f} GB/s of source read"
         + (f" ({tp['cast_plus_verify']:.3f} GB/s with verify)" if tp["cast_plus_verify"] else "")
         + _resumed_scope(report)),
    ]
    v = report.get("verify")
    if v:
        rows.append(("Verify", f"PASSED: {v['exact_blocks']:,} / {v['blocks']:,} blocks proved equal from disk, "
                     f"{v['sample_matrices']} matrices ({v['sample_elements']:,} values) fully dequantized, "
                     f"{v['carried_tensors']} carried tensors byte-identical{stored}"))
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(w)}  {val}" for k, val in rows)
