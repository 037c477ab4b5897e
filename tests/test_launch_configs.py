"""Every launch config the heuristic ships for the K3 shards, for both checkpoint formats (the
cast's NVFP4 and the MXFP4 release: the layout's two scale formats), launches, spills nothing and
meets the loop budget, compiled offline for sm90 (H200: TP8/16/32, EP8/16/32) and sm100 (B200: TP8/16) with
the Triton that `make test` installs; the static model's tile table matches those compiles.

One subprocess runs bench/sass_report.py without TRITON_INTERPRET (the kernels cannot be compiled
under the interpreter) over M in powers of two 1..16384, about a minute of compiles.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
M_LIST = [2**i for i in range(15)]  # 1 .. 16384


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("model") / "perf-model.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-P", str(REPO / "bench" / "sass_report.py"), "--no-peers", "--m-list",
         ",".join(map(str, M_LIST)), "--out", str(out)],
        capture_output=True, text=True, env=env, timeout=1800,
    )  # fmt: skip
    assert out.is_file(), proc.stderr[-4000:]
    result = json.loads(out.read_text())
    result["_proc"] = proc
    return result


def test_every_shipped_config_launches_without_spills_within_budget(report):
    from k3nvfp4.kernels import perf_model as pm

    sys.path.insert(0, str(REPO / "bench"))
    from sass_report import CHECKPOINTS, DEVICE_SHARDS, known_miss_bound

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
            bound = known_miss_bound(r["device"], r["shard"], kind, r["M"]) or pm.loop_budget(r["M"])
            if k["warp_instr_per_useful_weight"] > bound:
                failures.append(f"{where}: {k['warp_instr_per_useful_weight']:.4f} warp-instr/useful weight > {bound}")
            if k["family_mix"].get("convert", 0):
                failures.append(f"{where}: I2F/F2F in the loop")
    assert failures == [], "\n".join(failures)
    assert report["_proc"].returncode == 0, report["_proc"].stdout[-3000:] + report["_proc"].stderr[-3000:]


def test_padding_free_gemm1_tiles_on_tp_shards(report):
    """TP16 (I = 192) and TP32 (I = 96): GEMM1's column tiles cover I exactly at every M."""
    for r in report["rows"]:
        if r["shard"] in ("tp16", "tp32") and "kernels" in r:
            bn = r["config"]["block_n1"]
            assert (r["shard"] == "tp16" and 192 % bn == 0) or (r["shard"] == "tp32" and 96 % bn == 0), r["config"]


def test_tile_table_matches_the_compiles(report):
    """The heuristic's tile costs (tile_costs.COSTS) are what the compiler produces today: loop
    instructions, registers and shared memory of every shipped GEMM equal the table's entry
    (split-K and K tails change the epilogue: registers and instructions may move a little,
    never the launchability or CTAs per SM the model assumed; GEMM2's entry is the worse of its
    two reductions, so the shipped one's loop may be shorter)."""
    from k3nvfp4.kernels import perf_model as pm
    from k3nvfp4.kernels.moe_details.layout import E5M3_16, E8M0_32
    from k3nvfp4.kernels.moe_details.tile_costs import Tile, tile_cost

    formats = {"nvfp4": E5M3_16, "mxfp4": E8M0_32}
    for r in report["rows"]:
        if "kernels" not in r:
            continue
        c = r["config"]
        arch = pm.DEVICES[r["device"]].arch
        for k, kind, n in zip(r["kernels"], ("gemm1", "gemm2"), ("1", "2")):
            tile = Tile(kind, c["block_m"], c["swap_ab"], c[f"block_n{n}"], c[f"block_k{n}"], c[f"num_warps{n}"],
                        c[f"num_stages{n}"])
            cost = tile_cost(tile, arch, fmt=formats[r["checkpoint"]])
            assert cost is not None, f"{tile.label()} not in the table for sm_{arch} {r['checkpoint']}"
            where = f"{r['device']} {r['checkpoint']} {r['shard']} M={r['M']} {tile.label()} sk{c[f'split_k{n}']}"
            assert k["shared_bytes"] <= cost.shared_bytes + 1024, where
            modelled = pm.occupancy(pm.DEVICES[r["device"]], cost.registers, 32 * cost.num_warps, cost.shared_bytes)[0]
            assert k["ctas_per_sm"] >= modelled, where
            measured, table = k["instructions_per_iteration"], cost.instructions_per_iteration
            assert measured <= 1.05 * table, where
            # GEMM2's entry is the worse of its two top-k reductions (tile_costs): the shipped one
            # may be cheaper, never dearer. GEMM1 has one compile: it must match.
            assert kind == "gemm2" or measured >= 0.95 * table, where
