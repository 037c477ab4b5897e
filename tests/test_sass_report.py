"""The static SASS report's tools: its parser and loop finder on hand-written SASS, and the
change detectors of `bench/sass_report.py --check` (bench/report_check.py) on the committed
report: a moved or dropped row is named with its field, and the dequant's exact opcode counts
(bf16x2 products, rotations, PRMT) fire on a changed decode row. The counts themselves are
checked against a fresh compile by --check only: they change with any compiler update by design,
so they are not in `make test` (every shipped config's launchability and spill-freedom is, in
tests/test_launch_configs.py).
"""

from __future__ import annotations

import copy
import json
import pathlib
import sys

import pytest

from k3nvfp4.kernels.offline import sass

REPO = pathlib.Path(__file__).resolve().parent.parent

_SASS = """
	code for sm_90a
		Function : toy_kernel
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   S2R R0, SR_TID.X ;
        /*0020*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0030*/                   LOP3.LUT R8, R4, 0x81c081c0, RZ, 0xc0, !PT ;
        /*0040*/                   SHF.L.W.U32.HI R9, R4, 0x3, R4 ;
        /*0050*/                   HMUL2.BF16_V2 R8, R8, R10.H0_H0 ;
        /*0060*/                   HGMMA.64x16x16.F32.BF16 R24, R8, gdesc[UR8], R24 ;
        /*0070*/               @P0 BRA 0x20 ;
        /*0080*/                   BRA 0x90 ;
        /*0090*/                   ISETP.NE.AND P1, PT, R0, RZ, PT ;
        /*00a0*/              @!P1 BRA 0x90 ;
        /*00b0*/                   EXIT ;
"""


def test_parser_and_hot_loop_on_hand_written_sass():
    funcs = sass.parse_sass(_SASS)
    assert list(funcs) == ["toy_kernel"]
    ins = funcs["toy_kernel"]
    assert len(ins) == 12 and ins[5].opcode == "HMUL2.BF16_V2" and ins[7].predicate == "@P0"
    lps = sass.loops(ins)
    assert [(lp.start, lp.end) for lp in lps] == [(0x90, 0xA0), (0x20, 0x70)]  # innermost first
    hot = sass.hot_loop(ins)  # the loop with the MMA, not the smaller spin loop
    assert (hot.start, hot.end, hot.size) == (0x20, 0x70, 6)
    st = sass.loop_stats(hot)
    assert st.mma == 1 and st.family_mix == {"global_load": 1, "int_logic": 2, "f16x2": 1, "mma": 1, "control": 1}
    # 6 instructions x 4 warps over a 64 x 64 tile
    assert sass.warp_instr_per_weight(6, 4, 64 * 64) == pytest.approx(24 / 4096)
    assert sass.hbm_ceiling(sass.HBM_BUDGET / 2) == pytest.approx(2.0)
    assert 0.108 < sass.HBM_BUDGET < 0.11  # 132 SMs x 4 x 1.98 GHz vs 9.6e12 FP4 weights/s


def test_no_mma_loop_is_an_error():
    ins = sass.parse_sass(_SASS.replace("HGMMA.64x16x16.F32.BF16 R24, R8, gdesc[UR8], R24", "NOP"))["toy_kernel"]
    with pytest.raises(ValueError, match="MMA"):
        sass.hot_loop(ins)


# --- bench/report_check.py (sass_report.py --check), on the committed report ------------------

def _report_check():
    sys.path.insert(0, str(REPO / "bench"))
    import report_check

    return report_check


@pytest.fixture(scope="module")
def committed() -> dict:
    return json.loads((REPO / "bench" / "results" / "perf-model.json").read_text())


def test_an_unchanged_report_moves_no_row(committed):
    rc = _report_check()
    assert rc.moved_rows(committed, committed) == []
    assert rc.opcode_findings(committed["rows"]) == []


@pytest.mark.parametrize("section,field,change", [
    ("rows", "time_us", lambda v: v * 1.1),
    ("rows", "kernels[1].instructions_per_iteration", lambda v: v + 1),
    ("b200.fp4", "launches", lambda v: v + 1),
    ("fp4_modes", "registers", lambda v: v + 8),
    ("e4m3", "time_us", lambda v: v * 1.1),
])
def test_a_moved_row_is_named_with_its_field(committed, tmp_path, section, field, change):
    """report_check.moved_rows and run_checks (what --check exits 1 on) name the row and the field."""
    rc = _report_check()
    moved = copy.deepcopy(committed)
    rows = moved["b200"]["fp4"] if section == "b200.fp4" else moved["e4m3"]["rows"] if section == "e4m3" else moved[section]
    row = rows[len(rows) // 2]
    if field.startswith("kernels["):
        k = row["kernels"][int(field[8])]
        name = field.split(".", 1)[1]
        k[name] = change(k[name])
    else:
        row[field] = change(row[field])
    found = rc.moved_rows(moved, committed)
    assert len(found) == 1 and found[0].startswith(section) and field in found[0], found
    key = " ".join(str(x) for x in rc._key(row) if x is not None)
    assert key in found[0]
    # through run_checks against a committed file: without what builds or recompiles (the peers'
    # libraries, the FP4 table), which are not this test's subject
    path = tmp_path / "committed.json"
    path.write_text(json.dumps(committed))
    moved.pop("fp4_modes" if section != "fp4_modes" else "b200", None)
    for peer in ("marlin", "flashinfer"):
        moved[peer] = {**moved.get(peer, {}), "available": False}
    if section == "fp4_modes":
        rc_findings = [f for f in _run_checks_without_fp4_table(rc, moved, path) if f.startswith("moved:")]
    else:
        rc_findings = [f for f in rc.run_checks(moved, path) if f.startswith("moved:")]
    assert any(field in f and key in f for f in rc_findings), rc_findings


def test_e4m3_rows_against_the_cost_table(committed):
    """The committed e4m3 rows agree with their cost-table rows; a loop 10 % longer than the
    table's, or fewer CTAs per SM than it allows, is named (report_check.stale_w4a8_rows)."""
    rc = _report_check()
    rows = committed["e4m3"]["rows"]
    assert rc.stale_w4a8_rows(rows) == []
    moved = copy.deepcopy(rows)
    row = next(r for r in moved if r["shard"] == "ep16" and r["M"] == 64 and r["checkpoint"] == "mxfp4"
               and r["table"] == "normal")
    row["kernels"][0]["instructions_per_iteration"] = int(row["kernels"][0]["instructions_per_iteration"] * 1.1)
    row["kernels"][1]["ctas_per_sm"] = 0
    found = rc.stale_w4a8_rows(moved)
    assert len(found) == 2 and all("mxfp4 normal ep16 M=64" in f for f in found), found
    assert "loop" in found[0] and "CTAs/SM" in found[1], found


def _run_checks_without_fp4_table(rc, result, path):
    saved = rc.stale_fp4_table
    rc.stale_fp4_table = lambda: []  # its full re-measurement compiles; not this test's subject
    try:
        return rc.run_checks(result, path)
    finally:
        rc.stale_fp4_table = saved


def test_a_replaced_row_is_named_on_both_sides(committed):
    """A row that the run produces under another key (here: another arch) is new, and the
    committed row at the same checkpoint / device / shard / M is missing. (A point the run did
    not compute at all, e.g. with a shorter --m-list, is not reported: partial runs are allowed.)"""
    rc = _report_check()
    other = copy.deepcopy(committed)
    before = copy.deepcopy(other["rows"][3])
    other["rows"][3]["arch"] = "sm_91"
    name = lambda r: " ".join(str(x) for x in rc._key(r) if x is not None)  # noqa: E731
    assert rc.moved_rows(other, committed) == [f"rows {name(other['rows'][3])}: not in the committed report",
                                               f"rows {name(before)}: in the committed report, not produced"]


@pytest.mark.parametrize("opcode,change,expected", [
    ("PRMT", 1, "PRMT 1"),
    ("SHF.L.W.U32.HI", -1, "scale rotations -1"),
    ("f16x2", 2, "f16x2"),
])
def test_dequant_opcode_detectors_fire(committed, opcode, change, expected):
    """The exact-opcode change detectors (moved out of make test into --check): one extra byte
    shuffle, one rotation too few or two extra bf16x2 products in a decode row are named."""
    rc = _report_check()
    rows = copy.deepcopy(committed["rows"])
    row = next(r for r in rows if r["device"] == "H200" and r["M"] == 1 and r["shard"] == "tp16"
               and r["checkpoint"] == "nvfp4")
    k = row["kernels"][0]
    if opcode == "f16x2":
        k["family_mix"]["f16x2"] += change
    elif opcode == "SHF.L.W.U32.HI":
        words = k["weights_per_iteration"] // k["num_warps"] // 32 // 8
        k["opcode_mix"][opcode] = 5 * words + change
    else:
        k["opcode_mix"][opcode] = k["opcode_mix"].get(opcode, 0) + change
    found = rc.opcode_findings(rows)
    assert len(found) == 1 and "H200 nvfp4 tp16 M=1" in found[0] and expected in found[0], found


def test_flashinfer_statics_against_the_model_shape(committed):
    """report_check.flashinfer_findings on the committed W4A16 peer rows: the pingpong TILES and
    the COOPERATIVE_TILES pass (the 64x64 / 64x128 tiles' spills included: uncharged, in the peer's
    favour); a cooperative tile measured as pingpong, or counted with one warpgroup's MMAs, is named."""
    rc = _report_check()
    statics = committed["flashinfer"]["statics"]
    from peers import flashinfer_sass as fs

    pingpong = len(fs.TILES)
    assert [r["kernel_type"] for r in statics] == (["warp_specialized"] * pingpong
                                                   + ["cooperative"] * len(fs.COOPERATIVE_TILES))
    assert any(r["local_bytes"] for r in statics)
    assert rc.flashinfer_findings(statics) == []
    moved = copy.deepcopy(statics)
    moved[pingpong]["tile"]["schedule"] = "pingpong"
    moved[pingpong + 1]["mma_per_iteration"] //= 2
    found = rc.flashinfer_findings(moved)
    names = ["x".join(str(x) for x in t) for t in fs.COOPERATIVE_TILES[:2]]
    assert found == [f"flashinfer {names[0]}: kernel / schedule", f"flashinfer {names[1]}: MMAs per iteration"], found
    # The tiles whose shared memory exceeds an SM's are in FlashInfer's list and cannot launch: not a
    # finding, and their loops are not held to the bound; a tile that fits is.
    too_big = [r for r in statics if r["shared_bytes"] > 232448]
    assert [(r["tile"]["M"], r["tile"]["N"], r["tile"]["K"]) for r in too_big] == [(64, 128, 512), (128, 256, 256),
                                                                                   (256, 128, 256)]
    # The 256x256 tile spills (its loop long by local loads and stores, 0.43 without them against a
    # bound of 0.2 + 256 / 1024); counted without the spill instructions it would be named.
    big = copy.deepcopy(statics[-1])
    assert (big["tile"]["M"], big["tile"]["N"], big["local_bytes"] > 0) == (256, 256, True)
    assert big["warp_instr_per_weight"] > 0.45 > big["warp_instr_per_weight_without_spills"]
    big["warp_instr_per_weight_without_spills"] = big["warp_instr_per_weight"]
    big["local_bytes"] = 0
    found = rc.flashinfer_findings([*statics[:-1], big])
    assert found == ["flashinfer 256x256x128: warp-instructions per weight",
                     "flashinfer 256x256x128: spills without local memory"], found
