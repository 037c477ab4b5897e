"""Output locations checked before any work: a tool that would fail to write its result after an
hours-long run (an ``--out`` that names a file, a folder under a file, a read-only place) says so
at once, in one line naming the argument and the path.

The checks create nothing (a refused run leaves no folder behind) and read only the file system's
metadata. They cannot promise the write will succeed later (the disk may fill, permissions may
change), only that nothing known now makes it fail.
"""

from __future__ import annotations

import os
from pathlib import Path


class OutputPathError(ValueError):
    """An output location that cannot be written; the message names the argument and the path."""


def _first_existing(path: Path) -> tuple[Path, Path | None]:
    """(the deepest existing ancestor of ``path`` or ``path`` itself, the first missing component
    below it or None when ``path`` exists)."""
    below = None
    p = path
    while not os.path.lexists(p):
        below = p
        if p.parent == p:
            break
        p = p.parent
    return p, below


def _check_creatable(path: Path, arg: str, what: str) -> None:
    """``path`` does not exist: its deepest existing ancestor must be a writable folder."""
    anc, _ = _first_existing(path)
    if not anc.is_dir():
        raise OutputPathError(f"{arg} {path}: cannot create the {what}: {anc} is a file, not a directory")
    if not os.access(anc, os.W_OK | os.X_OK):
        raise OutputPathError(f"{arg} {path}: cannot create the {what}: {anc} is not writable")


def check_output_dir(path: str | os.PathLike, arg: str = "--out") -> Path:
    """Refuse (OutputPathError) an output directory that cannot be used: ``path`` exists and is
    not a directory, or is a directory that is not writable, or cannot be created (an ancestor is a
    file or not writable). An existing writable directory passes (the tool's own rules decide
    what it may replace in it). Returns ``path`` as a Path."""
    p = Path(path)
    if os.path.lexists(p):
        if not p.is_dir():
            raise OutputPathError(f"{arg} {p}: exists and is not a directory (the output is a folder of files; "
                                  "remove it or choose another path)")
        if not os.access(p, os.W_OK | os.X_OK):
            raise OutputPathError(f"{arg} {p}: directory is not writable")
        return p
    _check_creatable(p, arg, "directory")
    return p


def check_output_file(path: str | os.PathLike, arg: str) -> Path:
    """Refuse (OutputPathError) an output file that cannot be written: ``path`` is a directory,
    an existing file that is not writable, or cannot be created (its folder is missing under a
    file, or not writable). An existing writable file passes (it is replaced). Returns ``path``."""
    p = Path(path)
    if p.is_dir():
        raise OutputPathError(f"{arg} {p}: is a directory, expected a file path")
    if os.path.lexists(p):
        if not os.access(p.parent if str(p.parent) else Path("."), os.W_OK | os.X_OK):
            raise OutputPathError(f"{arg} {p}: its folder {p.parent} is not writable")
        return p
    _check_creatable(p, arg, "file")
    return p
