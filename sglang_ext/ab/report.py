"""Report files: JSON and Markdown written atomically (k3nvfp4.common.files), so an
interrupted run never leaves a half-written report under its final name."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Sequence

from ...common.files import write_text_atomic


def _jsonable(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def write_json(path: Path, obj: Any) -> None:
    """Strict JSON (NaN -> null) with stable key order."""
    write_text_atomic(path, json.dumps(_jsonable(obj), indent=2, allow_nan=False) + "\n")


def fmt(x: Any, spec: str = ".4g") -> str:
    """Table cell: numbers formatted, None as an en dash."""
    if x is None:
        return "–"
    if isinstance(x, float):
        return "nan" if math.isnan(x) else format(x, spec)
    return str(x)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub-flavoured Markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(fmt(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)
