"""A weak-memory adversary for Triton's CPU interpreter: global stores that a GPU may make visible
to other programs late are made visible late, so that a last-arrival sum that relies on an order
the kernel does not establish reads stale data here too.

The interpreter runs the programs of a launch one after another, each to its end, on one copy
of memory: every store is at once visible to every later program, which no GPU promises. Within
``weak_memory(mode)`` every launch runs under one of two models (a program = a CTA; its global
stores and float atomic adds are "writes"):

``"after_release"``
    A program's writes issued after its first release atomic (semantics release or acq_rel)
    are buffered and applied when the grid finishes; the writes before it are applied at once.
    Catches a store moved past the arrival.

``"unreleased"``
    Every write is buffered in its program until the program releases it: an atomic with
    release semantics (release / acq_rel) at GPU or system scope applies the program's writes
    issued before the program's last ``tl.debug_barrier()`` (a CTA's other threads' writes are
    ordered before the one thread's atomic by a barrier only); writes never released are
    applied when the grid finishes, the programs' buffers in a seeded random order. A program
    sees its own buffered writes (program order). A load by a program that has not performed
    an acquire atomic (acquire / acq_rel, GPU or system scope) sees, at every address another
    program of this grid has written, the value from before the grid (a load not ordered after
    the release may read any older value; the one before the grid is one of them). After its
    acquire, the whole program sees what was released: the barrier that orders the CTA's other
    threads after the acquiring thread is Triton's own (it broadcasts the atomic's result
    through shared memory), not in the kernel source, and the PTX dataflow check
    (tests/ptx_ordering.py) proves it is there.

Integer atomics (the arrival counters) are performed at once in both models: they are the
synchronisation. The launch's output, after the grid, is what a GPU would leave in memory.
Tested by tests/test_weak_memory.py.
"""

from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

MODES = ("after_release", "unreleased")


@dataclass
class _Write:
    addrs: np.ndarray  # uint64 element addresses (masked-off lanes dropped)
    values: np.ndarray  # the values, in the kernel's numpy dtype
    fadd: bool  # a float atomic add rather than a store


@dataclass
class _Program:
    pid: tuple
    pending: list[_Write] = field(default_factory=list)
    barrier_mark: int = 0  # writes pending[:barrier_mark] were issued before the last barrier
    released_once: bool = False
    acquired: bool = False


class _Adversary:
    def __init__(self, mode: str, seed: int):
        from triton._C.libtriton import interpreter as _interp
        from triton._C.libtriton import ir as _ir

        self.mode, self.rng = mode, random.Random(seed)
        self._interp, self._ir = _interp, _ir
        self.programs: list[_Program] = []
        self.current: _Program | None = None
        self.undo: dict[int, tuple[int, object]] = {}  # address -> (writer index, value before the grid)
        self.undo_arrays = None  # sorted (addresses, writers, values) of undo, rebuilt lazily
        self.written: set[int] = set()
        self.stats = {"buffered": 0, "stale_loads": 0, "forwarded": 0}

    # --- grid and programs
    def grid_start(self) -> None:
        self.programs, self.current, self.undo, self.undo_arrays = [], None, {}, None
        self.written: set[int] = set()  # addresses written (or poisoned) in this grid

    def program_start(self, pid: tuple) -> None:
        self.current = _Program(pid)
        self.programs.append(self.current)

    def grid_end(self) -> None:
        order = list(self.programs)
        self.rng.shuffle(order)
        for p in order:
            self._apply(p, p.pending)
            p.pending = []

    # --- memory
    def _apply(self, prog: _Program, writes: list[_Write]) -> None:
        me = self.programs.index(prog)
        for w in writes:
            if not w.addrs.size:
                continue
            before = self._interp.load(w.addrs, np.ones(w.addrs.shape, bool), np.zeros(w.addrs.shape, w.values.dtype),
                                       w.values.dtype)
            for a, v in zip(w.addrs.tolist(), before):
                self.undo.setdefault(a, (me, v))
            self.written.update(w.addrs.tolist())
            if w.fadd:
                self._interp.atomic_rmw(self._interp.RMW_OP.FADD, w.addrs, w.values, np.ones(w.addrs.shape, bool),
                                        self._interp.MEM_SEMANTIC.RELAXED)
            else:
                self._interp.store(w.addrs, w.values, np.ones(w.addrs.shape, bool))
            self.undo_arrays = None

    def write(self, ptrs, value, mask, fadd: bool) -> bool:
        """Buffer a write (True) or let it through (False)."""
        p = self.current
        if p is None or (self.mode == "after_release" and not p.released_once):
            return False
        m = mask.data.astype(bool).ravel() if mask is not None else np.ones(ptrs.data.size, bool)
        vals = np.broadcast_to(value.data, ptrs.data.shape).ravel()[m].copy()
        addrs = ptrs.data.ravel()[m].astype(np.uint64)
        p.pending.append(_Write(addrs, vals, fadd))
        self.stats["buffered"] += 1
        if not fadd:
            # What another program reads here before the store is released is the location's
            # older value; scratch memory holds anything, often the same call's bits of a
            # previous run (the allocator reuses blocks). Poison it (all-ones bytes: a NaN in
            # fp32 and bf16, -1 in integers) so that an early read cannot pass for the stored one.
            fresh = np.array([a not in self.written for a in addrs.tolist()], dtype=bool)
            if fresh.any():
                poison = np.full(int(fresh.sum()), 0xFF, np.uint8).repeat(vals.dtype.itemsize).view(vals.dtype)
                self._interp.store(addrs[fresh], poison, np.ones(int(fresh.sum()), bool))
                self.written.update(addrs[fresh].tolist())
        return True

    def barrier(self) -> None:
        if self.current is not None:
            self.current.barrier_mark = len(self.current.pending)

    def atomic(self, sem, scope, mask) -> None:
        """Called before an integer atomic is performed: release what it releases."""
        p = self.current
        if p is None or (mask is not None and not np.asarray(mask.data).any()):
            return
        S = self._interp.MEM_SEMANTIC
        releases = sem in (S.RELEASE, S.ACQUIRE_RELEASE)
        wide = scope in (self._ir.MEM_SYNC_SCOPE.GPU, self._ir.MEM_SYNC_SCOPE.SYSTEM)
        if self.mode == "after_release":
            p.released_once = p.released_once or releases
            return
        if releases and wide:
            self._apply(p, p.pending[:p.barrier_mark])
            p.pending, p.barrier_mark = p.pending[p.barrier_mark:], 0
        if sem in (S.ACQUIRE, S.ACQUIRE_RELEASE) and wide:
            p.acquired = True

    def _undo_arrays(self):
        if self.undo_arrays is None:
            addrs = np.fromiter(self.undo.keys(), dtype=np.uint64, count=len(self.undo))
            order = np.argsort(addrs)
            writers = np.array([w for w, _ in self.undo.values()], dtype=np.int64)[order]
            values = [v for _, v in self.undo.values()]
            self.undo_arrays = (addrs[order], writers, [values[i] for i in order])
        return self.undo_arrays

    def load(self, ptrs, mask, ret: np.ndarray) -> np.ndarray:
        """The values a load returns under the model: stale where not acquired, own writes forwarded."""
        p = self.current
        if p is None or not p.pending and (self.mode == "after_release" or p.acquired or not self.undo):
            return ret
        flat_addr = ptrs.data.ravel().astype(np.uint64)
        m = mask.data.astype(bool).ravel() if mask is not None else np.ones(flat_addr.size, bool)
        out = ret.copy().ravel()
        if self.mode == "unreleased" and not p.acquired and self.undo:
            addrs, writers, values = self._undo_arrays()
            me = self.programs.index(p)
            idx = np.clip(np.searchsorted(addrs, flat_addr), 0, len(addrs) - 1)
            hit = m & (addrs[idx] == flat_addr) & (writers[idx] != me)
            for i in np.nonzero(hit)[0]:
                out[i] = values[idx[i]]
            self.stats["stale_loads"] += int(hit.sum())
        for w in p.pending:  # program order: its own writes, oldest first
            if w.values.dtype.itemsize != out.dtype.itemsize:
                if np.isin(flat_addr[m], w.addrs).any():
                    raise NotImplementedError("weak_memory: a load of another width than the buffered write")
                continue
            sel = np.nonzero(m & np.isin(flat_addr, w.addrs))[0]
            if not sel.size:
                continue
            pos = {a: i for i, a in enumerate(w.addrs.tolist())}
            for i in sel:
                j = pos.get(int(flat_addr[i]))
                if j is not None:
                    v = w.values[j].view(out.dtype) if w.values.dtype != out.dtype else w.values[j]
                    out[i] = out[i] + v if w.fadd else v
                    self.stats["forwarded"] += 1
        return out.reshape(ret.shape)


@contextlib.contextmanager
def weak_memory(mode: str, seed: int = 0) -> Iterator[_Adversary]:
    """Run every interpreted launch in the block under ``mode`` (module docstring); yields the
    adversary (its ``stats`` count buffered writes, stale loads and forwarded loads)."""
    if mode not in MODES:
        raise ValueError(f"mode: {mode!r} (known: {', '.join(MODES)})")
    from triton.runtime import interpreter as ti

    adv = _Adversary(mode, seed)
    b = ti.interpreter_builder
    saved = {name: getattr(b, name) for name in ("set_grid_dim", "set_grid_idx", "create_masked_store",
                                                  "create_masked_load", "create_atomic_rmw", "create_atomic_cas",
                                                  "create_barrier")}
    own = {name for name in saved if name in vars(b)}  # patched on the instance by someone else
    restore_saved = ti.GridExecutor._restore_args_dev
    FADD = ti.InterpreterBuilder.ir_rmw_op_to_interpreter_rmw_op

    def set_grid_dim(nx, ny, nz):
        adv.grid_start()
        return saved["set_grid_dim"](nx, ny, nz)

    def set_grid_idx(x, y, z):
        adv.program_start((x, y, z))
        return saved["set_grid_idx"](x, y, z)

    def create_masked_store(ptrs, value, mask, cache_modifier, eviction_policy):
        if not adv.write(ptrs, value, mask, fadd=False):
            return saved["create_masked_store"](ptrs, value, mask, cache_modifier, eviction_policy)

    def create_masked_load(ptrs, mask, other, cache_modifier, eviction_policy, is_volatile):
        ret = saved["create_masked_load"](ptrs, mask, other, cache_modifier, eviction_policy, is_volatile)
        ret.data = adv.load(ptrs, mask, ret.data)
        return ret

    def create_atomic_rmw(rmwOp, ptr, val, mask, sem, scope):
        isem = ti.InterpreterBuilder.ir_sem_to_interpreter_sem[sem]
        if FADD.get(rmwOp) == adv._interp.RMW_OP.FADD:
            # a float atomic add is a write of the sum: buffered like a store (its old value,
            # unused by the kernels, is what memory holds now)
            if adv.write(ptr, val, mask, fadd=True):
                cur = saved["create_masked_load"](ptr, mask, None, None, None, False)
                return ti.TensorHandle(cur.data, val.dtype.scalar)
            return saved["create_atomic_rmw"](rmwOp, ptr, val, mask, sem, scope)
        adv.atomic(isem, scope, mask)
        return saved["create_atomic_rmw"](rmwOp, ptr, val, mask, sem, scope)

    def create_atomic_cas(ptr, cmp, val, sem, scope):
        adv.atomic(ti.InterpreterBuilder.ir_sem_to_interpreter_sem[sem], scope, None)
        return saved["create_atomic_cas"](ptr, cmp, val, sem, scope)

    def create_barrier():
        adv.barrier()
        return saved["create_barrier"]()

    def _restore_args_dev(self, *args, **kwargs):
        adv.grid_end()
        return restore_saved(self, *args, **kwargs)

    for name, fn in (("set_grid_dim", set_grid_dim), ("set_grid_idx", set_grid_idx),
                     ("create_masked_store", create_masked_store), ("create_masked_load", create_masked_load),
                     ("create_atomic_rmw", create_atomic_rmw), ("create_atomic_cas", create_atomic_cas),
                     ("create_barrier", create_barrier)):
        setattr(b, name, fn)
    ti.GridExecutor._restore_args_dev = _restore_args_dev
    try:
        yield adv
    finally:
        for name, fn in saved.items():
            if name in own:
                setattr(b, name, fn)
            else:
                delattr(b, name)  # the class's method again
        ti.GridExecutor._restore_args_dev = restore_saved


# Scratch buffers of the last-arrival sums: their contents after a launch differ by design
# (poisoned, or never read): the launch log compares the other arguments.
SCRATCH_ARGS = ("part_ptr", "buf_ptr", "tickets_ptr")


@dataclass
class Launch:
    kernel: str
    outputs: dict  # argument name -> tensor after the launch (a copy)

    def sum_name(self) -> str:
        """The last-arrival sum the kernel finishes (skeleton.py)."""
        if "gemm1" in self.kernel:
            return f"GEMM1's split-K sum ({self.kernel}: skeleton.split_k_arrive / split_k_sum)"
        if "gemm2" in self.kernel:
            return f"GEMM2's top-k sum ({self.kernel}: skeleton.combine_by_last_arrival)"
        return f"no last-arrival sum ({self.kernel})"


@contextlib.contextmanager
def launch_log() -> Iterator[list[Launch]]:
    """Record every interpreted launch in the block: the kernel's name and a copy of each tensor
    argument (but SCRATCH_ARGS) after it ran."""
    import inspect

    import torch
    from triton.runtime import interpreter as ti

    log: list[Launch] = []
    call = ti.GridExecutor.__call__

    def logged(self, *args, **kwargs):
        call(self, *args, **kwargs)
        names = inspect.signature(self.fn).parameters
        bound = inspect.signature(self.fn).bind_partial(*args, **{k: v for k, v in kwargs.items() if k in names}).arguments
        log.append(Launch(self.fn.__name__, {k: v.detach().clone() for k, v in bound.items()
                                            if isinstance(v, torch.Tensor) and k not in SCRATCH_ARGS}))

    # Buffers the host code allocates with torch.empty hold whatever memory held, and the rows a
    # kernel never writes (padding past the used blocks) would differ between two runs: zeroed
    # here, so that two runs compare bitwise.
    empty, empty_like = torch.empty, torch.empty_like
    ti.GridExecutor.__call__ = logged
    torch.empty = lambda *a, **kw: empty(*a, **kw).zero_()
    torch.empty_like = lambda *a, **kw: empty_like(*a, **kw).zero_()
    try:
        yield log
    finally:
        ti.GridExecutor.__call__ = call
        torch.empty, torch.empty_like = empty, empty_like


def first_difference(expected: list[Launch], got: list[Launch]) -> str | None:
    """The first launch whose outputs differ bitwise between two runs of the same calls, named
    with its sum and argument; None when every launch agrees."""
    import torch

    if [lg.kernel for lg in expected] != [lg.kernel for lg in got]:
        return f"different launches: {[lg.kernel for lg in expected]} vs {[lg.kernel for lg in got]}"
    for n, (a, b) in enumerate(zip(expected, got)):
        for name, t in a.outputs.items():
            u = b.outputs[name]
            same = torch.equal(_bits(t), _bits(u))
            if not same:
                return f"launch {n}: {b.sum_name()}: {name} differs"
    return None


def _bits(t):
    """A tensor's bytes (NaN compares equal to the same NaN)."""
    import torch

    return t.reshape(-1).contiguous().view(torch.uint8) if t.numel() else t
