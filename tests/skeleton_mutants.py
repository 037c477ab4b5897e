"""Mutants of the MoE skeleton's last-arrival sums, made in the Triton SOURCE: a text edit of a
copy of kernels/moe_details/skeleton.py, imported from a temporary folder, whose functions then
replace the real skeleton's in both kernel families' modules (moe_details/kernels.py and
moe_fp4_details/kernels.py import them by name). Used by the PTX dataflow check
(tests/ptx_ordering.py, in its compile subprocess) and by the weak-memory interpreter test
(tests/test_memory_ordering.py).

Every edit must match the skeleton's text exactly once, so a refactor of the skeleton makes
these tests fail loudly instead of compiling an unchanged kernel.
"""

from __future__ import annotations

import contextlib
import importlib.util
import pathlib
import sys
import tempfile
from dataclasses import dataclass
from typing import Iterator

SKELETON = pathlib.Path(__file__).resolve().parent.parent / "kernels" / "moe_details" / "skeleton.py"

_UP_STORE = "    tl.store(part + pid_k * slice_elems + I, acc_u, mask=mask)\n"
_SPLIT_K_RETURN = "    return arrive(tickets_ptr + pid_b * tl.num_programs(1) + pid_n, pid_k >= 0) == SPLIT_K - 1\n"
_TOPK_STORE = """    if ATOMIC:
        tl.atomic_add(buf_ptr + t_idx * H + n_idx, acc, mask=ok_r & ok_n)
    else:
        p_idx, _ = tile_index(pid_k * num_pairs + pair, offs_n, SWAP_AB)
        tl.store(buf_ptr + p_idx * H + n_idx, acc, mask=ok_r & ok_n)
"""
_TOPK_ARRIVE = "    old = arrive(tickets_ptr + token * tl.num_programs(1) + pid_n, row_ok)\n"


@dataclass(frozen=True)
class Mutant:
    """A source edit: (old, new) replacements applied in order, each matching exactly once;
    ``sums``: the last-arrival sums it breaks ("split_k", "top_k")."""

    name: str
    what: str
    edits: tuple[tuple[str, str], ...]
    sums: tuple[str, ...]


MUTANTS = {m.name: m for m in (
    Mutant("up_after_arrive", "split_k_arrive stores the up half of its partials after arrive()",
           ((_UP_STORE + _SPLIT_K_RETURN,
             _SPLIT_K_RETURN.replace("    return ", "    last = ") + _UP_STORE + "    return last\n"),), ("split_k",)),
    Mutant("topk_after_arrive", "combine_by_last_arrival stores (or atomically adds) its top-k rows after arrive()",
           ((_TOPK_STORE, ""), (_TOPK_ARRIVE, _TOPK_ARRIVE + _TOPK_STORE)), ("top_k",)),
    Mutant("no_barrier", "arrive() without tl.debug_barrier() before the atomic",
           (("    tl.debug_barrier()\n    return tl.atomic_add(", "    return tl.atomic_add("),), ("split_k", "top_k")),
    Mutant("relaxed", "the arrival atomic relaxed (sem='relaxed')",
           (('sem="acq_rel", scope="gpu"', 'sem="relaxed", scope="gpu"'),), ("split_k", "top_k")),
    Mutant("cta_scope", "the arrival atomic at CTA scope (scope='cta')",
           (('sem="acq_rel", scope="gpu"', 'sem="acq_rel", scope="cta"'),), ("split_k", "top_k")),
)}


def mutated_source(name: str, source: str | None = None) -> str:
    """The skeleton's source with mutant ``name``'s edits applied (ValueError naming the edit
    that does not match exactly once)."""
    m = MUTANTS[name]
    text = SKELETON.read_text() if source is None else source
    for old, new in m.edits:
        n = text.count(old)
        if n != 1:
            raise ValueError(f"mutant {name}: the skeleton text {old[:60]!r}... occurs {n} times (expected once)")
        text = text.replace(old, new)
    return text


def _kernel_modules():
    from k3nvfp4.kernels.moe_details import kernels as w4a16
    from k3nvfp4.kernels.moe_fp4_details import kernels as fp4
    from k3nvfp4.kernels.moe_w4a8_details import kernels as w4a8

    return (w4a16, fp4, w4a8)


@contextlib.contextmanager
def installed(name: str, folder: pathlib.Path | None = None) -> Iterator[object]:
    """Within the block, every kernel family (W4A16, FP4, the Hopper W4A8 mode) calls mutant ``name``'s skeleton functions (the
    mutated copy is a real file: Triton reads a jit function's source from it). Must be entered
    before the kernels are first compiled in this process (Triton keys its cache on the source of
    every function a kernel calls, read when the kernel is first compiled)."""
    from k3nvfp4.kernels.moe_details import skeleton

    with contextlib.ExitStack() as stack:
        if folder is None:
            folder = pathlib.Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="skeleton-mutant-")))
        path = folder / f"k3nvfp4_skeleton_{name}.py"
        path.write_text(mutated_source(name))
        spec = importlib.util.spec_from_file_location(f"k3nvfp4_skeleton_{name}", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
        saved = []
        for km in _kernel_modules():
            for attr, value in list(vars(km).items()):
                if getattr(skeleton, attr, None) is value and hasattr(mod, attr):
                    saved.append((km, attr, value))
                    setattr(km, attr, getattr(mod, attr))
        if not saved:
            raise RuntimeError("no skeleton function found in the kernel modules: nothing mutated")
        try:
            yield mod
        finally:
            for km, attr, value in saved:
                setattr(km, attr, value)
            sys.modules.pop(spec.name, None)
