"""``--verify``: prove from the files on disk that the NVFP4 output equals the MXFP4 source.

Runs in the worker that wrote the shard, right after the rename, so both files are still
in the page cache; it maps the files (never the tensors just written) and compares in place.
Per 32-element source block j (vectorised over whole matrices):
  proof  - the 16 packed bytes are identical (raw byte compare of the mapped ranges, no
           unpacking) and e4m3(scale_a) * scale_2 == e4m3(scale_b) * scale_2 == 2^k_j
           exactly, checked in the integer domain (scale_2 = 2^m: both E4M3 bytes, read as
           one uint16, equal a 256-entry table's pair for the E8M0 byte), or every nibble
           is +-0 and both scales finite (then any scale gives the same value);
  other  - blocks without that proof (re-quantized ...) are dequantized both ways in
           float64 and compared value by value: exact iff all 32 values are equal.
Plus a full dequantize-and-compare (float32, bitwise for exact blocks) of a sample of
matrices, the output header against the plan, and every carried tensor byte by byte.
The totals must agree with what the cast reported, or the verification fails.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import ctypes
import ctypes.util
import dataclasses
import functools
import math
import mmap

import numpy as np
import torch

from ..kernels import formats
from . import _progress
from .records import VerifyResult
from .safetensors_io import DTYPES, ITEMSIZE, CheckpointError, MappedShards, SafetensorsHeader, read_header

if TYPE_CHECKING:
    from .plan import ExpertMatrix, ShardTask


class _Ctx:
    def __init__(self, task: "ShardTask"):
        self.task = task
        self.headers: dict[str, SafetensorsHeader] = {}
        self.maps = {"src": MappedShards(task.source), "out": MappedShards(task.output)}
        self.res = VerifyResult(task.shard.name)

    def fail(self, msg: str) -> None:
        self.res.fail(msg)

    def out_header(self, shard: str) -> SafetensorsHeader:
        if shard not in self.headers:
            self.headers[shard] = read_header(self.task.output / shard)
        return self.headers[shard]

    def mapped(self, root: str, shard: str) -> mmap.mmap:
        """Shard of root "src" or "out", mapped: compared in place, without copying into buffers."""
        return self.maps[root].get(shard)

    def tensor(self, root: str, ref_shard: str, entry) -> torch.Tensor:
        mm = self.mapped(root, ref_shard)
        if entry.end > len(mm):
            raise CheckpointError(f"{ref_shard}: truncated: tensor {entry.name} ends beyond the file")
        dtype = DTYPES[entry.dtype]
        if entry.nbytes < 4096 or entry.begin % ITEMSIZE[entry.dtype]:
            return torch.frombuffer(bytearray(mm[entry.begin:entry.end]), dtype=dtype).reshape(entry.shape)
        return torch.frombuffer(mm, dtype=dtype, count=entry.nbytes // ITEMSIZE[entry.dtype], offset=entry.begin).reshape(entry.shape)

    def out_tensor(self, shard: str, name: str) -> torch.Tensor:
        h = self.out_header(shard)
        if name not in h.entries:
            raise CheckpointError(f"{h.path}: tensor {name} is missing from the output")
        return self.tensor("out", shard, h.entries[name])

    def close(self) -> None:
        for maps in self.maps.values():
            maps.close()


# Byte ranges are compared with libc's memcmp on the mapped memory (one pass, no
# temporaries); without it (no C library found), np.array_equal in 1 MiB chunks, which
# keeps its bool temporaries in cache instead of allocating one the size of a tensor.
_CMP_CHUNK = 1 << 20
# Rows per step of the sampled full dequantization (its float32 temporaries stay in cache).
_SAMPLE_ROWS = 128


def _load_memcmp():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        fn = libc.memcmp
    except (OSError, AttributeError, TypeError):
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    return fn


_MEMCMP = _load_memcmp()


def _equal_bytes(a: np.ndarray, b: np.ndarray, *, use_memcmp: bool = True) -> bool:
    """Raw byte equality of two uint8 arrays (views of mapped files; nothing is unpacked)."""
    a, b = a.reshape(-1), b.reshape(-1)
    if a.size != b.size:
        return False
    if a.size == 0:
        return True
    if use_memcmp and _MEMCMP is not None and a.flags.c_contiguous and b.flags.c_contiguous:
        return _MEMCMP(a.ctypes.data, b.ctypes.data, a.size) == 0
    for lo in range(0, a.size, _CMP_CHUNK):
        if not np.array_equal(a[lo : lo + _CMP_CHUNK], b[lo : lo + _CMP_CHUNK]):
            return False
    return True


def _same_bytes(a: mmap.mmap, a_off: int, b: mmap.mmap, b_off: int, n: int) -> bool:
    if a_off + n > len(a) or b_off + n > len(b):
        return False
    return _equal_bytes(np.frombuffer(a, np.uint8, n, a_off), np.frombuffer(b, np.uint8, n, b_off))


def _check_header(ctx: _Ctx) -> None:
    plan = ctx.task.shard
    h = ctx.out_header(plan.name)
    got = sorted(h.entries.values(), key=lambda e: e.begin)
    want = [it.spec for it in plan.items]
    if [(e.name, e.dtype, e.shape) for e in got] != [(s.name, s.dtype, s.shape) for s in want]:
        ctx.fail(f"{h.path}: tensors/dtypes/shapes differ from the plan")


def _check_carried(ctx: _Ctx) -> None:
    h = ctx.out_header(ctx.task.shard.name)
    for it in ctx.task.shard.items:
        if it.kind not in ("carry", "a_log_trim"):
            continue
        out = h.entries.get(it.spec.name)
        if out is None:
            continue  # reported by the header check
        n = out.nbytes if it.kind == "a_log_trim" else it.src.entry.nbytes
        if out.nbytes != n or not _same_bytes(
            ctx.mapped("src", it.src.shard), it.src.entry.begin, ctx.mapped("out", ctx.task.shard.name), out.begin, n
        ):
            ctx.fail(f"{h.path}: carried tensor {it.spec.name} differs from the source")
        ctx.res.carried_tensors += 1
        _progress.report(it.src.entry.nbytes)


def e4m3_pow2_table(scale_2: float) -> tuple[np.ndarray, np.ndarray] | None:
    """For scale_2 = 2^m: per E8M0 byte b, the E4M3 (fn) bit pattern of 2^(b - 127 - m) and
    whether E4M3 holds it exactly. None when scale_2 is not a finite power of two."""
    if not math.isfinite(scale_2) or scale_2 <= 0 or math.frexp(scale_2)[0] != 0.5:
        return None
    m = math.frexp(scale_2)[1] - 1
    j = np.arange(256, dtype=np.int64) - formats.E8M0_BIAS - m
    normal = (j + 7) << 3  # exponent field j + 7 (bias 7), mantissa 0; j in [-6, 8]
    subnormal = np.left_shift(1, np.clip(j + 9, 0, 7))  # 2^-9, 2^-8, 2^-7 -> mantissa 1, 2, 4
    bits = np.where(j >= -6, normal, subnormal)
    valid = (j >= formats.E4M3_MIN_EXP2) & (j <= formats.E4M3_MAX_EXP2) & (np.arange(256) != formats.E8M0_NAN)
    return np.where(valid, bits, 0).astype(np.uint8), valid


def e4m3_pair_table(scale_2: float) -> np.ndarray | None:
    """uint32 table, E8M0 byte b -> the two E4M3 bytes of one 32-block read as a uint16
    (both equal to the bit pattern of 2^(b - 127 - m)), or 0x10000, which no uint16
    equals, where E4M3 cannot hold that power of two. None when scale_2 is not 2^m."""
    lut = e4m3_pow2_table(scale_2)
    if lut is None:
        return None
    bits, valid = lut
    return np.where(valid, bits.astype(np.uint32) * 0x0101, 0x10000).astype(np.uint32)


@functools.lru_cache(maxsize=1)
def _e2m1_byte_values() -> np.ndarray:
    """uint64 [256]: the two float32 E2M1 values of each packed byte (low nibble first),
    decoded once by the format codecs; one gather then unpacks a whole row of bytes."""
    codes = formats.unpack_e2m1(torch.arange(256, dtype=torch.uint8))
    return formats.e2m1_to_float(codes).numpy().reshape(256, 2).copy().view(np.uint64).reshape(256)


def dequantize_rows_mxfp4(packed: np.ndarray, e8m0: np.ndarray) -> np.ndarray:
    """Same values and float32 rounding as ``formats.dequantize_mxfp4`` (codec tables, one
    gather per byte). packed uint8 [r, in/2], e8m0 uint8 [r, in/32] -> float32 [r, in]."""
    v = np.take(_e2m1_byte_values(), packed).view(np.float32).reshape(*e8m0.shape, formats.MXFP4_BLOCK)
    s = formats.e8m0_to_float(torch.from_numpy(np.ascontiguousarray(e8m0))).numpy()
    with np.errstate(over="ignore", invalid="ignore"):  # inf / NaN as torch gives them
        return (v * s[..., None]).reshape(packed.shape[0], -1)


def dequantize_rows_nvfp4(packed: np.ndarray, e4m3: np.ndarray, scale_2: float) -> np.ndarray:
    """Same values and float32 roundings as ``formats.dequantize_nvfp4`` ((value * scale) *
    scale_2). packed uint8 [r, in/2], e4m3 uint8 bit patterns [r, in/16] -> float32 [r, in]."""
    v = np.take(_e2m1_byte_values(), packed).view(np.float32).reshape(*e4m3.shape, formats.NVFP4_BLOCK)
    s = formats.e4m3_to_float(torch.from_numpy(np.ascontiguousarray(e4m3))).numpy()
    with np.errstate(over="ignore", invalid="ignore"):
        return ((v * s[..., None]) * np.float32(scale_2)).reshape(packed.shape[0], -1)


def _dequant_blocks_mx(packed16: torch.Tensor, e8m0: torch.Tensor) -> torch.Tensor:
    """[n, 16] packed bytes + [n] E8M0 -> float64 [n, 32]."""
    v = formats.e2m1_to_float(formats.unpack_e2m1(packed16)).to(torch.float64)
    return v * torch.exp2(e8m0.to(torch.float64) - formats.E8M0_BIAS).unsqueeze(1)


def _dequant_blocks_nv(packed16: torch.Tensor, e4m3_pairs: torch.Tensor, scale_2: float) -> torch.Tensor:
    """[n, 16] packed bytes + [n, 2] E4M3 + scale_2 -> float64 [n, 32]."""
    v = formats.e2m1_to_float(formats.unpack_e2m1(packed16)).to(torch.float64).view(-1, 2, 16)
    s = formats.e4m3_to_float(e4m3_pairs).to(torch.float64) * scale_2
    return (v * s.unsqueeze(-1)).view(-1, 32)


def _verify_matrix(ctx: _Ctx, m: "ExpertMatrix", sample: bool) -> float:
    """Check one matrix; returns its scale_2 (the caller checks w1/w3 share it)."""
    base = m.name.base
    src_p = ctx.tensor("src", m.packed.shard, m.packed.entry)
    src_s = ctx.tensor("src", m.scale.shard, m.scale.entry)
    out_p = ctx.out_tensor(m.packed.shard, f"{base}.weight")
    out_s = ctx.out_tensor(m.scale.shard, f"{base}.weight_scale")
    s2_t = ctx.out_tensor(m.scale.shard, f"{base}.weight_scale_2")
    if out_p.dtype != torch.uint8 or out_p.shape != src_p.shape:
        ctx.fail(f"{base}.weight: {out_p.dtype}{list(out_p.shape)}, expected uint8{list(src_p.shape)}")
        return float("nan")
    want_s = (src_s.shape[0], 2 * src_s.shape[1])
    if out_s.dtype != torch.float8_e4m3fn or tuple(out_s.shape) != want_s:
        ctx.fail(f"{base}.weight_scale: {out_s.dtype}{list(out_s.shape)}, expected float8_e4m3fn{list(want_s)}")
        return float("nan")
    if s2_t.dtype != torch.float32 or s2_t.numel() != 1:
        ctx.fail(f"{base}.weight_scale_2: {s2_t.dtype}{list(s2_t.shape)}, expected a float32 scalar")
        return float("nan")
    scale_2 = float(s2_t.reshape(()))
    if ctx.task.w4a4:
        inp = ctx.out_tensor(m.scale.shard, f"{base}.input_scale")
        if inp.dtype != torch.float32 or inp.numel() != 1 or float(inp.reshape(())) != 1.0:
            ctx.fail(f"{base}.input_scale: expected float32 scalar 1.0")

    p_src = src_p.reshape(-1, 16)  # one 32-element block per row
    p_out = out_p.reshape(-1, 16)
    e8m0 = src_s.reshape(-1)
    pairs = out_s.reshape(-1, 2)
    n = e8m0.numel()
    # Scale proof in the integer domain: with scale_2 = 2^m, e4m3(scale) * scale_2 == 2^k
    # iff both E4M3 bytes of the block are the bit pattern of 2^(k - m): one table gather
    # and one uint16 compare per block.
    lut = e4m3_pair_table(scale_2)
    e8m0_np, bits = e8m0.numpy(), pairs.view(torch.uint8).numpy()
    if lut is None:
        scale_ok = np.zeros(n, dtype=bool)
    else:
        scale_ok = np.take(lut, e8m0_np) == bits.view(np.uint16).reshape(-1)
    n_scale_ok = int(np.count_nonzero(scale_ok))
    if _equal_bytes(src_p.numpy(), out_p.numpy()):  # nibbles: raw bytes, the common case
        proved = scale_ok
        cand = np.flatnonzero(~scale_ok) if n_scale_ok < n else np.zeros(0, dtype=np.int64)
    else:
        same = (p_src.numpy() == p_out.numpy()).all(1)
        proved = same & scale_ok
        cand = np.flatnonzero(same & ~scale_ok)
    if cand.size:  # every nibble +-0 and finite scales: the value is 0 whatever the scale
        zero = ((p_src.numpy()[cand] & 0x77) == 0).all(1) & ((bits[cand] & 0x7F) != 0x7F).all(1)
        proved[cand[zero]] = True
    n_proved = int(np.count_nonzero(proved))
    rest = torch.from_numpy(np.flatnonzero(~proved)) if n_proved < n else torch.zeros(0, dtype=torch.int64)
    exact = n_proved
    if rest.numel():
        a = _dequant_blocks_mx(p_src[rest], e8m0[rest])
        b = _dequant_blocks_nv(p_out[rest], pairs[rest], scale_2)
        if not torch.isfinite(b).all():
            ctx.fail(f"{base}: non-finite NVFP4 values in {int((~torch.isfinite(b)).any(1).sum())} blocks")
        err = (a - b).abs()
        exact += int((err == 0).all(1).sum())
        ctx.res.max_abs_err = max(ctx.res.max_abs_err, float(err.max()))
    ctx.res.matrices += 1
    ctx.res.blocks += n
    ctx.res.proved_blocks += n_proved
    ctx.res.exact_blocks += exact

    if sample:  # full dequantize-and-compare with the format codecs, float32, row chunk by row chunk
        proved_rows = None if rest.numel() == 0 else proved.reshape(src_s.shape)
        sp, ss, op, os_ = src_p.numpy(), src_s.numpy(), out_p.numpy(), out_s.view(torch.uint8).numpy()
        ok, worst = True, None
        for r in range(0, sp.shape[0], _SAMPLE_ROWS):
            rows = slice(r, r + _SAMPLE_ROWS)
            mx = dequantize_rows_mxfp4(sp[rows], ss[rows]).view(np.int32)
            nv = dequantize_rows_nvfp4(op[rows], os_[rows], scale_2).view(np.int32)
            if proved_rows is None:
                ok = ok and np.array_equal(mx, nv)  # bitwise, signed zeros included
                continue
            blk = np.repeat(proved_rows[rows], 32, axis=1)
            ok = ok and np.array_equal(mx[blk], nv[blk])
            if not blk.all():
                d = float(np.abs(mx[~blk].view(np.float32) - nv[~blk].view(np.float32)).max())
                worst = d if worst is None else max(worst, d)
        if worst is not None and worst > ctx.res.max_abs_err * (1 + 1e-6):
            ctx.fail(f"{base}: dequantized error {worst:g} exceeds the block-level bound")
        if not ok:
            ctx.fail(f"{base}: values of proved blocks differ after dequantization")
        ctx.res.sample_matrices += 1
        ctx.res.sample_elements += 2 * src_p.numel()
    _progress.report(m.packed.entry.nbytes + m.scale.entry.nbytes)
    return scale_2


def is_local_group(members: list["ExpertMatrix"], shard: str) -> bool:
    """True when every tensor of the group (source, hence output) lives in ``shard``."""
    return all(r.shard == shard for m in members for r in (m.packed, m.scale))


def verify_shard(task: "ShardTask", *, groups: str = "all", check_shard: bool = True) -> VerifyResult:
    """Verify output shard ``task.shard`` (header, carried tensors) and expert groups anchored
    in it: ``groups`` = "all", "local" (only groups entirely inside this shard; the others are
    listed in the result's ``deferred_groups``) or "nonlocal" (only those)."""
    ctx = _Ctx(task)
    deferred = []
    try:
        if check_shard:
            _check_header(ctx)
            _check_carried(ctx)
        for g in task.shard.anchored_groups:
            members = task.groups[g]
            local = is_local_group(members, task.shard.name)
            if (groups == "local" and not local) or (groups == "nonlocal" and local):
                deferred.append(g)
                continue
            s2 = [_verify_matrix(ctx, m, sample=ctx.res.sample_matrices < task.verify_sample) for m in members]
            if len(set(s2)) > 1:
                ctx.fail(f"layer {g[0]} expert {g[1]}: w1/w3 weight_scale_2 differ ({s2}); marlin needs one")
    finally:
        ctx.close()
    ctx.res.deferred_groups = deferred if groups == "local" else []
    return ctx.res


def progress_bytes(task: "ShardTask", *, groups: str = "all", check_shard: bool = True) -> int:
    """The source bytes verify_shard(task, groups=, check_shard=) reports as progress: its carried
    tensors and the matrices of the groups it verifies (a group anchored here may have members in
    another shard). A verify bar's total is the sum of these, so it ends at exactly 100%; the
    shards' file sizes would not match when only some shards are verified (a resumed run)."""
    n = 0
    if check_shard:
        n += sum(it.src.entry.nbytes for it in task.shard.items if it.kind in ("carry", "a_log_trim"))
    for g in task.shard.anchored_groups:
        members = task.groups[g]
        local = is_local_group(members, task.shard.name)
        if (groups == "local" and not local) or (groups == "nonlocal" and local):
            continue
        n += sum(m.packed.entry.nbytes + m.scale.entry.nbytes for m in members)
    return n


def verify_nonlocal(task: "ShardTask") -> VerifyResult:
    """The second verify pass: groups of this shard that span shards (all output now committed)."""
    return verify_shard(dataclasses.replace(task, verify_sample=0), groups="nonlocal", check_shard=False)  # sampled in-line


def verify_full(task: "ShardTask") -> VerifyResult:
    """Verify a whole shard (used for shards finished by an earlier, resumed run)."""
    return verify_shard(task, groups="all", check_shard=True)
