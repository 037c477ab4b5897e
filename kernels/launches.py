"""Count the device launches of a piece of host code: Triton kernel launches and the torch ops
that launch a kernel on a GPU (memsets, copies, arithmetic), with host synchronisations flagged.

Used by tests/test_launches.py (CPU, interpreter or no execution at all) and bench/bench_graph.py
(GPU). Triton launches are counted where every ``kernel[grid](...)`` goes through
(``KernelInterface.__getitem__``, for compiled and interpreted kernels alike); torch ops through a
TorchDispatchMode. Only allocation and view ops are treated as launch-free (``torch.empty`` takes
memory from the caching allocator; a view moves no data); every other op counts, so an op this
list does not know is counted, never missed. Ops the interpreter runs inside a Triton launch are
not counted (they are that launch).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

from torch.utils._python_dispatch import TorchDispatchMode

# aten ops that allocate without initialising, or only create a view / read metadata.
_FREE_OPS = frozenset({
    "empty.memory_format", "empty_strided.default", "empty_like.default", "new_empty.default",
    "new_empty_strided.default",
    "view.default", "_unsafe_view.default", "as_strided.default", "alias.default", "detach.default",
    "slice.Tensor", "select.int", "t.default", "transpose.int", "permute.default", "expand.default",
    "unsqueeze.default", "squeeze.dim", "squeeze.default", "split.Tensor", "unbind.int",
    "lift_fresh.default", "sym_size.int", "sym_stride.int", "sym_numel.default", "sym_storage_offset.default",
})
# Ops that make the host wait for the device (values read back, data-dependent shapes).
_SYNC_OPS = frozenset({
    "_local_scalar_dense.default", "nonzero.default", "masked_select.default", "unique_dim.default",
    "_unique2.default", "equal.default", "is_nonzero.default", "item.default",
})


@dataclass
class LaunchCount:
    """What one counted region launched, in order."""

    triton: list[str] = field(default_factory=list)  # Triton kernel names
    torch_ops: list[str] = field(default_factory=list)  # aten ops that launch a kernel on a GPU
    syncs: list[str] = field(default_factory=list)  # aten ops that synchronise with the host

    @property
    def total(self) -> int:
        """Device launches: Triton kernels plus launching torch ops."""
        return len(self.triton) + len(self.torch_ops)

    def summary(self) -> dict:
        return {"launches": self.total, "triton": list(self.triton), "torch_ops": list(self.torch_ops),
                "syncs": list(self.syncs)}


class _OpCounter(TorchDispatchMode):
    def __init__(self, count: LaunchCount, inside: threading.local):
        super().__init__()
        self.count, self.inside = count, inside

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not getattr(self.inside, "active", False):
            name = f"{func.overloadpacket.__name__}.{func._overloadname}"
            if name in _SYNC_OPS:
                self.count.syncs.append(name)
            if name not in _FREE_OPS:
                self.count.torch_ops.append(name)
        return func(*args, **(kwargs or {}))


def _launch_classes() -> list[type]:
    """The classes whose __getitem__ launches kernels (compiled and interpreted)."""
    from triton.runtime.jit import KernelInterface

    classes = [KernelInterface]
    try:
        from triton.runtime.interpreter import InterpretedFunction

        classes.append(InterpretedFunction)
    except ImportError:  # pragma: no cover - interpreter module absent
        pass
    from triton.runtime.jit import JITFunction

    classes.append(JITFunction)
    # Patch each class that defines __getitem__ itself (a subclass may override the base's).
    return [c for c in dict.fromkeys(classes) if "__getitem__" in c.__dict__]


@contextlib.contextmanager
def count_launches(execute: bool = True) -> Iterator[LaunchCount]:
    """Count the launches made inside the ``with`` block (this thread's).

    execute=False: Triton kernels are counted but not run (the host code path and its torch ops
    still run), e.g. to count a call at shapes too large for the interpreter; the outputs are then
    meaningless.
    """
    count = LaunchCount()
    inside = threading.local()
    patched = []

    def wrap(orig):
        def __getitem__(self, grid):
            launcher = orig(self, grid)

            def launch(*args, **kwargs):
                if getattr(inside, "active", False):  # a nested patched __getitem__: one launch
                    return launcher(*args, **kwargs)
                count.triton.append(getattr(self, "__name__", None) or getattr(getattr(self, "fn", None), "__name__", "?"))
                if not execute:
                    return None
                inside.active = True
                try:
                    return launcher(*args, **kwargs)
                finally:
                    inside.active = False

            return launch

        return __getitem__

    for cls in _launch_classes():
        orig = cls.__dict__["__getitem__"]
        patched.append((cls, orig))
        cls.__getitem__ = wrap(orig)
    try:
        with _OpCounter(count, inside):
            yield count
    finally:
        for cls, orig in patched:
            cls.__getitem__ = orig
