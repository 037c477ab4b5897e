"""Read and validate a Kimi-K3 MXFP4 checkpoint; plan every output shard of the cast.

Everything that can be checked without reading tensor data is checked here, before a
single byte is written: config, index, every shard header (missing, truncated, corrupt),
index entries that name absent tensors, expert tensor dtypes and shapes.
"""

from __future__ import annotations

import hashlib
import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from .layout import CONFIG_FILE, HF_QUANT_CONFIG_FILE, INDEX_FILE, KDA_A_LOG_RE, REPORT_FILE, ExpertMatrixName, parse_expert_tensor
from .quant_config import exclude_module_globs, source_quantization_config
from .safetensors_io import FLOAT_TAGS, CheckpointError, OutputSpec, SafetensorsHeader, TensorEntry, read_header


@dataclass(frozen=True)
class SourceRef:
    shard: str
    entry: TensorEntry


@dataclass(frozen=True)
class ExpertMatrix:
    """One MXFP4 expert matrix of the source: where its packed nibbles and E8M0 scales live."""

    name: ExpertMatrixName
    packed: SourceRef
    scale: SourceRef

    @property
    def rows(self) -> int:
        return self.packed.entry.shape[0]

    @property
    def in_dim(self) -> int:
        return 2 * self.packed.entry.shape[1]


@dataclass(frozen=True)
class OutputItem:
    """One tensor of an output shard and how to produce it.

    kind: "carry" (raw bytes of ``src``), "a_log_trim" (first ``num_heads`` elements of
    ``src``), or an expert output: "weight" | "weight_scale" | "weight_scale_2" |
    "input_scale" of matrix ``matrix`` (group ``group``).
    """

    spec: OutputSpec
    kind: str
    src: SourceRef | None = None
    matrix: str | None = None  # ExpertMatrixName.base
    group: tuple[int, int, str] | None = None


@dataclass
class ShardPlan:
    name: str
    items: list[OutputItem]
    source_bytes: int  # size of the source shard file
    anchored_groups: list[tuple[int, int, str]] = field(default_factory=list)  # groups counted here


@dataclass(frozen=True)
class ShardTask:
    """One output shard's work, as sent to a pool worker (cast) and to the verifier: the shard's
    plan and the expert groups it touches. Lives here, with the plan, so that convert.py and
    verify.py both import it without importing each other."""

    source: Path
    output: Path
    shard: ShardPlan
    groups: dict  # group -> list[ExpertMatrix], the groups this shard touches
    num_heads: int | None
    strict: bool
    w4a4: bool = False
    verify_sample: int = 1
    verify: bool = False  # verify the shard right after writing it (groups inside the shard)


@dataclass
class CastPlan:
    source: Path
    config: dict
    text_config: dict
    shards: list[ShardPlan]
    groups: dict[tuple[int, int, str], list[ExpertMatrix]]  # w13: [w1, w3]; w2: [w2]
    a_log: list[SourceRef]
    num_heads: int | None
    head_dim: int | None
    exclude_modules: list[str]
    side_files: list[Path]  # relative to source
    fingerprint: str
    fingerprint_parts: dict  # tool version, options, source file hashes, shard sizes and mtimes
    total_source_bytes: int
    w4a4: bool
    trim_a_log: bool

    @property
    def matrices(self) -> dict[str, ExpertMatrix]:
        return {m.name.base: m for ms in self.groups.values() for m in ms}


def fingerprint_differences(old: dict, new: dict) -> list[str]:
    """What changed between two plans' fingerprint parts, in words (empty: nothing)."""
    out = []
    for opt in ("w4a4", "trim_a_log"):
        if old.get(opt) != new.get(opt):
            flag = "--" + opt.replace("_", "-")
            out.append(f"option {flag} was {'on' if old.get(opt) else 'off'}, now {'on' if new.get(opt) else 'off'}")
    if old.get("tool_version") != new.get("tool_version"):
        out.append(f"k3nvfp4-cast version {old.get('tool_version')} -> {new.get('tool_version')}")
    for kind in ("files", "shards"):
        a, b = old.get(kind, {}), new.get(kind, {})
        out += [f"source {name} changed" for name in sorted(set(a) & set(b)) if a[name] != b[name]]
        out += [f"source {name} is new" for name in sorted(set(b) - set(a))]
        out += [f"source {name} is gone" for name in sorted(set(a) - set(b))]
    return out


def _load_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from None


def _expect(cond: bool, msg: str) -> None:
    if not cond:
        raise CheckpointError(msg)


def plan_cast(source: Path, *, w4a4: bool = False, trim_a_log: bool = False, tool_version: str = "") -> CastPlan:
    """Validate the source checkpoint and plan the output (reads headers only)."""
    config_path, index_path = source / CONFIG_FILE, source / INDEX_FILE
    config = _load_json(config_path)
    source_quantization_config(config, str(config_path))
    text = config.get("text_config", {})
    weight_map, headers = _read_index_and_headers(source, index_path)
    groups = _expert_groups(source, weight_map, headers)
    lac = text.get("linear_attn_config") or {}
    num_heads, head_dim = lac.get("num_heads"), lac.get("head_dim")
    a_log = _a_log_refs(source, config_path, weight_map, headers, trim_a_log, num_heads)
    trim = {r.entry.name for r in a_log} if trim_a_log else set()
    shards = [_shard_plan(shard, h, groups, trim, num_heads, w4a4) for shard, h in headers.items()]
    parts = _fingerprint_parts(config_path, index_path, headers, tool_version=tool_version, w4a4=w4a4,
                               trim_a_log=trim_a_log)
    return CastPlan(
        source=source,
        config=config,
        text_config=text,
        shards=shards,
        groups=groups,
        a_log=a_log,
        num_heads=num_heads,
        head_dim=head_dim,
        exclude_modules=_exclude_modules(weight_map, headers, groups),
        side_files=_side_files(source, headers),
        fingerprint=hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest(),
        fingerprint_parts=parts,
        total_source_bytes=sum(h.file_size for h in headers.values()),
        w4a4=w4a4,
        trim_a_log=trim_a_log,
    )


def _read_index_and_headers(source: Path, index_path: Path) -> tuple[dict[str, str], dict[str, SafetensorsHeader]]:
    """The index's weight map and every shard's header, each tensor in exactly the shard the
    index names."""
    index = _load_json(index_path)
    weight_map = index.get("weight_map")
    _expect(isinstance(weight_map, dict) and weight_map, f"{index_path}: no weight_map")
    headers: dict[str, SafetensorsHeader] = {}
    for shard in sorted(set(weight_map.values())):
        _expect("/" not in shard and not shard.startswith("."), f"{index_path}: suspicious shard name {shard!r}")
        path = source / shard
        if not path.is_file():
            raise CheckpointError(f"{path}: shard named by {INDEX_FILE} is missing")
        headers[shard] = read_header(path)
    for name, shard in weight_map.items():
        if name not in headers[shard].entries:
            raise CheckpointError(f"{source / shard}: tensor {name} named by {INDEX_FILE} is absent from the shard")
    for shard, h in headers.items():
        extra = [n for n in h.entries if weight_map.get(n) != shard]
        if extra:
            raise CheckpointError(f"{h.path}: tensor {extra[0]} is not mapped to this shard by {INDEX_FILE}")
    return weight_map, headers


def _expert_groups(source: Path, weight_map: dict[str, str],
                   headers: dict[str, SafetensorsHeader]) -> dict[tuple[int, int, str], list[ExpertMatrix]]:
    """The routed experts' matrices: weight_packed paired with weight_scale, dtypes and shapes
    checked, grouped as w13 ([w1, w3], same shape) and w2 (shaped to match its w1)."""
    parts: dict[str, dict[str, SourceRef]] = defaultdict(dict)
    names: dict[str, ExpertMatrixName] = {}
    for name, shard in weight_map.items():
        parsed = parse_expert_tensor(name)
        if parsed is not None:
            mname, kind = parsed
            parts[mname.base][kind] = SourceRef(shard, headers[shard].entries[name])
            names[mname.base] = mname
    groups: dict[tuple[int, int, str], list[ExpertMatrix]] = defaultdict(list)
    for base in sorted(parts):
        p = parts[base]
        for kind in ("weight_packed", "weight_scale"):
            _expect(kind in p, f"{source}: expert matrix {base} has no {base}.{kind} in {INDEX_FILE}")
        pk, sc = p["weight_packed"].entry, p["weight_scale"].entry
        _expect(pk.dtype == "U8", f"{source / p['weight_packed'].shard}: tensor {pk.name} has dtype {pk.dtype}, expected U8 (packed E2M1)")
        _expect(sc.dtype == "U8", f"{source / p['weight_scale'].shard}: tensor {sc.name} has dtype {sc.dtype}, expected U8 (E8M0)")
        _expect(len(pk.shape) == 2, f"{source / p['weight_packed'].shard}: tensor {pk.name} has shape {list(pk.shape)}, expected 2-D [out, in/2]")
        rows, in_dim = pk.shape[0], 2 * pk.shape[1]
        _expect(in_dim % 32 == 0, f"{source / p['weight_packed'].shard}: tensor {pk.name}: in-dim {in_dim} is not a multiple of 32")
        _expect(
            sc.shape == (rows, in_dim // 32),
            f"{source / p['weight_scale'].shard}: tensor {sc.name} has shape {list(sc.shape)}, expected {[rows, in_dim // 32]} for {pk.name} {list(pk.shape)}",
        )
        m = ExpertMatrix(names[base], p["weight_packed"], p["weight_scale"])
        groups[m.name.group].append(m)
    for g, ms in groups.items():
        ms.sort(key=lambda m: {"w1": 0, "w3": 1, "w2": 2}[m.name.proj])
        if g[2] == "w13":
            projs = [m.name.proj for m in ms]
            _expect(projs == ["w1", "w3"], f"{source}: layer {g[0]} expert {g[1]} has {projs}, expected both w1 and w3")
            _expect(
                ms[0].packed.entry.shape == ms[1].packed.entry.shape,
                f"{source}: {ms[1].packed.entry.name} shape {list(ms[1].packed.entry.shape)} differs from {ms[0].packed.entry.name} {list(ms[0].packed.entry.shape)}",
            )
    for (layer, expert, kind), ms in groups.items():
        if kind == "w2" and (layer, expert, "w13") in groups:
            w1 = groups[(layer, expert, "w13")][0]
            want = (w1.in_dim, w1.rows // 2)
            got = ms[0].packed.entry.shape
            _expect(got == want, f"{source}: {ms[0].packed.entry.name} has shape {list(got)}, expected {list(want)} (w2 of a [{w1.rows}, {w1.in_dim}] w1)")
    _expect(bool(groups), f"{source}: no MXFP4 routed experts (*.block_sparse_moe.experts.E.w{{1,2,3}}.weight_packed) in {INDEX_FILE}")
    return dict(groups)


def _a_log_refs(source: Path, config_path: Path, weight_map: dict[str, str], headers: dict[str, SafetensorsHeader],
                trim_a_log: bool, num_heads: int | None) -> list[SourceRef]:
    """The KDA A_log tensors; with --trim-a-log the config must give num_heads and each must be
    1-D with at least num_heads elements."""
    a_log = [SourceRef(s, headers[s].entries[n]) for n, s in sorted(weight_map.items()) if KDA_A_LOG_RE.match(n)]
    if trim_a_log and a_log:
        _expect(isinstance(num_heads, int), f"{config_path}: --trim-a-log needs text_config.linear_attn_config.num_heads")
        for ref in a_log:
            e = ref.entry
            _expect(
                len(e.shape) == 1 and e.shape[0] >= num_heads,
                f"{source / ref.shard}: tensor {e.name} has shape {list(e.shape)}; --trim-a-log expects 1-D [head_dim >= {num_heads}]",
            )
    return a_log


def _shard_plan(shard: str, h: SafetensorsHeader, groups: dict[tuple[int, int, str], list[ExpertMatrix]],
                trim: set[str], num_heads: int | None, w4a4: bool) -> ShardPlan:
    """One output shard: its tensors in source byte order (sequential reads), each carried, trimmed
    (the A_log tensors named in ``trim``) or cast; the groups whose first matrix lives here are
    anchored (counted and verified) here."""
    items: list[tuple[int, int, OutputItem]] = []
    for e in sorted(h.entries.values(), key=lambda e: e.begin):
        ref = SourceRef(shard, e)
        parsed = parse_expert_tensor(e.name)
        if parsed is None:
            if e.name in trim and e.shape[0] != num_heads:
                spec = OutputSpec(e.name, e.dtype, (num_heads,))
                items.append((e.begin, 0, OutputItem(spec, "a_log_trim", ref)))
            else:
                items.append((e.begin, 0, OutputItem(OutputSpec(e.name, e.dtype, e.shape), "carry", ref)))
            continue
        mname, kind = parsed
        base, g = mname.base, mname.group
        if kind == "weight_packed":
            items.append((e.begin, 0, OutputItem(OutputSpec(f"{base}.weight", "U8", e.shape), "weight", ref, base, g)))
        else:
            rows, nb = e.shape
            outs = [
                OutputSpec(f"{base}.weight_scale", "F8_E4M3", (rows, 2 * nb)),
                OutputSpec(f"{base}.weight_scale_2", "F32", ()),
            ]
            if w4a4:
                outs.append(OutputSpec(f"{base}.input_scale", "F32", ()))
            for k, spec in enumerate(outs):
                items.append((e.begin, k, OutputItem(spec, spec.name.rsplit(".", 1)[1], ref, base, g)))
    items.sort(key=lambda t: (t[0], t[1]))
    return ShardPlan(
        name=shard,
        items=[it for _, _, it in items],
        source_bytes=h.file_size,
        anchored_groups=sorted(g for g, ms in groups.items() if ms[0].packed.shard == shard),
    )


def _exclude_modules(weight_map: dict[str, str], headers: dict[str, SafetensorsHeader],
                     groups: dict[tuple[int, int, str], list[ExpertMatrix]]) -> list[str]:
    """exclude_modules: globs of the modules whose .weight stayed an unquantized 2-D float tensor."""
    unquantized = [
        n[: -len(".weight")]
        for n, s in weight_map.items()
        if n.endswith(".weight") and headers[s].entries[n].dtype in FLOAT_TAGS and len(headers[s].entries[n].shape) == 2
    ]
    return exclude_module_globs(unquantized, [m.name.base for ms in groups.values() for m in ms])


def _side_files(source: Path, headers: dict[str, SafetensorsHeader]) -> list[Path]:
    """Files copied as they are (tokenizer, code, ...), relative to the source: not the tensors,
    not what the tool writes itself, not hidden (.cache, .git ...)."""
    skip = {CONFIG_FILE, INDEX_FILE, HF_QUANT_CONFIG_FILE, REPORT_FILE, *headers}
    return sorted(
        p.relative_to(source)
        for p in source.rglob("*")
        if p.is_file()
        and str(p.relative_to(source)) not in skip
        and not p.name.endswith(".safetensors")
        and not any(part.startswith(".") for part in p.relative_to(source).parts)
    )


def _fingerprint_parts(config_path: Path, index_path: Path, headers: dict[str, SafetensorsHeader], *,
                       tool_version: str, w4a4: bool, trim_a_log: bool) -> dict:
    """What a cast depends on, part by part (a refused resume says which part changed)."""
    return {
        "tool_version": tool_version, "w4a4": w4a4, "trim_a_log": trim_a_log,
        "files": {config_path.name: hashlib.sha256(config_path.read_bytes()).hexdigest(),
                  index_path.name: hashlib.sha256(index_path.read_bytes()).hexdigest()},
        "shards": {shard: f"{h.path.stat().st_size} bytes, mtime {h.path.stat().st_mtime_ns}"
                   for shard, h in sorted(headers.items())},
    }
