"""What the ranks of a cast across nodes check of each other.

- At start (:func:`launch_info`, :func:`launch_differences`): every rank planned the same
  source (the plan's fingerprint: config and index hashes, every shard's size and mtime), with
  the same options and tool version. The source may be mounted at another path on another node;
  what it holds must be the same.
- After rank 0 prepared the output (:func:`write_launch_token`, :func:`check_launch_token`): every
  rank sees the very directory rank 0 prepared, proven by a random token rank 0 wrote into it
  (the same path string on two nodes can name two local disks; two path strings can name one
  shared directory).
- At the end, on rank 0 (:func:`coverage_problems`): the gathered records and verify results
  cover every shard of the plan exactly once, and their totals equal the plan's.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from pathlib import Path

from .layout import STATE_DIR
from .plan import CastPlan
from .records import LaunchInfo, VerifySummary
from .safetensors_io import CheckpointError, write_atomic_text

LAUNCH_TOKEN_FILE = "launch.json"
# Options every rank must share; --workers and --no-progress may differ from node to node.
SHARED_OPTIONS = ("verify", "strict", "w4a4", "trim_a_log", "overwrite", "verify_sample")


def launch_info(options, plan: CastPlan, tool_version: str) -> LaunchInfo:
    """What a rank sends at start (``options``: a CastOptions)."""
    return LaunchInfo(
        tool_version=tool_version,
        fingerprint=plan.fingerprint,
        fingerprint_parts=plan.fingerprint_parts,
        options={k: getattr(options, k) for k in SHARED_OPTIONS},
        source=str(Path(options.source).resolve()),
        output=str(Path(options.output).resolve()),
    )


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _value(v) -> str:
    return ("on" if v else "off") if isinstance(v, bool) else repr(v)


def launch_differences(infos: list[LaunchInfo], who=lambda r: f"rank {r}") -> list[str]:
    """How each rank's start differs from rank 0's, in words (empty: all alike)."""
    ref = infos[0]
    out = []
    for r, info in enumerate(infos[1:], 1):
        me, zero = who(r), who(0)
        diffs = []
        if info.tool_version != ref.tool_version:
            diffs.append(f"{me} runs k3nvfp4-cast {info.tool_version}, {zero} {ref.tool_version}")
        for k in SHARED_OPTIONS:
            a, b = ref.options.get(k), info.options.get(k)
            if a != b:
                diffs.append(f"{_flag(k)} is {_value(b)} at {me}, {_value(a)} at {zero}")
        pa, pb = ref.fingerprint_parts, info.fingerprint_parts
        source = []
        for kind in ("files", "shards"):  # the rest of the fingerprint is the options and version above
            a, b = pa.get(kind, {}), pb.get(kind, {})
            source += [f"source {name}: {b.get(name, 'absent')} at {me}, {a.get(name, 'absent')} at {zero}"
                       for name in sorted(set(a) | set(b)) if a.get(name) != b.get(name)]
        if source:
            source[-1] += f" ({me} reads {info.source}, {zero} {ref.source})"
        elif info.fingerprint != ref.fingerprint and not diffs:
            source.append(f"{me} planned another cast than {zero} (fingerprint {info.fingerprint[:12]} vs "
                          f"{ref.fingerprint[:12]})")
        out += diffs + source
    return out


def write_launch_token(output: Path, world_size: int) -> str:
    """Rank 0: a fresh random token in the output's state folder; returns it."""
    token = secrets.token_hex(16)
    write_atomic_text(output / STATE_DIR / LAUNCH_TOKEN_FILE, json.dumps({"token": token, "world_size": world_size}) + "\n")
    return token


def check_launch_token(output: Path, token: str, root_output: str) -> None:
    """A rank other than 0: raise CheckpointError unless ``output`` holds rank 0's ``token``."""
    path = output / STATE_DIR / LAUNCH_TOKEN_FILE
    try:
        seen = json.loads(path.read_text()).get("token")
    except (OSError, ValueError):
        seen = None
    if seen != token:
        raise CheckpointError(
            f"--output-ckpt {output}: not the directory rank 0 prepared ({root_output} on rank 0; "
            f"{path} {'holds another launch token' if seen else 'is missing'}): the output must be one "
            "directory on storage that every rank shares")


@dataclass(frozen=True)
class PlanTotals:
    """What a complete cast of ``plan`` counts."""

    shards: frozenset[str]
    matrices: int
    blocks: int  # 32-element source blocks
    carried_tensors: int


def plan_totals(plan: CastPlan) -> PlanTotals:
    return PlanTotals(
        shards=frozenset(sp.name for sp in plan.shards),
        matrices=len(plan.matrices),
        blocks=sum(m.rows * m.in_dim // 32 for m in plan.matrices.values()),
        carried_tensors=sum(1 for sp in plan.shards for it in sp.items if it.kind in ("carry", "a_log_trim")),
    )


def _cover(names: list[str], want: frozenset[str], what: str) -> list[str]:
    out = []
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        out.append(f"shard(s) {', '.join(dup)} {what} more than once")
    missing = sorted(want - set(names))
    if missing:
        out.append(f"shard(s) {', '.join(missing)} {what} by no rank")
    extra = sorted(set(names) - want)
    if extra:
        out.append(f"shard(s) {', '.join(extra)} {what} but not in the plan")
    return out


def coverage_problems(totals: PlanTotals, cast_shards: list[str], matrices: int, blocks: int,
                      verified_shards: list[str] | None = None, verify: VerifySummary | None = None) -> list[str]:
    """Rank 0 over what every rank reported: each shard of the plan cast (and, with --verify,
    checked) exactly once, and the totals equal the plan's. Empty: no gap."""
    out = _cover(cast_shards, totals.shards, "cast")
    if matrices != totals.matrices:
        out.append(f"{matrices} matrices cast, the plan has {totals.matrices}")
    if blocks != totals.blocks:
        out.append(f"{blocks} blocks cast, the plan has {totals.blocks}")
    if verify is not None:
        out += _cover(verified_shards or [], totals.shards, "verified")
        for key, want in (("matrices", totals.matrices), ("blocks", totals.blocks),
                          ("carried_tensors", totals.carried_tensors)):
            got = getattr(verify, key)
            if got != want:
                out.append(f"verified {got} {key.replace('_', ' ')}, the plan has {want}")
    return out
