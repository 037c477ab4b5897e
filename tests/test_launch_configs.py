"""Every launch config the heuristic ships for the K3 shards, for both checkpoint formats (the
cast's NVFP4 and the MXFP4 release: the layout's two scale formats), compiles, launches (shared
memory, registers), spills nothing and has no I2F/F2F in its hot loop, compiled offline for sm90
(H200: TP8/16/32, EP8/16/32) and sm100 (B200: TP8/16) with the Triton that `make test` installs;
the same for the Hopper W4A8 mode (e4m3, H200, both checkpoints' weight blocks), whose GEMMs must
also be FP8 wgmma (`.e4m3.e4m3`, no bf16 wgmma) with the expanded weights as the register operand.
Those are correctness on a GPU. The loop budgets, the tile table's freshness and the predictions
are change detectors: `bench/sass_report.py --check` holds them (bench/README.md).

The compiles are the session's one run of bench/sass_report.py (tests/shared_compiles.py: no
TRITON_INTERPRET, M in powers of two 1..16384), shared with tests/test_memory_ordering.py.
"""

from __future__ import annotations

import pathlib
import sys

import pytest

from shared_compiles import M_LIST

REPO = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def report(static_report) -> dict:
    assert static_report.result is not None, static_report.stderr_tail
    return static_report.result


def test_every_shipped_config_launches_without_spills(report):
    from k3nvfp4.kernels import perf_model as pm

    sys.path.insert(0, str(REPO / "bench"))
    from sass_report import CHECKPOINTS, DEVICE_SHARDS

    rows = report["rows"]
    expected = {(d, c, s, M) for d, shards in DEVICE_SHARDS.items() for c in CHECKPOINTS for s in shards for M in M_LIST}
    assert {(r["device"], r["checkpoint"], r["shard"], r["M"]) for r in rows} == expected
    failures = []
    for r in rows:
        if "error" in r:
            failures.append(f"{r['device']} {r['shard']} M={r['M']}: {r['error']}")
            continue
        for k, kind in zip(r["kernels"], ("gemm1", "gemm2")):
            device = pm.DEVICES[r["device"]]
            where = f"{r['device']} {r['checkpoint']} {r['shard']} M={r['M']} {kind} {k['config']}"
            if not k["launchable"] or k["shared_bytes"] > device.shared_per_block:
                failures.append(f"{where}: cannot launch ({k['why_not']})")
            if k["local_bytes"]:
                failures.append(f"{where}: spills {k['local_bytes']} B")
            if k["family_mix"].get("convert", 0):
                failures.append(f"{where}: I2F/F2F in the loop")
    assert failures == [], "\n".join(failures)
    assert report["errors"] == [], report["errors"]


def test_padding_free_gemm1_tiles_on_tp_shards(report):
    """TP16 (I = 192) and TP32 (I = 96): GEMM1's column tiles cover I exactly at every M."""
    for r in report["rows"]:
        if r["shard"] in ("tp16", "tp32") and "kernels" in r:
            bn = r["config"]["block_n1"]
            assert (r["shard"] == "tp16" and 192 % bn == 0) or (r["shard"] == "tp32" and 96 % bn == 0), r["config"]


def test_fp4_modes_shipped_configs_launch_without_spills(report):
    """Both FP4 modes on B200 (TP8 / TP16, the heuristic's pick at each M, compiled): every GEMM
    launches and spills nothing, and each GEMM kind compiles to the native block-scaled MMA."""
    rows = report["b200"]["fp4"]
    assert {r["implementation"] for r in rows} == {"k3nvfp4 nvfp4", "k3nvfp4 mxfp8"}
    assert {r["shard"] for r in rows} == {"tp8", "tp16"}
    bad = [f"{r['implementation']} {r['shard']} M={r['M']} {k['config']}: launchable={k['launchable']} "
           f"spill={k['local_bytes']} B" for r in rows for k in r["kernels"] if not k["launchable"] or k["local_bytes"]]
    assert bad == [], "\n".join(bad)
    mma = report["fp4_modes"]
    assert mma and all(r["native"] and r["local_bytes"] == 0 for r in mma), mma


def test_e4m3_shipped_configs_launch_without_spills_on_fp8_wgmma(report):
    """The Hopper W4A8 mode's rows (H200, every shard and M of the W4A16 rows, both checkpoints, both
    E4M3 tables the preparation may choose):
    W4A8Config.heuristic's pick launches, spills nothing, and each GEMM is FP8 wgmma (`.e4m3.e4m3`,
    K = 32) with the expanded weights from registers, an MMA in the hot loop and no bf16 wgmma (no
    decomposition). TP32 (I = 96, not a multiple of 64) is the one shard it cannot run."""
    sys.path.insert(0, str(REPO / "bench"))
    from sass_report import CHECKPOINTS, DEVICE_SHARDS

    rows = report["e4m3"]["rows"]
    assert {(r["checkpoint"], r["table"], r["shard"], r["M"]) for r in rows} == {
        (c, t, s, M) for c in CHECKPOINTS for t in ("full", "normal") for s in DEVICE_SHARDS["H200"] for M in M_LIST}
    failures = []
    for r in rows:
        where = f"e4m3 {r['checkpoint']} {r['table']} {r['shard']} M={r['M']}"
        if "error" in r:
            if not (r["shard"] == "tp32" and r["error"].startswith("not runnable")):
                failures.append(f"{where}: {r['error']}")
            continue
        if r["shard"] == "tp32":
            failures.append(f"{where}: ran on I = 96")
        for k, kind in zip(r["kernels"], ("gemm1", "gemm2")):
            w = f"{where} {kind} {k['config']}"
            if not k["launchable"]:
                failures.append(f"{w}: cannot launch ({k['why_not']})")
            if k["local_bytes"] or k["local_memory_ops_in_loop"]:
                failures.append(f"{w}: spills {k['local_bytes']} B")
            if not (k["wgmma_forms"] and all(f.endswith("k32.f32.e4m3.e4m3") for f in k["wgmma_forms"])
                    and k["wgmma_bf16_in_ptx"] == 0 and k["mma_per_iteration"] >= 1 and k["a_in_registers"]):
                failures.append(f"{w}: not FP8 wgmma from registers ({k['wgmma_forms']}, bf16 "
                                f"{k['wgmma_bf16_in_ptx']}, loop MMAs {k['mma_per_iteration']})")
    assert failures == [], "\n".join(failures)


def test_e4m3_normal_table_shortens_every_loop(report):
    """Where the full and the normal E4M3 table's rows pick the same tile, the normal table's hot
    loop is shorter, GEMM1 and GEMM2 alike (two multiply-adds per block instead of 11
    instructions; 6-15 % of the loop with Triton 3.8): the kernels do take the table the weights
    chose, and the report's normal rows are not the full table under another name."""
    rows = {(r["checkpoint"], r["shard"], r["M"], r["table"]): r for r in report["e4m3"]["rows"] if "kernels" in r}
    compared, failures = 0, []
    for (ckpt, shard, M, table), full in rows.items():
        normal = rows.get((ckpt, shard, M, "normal"))
        if table != "full" or normal is None:
            continue
        for kind, kf, kn in zip(("gemm1", "gemm2"), full["kernels"], normal["kernels"]):
            if kf["config"] != kn["config"]:
                continue
            compared += 1
            if not kn["instructions_per_iteration"] < 0.97 * kf["instructions_per_iteration"]:
                failures.append(f"e4m3 {ckpt} {shard} M={M} {kind} {kf['config']}: normal "
                                f"{kn['instructions_per_iteration']} vs full {kf['instructions_per_iteration']}")
    assert compared >= 100 and failures == [], (compared, failures)
