"""The cast's records: what one module, process, rank or run hands to another.

A record crosses a boundary as JSON-able data (``to_json``) and is read back by ``from_json``:

- :class:`ShardRecord`: one output shard cast (``convert.cast_shard``, in a pool process). It is
  the resume record ``<output>/.k3nvfp4-cast/<shard>.json``, an entry of a rank's cast message
  and of ``cast_report.json``'s ``per_shard``.
- :class:`VerifyResult`: ``--verify`` of one shard (``verify.verify_shard``);
  :class:`VerifySummary`: their sum on rank 0, checked against the cast's own figures (the
  report's ``verify`` section).
- :class:`ALogCheck`: the check of one KDA ``A_log`` tensor (a shard record's ``a_log``).
- The rank messages of a cast across nodes (coordinator.GlooCoordinator sends them as JSON):
  :class:`LaunchInfo` (start), :class:`Prepared` (rank 0 made the output ready),
  :class:`RankRow` / :class:`CastMessage` (every shard committed), :class:`VerifyMessage`.

The JSON keys are those the dict-based records of earlier versions wrote, so a resume record
written by an earlier run is read as it is. A record that lacks a field or holds a value of the
wrong type raises :class:`RecordError` naming the field; the caller names the file.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ..kernels.cast import CastStats
from .safetensors_io import CheckpointError

Group = tuple[int, int, str]  # (layer, expert, "w13" | "w2")


class RecordError(CheckpointError):
    """A record (resume file, rank message) that this version cannot read."""


def _get(data: Any, key: str, kind: type | tuple[type, ...], what: str) -> Any:
    """``data[key]``, which must be of ``kind`` (a tuple: any of them; NoneType for null)."""
    if not isinstance(data, dict):
        raise RecordError(f"{what}: expected a JSON object, got {type(data).__name__}")
    if key not in data:
        raise RecordError(f"{what}: no {key!r}")
    return _typed(data[key], key, kind, what)


def _opt(data: dict, key: str, kind: type | tuple[type, ...], what: str) -> Any:
    """``data[key]`` where the key may be absent (None then)."""
    return _typed(data[key], key, kind, what) if key in data else None


def _typed(value: Any, key: str, kind: type | tuple[type, ...], what: str) -> Any:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool):  # a JSON true is no number
        ok = bool in kinds
    else:  # JSON has one number type: 3 reads as a float where a float is expected
        ok = isinstance(value, kinds) or (float in kinds and isinstance(value, int))
    if not ok:
        names = " or ".join("null" if k is type(None) else k.__name__ for k in kinds)
        raise RecordError(f"{what}: {key!r} is {value!r}, expected {names}")
    return float(value) if float in kinds and isinstance(value, int) and not isinstance(value, bool) else value


def cast_stats_from_json(data: Any, what: str = "stats") -> CastStats:
    """CastStats from its to_dict() form (a shard record's or cast_report.json's "stats")."""
    return CastStats(
        blocks=_get(data, "blocks", int, what),
        exact_blocks=_get(data, "exact_blocks", int, what),
        zero_exponent_blocks=_get(data, "zero_exponent_blocks", int, what),
        out_of_range_blocks=_get(data, "out_of_range_blocks", int, what),
        max_abs_err=_get(data, "max_abs_err", float, what),
    )


def _group_from_json(g: Any, what: str) -> Group:
    if not (isinstance(g, (list, tuple)) and len(g) == 3 and isinstance(g[0], int) and isinstance(g[1], int)
            and isinstance(g[2], str)):
        raise RecordError(f"{what}: expert group {g!r} is not [layer, expert, kind]")
    return (g[0], g[1], g[2])


@dataclass(frozen=True)
class ALogCheck:
    """One KDA A_log tensor: the elements beyond ``num_heads`` must be exactly zero.

    padding_elements / padding_all_zero / padding_max_abs are None where the shape is not the
    expected 1-D [>= num_heads] (``note`` says so; the tensor is carried as it is);
    trimmed_to: num_heads where --trim-a-log cut the tensor to it."""

    name: str
    shape: list[int]
    num_heads: int | None
    padding_elements: int | None = None
    padding_all_zero: bool | None = None
    padding_max_abs: float | None = None
    note: str | None = None
    trimmed_to: int | None = None

    def to_json(self) -> dict:
        out: dict[str, Any] = {"name": self.name, "shape": list(self.shape), "num_heads": self.num_heads,
                               "padding_elements": self.padding_elements, "padding_all_zero": self.padding_all_zero}
        for key in ("padding_max_abs", "note", "trimmed_to"):  # written only where they apply
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out

    @classmethod
    def from_json(cls, data: Any, what: str = "A_log check") -> "ALogCheck":
        opt = (int, type(None))
        name = _get(data, "name", str, what)
        return cls(
            name=name,
            shape=list(_get(data, "shape", list, what)),
            num_heads=_get(data, "num_heads", opt, what),
            padding_elements=_get(data, "padding_elements", opt, what),
            padding_all_zero=_get(data, "padding_all_zero", (bool, type(None)), what),
            padding_max_abs=_opt(data, "padding_max_abs", (float, type(None)), what),
            note=_opt(data, "note", (str, type(None)), what),
            trimmed_to=_opt(data, "trimmed_to", opt, what),
        )


# The counters of a verify result, summed over shards by VerifySummary.
_VERIFY_COUNTS = ("matrices", "blocks", "proved_blocks", "exact_blocks", "sample_matrices", "sample_elements",
                  "carried_tensors", "mismatches")
MAX_EXAMPLES = 5  # mismatch examples a shard keeps
MAX_SUMMARY_EXAMPLES = 10  # and the summary over every shard


@dataclass
class VerifyResult:
    """``--verify`` of one output shard: counts of matrices and 32-element blocks checked,
    proved_blocks (equal by the byte and scale proof), exact_blocks (proved, or equal value by
    value), max_abs_err (float64, over the blocks that are not exact), the sampled full
    dequantizations, carried tensors compared byte by byte, and the mismatches found (at most
    MAX_EXAMPLES described). deferred_groups: expert groups that span shards, left for the
    second pass (``verify_nonlocal``)."""

    shard: str
    matrices: int = 0
    blocks: int = 0
    proved_blocks: int = 0
    exact_blocks: int = 0
    max_abs_err: float = 0.0
    sample_matrices: int = 0
    sample_elements: int = 0
    carried_tensors: int = 0
    mismatches: int = 0
    mismatch_examples: list[str] = field(default_factory=list)
    deferred_groups: list[Group] = field(default_factory=list)

    def fail(self, message: str) -> None:
        """Count one mismatch (the first MAX_EXAMPLES are kept in words)."""
        self.mismatches += 1
        if len(self.mismatch_examples) < MAX_EXAMPLES:
            self.mismatch_examples.append(message)

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        out["deferred_groups"] = [list(g) for g in self.deferred_groups]
        return out

    @classmethod
    def from_json(cls, data: Any, what: str = "verify result") -> "VerifyResult":
        counts = {k: _get(data, k, int, what) for k in _VERIFY_COUNTS}
        examples = _get(data, "mismatch_examples", list, what)
        deferred = _opt(data, "deferred_groups", list, what) or []
        return cls(shard=_get(data, "shard", str, what), max_abs_err=_get(data, "max_abs_err", float, what),
                   mismatch_examples=[str(e) for e in examples],
                   deferred_groups=[_group_from_json(g, what) for g in deferred], **counts)


@dataclass
class VerifySummary:
    """Every shard's VerifyResult summed (the report's ``verify`` section), the mismatches
    including any disagreement with the cast's own figures and any coverage gap."""

    matrices: int = 0
    blocks: int = 0
    proved_blocks: int = 0
    exact_blocks: int = 0
    sample_matrices: int = 0
    sample_elements: int = 0
    carried_tensors: int = 0
    mismatches: int = 0
    max_abs_err: float = 0.0
    mismatch_examples: list[str] = field(default_factory=list)

    @classmethod
    def merge(cls, results: list[VerifyResult], cast_stats: CastStats) -> "VerifySummary":
        """The shards' results summed; the cast's claims (``cast_stats``) must agree with what
        was proved from disk, each disagreement one more mismatch."""
        out = cls(**{k: sum(getattr(r, k) for r in results) for k in _VERIFY_COUNTS},
                  max_abs_err=max((r.max_abs_err for r in results), default=0.0))
        examples = [e for r in results for e in r.mismatch_examples]
        claims = []
        if out.blocks != cast_stats.blocks:
            claims.append(f"verified {out.blocks} blocks but the cast reported {cast_stats.blocks}")
        if out.exact_blocks != cast_stats.exact_blocks:
            claims.append(f"{out.exact_blocks} blocks proved exact on disk but the cast reported {cast_stats.exact_blocks}")
        if out.max_abs_err > cast_stats.max_abs_err * (1 + 1e-9):
            claims.append(f"max_abs_err on disk {out.max_abs_err:g} exceeds the cast's {cast_stats.max_abs_err:g}")
        out.mismatches += len(claims)
        out.mismatch_examples = (examples + claims)[:MAX_SUMMARY_EXAMPLES]
        return out

    def add_gaps(self, gaps: list[str]) -> None:
        """Coverage gaps (rank_checks.coverage_problems) count as mismatches too."""
        self.mismatches += len(gaps)
        self.mismatch_examples = (self.mismatch_examples + gaps)[:MAX_SUMMARY_EXAMPLES]

    def failure(self) -> str | None:
        """The one-line --verify failure, or None when it passed."""
        if not self.mismatches:
            return None
        return "--verify FAILED: " + "; ".join(self.mismatch_examples) + f" ({self.mismatches} mismatches)"

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class ShardRecord:
    """One output shard cast: who cast it (pid) and how long it took, the bytes it read
    (source_bytes: its own source shard; extra_bytes_read: tensors of groups that span shards,
    read from their other shards) and wrote, the expert matrices anchored in it and their cast
    statistics, its A_log checks, and its in-line verify result (``--verify``; None without)."""

    shard: str
    pid: int
    cast_seconds: float
    seconds: float
    source_bytes: int
    extra_bytes_read: int
    output_bytes: int
    matrices: int
    stats: CastStats
    a_log: list[ALogCheck] = field(default_factory=list)
    verify: VerifyResult | None = None

    def to_json(self) -> dict:
        # The key order of the dict records of earlier versions (cast_report.json's per_shard).
        return {
            "pid": self.pid,
            "verify": None if self.verify is None else self.verify.to_json(),
            "cast_seconds": self.cast_seconds,
            "shard": self.shard,
            "source_bytes": self.source_bytes,
            "extra_bytes_read": self.extra_bytes_read,
            "output_bytes": self.output_bytes,
            "matrices": self.matrices,
            "stats": self.stats.to_dict(),
            "a_log": [a.to_json() for a in self.a_log],
            "seconds": self.seconds,
        }

    @classmethod
    def from_json(cls, data: Any, what: str = "shard record") -> "ShardRecord":
        shard = _get(data, "shard", str, what)
        what = f"{what} of {shard}"
        verify = _get(data, "verify", (dict, type(None)), what)
        return cls(
            shard=shard,
            pid=_get(data, "pid", int, what),
            cast_seconds=_get(data, "cast_seconds", float, what),
            seconds=_get(data, "seconds", float, what),
            source_bytes=_get(data, "source_bytes", int, what),
            extra_bytes_read=_get(data, "extra_bytes_read", int, what),
            output_bytes=_get(data, "output_bytes", int, what),
            matrices=_get(data, "matrices", int, what),
            stats=cast_stats_from_json(_get(data, "stats", dict, what), f"{what}: stats"),
            a_log=[ALogCheck.from_json(a, f"{what}: a_log") for a in _get(data, "a_log", list, what)],
            verify=None if verify is None else VerifyResult.from_json(verify, f"{what}: verify"),
        )


# -- the rank messages ---------------------------------------------------------------------


@dataclass(frozen=True)
class LaunchInfo:
    """What a rank sends at start: the plan it made (fingerprint and its parts), the options
    every rank must share (rank_checks.SHARED_OPTIONS) and where it reads and writes."""

    tool_version: str
    fingerprint: str
    fingerprint_parts: dict
    options: dict
    source: str
    output: str

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Any, what: str = "launch info") -> "LaunchInfo":
        return cls(**{f.name: _get(data, f.name, dict if f.name in ("fingerprint_parts", "options") else str, what)
                      for f in dataclasses.fields(cls)})


@dataclass(frozen=True)
class Prepared:
    """Rank 0, after preparing the output: whether it already holds a finished cast of this
    source with these options; the launch token it wrote there (ranks > 0 must see it, None when
    single) and the output directory as rank 0 resolved it."""

    finished: bool
    token: str | None
    output: str

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Any, what: str = "prepared message") -> "Prepared":
        return cls(finished=_get(data, "finished", bool, what), token=_get(data, "token", (str, type(None)), what),
                   output=_get(data, "output", str, what))


@dataclass
class RankRow:
    """One rank's part of the cast (the report's ``ranks.per_rank``): its shards, how many it
    cast now and how many an earlier run had, the bytes cast now, its timings (None: not
    reached, or not run)."""

    rank: int
    host: str
    pid: int
    workers: int
    shards: list[str]
    cast_now: int
    resumed: int
    bytes_cast_now: int
    cast_seconds: float | None = None
    verify_seconds: float | None = None

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        for key in ("cast_seconds", "verify_seconds"):  # absent rather than null, as before
            if out[key] is None:
                del out[key]
        return out

    @classmethod
    def from_json(cls, data: Any, what: str = "rank row") -> "RankRow":
        opt = (float, type(None))
        return cls(
            rank=_get(data, "rank", int, what), host=_get(data, "host", str, what), pid=_get(data, "pid", int, what),
            workers=_get(data, "workers", int, what), shards=[str(s) for s in _get(data, "shards", list, what)],
            cast_now=_get(data, "cast_now", int, what), resumed=_get(data, "resumed", int, what),
            bytes_cast_now=_get(data, "bytes_cast_now", int, what),
            cast_seconds=_opt(data, "cast_seconds", opt, what),
            verify_seconds=_opt(data, "verify_seconds", opt, what),
        )


@dataclass
class CastMessage:
    """A rank's 'cast' exchange: the records of its shards (cast now or by an earlier run) and
    its row."""

    records: dict[str, ShardRecord]
    rank: RankRow

    def to_json(self) -> dict:
        return {"records": {name: r.to_json() for name, r in self.records.items()}, "rank": self.rank.to_json()}

    @classmethod
    def from_json(cls, data: Any, what: str = "cast message") -> "CastMessage":
        records = _get(data, "records", dict, what)
        return cls(records={name: ShardRecord.from_json(r, what) for name, r in records.items()},
                   rank=RankRow.from_json(_get(data, "rank", dict, what), what))


@dataclass
class VerifyMessage:
    """A rank's 'verify' exchange: its shards' results, the shards it verified and how long it
    took (None: a finished cast verified again, where the report keeps rank 0's time)."""

    results: list[VerifyResult]
    verified: list[str]
    verify_seconds: float | None = None

    def to_json(self) -> dict:
        return {"results": [r.to_json() for r in self.results], "verified": list(self.verified),
                "verify_seconds": self.verify_seconds}

    @classmethod
    def from_json(cls, data: Any, what: str = "verify message") -> "VerifyMessage":
        return cls(results=[VerifyResult.from_json(r, what) for r in _get(data, "results", list, what)],
                   verified=[str(s) for s in _get(data, "verified", list, what)],
                   verify_seconds=_opt(data, "verify_seconds", (float, type(None)), what))
