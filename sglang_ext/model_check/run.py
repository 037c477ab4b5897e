"""One model-class check on one rank, and several ranks over torch.distributed.

:func:`check_rank` builds SGLang's Kimi-K3 model from the checkpoint's config.json with
``--moe-runner-backend triton_situ`` (see :mod:`.sglang_path`), poisons every parameter the
checkpoint must fill, loads through SGLang's own weight iterator and ``load_weights`` with every
weight loader instrumented, and then checks: every checkpoint tensor landed (or belongs to an
expert of another EP rank, or to a layer beyond a ``--layers`` truncation), every parameter
holds exactly its checkpoint bytes (:mod:`.expected`), the quant method of every linear and the
empty-exclude control (:mod:`.quant_audit`), post-processing, and one MoE block's forward
against the plain-torch reference (:mod:`.forward`). It returns a JSON-able report whose
``problems`` list is empty when everything holds.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

_LAYER_RE = re.compile(r"\.layers\.(\d+)\.")
_LIST_CAP = 200  # name lists longer than this are cut in the report (counts stay exact)


@dataclass(frozen=True)
class CheckOptions:
    """One check: a checkpoint under one parallel layout."""

    ckpt: Path
    tp_size: int = 1
    ep_size: int = 1
    num_layers: int | None = None  # --json-model-override-args num_hidden_layers (truncated model)
    routed_scaling_factor: float | None = 2.5  # override for the check; None keeps the checkpoint's
    tokens: int = 8
    seed: int = 0
    moe_layer: int | None = None  # block for the forward check (default: the first MoE layer)
    forward: bool = True

    def label(self) -> str:
        return f"{self.ckpt} tp{self.tp_size}/ep{self.ep_size}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _capped(names: list[str]) -> list[str]:
    return names if len(names) <= _LIST_CAP else names[:_LIST_CAP] + [f"... {len(names) - _LIST_CAP} more"]


def _a_log_forms(reader, text: dict[str, Any]) -> list[dict[str, Any]]:
    heads = (text.get("linear_attn_config") or {}).get("num_heads")
    out = []
    for name in reader.names():
        if not name.endswith(".A_log"):
            continue
        t = reader.get(name).reshape(-1)
        out.append({
            "name": name, "stored": int(t.numel()), "num_heads": heads,
            "form": "trimmed" if t.numel() == heads else "padded",
            "padding_zero": bool((t[heads:] == 0).all()) if heads is not None else None,
        })  # fmt: skip
    return out


def _moe_after_postprocess(model: torch.nn.Module) -> tuple[dict[str, Any], list[str]]:
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    from ..backend_triton import WEIGHTS_ATTR

    info, problems = {}, []
    for prefix, layer in model.named_modules():
        if not isinstance(layer, FusedMoE):
            continue
        weights = getattr(layer, WEIGHTS_ATTR, None)
        has_weights = weights is not None
        freed = all(getattr(layer, p).numel() == 0 for p in ("w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale"))
        info[prefix] = {
            "runner_backend": getattr(layer.runner_backend, "value", str(layer.runner_backend)),
            "local_experts": layer.num_local_experts, "global_experts": layer.num_experts,
            "moe_ep_rank": layer.moe_ep_rank, "moe_ep_size": layer.moe_ep_size,
            "moe_tp_rank": layer.moe_tp_rank, "moe_tp_size": layer.moe_tp_size,
            "intermediate_per_rank": layer.intermediate_size_per_partition,
            "kernel_weights": has_weights, "modelopt_params_freed": freed,
            "kernel_weights_sha256": _digest(weights) if has_weights else None,
            "kernel_values_sha256": _value_digest(weights) if has_weights else None,
        }  # fmt: skip
        if not has_weights:
            problems.append(f"{prefix}: no triton_situ kernel weights after process_weights_after_loading")
    return info, problems


def _digest(weights: Any) -> str:
    """sha256 over the kernel-layout tensors (equal digests: bit-identical kernel inputs)."""
    h = hashlib.sha256()
    for f in dataclasses.fields(weights):
        value = getattr(weights, f.name)
        if isinstance(value, torch.Tensor):
            h.update(f.name.encode())
            h.update(value.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _value_digest(weights: Any) -> str:
    """sha256 over the weights' dequantized values (float64, signs of zeros included): equal for
    two layouts that differ only in the scales of all-zero blocks. One expert at a time (a whole
    K3 layer in float64 would be hundreds of GB)."""
    from k3nvfp4.kernels import NVFP4MoEWeights, formats
    from k3nvfp4.kernels.moe_details.layout import dequantize_tiles

    H, I = weights.hidden_size, weights.intermediate_size
    tiled = isinstance(weights, NVFP4MoEWeights)
    # else FP4MMAWeights: ModelOpt-layout nibbles with E4M3 scales (nvfp4) or E8M0 scales with
    # scale_2 folded in and scale_2 all 1 (mxfp8)
    mx = not tiled and weights.act_quant == "mxfp8"

    def values(w: torch.Tensor, scale: torch.Tensor, k: int) -> torch.Tensor:
        if tiled:
            return dequantize_tiles(w, scale, k, weights.scale_format).double()
        if mx:
            return formats.dequantize_mxfp4(w, scale).double()
        return formats.dequantize_nvfp4(w, scale, 1.0).double()

    s13, s2 = (weights.w13_e8m0, weights.w2_e8m0) if mx else (weights.w13_scale, weights.w2_scale)
    h = hashlib.sha256()
    for e in range(weights.num_experts):
        v13 = values(weights.w13[e], s13[e], H)
        v13[:I] *= weights.w13_scale_2[e, 0].double()
        v13[I:] *= weights.w13_scale_2[e, 1].double()
        v2 = values(weights.w2[e], s2[e], I) * weights.w2_scale_2[e].double()
        for v in (v13, v2):
            h.update(v.cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def _coverage(reader, landed: set[str], log, results, beyond) -> tuple[dict[str, Any], list[str]]:
    """Where every checkpoint tensor went: landed here (content verified), on another EP rank,
    beyond a truncated model, or nowhere (skipped / stray / never produced)."""
    names = reader.names()
    seen, called = set(log.seen), set(log.calls)
    in_mismatch = {s for r in results if r.problem for s in r.sources}
    kept = [n for n in names if not beyond(n)]
    not_produced = [n for n in kept if n not in seen]
    # EP: SGLang's expert loader is called for every expert and keeps only this rank's.
    other_ranks = {n for n in kept if n in called and n not in landed and ".experts." in n and n not in in_mismatch}
    skipped = [n for n in kept if n not in landed and n not in called]
    stray = [n for n in kept if n in called and n not in landed and n not in in_mismatch and n not in other_ranks]
    problems = [f"checkpoint tensor {n} skipped: no weight_loader call and not found in any parameter" for n in skipped]
    problems += [f"checkpoint tensor {n}: SGLang loaded it, but not where the K3 layout puts it" for n in stray]
    problems += [f"checkpoint tensor {n} never produced by SGLang's weight iterator" for n in not_produced]
    return {
        "checkpoint": len(names), "produced_by_iterator": len(seen), "landed": len(landed),
        "landed_names": sorted(landed), "landed_without_weight_loader": sorted(landed - called),
        "experts_of_other_ranks": len(other_ranks), "beyond_truncated_model": len(names) - len(kept),
        "skipped": _capped(skipped), "stray": _capped(stray), "not_produced_by_iterator": _capped(not_produced),
    }, problems  # fmt: skip


def check_rank(opts: CheckOptions, *, rank: int = 0, world_size: int = 1, port: int | None = None) -> dict[str, Any]:
    """The whole check on this rank (this process joins a ``world_size``-rank group)."""
    from . import noise

    noise.install()  # before SGLang is imported: its known start-up messages are listed, not printed
    from .ckpt_reader import CheckpointReader, read_config
    from .expert_format import expert_format
    from .expected import check_params, plan_params, poison
    from .forward import find_block, run_block
    from .instrument import LoadLog, instrument_loaders, tap
    from .quant_audit import audit, control_quant_config, kv_cache_scales, quant_summary
    from .reference import BlockConfig
    from .sglang_path import (
        build_model,
        init_parallel,
        load_sglang_plugins,
        load_weights,
        postprocess_weights,
        server_args_for,
        weight_iterator,
    )

    times: dict[str, float] = {}
    t0 = time.perf_counter()
    ckpt = Path(opts.ckpt)
    fmt = expert_format(read_config(ckpt))  # a clear error before SGLang's
    reader = CheckpointReader(ckpt)
    load_sglang_plugins()
    overrides: dict[str, Any] = {}
    if opts.num_layers is not None:
        overrides["num_hidden_layers"] = opts.num_layers
    if opts.routed_scaling_factor is not None:
        overrides["routed_scaling_factor"] = opts.routed_scaling_factor
    server_args = server_args_for(ckpt, tp_size=opts.tp_size, ep_size=opts.ep_size, text_overrides=overrides)
    device = init_parallel(server_args, rank=rank, world_size=world_size, port=port or free_port())
    built = build_model(server_args, rank=rank, device=device)
    model = built.model
    text = built.model_config.hf_text_config.to_dict()
    n_layers = int(text["num_hidden_layers"])
    times["build"] = time.perf_counter() - t0

    # Load, with every planned parameter poisoned and every loader call logged.
    t1 = time.perf_counter()
    plan = plan_params(model, reader, fmt)
    poison(plan)
    log = LoadLog()
    instrument_loaders(model, log)

    def beyond(name: str) -> bool:
        m = _LAYER_RE.search(name)
        return m is not None and int(m.group(1)) >= n_layers

    kept_shards = {reader.shard_of(n) for n in reader.names() if not beyond(n)}
    load_weights(built, tap(weight_iterator(built, keep_file=lambda f: Path(f).name in kept_shards), log))
    times["load"] = time.perf_counter() - t1

    t2 = time.perf_counter()
    results, landed, n_expert_checks = check_params(plan, reader, fmt)
    tensors, problems = _coverage(reader, set(landed), log, results, beyond)
    tensors["shards_read"], tensors["shards"] = len(kept_shards), len(set(reader.weight_map.values()))
    mismatches = [r for r in results if r.problem]
    problems += [f"parameter {r.name} (from {r.sources}): {r.problem}" for r in mismatches]
    problems += [f"parameter {n} has no checkpoint tensor (keeps SGLang's initial value)" for n in plan.unplanned]
    control = control_quant_config(ckpt, server_args, built.load_config) if built.quant_config is not None else None
    entries, q_problems = audit(model, built.quant_calls, control, fmt.method)
    problems += q_problems
    times["check"] = time.perf_counter() - t2

    t3 = time.perf_counter()
    postprocess_weights(built)
    kv, kv_problems = kv_cache_scales(model)
    moe_info, moe_problems = _moe_after_postprocess(model)
    problems += kv_problems + moe_problems
    times["postprocess"] = time.perf_counter() - t3

    fwd = None
    if opts.forward:
        t4 = time.perf_counter()
        try:
            prefix, block = find_block(model, opts.moe_layer)
            fwd = run_block(block, prefix, reader, BlockConfig.from_text_config(text), fmt, tokens=opts.tokens,
                            seed=opts.seed, dtype=built.model_config.dtype, device=device).to_dict()  # fmt: skip
            problems += [f"{prefix} forward: {p}" for p in fwd["problems"]]
        except (KeyError, ValueError, RuntimeError) as exc:
            problems.append(f"MoE block forward check could not run: {type(exc).__name__}: {exc}")
        times["forward"] = time.perf_counter() - t4
    times["total"] = time.perf_counter() - t0

    return {
        "checkpoint": str(ckpt), "rank": rank, "world_size": world_size, "tp_size": opts.tp_size,
        "ep_size": opts.ep_size, "device": str(device), "model_class": type(model).__name__,
        "model_loader": type(built.loader).__name__, "quant_config": type(built.quant_config).__name__,
        "expert_format": fmt.name,
        "moe_runner_backend": server_args.moe_runner_backend, "overrides": overrides,
        "num_hidden_layers": n_layers,
        "tensors": tensors,
        "params": {
            "planned": len(plan.params), "compared": len(results), "mismatches": len(mismatches),
            "expert_checks": n_expert_checks, "defaults": plan.defaults, "unplanned": plan.unplanned,
            "mismatch_details": [{"param": r.name, "sources": r.sources, "problem": r.problem} for r in mismatches][:_LIST_CAP],
        },
        "a_log": _a_log_forms(reader, text),
        "quant": quant_summary(entries),
        "kv_cache": kv,
        "moe_layers": moe_info,
        "forward": fwd,
        "timings_s": {k: round(v, 2) for k, v in times.items()},
        "sglang_known_messages": noise.seen(),
        "problems": problems,
        "ok": not problems,
    }  # fmt: skip


# --- several checks, several ranks ----------------------------------------------------------


def _rank_entry(rank: int, world: int, port: int, options: list[CheckOptions], out_dir: str) -> None:
    from .sglang_path import teardown_parallel

    reports = []
    for opts in options:
        try:
            reports.append(check_rank(opts, rank=rank, world_size=world, port=port))
        except Exception as exc:  # report it; the other ranks may be stuck in a collective
            reports.append({"checkpoint": str(opts.ckpt), "rank": rank, "tp_size": opts.tp_size, "ep_size": opts.ep_size,
                            "problems": [f"{type(exc).__name__}: {exc}"], "ok": False})  # fmt: skip
            Path(out_dir, f"rank{rank}.json").write_text(json.dumps(reports, indent=1, default=str))
            raise
        teardown_parallel()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(reports, indent=1, default=str))


def run_checks(options: list[CheckOptions]) -> list[dict[str, Any]]:
    """Every check; one entry per check with its rank reports and the cross-rank verdict.

    World size = tp_size of each check (SGLang: ep divides tp). Single-rank checks run in this
    process, one after the other; the checks of each larger world run in that many spawned
    processes (multiprocessing "spawn", as SGLang starts its schedulers), which run them in turn.
    """
    by_world: dict[int, list[CheckOptions]] = {}
    for o in options:
        if o.tp_size < 1 or o.ep_size < 1 or o.tp_size % o.ep_size:
            raise ValueError(f"--parallel {o.tp_size}x{o.ep_size}: tp must be a positive multiple of ep")
        by_world.setdefault(o.tp_size, []).append(o)
    runs: list[dict[str, Any]] = []
    for world, opts in sorted(by_world.items()):
        if world == 1:
            from .sglang_path import teardown_parallel

            port = free_port()
            per_check = []
            for o in opts:
                per_check.append([check_rank(o, rank=0, world_size=1, port=port)])
                teardown_parallel()
        else:
            import torch.multiprocessing as mp

            with tempfile.TemporaryDirectory(prefix="k3nvfp4-model-check-") as out_dir:
                try:
                    mp.spawn(_rank_entry, args=(world, free_port(), opts, out_dir), nprocs=world, join=True)
                except Exception as exc:
                    failure = f"rank processes failed: {type(exc).__name__}: {str(exc)[-2000:]}"
                else:
                    failure = None
                rank_reports = []
                for r in range(world):
                    f = Path(out_dir, f"rank{r}.json")
                    rank_reports.append(json.loads(f.read_text()) if f.is_file() else [])
            per_check = []
            for i in range(len(opts)):
                ranks = [rr[i] if i < len(rr) else {"rank": r, "problems": [failure or "no report"], "ok": False}
                         for r, rr in enumerate(rank_reports)]  # fmt: skip
                per_check.append(ranks)
        for o, ranks in zip(opts, per_check):
            runs.append(_combine(o, ranks))
    return runs


def _combine(opts: CheckOptions, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Cross-rank verdict: every tensor landed on some rank; all ranks computed the same output."""
    problems = [f"rank {r.get('rank')}: {p}" for r in ranks for p in r.get("problems", [])]
    complete = [r for r in ranks if "tensors" in r]
    if len(complete) == len(ranks):
        landed = set().union(*(r["tensors"]["landed_names"] for r in ranks))
        from .ckpt_reader import CheckpointReader

        names = CheckpointReader(opts.ckpt).names()
        n_layers = ranks[0]["num_hidden_layers"]
        missing = [n for n in names if n not in landed
                   and not ((m := _LAYER_RE.search(n)) and int(m.group(1)) >= n_layers)]  # fmt: skip
        problems += [f"checkpoint tensor {n} landed on no rank" for n in missing]
        digests = {r["forward"]["out_sha256"] for r in ranks if r.get("forward")}
        if len(digests) > 1:
            problems.append(f"the ranks' MoE block outputs differ ({len(digests)} distinct results after SGLang's all-reduce)")
    return {"checkpoint": str(opts.ckpt), "tp_size": opts.tp_size, "ep_size": opts.ep_size,
            "options": {k: str(v) if isinstance(v, Path) else v for k, v in vars(opts).items()},
            "ranks": ranks, "problems": problems, "ok": not problems}  # fmt: skip

