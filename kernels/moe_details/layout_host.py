"""The kernel layout's nibble and scale-word maps (layout.py) on the host.

Two implementations of the same maps, the first that is available:

- **numba** (compiled loops, one pass over the bytes, parallel over tiles with ``prange``, no
  temporaries): about 2.4 GB/s of source on this project's 2-core CPU. numba is a core dependency
  (SGLang depends on it too); the loops are compiled on first use and cached.
- **numpy** (where numba cannot be imported, e.g. a bare GPU box on a PYTHONPATH shim): cache-sized
  chunks, no step byte-granular (below), about 0.5 GB/s single-threaded. numpy's many short calls
  release and retake the GIL too often for threads to help, so it runs in one thread.

Why not torch ops: torch's CPU kernels have no fast path for byte-granular strided copies or for
small-table lookups (index_select / take are 5-10x slower than numpy.take here); the first version
of this code, int64 gathers over index tensors, ran at 0.03 GB/s.

The map per 16-row x 64-K tile (layout.py's docstring: source byte of row 8h + g at K byte
8s + 4j + t; kernel word (g, t, s) holds the 8 nibbles of rows g, g + 8 at K 16s + 8j + 2t + p):
word(g, t, s) = LO[A_t | B_t << 8] | HI[C_t | D_t << 8], where A, B, C, D are the bytes of rows
(h0, j0), (h0, j1), (h1, j0), (h1, j1) and LO, HI two 65536-entry uint32 tables (256 KiB each,
L2-resident) built from the bit placement (:func:`pair_tables`). The numpy path gets there without
byte-granular steps:

1. uint32 units. The 4 source bytes t = 0..3 of row (h, g) at (s, j) are one little-endian
   uint32: A = (h0, j0), B = (h0, j1), C = (h1, j0), D = (h1, j1), each indexed [g, s].
2. A 4 x 4 byte transpose (SWAR): t02 = bytes (A0 B0 A2 B2), t13 = (A1 B1 A3 B3), and the same
   for C, D; as uint16 pairs these are (A_t | B_t << 8) for t = 0, 2 and 1, 3.
3. The two table lookups (numpy.take), then the words to their places.

The inverses run the same steps backwards (the byte transpose is its own inverse).
"""

from __future__ import annotations

import functools
import sys
import threading

import numpy as np
import torch

TILE_ROWS, TILE_K, TILE_BYTES = 16, 64, 512
_ROW_TILE_K_BYTES = TILE_K // 2  # 32 source bytes per row and K tile
_CHUNK_BYTES = 1 << 17  # source bytes per chunk: the chunk and its temporaries stay in L2

if sys.byteorder != "little":  # the uint32 / uint16 views below read bytes little-endian
    raise ImportError("k3nvfp4's host layout code needs a little-endian CPU")

_M8 = np.uint32(0x00FF00FF)
_M8H = np.uint32(0xFF00FF00)
_SH8 = np.uint32(8)


@functools.lru_cache(maxsize=None)
def pair_tables(word_bits: bytes) -> tuple[np.ndarray, ...]:
    """(LO, HI, INV_LO, INV_HI) uint32 [65536] each, and BYTE uint32 [4, 256], from the bit placement ``word_bits``: the
    bytes of an int64 [8, 16] array (layout.word_bit_tables(): the word bits of code c at element
    e = 4h + 2p + j). LO[a | b << 8]: the word bits of byte a at (h0, j0) and byte b at (h0, j1);
    HI the same for (h1, j0), (h1, j1). INV_LO[v]: the bytes [A, B, C, D] (a little-endian
    uint32) that word bits 0..15 = v come from; INV_HI for bits 16..31. BYTE[k, b]: the word bits
    of byte b as A, B, C, D (k = 0..3)."""
    wt = np.frombuffer(word_bits, dtype=np.int64).reshape(8, 16).astype(np.uint64)
    byte = np.arange(256)
    lo_n, hi_n = byte & 15, byte >> 4

    def contrib(h: int, j: int) -> np.ndarray:  # uint64 [256]: a byte's two nibbles p = 0, 1
        return wt[4 * h + j][lo_n] | wt[4 * h + 2 + j][hi_n]

    def pair(h: int) -> np.ndarray:  # index a | b << 8: b on the outer axis
        return (contrib(h, 0)[None, :] | contrib(h, 1)[:, None]).reshape(-1).astype(np.uint32)

    lo, hi = pair(0), pair(1)
    # Inverse: each word bit comes from exactly one source bit (the map is a bijection of 32 bits).
    src_of = np.full(32, -1, dtype=np.int64)
    for k, table in ((0, lo), (2, hi)):  # source byte k of [A, B, C, D]: a (k = 0, 2) or b (k + 1)
        for bit in range(16):
            src_of[int(table[1 << bit]).bit_length() - 1] = 8 * k + bit
    if (src_of < 0).any():
        raise ValueError("word_bits: not a bijection of the word's 32 bits")
    v = np.arange(65536, dtype=np.uint64)
    inv = []
    for half in range(2):
        acc = np.zeros(65536, dtype=np.uint64)
        for q in range(16):
            acc |= ((v >> np.uint64(q)) & np.uint64(1)) << np.uint64(src_of[16 * half + q])
        inv.append(acc.astype(np.uint32))
    # Per-byte tables (4 KiB, L1-resident) for the compiled loop: word bits of byte (h, j) = A..D.
    byte_tables = np.stack([contrib(0, 0), contrib(0, 1), contrib(1, 0), contrib(1, 1)]).astype(np.uint32)
    for t in (lo, hi, *inv, byte_tables):
        t.setflags(write=False)
    return lo, hi, inv[0], inv[1], byte_tables


def _transpose4x4(a, b, c, d, out02_ab, out13_ab, out02_cd, out13_cd, tmp) -> None:
    """SWAR byte transpose of uint32 arrays (bytes t = 0..3): out02_ab = bytes (a0 b0 a2 b2),
    out13_ab = (a1 b1 a3 b3), the same for c, d. All arguments are uint32 arrays of one shape."""
    for x, y, o02, o13 in ((a, b, out02_ab, out13_ab), (c, d, out02_cd, out13_cd)):
        np.bitwise_and(x, _M8, out=o02)
        np.bitwise_and(y, _M8, out=tmp)
        np.left_shift(tmp, _SH8, out=tmp)
        np.bitwise_or(o02, tmp, out=o02)
        np.right_shift(x, _SH8, out=o13)
        np.bitwise_and(o13, _M8, out=o13)
        np.bitwise_and(y, _M8H, out=tmp)
        np.bitwise_or(o13, tmp, out=o13)


def _untranspose4x4(y0, y1, y2, y3, a, b, c, d, tmp) -> None:
    """Inverse of the transpose as it is used in pack: words y_t with bytes (A_t B_t C_t D_t)
    -> a, b, c, d with bytes t = 0..3 (all uint32 arrays of one shape)."""
    # pairs of 16-bit halves first: p02 = (y0.lo16 | y2.lo16 << 16) = bytes (A0 B0 A2 B2), etc.
    lo16, hi16, sh16 = np.uint32(0xFFFF), np.uint32(0xFFFF0000), np.uint32(16)
    for ya, yb, x02, x13 in ((y0, y2, a, c), (y1, y3, b, d)):  # x02 <- low halves, x13 <- high halves
        np.bitwise_and(ya, lo16, out=x02)
        np.left_shift(yb, sh16, out=tmp)
        np.bitwise_or(x02, tmp, out=x02)  # (A_t B_t A_t+2 B_t+2) for t = 0 (a) or 1 (b)
        np.right_shift(ya, sh16, out=x13)
        np.bitwise_and(yb, hi16, out=tmp)
        np.bitwise_or(x13, tmp, out=x13)  # (C_t D_t C_t+2 D_t+2) for t = 0 (c) or 1 (d)
    # now a = (A0 B0 A2 B2), b = (A1 B1 A3 B3), c = (C0 D0 C2 D2), d = (C1 D1 C3 D3): interleave
    for x, y in ((a, b), (c, d)):
        e = (x & _M8) | ((y & _M8) << _SH8)  # (A0 A1 A2 A3) or (C0 C1 C2 C3)
        f = ((x >> _SH8) & _M8) | (y & _M8H)  # (B0 B1 B2 B3) or (D0 D1 D2 D3)
        x[...] = e
        y[...] = f


def _chunks(units: int, unit_bytes: int) -> list[tuple[int, int]]:
    step = max(1, _CHUNK_BYTES // max(unit_bytes, 1))
    return [(lo, min(lo + step, units)) for lo in range(0, units, step)]


def _pack_nibbles_np(src: np.ndarray, k_tiles: int, tables: tuple, out: np.ndarray | None = None) -> np.ndarray:
    """The numpy path of :func:`pack_nibbles`."""
    U, _, half_k = src.shape
    out = np.empty((U, k_tiles, TILE_BYTES), dtype=np.uint8) if out is None else out
    lo_t, hi_t = tables[0], tables[1]
    kp = k_tiles * _ROW_TILE_K_BYTES

    def run(u0: int, u1: int) -> None:
        n = u1 - u0
        s = src[u0:u1]
        if kp != half_k:
            s = np.concatenate([s, np.zeros((n, TILE_ROWS, kp - half_k), dtype=np.uint8)], axis=2)
        w = np.ascontiguousarray(s).view(np.uint32).reshape(n, 2, 8, k_tiles * 4, 2)  # n h g (KT s) j
        # Gather A, B, C, D contiguous in source order [n, g, (KT s)] (inner stride 8 bytes: one long
        # loop each); the SWAR ops then run on contiguous arrays.
        shape = (n, 8, k_tiles * 4)
        a, b, c, d = (np.ascontiguousarray(w[:, h, :, :, j]) for h in range(2) for j in range(2))
        t02_ab, t13_ab, t02_cd, t13_cd, tmp = (np.empty(shape, np.uint32) for _ in range(5))
        _transpose4x4(a, b, c, d, t02_ab, t13_ab, t02_cd, t13_cd, tmp)
        o = out[u0:u1].view(np.uint32).reshape(n, k_tiles, 8, 2, 2, 4)  # n KT g t_hi t_lo s
        for t_lo, ab, cd in ((0, t02_ab, t02_cd), (1, t13_ab, t13_cd)):
            word = np.take(lo_t, ab.view(np.uint16))  # n g (KT s t_hi)
            word |= np.take(hi_t, cd.view(np.uint16))
            np.copyto(o[:, :, :, :, t_lo, :], word.reshape(n, 8, k_tiles, 4, 2).transpose(0, 2, 1, 4, 3))

    for lo, hi in _chunks(U, TILE_ROWS * half_k):  # one thread: see the module docstring
        run(lo, hi)
    return out


def _unpack_nibbles_np(tiles: np.ndarray, half_k: int, tables: tuple, out: np.ndarray | None = None) -> np.ndarray:
    """The numpy path of :func:`unpack_nibbles`."""
    U, k_tiles, _ = tiles.shape
    out = np.empty((U, TILE_ROWS, half_k), dtype=np.uint8) if out is None else out
    inv_lo, inv_hi = tables[2], tables[3]
    kp = k_tiles * _ROW_TILE_K_BYTES

    def run(u0: int, u1: int) -> None:
        n = u1 - u0
        o = tiles[u0:u1].view(np.uint32).reshape(n, k_tiles, 8, 4, 4)  # n KT g t s
        y = np.take(inv_lo, o & np.uint32(0xFFFF))  # bytes (A_t B_t C_t D_t), n KT g t s
        y |= np.take(inv_hi, o >> np.uint32(16))
        shape = (n, k_tiles, 8, 4)
        a, b, c, d, tmp = (np.empty(shape, np.uint32) for _ in range(5))
        _untranspose4x4(y[:, :, :, 0], y[:, :, :, 1], y[:, :, :, 2], y[:, :, :, 3], a, b, c, d, tmp)
        w = np.empty((n, 2, 8, k_tiles, 4, 2), dtype=np.uint32)  # n h g KT s j
        for h, j, x in ((0, 0, a), (0, 1, b), (1, 0, c), (1, 1, d)):
            np.copyto(w[:, h, :, :, :, j], x.transpose(0, 2, 1, 3))
        out[u0:u1] = w.view(np.uint8).reshape(n, TILE_ROWS, kp)[:, :, :half_k]

    for lo, hi in _chunks(U, k_tiles * TILE_BYTES):  # one thread: see the module docstring
        run(lo, hi)
    return out


def _tile_scale_bytes_np(codes: np.ndarray, k_tiles: int, words_per_lane: int, shift: int,
                         luts: np.ndarray, units_per_lut: int) -> np.ndarray:
    """The numpy path of :func:`tile_scale_bytes`."""
    U, _, G = codes.shape
    gp = k_tiles * 2 * words_per_lane
    out = np.empty((U, k_tiles, 8 * words_per_lane), dtype=np.int32)
    sh, sh16 = np.uint32(shift), np.uint32(shift + 16)

    def run(u0: int, u1: int) -> None:
        n = u1 - u0
        which = (np.arange(u0, u1) // units_per_lut)[:, None, None]
        c = luts[which, codes[u0:u1]]
        if gp != G:
            c = np.concatenate([c, np.zeros((n, TILE_ROWS, gp - G), dtype=np.uint8)], axis=2)
        c = c.reshape(n, 2, 8, k_tiles, words_per_lane, 2).astype(np.uint32)  # n hh g KT i par
        direct = (c[:, 0, ..., 0] << sh) | (c[:, 1, ..., 0] << sh16)  # n g KT i
        rot = (c[:, 0, ..., 1] << sh) | (c[:, 1, ..., 1] << sh16)
        direct |= (rot >> _SH8) | (rot << np.uint32(24))
        np.copyto(out[u0:u1].view(np.uint32).reshape(n, k_tiles, 8, words_per_lane), direct.transpose(0, 2, 1, 3))

    for lo, hi in _chunks(U, TILE_ROWS * G * 8):  # one thread: see the module docstring
        run(lo, hi)
    return out


def _untile_scale_bytes_np(words: np.ndarray, groups: int, words_per_lane: int, shift: int) -> np.ndarray:
    """The numpy path of :func:`untile_scale_bytes`."""
    U, k_tiles, _ = words.shape
    out = np.empty((U, TILE_ROWS, groups), dtype=np.uint8)

    def run(u0: int, u1: int) -> None:
        n = u1 - u0
        w = words[u0:u1].view(np.uint32).reshape(n, k_tiles, 8, words_per_lane)  # n KT g i
        rot = (w << _SH8) | (w >> np.uint32(24))
        c = np.empty((n, 2, 8, k_tiles, words_per_lane, 2), dtype=np.uint8)  # n hh g KT i par
        for hh in range(2):
            s = np.uint32(shift + 16 * hh)
            for par, x in ((0, w), (1, rot)):
                np.copyto(c[:, hh, :, :, :, par], ((x >> s) & np.uint32(0xFF)).transpose(0, 2, 1, 3), casting="unsafe")
        out[u0:u1] = c.reshape(n, TILE_ROWS, -1)[:, :, :groups]

    for lo, hi in _chunks(U, k_tiles * 8 * words_per_lane * 4 * 8):  # one thread: see the module docstring
        run(lo, hi)
    return out


def apply_lut(lut: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """lut uint8 [256] applied to uint8 ``codes`` (contiguous, any shape), in chunks (np.take
    would otherwise make an intp copy of the whole index)."""
    flat = codes.reshape(-1)
    out = np.empty_like(flat)
    for lo, hi in _chunks(flat.size, 1):
        np.take(lut, flat[lo:hi], out=out[lo:hi])
    return out.reshape(codes.shape)


# --- numba: compiled loops, one pass, parallel over tiles ---------------------------------------

_JIT_LOCK = threading.Lock()
_IDENTITY = np.arange(256, dtype=np.uint8)  # numba's default threading layer takes one caller at a time


@functools.lru_cache(maxsize=1)
def _jit():
    """The compiled kernels (a dict), or None where numba cannot be imported."""
    try:
        import numba
    except ImportError:
        return None
    njit = functools.partial(numba.njit, parallel=True, cache=True, boundscheck=False, nogil=True)

    @njit
    def pack(src, out, tb):  # src u8 [U, 16, hk]; out u32 [U, KT, 128]; tb u32 [4, 256]
        U, hk, KT = src.shape[0], src.shape[2], out.shape[1]
        for p in numba.prange(U * KT):
            u, kt = p // KT, p % KT
            base = kt * 32
            if base + 32 <= hk:  # a whole K tile: no bounds checks in the loop
                for g in range(8):
                    for s in range(4):
                        for t in range(4):
                            col = base + 8 * s + t
                            out[u, kt, 16 * g + 4 * t + s] = (tb[0, src[u, g, col]] | tb[1, src[u, g, col + 4]]
                                                              | tb[2, src[u, g + 8, col]] | tb[3, src[u, g + 8, col + 4]])
            else:  # the K tile that padding completes
                for g in range(8):
                    for s in range(4):
                        for t in range(4):
                            col = base + 8 * s + t
                            w = np.uint32(0)
                            if col < hk:
                                w |= tb[0, src[u, g, col]] | tb[2, src[u, g + 8, col]]
                            if col + 4 < hk:
                                w |= tb[1, src[u, g, col + 4]] | tb[3, src[u, g + 8, col + 4]]
                            out[u, kt, 16 * g + 4 * t + s] = w

    @njit
    def unpack(tiles, out, inv_lo, inv_hi):  # tiles u32 [U, KT, 128]; out u8 [U, 16, hk]
        U, KT, hk = tiles.shape[0], tiles.shape[1], out.shape[2]
        for p in numba.prange(U * KT):
            u, kt = p // KT, p % KT
            base = kt * 32
            for g in range(8):
                for s in range(4):
                    for t in range(4):
                        w = tiles[u, kt, 16 * g + 4 * t + s]
                        y = inv_lo[w & 0xFFFF] | inv_hi[w >> 16]  # bytes (A, B, C, D)
                        col = base + 8 * s + t
                        if col < hk:
                            out[u, g, col] = y & 0xFF
                            out[u, 8 + g, col] = (y >> 16) & 0xFF
                        if col + 4 < hk:
                            out[u, g, col + 4] = (y >> 8) & 0xFF
                            out[u, 8 + g, col + 4] = y >> 24

    @njit
    def tile(codes, out, luts, units_per_lut, wpl, shift):  # codes u8 [U, 16, G]; out u32 [U, KT, 8 wpl]
        U, G, KT = codes.shape[0], codes.shape[2], out.shape[1]
        s16 = shift + 16
        for p in numba.prange(U * KT):
            u, kt = p // KT, p % KT
            lut = luts[u // units_per_lut]
            for g in range(8):
                for i in range(wpl):
                    col = kt * 2 * wpl + 2 * i
                    # (row g, group col) and (g + 8, col) in place, (g, col + 1) and (g + 8, col + 1) rotated
                    direct = np.uint32(0)
                    rot = np.uint32(0)
                    if col < G:
                        direct = (np.uint32(lut[codes[u, g, col]]) << shift) | (np.uint32(lut[codes[u, g + 8, col]]) << s16)
                    if col + 1 < G:
                        rot = (np.uint32(lut[codes[u, g, col + 1]]) << shift) | (np.uint32(lut[codes[u, g + 8, col + 1]]) << s16)
                    out[u, kt, g * wpl + i] = direct | (rot >> 8) | (rot << 24)

    @njit
    def untile(words, out, wpl, shift):  # words u32 [U, KT, 8 wpl]; out u8 [U, 16, G]
        U, KT, G = words.shape[0], words.shape[1], out.shape[2]
        for p in numba.prange(U * KT):
            u, kt = p // KT, p % KT
            for g in range(8):
                for i in range(wpl):
                    w = words[u, kt, g * wpl + i]
                    rot = (w << 8) | (w >> 24)
                    col = kt * 2 * wpl + 2 * i
                    if col < G:
                        out[u, g, col] = (w >> shift) & 0xFF
                        out[u, g + 8, col] = (w >> (shift + 16)) & 0xFF
                    if col + 1 < G:
                        out[u, g, col + 1] = (rot >> shift) & 0xFF
                        out[u, g + 8, col + 1] = (rot >> (shift + 16)) & 0xFF

    @njit
    def e4m3_flags(bits):  # bits u8 [N] -> (NaN patterns, non-positive scales: sign set or +-0)
        nan = 0
        special = 0
        for i in numba.prange(bits.shape[0]):
            m = bits[i] & 0x7F
            nan += m == 0x7F
            special += (bits[i] >= 0x80) or m == 0
        return nan, special

    @njit
    def e8m0_bytes(packed, bits, m, j_of, out):  # see e8m0_from_pow2_e4m3; returns the bad-block count
        E, N, B = out.shape
        bad = 0
        for p in numba.prange(E * N):
            e, n = p // N, p % N
            for b in range(B):
                nz0 = False
                nz1 = False
                for q in range(8):
                    nz0 |= (packed[e, n, 16 * b + q] & 0x77) != 0
                    nz1 |= (packed[e, n, 16 * b + 8 + q] & 0x77) != 0
                b0 = bits[e, n, 2 * b]
                b1 = bits[e, n, 2 * b + 1]
                nz0 = nz0 and (b0 & 0x7F) != 0
                nz1 = nz1 and (b1 & 0x7F) != 0
                j0 = j_of[b0]
                j1 = j_of[b1]
                byte = np.int32(m[e, n]) + 127 + (j0 if nz0 else j1)
                wrong = ((nz0 and j0 == -128) or (nz1 and j1 == -128) or (nz0 and nz1 and j0 != j1)
                         or ((nz0 or nz1) and (byte < 1 or byte > 254)))
                bad += wrong
                out[e, n, b] = np.uint8(byte) if (nz0 or nz1) and not wrong else np.uint8(127)
        return bad

    return {"numba": numba, "pack": pack, "unpack": unpack, "tile": tile, "untile": untile,
            "e4m3_flags": e4m3_flags, "e8m0_bytes": e8m0_bytes}


def _run_jit(name: str, *args):
    jit = _jit()
    with _JIT_LOCK:
        nb = jit["numba"]
        nb.set_num_threads(max(1, min(torch.get_num_threads(), nb.config.NUMBA_NUM_THREADS)))
        return jit[name](*args)


def e4m3_flags(bits: np.ndarray, use_numba: bool | None = None) -> tuple[bool, bool]:
    """E4M3 block-scale bits uint8 (any shape) -> (some are NaN patterns 0x7F / 0xFF, some are
    negative or +-0), in one pass."""
    flat = bits.reshape(-1)
    if backend(use_numba) == "numba":
        nan, special = _run_jit("e4m3_flags", flat)
        return bool(nan), bool(special)
    magnitude = flat & 0x7F
    return bool((magnitude == 0x7F).any()), bool((flat >= 0x80).any() or (magnitude == 0).any())


def backend(use_numba: bool | None = None) -> str:
    """"numba" or "numpy": what the functions below run (use_numba None: numba if importable)."""
    if use_numba is None:
        use_numba = _jit() is not None
    if use_numba and _jit() is None:
        raise RuntimeError("layout_host: numba is not importable")
    return "numba" if use_numba else "numpy"


def pack_nibbles(src: np.ndarray, k_tiles: int, tables: tuple, out: np.ndarray | None = None,
                 use_numba: bool | None = None) -> np.ndarray:
    """ModelOpt nibbles uint8 [U, 16, k/2] (U row tiles of 16 rows) -> kernel layout uint8
    [U, k_tiles, 512] (into ``out`` if given); K is zero-padded to 64 * k_tiles. ``tables``:
    :func:`pair_tables`."""
    if backend(use_numba) == "numpy":
        return _pack_nibbles_np(src, k_tiles, tables, out)
    U = src.shape[0]
    out = np.empty((U, k_tiles, TILE_BYTES), dtype=np.uint8) if out is None else out
    _run_jit("pack", src, out.view(np.uint32), tables[4])
    return out


def unpack_nibbles(tiles: np.ndarray, half_k: int, tables: tuple, out: np.ndarray | None = None,
                   use_numba: bool | None = None) -> np.ndarray:
    """Inverse of :func:`pack_nibbles`: uint8 [U, KT, 512] -> uint8 [U, 16, half_k]."""
    if backend(use_numba) == "numpy":
        return _unpack_nibbles_np(tiles, half_k, tables, out)
    out = np.empty((tiles.shape[0], TILE_ROWS, half_k), dtype=np.uint8) if out is None else out
    _run_jit("unpack", tiles.view(np.uint32), out, tables[2], tables[3])
    return out


def tile_scale_bytes(codes: np.ndarray, k_tiles: int, words_per_lane: int, shift: int,
                     luts: np.ndarray | None = None, units_per_lut: int = 1, use_numba: bool | None = None
                     ) -> np.ndarray:
    """Scale bytes uint8 [U, 16, G] (G <= k_tiles * 2 * words_per_lane; zero-padded to it) ->
    scale words int32 [U, k_tiles, 8 * words_per_lane] (layout.py's docstring: word (g, i) = the
    pairs (rows g, g + 8) of groups 2i in place and 2i + 1 rotated right by 8 bits). Each byte of
    unit u is first mapped through ``luts[u // units_per_lut]`` (luts uint8 [L, 256]; None: as is):
    one table for a whole tensor, or one per matrix (E8M0's per-expert exponent offset)."""
    if luts is None:
        luts, units_per_lut = _IDENTITY[None], max(1, codes.shape[0])
    if backend(use_numba) == "numpy":
        return _tile_scale_bytes_np(codes, k_tiles, words_per_lane, shift, luts, units_per_lut)
    out = np.empty((codes.shape[0], k_tiles, 8 * words_per_lane), dtype=np.int32)
    _run_jit("tile", codes, out.view(np.uint32), luts, units_per_lut, words_per_lane, shift)
    return out


def untile_scale_bytes(words: np.ndarray, groups: int, words_per_lane: int, shift: int,
                       use_numba: bool | None = None) -> np.ndarray:
    """Inverse of :func:`tile_scale_bytes` (without the lut): int32 [U, KT, 8 * words_per_lane]
    -> uint8 [U, 16, groups]."""
    if backend(use_numba) == "numpy":
        return _untile_scale_bytes_np(words, groups, words_per_lane, shift)
    out = np.empty((words.shape[0], TILE_ROWS, groups), dtype=np.uint8)
    _run_jit("untile", words.view(np.uint32), out, words_per_lane, shift)
    return out


def _pow2_exponents() -> np.ndarray:
    """int32 [256]: E4M3 bits -> j where the value is +2^j, else -128 (zero, negative, not a power of two)."""
    out = np.full(256, -128, dtype=np.int32)
    for b in range(1, 0x7F):
        e, mant = b >> 3, b & 7
        if e and not mant:
            out[b] = e - 7  # normal: 2^(e - 7)
        elif not e and mant in (1, 2, 4):
            out[b] = {1: -9, 2: -8, 4: -7}[mant]  # subnormal m x 2^-9
    return out


def e8m0_from_pow2_e4m3(packed: np.ndarray, bits: np.ndarray, m: np.ndarray) -> tuple[np.ndarray, int] | None:
    """The E8M0 bytes per 32 of NVFP4 matrices that are exactly MXFP4 (moe_fp4_details.weights.
    recover_e8m0 says the rule), in one compiled pass: packed uint8 [E, N, K/2], E4M3 bits uint8
    [E, N, K/16], m int32 [E, N] (scale_2 = 2^m) -> (uint8 [E, N, K/32], the number of blocks that
    break the rule). None where numba cannot be imported (the caller's torch path runs)."""
    if backend() != "numba":
        return None
    out = np.empty((*bits.shape[:2], bits.shape[2] // 2), dtype=np.uint8)
    bad = _run_jit("e8m0_bytes", packed, bits, m, _POW2, out)
    return out, int(bad)


_POW2 = _pow2_exponents()
