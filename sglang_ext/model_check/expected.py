"""Where every checkpoint tensor must land in SGLang's Kimi-K3 model, and whether it did.

An independent statement of the layout (not read back from SGLang's loader): the mapper's
renames (:func:`ckpt_reader.runtime_name`), the fusions of ``KimiK3LinearForCausalLM.load_weights``
(q/k/v/g -> ``fused_qkvg_proj``, q/k/v conv1d -> ``qkv_conv1d``, gate/up -> ``gate_up_proj``
for the dense MLP and the shared experts, q_a/kv_a -> ``fused_qkv_a_proj_with_mqa``), K3's
``A_log`` (the first ``num_heads`` values of a head_dim-padded or trimmed vector), the
routed experts' parameters (:mod:`.expert_format`: ``w13`` = w1 rows then w3 rows) and the
tensor-/expert-parallel slicing by module class (column-parallel: rows of each fused part;
row-parallel: columns; vocab-parallel: a row range; experts: the contiguous global range of
this EP rank and the MoE-TP slice of the intermediate dimension).

:func:`plan_params` decides, from names and module types only, which checkpoint tensors each
parameter holds; the caller poisons those parameters (:func:`poison`), lets SGLang load, and
:func:`check_params` compares every planned parameter with the checkpoint bytes (exact: bit
for bit when the dtypes agree, value for value after a widening cast such as the bf16 conv1d
weights SGLang keeps in fp32).
"""

from __future__ import annotations

from dataclasses import dataclass, field
import torch

from .ckpt_reader import CheckpointReader, runtime_name
from .expert_format import ExpertFormat

# Fused runtime module -> checkpoint modules, in shard order.
FUSED_MODULES: dict[str, tuple[str, ...]] = {
    "fused_qkvg_proj": ("q_proj", "k_proj", "v_proj", "g_proj"),
    "qkv_conv1d": ("q_conv1d", "k_conv1d", "v_conv1d"),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "fused_qkv_a_proj_with_mqa": ("q_a_proj", "kv_a_proj_with_mqa"),
}
# Parameters SGLang creates that a W4A16 ModelOpt checkpoint does not fill; they keep SGLang's
# initial value (KV-cache scales -> 1.0 after loading, MoE input scales = 1.0).
DEFAULT_PARAM_SUFFIXES = (".k_scale", ".v_scale", ".w13_input_scale", ".w2_input_scale")


@dataclass
class ParamPlan:
    """One SGLang parameter and the checkpoint tensors it must hold."""

    name: str
    param: torch.nn.Parameter
    module: torch.nn.Module
    local_name: str
    sources: list[str]
    kind: str  # "direct", "fused", "a_log", "experts"
    missing: list[str] = field(default_factory=list)  # fused parts the checkpoint lacks


@dataclass
class ParamResult:
    name: str
    sources: list[str]
    problem: str | None  # None: equal


@dataclass
class Plan:
    params: list[ParamPlan]
    defaults: list[str]  # no checkpoint tensor, allowed (DEFAULT_PARAM_SUFFIXES)
    unplanned: list[str]  # no checkpoint tensor, not allowed
    moe_layers: list[tuple[str, torch.nn.Module]]  # (runtime prefix, FusedMoE)


def _aliases(model: torch.nn.Module) -> dict[int, list[tuple[str, torch.nn.Module, str]]]:
    """id(param) -> [(full name, owning module, local name)] over every registered alias."""
    out: dict[int, list] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for local, param in module.named_parameters(recurse=False):
            full = f"{mod_name}.{local}" if mod_name else local
            entry = (full, module, local)
            if entry not in out.setdefault(id(param), []):
                out[id(param)].append(entry)
    return out


def plan_params(model: torch.nn.Module, reader: CheckpointReader, fmt: ExpertFormat) -> Plan:
    """Which checkpoint tensors every parameter of ``model`` must hold (names and types only)."""
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    rt2ck = {runtime_name(n): n for n in reader.names()}
    params = dict(model.named_parameters())
    aliases = _aliases(model)
    plans, defaults, unplanned, moe_layers, seen_moe = [], [], [], [], set()
    for name, param in params.items():
        entries = aliases.get(id(param), [(name, None, name.rsplit(".", 1)[-1])])
        moe = next(((full, mod) for full, mod, _ in entries if isinstance(mod, FusedMoE)), None)
        if moe is not None:
            prefix = moe[0].rsplit(".", 1)[0]
            if prefix not in seen_moe:
                seen_moe.add(prefix)
                moe_layers.append((prefix, moe[1]))
            local = moe[0].rsplit(".", 1)[1]
            if local in fmt.params or (local.endswith("_input_scale") and _has_input_scales(prefix, moe[1], rt2ck)):
                plans.append(ParamPlan(name, param, moe[1], local, [], "experts"))
            elif name.endswith(DEFAULT_PARAM_SUFFIXES):
                defaults.append(name)
            else:
                unplanned.append(name)
            continue
        plan = None
        for full, module, local in entries:
            plan = _plan_one(full, param, module, local, rt2ck)
            if plan is not None:
                break
        if plan is not None:
            plans.append(plan)
        elif name.endswith(DEFAULT_PARAM_SUFFIXES):
            defaults.append(name)
        else:
            unplanned.append(name)
    return Plan(plans, defaults, unplanned, moe_layers)


def _has_input_scales(prefix: str, layer, rt2ck: dict[str, str]) -> bool:
    return any(f"{prefix}.{e}.{proj}.input_scale" in rt2ck for e in range(layer.num_experts) for proj in ("w1", "w3", "w2"))


def _plan_one(full: str, param, module, local: str, rt2ck: dict[str, str]) -> ParamPlan | None:
    if full in rt2ck:
        return ParamPlan(full, param, module, local, [rt2ck[full]], "a_log" if local == "A_log" else "direct")
    parent, _, leaf = full.rpartition(".")
    mod_path, _, fused = parent.rpartition(".")
    if fused in FUSED_MODULES:
        names = [f"{mod_path}.{part}.{leaf}" for part in FUSED_MODULES[fused]]
        have = [rt2ck[n] for n in names if n in rt2ck]
        if have:
            return ParamPlan(full, param, module, local, have, "fused", [n for n in names if n not in rt2ck])
    return None


# --- sentinel ------------------------------------------------------------------------------


def poison(plan: Plan) -> None:
    """Fill every planned parameter with a value no checkpoint holds (NaN for floats, 0xA5 bytes
    otherwise), so a tensor SGLang skips cannot pass for loaded by chance."""
    with torch.no_grad():
        for p in plan.params:
            t = p.param.data
            if t.numel() == 0:
                continue
            if t.dtype.is_floating_point:
                t.fill_(float("nan"))
            else:
                t.view(torch.uint8).fill_(0xA5)


# --- comparison ----------------------------------------------------------------------------


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _is_fp8(dtype: torch.dtype) -> bool:
    return dtype.itemsize == 1 and dtype.is_floating_point


def compare(actual: torch.Tensor, expected: torch.Tensor) -> str | None:
    """None when ``actual`` holds exactly ``expected``; else what differs."""
    if tuple(actual.shape) != tuple(expected.shape):
        return f"shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
    actual = actual.detach().cpu()
    if actual.dtype == expected.dtype:
        diff = _bytes(actual) != _bytes(expected)
        if not bool(diff.any()):
            return None
        n = int(diff.view(actual.numel(), -1).any(dim=1).sum()) if actual.numel() else 0
        return f"{n} of {actual.numel()} elements differ from the checkpoint (dtype {actual.dtype})"
    floats = actual.dtype.is_floating_point and expected.dtype.is_floating_point
    if floats and not _is_fp8(actual.dtype) and not _is_fp8(expected.dtype):
        a, e = actual.double(), expected.double()
        diff = ~((a == e) | (a.isnan() & e.isnan()))
        if not bool(diff.any()):
            return None
        return (f"{int(diff.sum())} of {actual.numel()} values differ from the checkpoint "
                f"({expected.dtype} -> {actual.dtype})")  # fmt: skip
    return f"dtype {actual.dtype}, checkpoint {expected.dtype}"


def _rank_size(group) -> tuple[int, int]:
    from sglang.srt.distributed.utils import get_group_rank_size

    return get_group_rank_size(group) if group is not None else (0, 1)


def _expected_dense(p: ParamPlan, parts: list[torch.Tensor]) -> torch.Tensor:
    """What a non-expert parameter must hold on this rank (its shape, the checkpoint's dtype)."""
    from sglang.srt.layers.linear import ColumnParallelLinear, RowParallelLinear
    from sglang.srt.layers.vocab_parallel_embedding import VocabParallelEmbedding

    module, shape = p.module, tuple(p.param.shape)
    if p.kind == "a_log":
        # K3: the first num_heads values (padded to head_dim in the release, or trimmed),
        # sharded over attention TP by heads.
        rank, size = getattr(module, "attn_tp_rank", 0), getattr(module, "attn_tp_size", 1)
        local = p.param.numel()
        flat = parts[0].reshape(-1)
        return flat[rank * local:(rank + 1) * local].reshape(shape)
    if p.local_name == "dt_bias":
        rank, size = getattr(module, "attn_tp_rank", 0), getattr(module, "attn_tp_size", 1)
        return parts[0].chunk(size, 0)[rank].reshape(shape)
    if isinstance(module, VocabParallelEmbedding):
        idx = module.shard_indices
        rows = parts[0][idx.org_vocab_start_index:idx.org_vocab_end_index]
        padded = torch.zeros(shape, dtype=rows.dtype)
        padded[: rows.shape[0]] = rows  # SGLang zero-fills the padding rows
        return padded
    if isinstance(module, RowParallelLinear):
        rank, size = _rank_size(getattr(module, "tp_group", None))
        return parts[0].chunk(size, 1)[rank].reshape(shape)
    if isinstance(module, ColumnParallelLinear):
        rank, size = _rank_size(getattr(module, "tp_group", None))
        return torch.cat([t.chunk(size, 0)[rank] for t in parts]).reshape(shape)
    return (torch.cat(parts) if len(parts) > 1 else parts[0]).reshape(shape)


def check_params(plan: Plan, reader: CheckpointReader, fmt: ExpertFormat) -> tuple[list[ParamResult], set[str], int]:
    """Compare every planned parameter; returns (results, checkpoint names verified in place,
    number of (layer, local expert) checks)."""
    results: list[ParamResult] = []
    landed: set[str] = set()
    for p in plan.params:
        if p.kind == "experts":
            continue
        if p.missing:
            results.append(ParamResult(p.name, p.sources, f"checkpoint lacks fused parts {p.missing}"))
            continue
        try:
            expected = _expected_dense(p, [reader.get(s) for s in p.sources])
            problem = compare(p.param.data, expected)
        except RuntimeError as exc:  # a reshape that cannot fit
            problem = f"cannot lay {p.sources} into {tuple(p.param.shape)}: {exc}"
        results.append(ParamResult(p.name, p.sources, problem))
        if problem is None:
            landed.update(p.sources)
    n_expert_checks = 0
    rt2ck = {runtime_name(n): n for n in reader.names()}
    for prefix, layer in plan.moe_layers:
        r, n, ok = _check_experts(prefix, layer, rt2ck, reader, fmt)
        results.extend(r)
        landed.update(ok)
        n_expert_checks += n
    return results, landed, n_expert_checks


def _check_experts(prefix: str, layer, rt2ck: dict[str, str], reader: CheckpointReader, fmt: ExpertFormat):
    """Every expert parameter of every local expert of one FusedMoE against the checkpoint."""
    results, landed, checks = [], set(), 0
    e_local_n, ep_rank = layer.num_local_experts, layer.moe_ep_rank
    tp_rank, tp_size = layer.moe_tp_rank, layer.moe_tp_size

    def rows(t):
        return t.chunk(tp_size, 0)[tp_rank]

    def cols(t):
        return t.chunk(tp_size, 1)[tp_rank]

    for e_local in range(e_local_n):
        e = ep_rank * e_local_n + e_local
        names = {(proj, suf): rt2ck.get(f"{prefix}.{e}.{proj}.{suf}") for proj in ("w1", "w3", "w2")
                 for suf in fmt.suffixes}  # fmt: skip
        sources = [v for v in names.values() if v is not None]
        label = f"{prefix}[expert {e} -> local {e_local}]"
        absent = [f"{prefix}.{e}.{proj}.{suf}" for (proj, suf), v in names.items() if v is None]
        if absent:
            results.append(ParamResult(label, sources, f"checkpoint lacks {absent} ({fmt.name})"))
            continue
        expected = fmt.expected({k: reader.get(v) for k, v in names.items()}, rows, cols, layer, e_local)
        problems = []
        for pname, exp in expected.items():
            actual = getattr(layer, pname).data[e_local]
            problem = compare(actual, exp.reshape(actual.shape) if exp.numel() == actual.numel() else exp)
            if problem is not None:
                problems.append(f"{pname}: {problem}")
        checks += 1
        results.append(ParamResult(label, sources, "; ".join(problems) or None))
        if not problems:
            landed.update(sources)
    landed |= _check_input_scales(prefix, layer, rt2ck, reader, results)
    return results, checks, landed


def _check_input_scales(prefix: str, layer, rt2ck, reader, results) -> set[str]:
    """W4A4 casts carry per-expert input_scale; SGLang keeps them for all global experts."""
    landed = set()
    for e in range(layer.num_experts):
        names = [rt2ck.get(f"{prefix}.{e}.{proj}.input_scale") for proj in ("w1", "w3", "w2")]
        if not any(names):
            continue
        label = f"{prefix}[expert {e}].input_scale"
        if not all(names):
            results.append(ParamResult(label, [n for n in names if n], "input_scale missing for some of w1/w3/w2"))
            continue
        i1, i3, i2 = (reader.get(n).reshape(()) for n in names)
        problems = [pr for pr in (compare(layer.w13_input_scale.data[e].reshape(-1), torch.stack([i1, i3])),
                                  compare(layer.w2_input_scale.data[e].reshape(()), i2)) if pr]  # fmt: skip
        results.append(ParamResult(label, names, "; ".join(problems) or None))
        if not problems:
            landed.update(names)
    return landed
