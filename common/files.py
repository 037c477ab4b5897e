"""Atomic file writes: the one helper every package uses (tuner JSON, cast text files and
copies, A/B reports).

A file appears under its final name only complete: the data goes to a fresh temporary beside
it (``.<name>.<pid>.<random>.partial``, created exclusively, so concurrent writers never share
one, and with the process umask's permissions), is fsynced, then renamed over the target. On
any error the temporary is removed and the error propagates; the target keeps its old
content (or stays absent). Parent directories are created.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

PARTIAL_SUFFIX = ".partial"


def _fresh_temp(path: Path) -> Path:
    while True:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}{PARTIAL_SUFFIX}")
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            return tmp
        except FileExistsError:
            continue


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; write it inside the block. On a normal exit it
    is fsynced and renamed onto ``path``; on an exception it is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _fresh_temp(path)
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json_atomic(path: str | os.PathLike, obj: Any, *, indent: int = 2, allow_nan: bool = True) -> None:
    """``json.dumps(obj, indent=indent)`` plus a final newline, written atomically."""
    write_text_atomic(path, json.dumps(obj, indent=indent, allow_nan=allow_nan) + "\n")


def copy_file_atomic(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Copy ``src`` (data and metadata, as shutil.copy2) onto ``dst`` atomically."""
    with atomic_path(dst) as tmp:
        shutil.copy2(src, tmp)
