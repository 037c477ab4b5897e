"""Byte-level safetensors reading and streaming writing.

The cast never holds a whole shard: it parses the header itself, reads one tensor at a
time, copies carried tensors as raw byte ranges (byte-identical by construction) and
streams its output into a file whose header is known up front (every output shape and
dtype follows from the source header). Files are validated strictly so that a truncated
or corrupt shard fails with its name before anything is written.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Iterable

import torch

from ..common.files import write_text_atomic

# safetensors dtype tags <-> torch dtypes (the subset a K3 checkpoint uses, plus neighbours).
DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
DTYPE_TAGS: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
ITEMSIZE: dict[str, int] = {k: torch.empty(0, dtype=v).element_size() for k, v in DTYPES.items()}
FLOAT_TAGS = frozenset({"F16", "BF16", "F32", "F64"})

_MAX_HEADER = 100 * 1024 * 1024  # the safetensors library's own limit
_COPY_CHUNK = 64 * 1024 * 1024


class CheckpointError(Exception):
    """A checkpoint that cannot be read or written; the message names the file/tensor."""


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str  # safetensors tag, e.g. "U8"
    shape: tuple[int, ...]
    begin: int  # absolute file offsets [begin, end)
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass
class SafetensorsHeader:
    path: Path
    entries: dict[str, TensorEntry]
    metadata: dict[str, str] | None
    file_size: int


def read_header(path: str | os.PathLike) -> SafetensorsHeader:
    """Parse and validate a safetensors header (no tensor data is read).

    Raises CheckpointError naming the file when it is missing, truncated or corrupt.
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header)")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER or 8 + n > size:
                raise CheckpointError(
                    f"{path}: corrupt or truncated safetensors file (header claims {n} bytes, file has {size})"
                )
            raw = f.read(n)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: shard file is missing") from None
    except IsADirectoryError:
        raise CheckpointError(f"{path}: is a directory, expected a safetensors file") from None
    try:
        header = json.loads(raw.decode("utf-8"))
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
    except (UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"{path}: corrupt safetensors header ({exc})") from None
    data_start = 8 + n
    metadata = header.pop("__metadata__", None)
    entries: dict[str, TensorEntry] = {}
    for name, info in header.items():
        try:
            dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        except (KeyError, TypeError):
            raise CheckpointError(f"{path}: corrupt header entry for tensor {name}") from None
        # JSON integers only (bool is an int to Python): int("3") or a float would hide a corrupt entry.
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            raise CheckpointError(f"{path}: tensor {name}: shape {shape!r} is not a list of non-negative integers")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
            raise CheckpointError(f"{path}: tensor {name}: data_offsets {offsets!r} are not two integers")
        shape, (b, e) = tuple(shape), offsets
        if dtype not in DTYPES:
            raise CheckpointError(f"{path}: tensor {name} has unsupported dtype {dtype}")
        numel = 1
        for d in shape:
            numel *= d
        if e - b != numel * ITEMSIZE[dtype] or b < 0:
            raise CheckpointError(f"{path}: tensor {name}: data_offsets {b}..{e} do not match {dtype}{list(shape)}")
        if data_start + e > size:
            raise CheckpointError(
                f"{path}: truncated: tensor {name} ends at byte {data_start + e} but the file has {size} bytes"
            )
        entries[name] = TensorEntry(name, dtype, shape, data_start + b, data_start + e)
    return SafetensorsHeader(path, entries, metadata, size)


def read_tensor(f: BinaryIO, entry: TensorEntry) -> torch.Tensor:
    """Read one tensor's bytes from an open file into a new CPU tensor."""
    buf = bytearray(entry.nbytes)
    f.seek(entry.begin)
    got = f.readinto(buf)
    if got != entry.nbytes:
        raise CheckpointError(f"{getattr(f, 'name', '?')}: short read of tensor {entry.name} ({got}/{entry.nbytes} bytes)")
    if entry.nbytes == 0:
        return torch.empty(entry.shape, dtype=DTYPES[entry.dtype])
    return torch.frombuffer(buf, dtype=DTYPES[entry.dtype]).reshape(entry.shape)


class MappedShards:
    """Shards of one folder, mapped on first use, MAP_PRIVATE (ACCESS_COPY): tensors and byte
    ranges are read in place, and nothing written to a mapping can reach the file."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self._maps: dict[str, mmap.mmap] = {}

    def get(self, shard: str) -> mmap.mmap:
        mm = self._maps.get(shard)
        if mm is None:
            with open(self.root / shard, "rb") as f:
                mm = self._maps[shard] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        return mm

    def close(self) -> None:
        for mm in self._maps.values():
            try:
                mm.close()
            except BufferError:  # a tensor still views it; the mapping goes with it
                pass
        self._maps.clear()


@dataclass(frozen=True)
class OutputSpec:
    """One tensor of an output file, in write order."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = ITEMSIZE[self.dtype]
        for d in self.shape:
            n *= d
        return n


def _header_bytes(specs: Iterable[OutputSpec], metadata: dict[str, str] | None) -> bytes:
    header: dict = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    off = 0
    for s in specs:
        header[s.name] = {"dtype": s.dtype, "shape": list(s.shape), "data_offsets": [off, off + s.nbytes]}
        off += s.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format pads the header to 8 bytes with spaces
    return struct.pack("<Q", len(raw)) + raw


@dataclass
class StreamingWriter:
    """Write a safetensors file tensor by tensor, in the order of ``specs``.

    Data goes to ``<dir>/.<name>.partial``; ``commit()`` fsyncs and renames it onto the
    final name, so a file under its final name is always complete. ``abort()`` removes it.
    """

    path: Path
    specs: list[OutputSpec]
    metadata: dict[str, str] | None = None
    _f: BinaryIO | None = field(default=None, init=False, repr=False)
    _next: int = field(default=0, init=False, repr=False)

    @property
    def tmp_path(self) -> Path:
        return self.path.with_name(f".{self.path.name}.partial")

    def __enter__(self) -> "StreamingWriter":
        # Unbuffered: copy_file_range moves the fd offset behind a buffered writer's back.
        self._f = open(self.tmp_path, "wb", buffering=0)
        self._write(_header_bytes(self.specs, self.metadata))
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()

    def _write(self, data) -> None:
        view = memoryview(data).cast("B")
        try:
            while len(view):
                n = self._f.write(view)
                view = view[n:]
        except OSError as exc:
            raise CheckpointError(f"{self.path}: write failed: {exc.strerror or exc}") from exc

    def _expect(self, name: str, nbytes: int) -> None:
        if self._next >= len(self.specs):
            raise RuntimeError(f"{self.path}: unexpected extra tensor {name}")
        spec = self.specs[self._next]
        if spec.name != name or spec.nbytes != nbytes:
            raise RuntimeError(f"{self.path}: expected {spec.name} ({spec.nbytes} B), got {name} ({nbytes} B)")
        self._next += 1

    def write_tensor(self, name: str, t: torch.Tensor) -> None:
        spec = self.specs[self._next] if self._next < len(self.specs) else None
        if spec is not None and (DTYPE_TAGS.get(t.dtype) != spec.dtype or tuple(t.shape) != spec.shape):
            raise RuntimeError(
                f"{self.path}: tensor {name} is {t.dtype}{list(t.shape)}, header says {spec.dtype}{list(spec.shape)}"
            )
        t = t.contiguous()
        self._expect(name, t.numel() * t.element_size())
        if t.numel():
            self._write(t.reshape(-1).view(torch.uint8).numpy())

    def write_bytes(self, name: str, data) -> None:
        self._expect(name, len(data))
        self._write(data)

    def copy_range(self, name: str, src: BinaryIO, begin: int, nbytes: int) -> None:
        """Copy ``nbytes`` raw bytes of ``src`` from ``begin`` (a carried tensor)."""
        self._expect(name, nbytes)
        if not hasattr(os, "copy_file_range"):  # Linux only
            self._copy_fallback(name, src, begin, nbytes)
            return
        src_fd, dst_fd = src.fileno(), self._f.fileno()
        off, left = begin, nbytes
        try:
            while left:
                n = os.copy_file_range(src_fd, dst_fd, min(left, _COPY_CHUNK), off)
                if n == 0:
                    raise CheckpointError(f"{getattr(src, 'name', '?')}: short read of tensor {name}")
                off += n
                left -= n
        except OSError as exc:
            if left != nbytes:
                raise CheckpointError(f"{self.path}: write failed: {exc.strerror or exc}") from exc
            self._copy_fallback(name, src, begin, nbytes)
            return
        # copy_file_range moves the destination file position itself.

    def _copy_fallback(self, name: str, src: BinaryIO, begin: int, nbytes: int) -> None:
        src.seek(begin)
        left = nbytes
        while left:
            chunk = src.read(min(left, _COPY_CHUNK))
            if not chunk:
                raise CheckpointError(f"{getattr(src, 'name', '?')}: short read of tensor {name}")
            self._write(chunk)
            left -= len(chunk)

    def commit(self) -> None:
        if self._next != len(self.specs):
            raise RuntimeError(f"{self.path}: only {self._next} of {len(self.specs)} tensors written")
        try:
            os.fsync(self._f.fileno())
            self._f.close()
        except OSError as exc:
            raise CheckpointError(f"{self.path}: write failed: {exc.strerror or exc}") from exc
        os.replace(self.tmp_path, self.path)

    def abort(self) -> None:
        if self._f is not None and not self._f.closed:
            self._f.close()
        try:
            self.tmp_path.unlink()
        except FileNotFoundError:
            pass


def write_atomic_text(path: Path, text: str) -> None:
    """Write a small text file atomically (k3nvfp4.common.files); a failure is a CheckpointError."""
    try:
        write_text_atomic(path, text)
    except OSError as exc:
        raise CheckpointError(f"{path}: write failed: {exc.strerror or exc}") from exc
