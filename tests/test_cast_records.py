"""The cast's records (checkpoint/records.py): JSON round trips, hand-written JSON read back,
and the one-line errors for a record this version cannot read."""

from __future__ import annotations

import json

import pytest

from k3nvfp4.checkpoint.records import (ALogCheck, CastMessage, LaunchInfo, Prepared, RankRow, RecordError,
                                        ShardRecord, VerifyMessage, VerifyResult, VerifySummary)
from k3nvfp4.kernels.cast import CastStats


def _via_json(obj):
    """What another process or rank reads: the JSON text, parsed again."""
    return type(obj).from_json(json.loads(json.dumps(obj.to_json())))


def _record(shard: str = "m-1.safetensors", deferred=((3, 1, "w13"),)) -> ShardRecord:
    verify = VerifyResult(shard, matrices=6, blocks=96, proved_blocks=90, exact_blocks=94, max_abs_err=0.25,
                          sample_matrices=1, sample_elements=512, carried_tensors=4, deferred_groups=list(deferred))
    a_logs = [ALogCheck("l.0.self_attn.A_log", [8], 4, padding_elements=4, padding_all_zero=True, padding_max_abs=0.0,
                        trimmed_to=4),
              ALogCheck("l.1.self_attn.A_log", [2, 4], 4, note="unexpected shape; carried as is")]
    return ShardRecord(shard=shard, pid=11, cast_seconds=0.5, seconds=0.75, source_bytes=1000, extra_bytes_read=64,
                       output_bytes=1100, matrices=6, stats=CastStats(96, 94, 3, 5, 0.25), a_log=a_logs, verify=verify)


def test_every_record_survives_json():
    rec = _record()
    back = _via_json(rec)
    assert back == rec and back.verify.deferred_groups == [(3, 1, "w13")]  # tuples again, as the plan's groups
    assert _via_json(ShardRecord(**{**rec.__dict__, "verify": None})).verify is None
    row = RankRow(1, "node2", 77, 4, ["a", "b"], cast_now=1, resumed=1, bytes_cast_now=10, cast_seconds=1.0)
    msg = CastMessage({rec.shard: rec}, row)
    assert _via_json(msg) == msg
    vmsg = VerifyMessage([rec.verify], [rec.shard], verify_seconds=2.5)
    assert _via_json(vmsg) == vmsg
    info = LaunchInfo("0.1.0", "ab", {"files": {"config.json": "cc"}}, {"verify": True}, "/src", "/out")
    assert _via_json(info) == info
    assert _via_json(Prepared(False, None, "/out")) == Prepared(False, None, "/out")


def test_json_keys_are_those_of_the_earlier_dict_records():
    out = _record().to_json()
    assert list(out) == ["pid", "verify", "cast_seconds", "shard", "source_bytes", "extra_bytes_read", "output_bytes",
                         "matrices", "stats", "a_log", "seconds"]
    assert out["stats"] == {"blocks": 96, "exact_blocks": 94, "zero_exponent_blocks": 3, "out_of_range_blocks": 5,
                            "max_abs_err": 0.25}
    assert out["a_log"] == [
        {"name": "l.0.self_attn.A_log", "shape": [8], "num_heads": 4, "padding_elements": 4, "padding_all_zero": True,
         "padding_max_abs": 0.0, "trimmed_to": 4},
        {"name": "l.1.self_attn.A_log", "shape": [2, 4], "num_heads": 4, "padding_elements": None,
         "padding_all_zero": None, "note": "unexpected shape; carried as is"}]
    assert out["verify"]["deferred_groups"] == [[3, 1, "w13"]]
    # A rank row without timings has no such keys (the report's per_rank rows as before).
    assert "cast_seconds" not in RankRow(0, "h", 1, 1, [], 0, 0, 0).to_json()


@pytest.mark.parametrize("change, message", [
    (lambda d: d.pop("matrices"), "shard record of m-1.safetensors: no 'matrices'"),
    (lambda d: d.update(matrices=True), "'matrices' is True, expected int"),
    (lambda d: d.update(seconds="1.0"), "'seconds' is '1.0', expected float"),
    (lambda d: d["stats"].pop("max_abs_err"), "shard record of m-1.safetensors: stats: no 'max_abs_err'"),
    (lambda d: d["verify"].update(deferred_groups=[[3, "w13"]]), "expert group [3, 'w13'] is not [layer, expert, kind]"),
    (lambda d: d.update(a_log={}), "'a_log' is {}, expected list"),
])
def test_a_record_this_version_cannot_read_names_the_field(change, message):
    data = _record().to_json()
    change(data)
    with pytest.raises(RecordError) as err:
        ShardRecord.from_json(data)
    assert message in str(err.value)


def test_verify_summary_adds_the_casts_disagreements_and_gaps():
    a = VerifyResult("a", matrices=2, blocks=10, exact_blocks=9, max_abs_err=0.5, carried_tensors=1)
    b = VerifyResult("b", matrices=1, blocks=6, exact_blocks=6, carried_tensors=2)
    b.fail("b: carried tensor x differs")
    ok = VerifySummary.merge([a, b], CastStats(blocks=16, exact_blocks=15, max_abs_err=0.5))
    assert (ok.matrices, ok.blocks, ok.exact_blocks, ok.carried_tensors, ok.max_abs_err) == (3, 16, 15, 3, 0.5)
    assert ok.mismatches == 1 and ok.failure() == "--verify FAILED: b: carried tensor x differs (1 mismatches)"
    bad = VerifySummary.merge([a], CastStats(blocks=12, exact_blocks=9, max_abs_err=0.25))
    assert bad.mismatch_examples == ["verified 10 blocks but the cast reported 12",
                                     "max_abs_err on disk 0.5 exceeds the cast's 0.25"] and bad.mismatches == 2
    bad.add_gaps(["shard(s) c verified by no rank"])
    assert bad.mismatches == 3 and bad.mismatch_examples[-1] == "shard(s) c verified by no rank"
    assert VerifySummary.merge([a], CastStats(blocks=10, exact_blocks=9, max_abs_err=0.5)).failure() is None
