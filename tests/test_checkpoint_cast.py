"""End to end: the k3nvfp4-cast CLI on synthetic Kimi-K3 checkpoints.

Oracles are independent of the package's codecs: ml_dtypes float4_e2m1fn / float8_e8m0fnu
decode the MXFP4 source, torch's float8_e4m3fn decodes the NVFP4 scales, and the
safetensors library (not the tool's own reader) loads every file.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from k3nvfp4.checkpoint import convert as convert_mod
from k3nvfp4.checkpoint.cli import main
from k3nvfp4.checkpoint.layer import load_moe_layer_nvfp4
from k3nvfp4.checkpoint.synthetic import write_synthetic_checkpoint

SMALL = dict(num_layers=4, num_experts=3, hidden_size=64, intermediate_size=64, num_shards=3, model_hidden_size=64)


def _load_all(ckpt: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _tree_hash(d: Path) -> dict[str, str]:
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*")) if p.is_file()}


def _mx_values(packed: torch.Tensor, scale: torch.Tensor) -> np.ndarray:
    """MXFP4 -> float64 with ml_dtypes as the oracle."""
    p = packed.numpy()
    codes = np.stack([p & 0x0F, p >> 4], axis=-1).reshape(p.shape[0], -1)
    v = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    s = scale.numpy().view(ml_dtypes.float8_e8m0fnu).astype(np.float64)
    return v * np.repeat(s, 32, axis=1)


def _nv_values(packed: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor) -> np.ndarray:
    p = packed.numpy()
    codes = np.stack([p & 0x0F, p >> 4], axis=-1).reshape(p.shape[0], -1)
    v = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    s = scale.to(torch.float64).numpy() * float(scale_2)
    return v * np.repeat(s, 16, axis=1)


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    # Zero-exponent blocks (all +-0 nibbles) plus a share of out-of-range blocks.
    return write_synthetic_checkpoint(
        tmp_path_factory.mktemp("src") / "k3", **SMALL, out_of_range_fraction=0.02, zero_exponent_fraction=0.03, seed=1
    )


@pytest.fixture(scope="module")
def cast_run(source, tmp_path_factory):
    before = _tree_hash(source)
    out = tmp_path_factory.mktemp("out") / "k3-nvfp4"
    rc = main(["--source_ckpt", str(source), "--output_ckpt", str(out), "--verify", "--workers", "1", "--no-progress"])
    assert rc == 0
    return out, before


def test_source_untouched(source, cast_run):
    out, before = cast_run
    assert _tree_hash(source) == before


def test_expert_values_and_layout(source, cast_run):
    out, _ = cast_run
    src, dst = _load_all(source), _load_all(out)
    bases = sorted({n.rsplit(".", 1)[0] for n in src if n.endswith(".weight_packed")})
    assert len(bases) == 3 * 3 * 3  # 3 MoE layers x 3 experts x w1/w2/w3
    n_exact = n_blocks = 0
    for base in bases:
        packed, scale = src[f"{base}.weight_packed"], src[f"{base}.weight_scale"]
        w, ws, ws2 = dst[f"{base}.weight"], dst[f"{base}.weight_scale"], dst[f"{base}.weight_scale_2"]
        assert w.dtype == torch.uint8 and w.shape == packed.shape
        assert ws.dtype == torch.float8_e4m3fn and ws.shape == (scale.shape[0], scale.shape[1] * 2)
        assert ws2.dtype == torch.float32 and ws2.shape == ()
        assert f"{base}.weight_packed" not in dst and f"{base}.input_scale" not in dst
        a, b = _mx_values(packed, scale), _nv_values(w, ws, ws2)
        blocks_equal = (a == b).reshape(-1, 32).all(1)
        n_exact += int(blocks_equal.sum())
        n_blocks += blocks_equal.size
        # In-window blocks are bit-exact with the nibbles untouched (signed zeros kept).
        k = scale.numpy().astype(np.int64)
        group_max = k.max()
        if base.endswith(("w1", "w3")):  # shared scale_2 with its sibling
            sib = base[:-1] + ("3" if base.endswith("1") else "1")
            group_max = max(group_max, int(src[f"{sib}.weight_scale"].max()))
            assert float(dst[f"{sib}.weight_scale_2"]) == float(ws2)
        assert float(ws2) == 2.0 ** (group_max - 127 - 8)
        in_window = ((group_max - k) <= 17).reshape(-1)
        assert blocks_equal[in_window].all(), base
        assert torch.equal(w.reshape(-1, 16)[torch.from_numpy(in_window)], packed.reshape(-1, 16)[torch.from_numpy(in_window)])
    report = json.loads((out / "cast_report.json").read_text())
    assert report["stats"]["blocks"] == n_blocks
    assert report["stats"]["exact_blocks"] == n_exact
    assert report["stats"]["out_of_range_blocks"] > 0 and report["stats"]["zero_exponent_blocks"] > 0
    assert report["matrices_cast"] == len(bases)
    v = report["verify"]
    assert v["mismatches"] == 0 and v["blocks"] == n_blocks and v["exact_blocks"] == n_exact
    assert v["sample_matrices"] > 0 and v["carried_tensors"] > 0
    # Some matrix has its packed nibbles and E8M0 scales in different shards.
    assert any(r["extra_bytes_read"] > 0 for r in report["per_shard"])


def test_carried_tensors_identical_and_index(source, cast_run):
    out, _ = cast_run
    src, dst = _load_all(source), _load_all(out)
    carried = [n for n in src if not n.endswith((".weight_packed", ".weight_scale"))]
    assert any(n.endswith(".A_log") for n in carried) and "language_model.lm_head.weight" in carried
    for n in carried:
        assert dst[n].dtype == src[n].dtype and torch.equal(dst[n].view(torch.uint8), src[n].view(torch.uint8)), n
    index = json.loads((out / "model.safetensors.index.json").read_text())
    src_index = json.loads((source / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(dst)
    assert sorted(set(index["weight_map"].values())) == sorted(set(src_index["weight_map"].values()))
    for name, shard in index["weight_map"].items():
        with safe_open(str(out / shard), "pt") as f:
            assert name in f.keys()
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in dst.values())
    # Every non-weight file is copied verbatim.
    for p in source.iterdir():
        if p.suffix != ".safetensors" and p.name not in ("config.json", "model.safetensors.index.json"):
            assert (out / p.name).read_bytes() == p.read_bytes(), p.name


def test_configs(source, cast_run):
    out, _ = cast_run
    cfg = json.loads((out / "config.json").read_text())
    src_cfg = json.loads((source / "config.json").read_text())
    q = cfg["quantization_config"]
    assert q["quant_method"] == "modelopt" and q["quant_algo"] == "NVFP4"
    assert q["format"] == "nvfp4-pack-quantized" and q["group_size"] == 16
    assert q["input_activations"] is None
    assert "quantization_config" not in cfg["text_config"]
    # Everything else unchanged.
    src_cfg["text_config"].pop("quantization_config")
    cfg.pop("quantization_config")
    assert cfg == src_cfg
    hq = json.loads((out / "hf_quant_config.json").read_text())
    assert hq["quantization"]["quant_algo"] == "NVFP4" and hq["quantization"]["exclude_modules"] == q["exclude_modules"]


def test_a_log_reported(cast_run):
    out, _ = cast_run
    a = json.loads((out / "cast_report.json").read_text())["a_log"]
    assert a["tensors"] == 3 and a["padding_all_zero"] == 3 and a["trimmed"] == 0  # KDA layers 0, 1, 2
    assert all(d["padding_elements"] == 2 for d in a["details"])  # head_dim 8, num_heads 6


def test_layer_loader(source, cast_run):
    out, _ = cast_run
    layer = load_moe_layer_nvfp4(out, 2, experts=[2, 0])
    assert layer.hidden_act == "situ" and layer.situ_beta == 4.0 and layer.situ_linear_beta == 25.0 and layer.top_k == 4
    assert layer.experts == (2, 0) and layer.layer == 2
    t = layer.weights.to_modelopt()
    assert t.w13.shape == (2, 128, 32) and t.w13_scale.shape == (2, 128, 4) and t.w13_scale_2.shape == (2, 2)
    assert t.w2.shape == (2, 64, 32) and t.w2_scale.shape == (2, 64, 4) and t.w2_scale_2.shape == (2,)
    base = "language_model.model.layers.2.block_sparse_moe.experts.2"
    dst = _load_all(out)
    assert torch.equal(t.w13[0, :64], dst[f"{base}.w1.weight"])
    assert torch.equal(t.w13[0, 64:], dst[f"{base}.w3.weight"])
    assert torch.equal(t.w2[0], dst[f"{base}.w2.weight"])
    assert torch.equal(t.w13_scale[0, :64].view(torch.uint8), dst[f"{base}.w1.weight_scale"].view(torch.uint8))
    assert torch.equal(t.w13_scale[0, 64:].view(torch.uint8), dst[f"{base}.w3.weight_scale"].view(torch.uint8))
    assert t.w13_scale_2[0, 0] == t.w13_scale_2[0, 1] == dst[f"{base}.w1.weight_scale_2"]
    assert t.w2_scale_2[1] == dst["language_model.model.layers.2.block_sparse_moe.experts.0.w2.weight_scale_2"]
    with pytest.raises(KeyError, match="layer 0"):
        load_moe_layer_nvfp4(out, 0)
    with pytest.raises(KeyError, match=r"layer 1 has no expert\(s\) 7 \(it has 3 experts: 0-2\)"):
        load_moe_layer_nvfp4(out, 1, experts=[7])
    with pytest.raises(KeyError, match="k3nvfp4-cast"):
        load_moe_layer_nvfp4(source, 1)


def test_w4a4_trim_strict_and_workers(source, tmp_path, capsys):
    out = tmp_path / "w4a4"
    rc = main(["--source_ckpt", str(source), "--output_ckpt", str(out), "--w4a4", "--trim-a-log", "--workers", "2",
               "--verify", "--no-progress"])
    assert rc == 0
    dst = _load_all(out)
    scales = [n for n in dst if n.endswith(".input_scale")]
    assert len(scales) == 27 and all(dst[n].dtype == torch.float32 and float(dst[n]) == 1.0 for n in scales)
    a_logs = [n for n in dst if n.endswith(".A_log")]
    src = _load_all(source)
    assert a_logs and all(torch.equal(dst[n], src[n][:6]) for n in a_logs)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["input_activations"]["num_bits"] == 4
    # --strict refuses the out-of-range blocks of this source; nothing half-written remains.
    capsys.readouterr()
    strict = tmp_path / "strict"
    assert main(["--source_ckpt", str(source), "--output_ckpt", str(strict), "--strict", "--workers", "1", "--no-progress"]) == 1
    assert "--strict" in capsys.readouterr().err
    assert not (strict / "config.json").exists() and not list(strict.glob(".*.partial"))


def test_resume_after_interruption_is_byte_identical(source, cast_run, tmp_path, monkeypatch, capsys):
    ref, _ = cast_run
    out = tmp_path / "resumed"
    monkeypatch.chdir(tmp_path)  # the output typed relative: the report stores it absolute
    args = ["--source_ckpt", str(source), "--output_ckpt", "resumed", "--workers", "1", "--no-progress", "--verify"]
    real = convert_mod.cast_shard
    calls = []

    def crash_on_second(task):
        calls.append(task.shard.name)
        if len(calls) == 2:
            raise KeyboardInterrupt  # as a Ctrl-C in the middle of the run
        return real(task)

    monkeypatch.setattr(convert_mod, "cast_shard", crash_on_second)
    assert main(args) == 130
    assert not (out / "cast_report.json").exists() and not list(out.glob(".*.partial"))
    assert len(list(out.glob("*.safetensors"))) == 1
    monkeypatch.setattr(convert_mod, "cast_shard", real)
    capsys.readouterr()
    assert main(args) == 0
    report = json.loads((out / "cast_report.json").read_text())
    assert report["shards"] == {"total": 3, "cast_now": 2, "resumed": 1}
    assert report["output"] == report["options"]["output"] == str(out.resolve())
    assert report["source"] == str(source.resolve()) and report["throughput_gb_per_s"]["shards_covered"] == 2
    throughput = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("Throughput"))
    assert throughput.endswith("GB/s with verify), this run's 2 of 3 shards (1 cast by an earlier run)"), throughput
    skip = {"cast_report.json"}
    assert {k: v for k, v in _tree_hash(out).items() if k not in skip} == {
        k: v for k, v in _tree_hash(ref).items() if k not in skip
    }
    # The same command on the finished output: nothing is cast again; --verify proves it again.
    capsys.readouterr()
    before = _tree_hash(out)
    monkeypatch.setattr(convert_mod, "cast_shard", crash_on_second)  # would fail if anything were cast
    calls.clear()
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "already a finished cast" in printed and "verified again" in printed and "Verify" in printed and "PASSED" in printed
    assert "when the output was written" not in printed
    assert calls == []
    # Without --verify the stored verify result is shown as such, not as a new verification.
    assert main([a for a in args if a != "--verify"]) == 0
    printed = capsys.readouterr().out
    verify_line = next(x for x in printed.splitlines() if x.startswith("Verify"))
    assert "PASSED" in verify_line and verify_line.endswith("(when the output was written; --verify runs it again)")
    assert "final verify pass" in printed and "s (when the output was written" in printed
    assert calls == []
    assert {k: v for k, v in _tree_hash(out).items() if k not in skip} == {k: v for k, v in before.items() if k not in skip}
    # Other options: refused, saying which one; with --overwrite it is redone.
    monkeypatch.setattr(convert_mod, "cast_shard", real)
    assert main(args + ["--w4a4"]) == 1
    err = capsys.readouterr().err
    assert "a finished cast of other inputs (option --w4a4 was off, now on)" in err and "--overwrite" in err
    assert main(args + ["--overwrite"]) == 0


def _earlier_versions_record(written: dict) -> dict:
    """The resume record as the dict-based cast of earlier versions wrote it: these keys in this
    order, written out here (not produced by ShardRecord), with the figures of ``written``."""
    v = written["verify"]
    return {
        "pid": 4242,
        "verify": {"shard": v["shard"], "matrices": v["matrices"], "blocks": v["blocks"],
                   "proved_blocks": v["proved_blocks"], "exact_blocks": v["exact_blocks"],
                   "max_abs_err": v["max_abs_err"], "sample_matrices": v["sample_matrices"],
                   "sample_elements": v["sample_elements"], "carried_tensors": v["carried_tensors"],
                   "mismatches": 0, "mismatch_examples": [], "deferred_groups": v["deferred_groups"]},
        "cast_seconds": 1.5,
        "shard": written["shard"],
        "source_bytes": written["source_bytes"],
        "extra_bytes_read": written["extra_bytes_read"],
        "output_bytes": written["output_bytes"],
        "matrices": written["matrices"],
        "stats": {k: written["stats"][k] for k in ("blocks", "exact_blocks", "zero_exponent_blocks",
                                                   "out_of_range_blocks", "max_abs_err")},
        "a_log": [{"name": a["name"], "shape": a["shape"], "num_heads": a["num_heads"],
                   "padding_elements": a["padding_elements"], "padding_all_zero": a["padding_all_zero"],
                   "padding_max_abs": a["padding_max_abs"]} for a in written["a_log"]],
        "seconds": 2,  # an integer where a float is expected: JSON has one number type
    }


def test_resume_reads_an_earlier_versions_record_and_refuses_an_unreadable_one(source, cast_run, tmp_path,
                                                                                 monkeypatch, capsys):
    ref, _ = cast_run
    out = tmp_path / "resumed"
    args = ["--source_ckpt", str(source), "--output_ckpt", str(out), "--workers", "1", "--no-progress", "--verify"]
    real, calls = convert_mod.cast_shard, []

    def crash_on_second(task):
        calls.append(task.shard.name)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(task)

    monkeypatch.setattr(convert_mod, "cast_shard", crash_on_second)
    assert main(args) == 130
    monkeypatch.setattr(convert_mod, "cast_shard", real)
    (record,) = (out / ".k3nvfp4-cast").glob("*.safetensors.json")
    shard = record.name[: -len(".json")]
    old = _earlier_versions_record(json.loads(record.read_text()))
    # Unreadable records are refused naming the file and what to do; nothing is lost.
    for broken in ('{"pid": 1, "shard"', json.dumps({**old, "stats": {"blocks": 3}}), json.dumps({**old, "matrices": "27"})):
        record.write_text(broken)
        capsys.readouterr()
        assert main(args) == 1
        err = capsys.readouterr().err
        assert f"{record}: not a resume record this version reads" in err and f"delete it to cast {shard} again" in err, err
        assert (out / shard).is_file() and not (out / "cast_report.json").exists()
    assert "'matrices' is '27', expected int" in err
    # The earlier version's record resumes: that shard is not cast again and its record is reported as it was.
    record.write_text(json.dumps(old) + "\n")
    calls.clear()
    monkeypatch.setattr(convert_mod, "cast_shard", lambda task: calls.append(task.shard.name) or real(task))
    assert main(args) == 0
    assert shard not in calls and len(calls) == 2
    report = json.loads((out / "cast_report.json").read_text())
    assert report["shards"] == {"total": 3, "cast_now": 2, "resumed": 1}
    (per_shard,) = [r for r in report["per_shard"] if r["shard"] == shard]
    assert per_shard == {**old, "seconds": 2.0} and list(per_shard) == list(old)
    assert report["verify"]["mismatches"] == 0
    skip = {"cast_report.json"}
    assert {k: v for k, v in _tree_hash(out).items() if k not in skip} == {
        k: v for k, v in _tree_hash(ref).items() if k not in skip}


def test_refused_resume_names_the_changed_source_file(source, tmp_path, capsys):
    """A finished or interrupted cast of a source that has changed since is refused, and the
    error names the file that changed (hyphenated flags, as every other tool of the project)."""
    import os
    import shutil

    src = tmp_path / "src"
    shutil.copytree(source, src)
    out = tmp_path / "out"
    args = ["--source-ckpt", str(src), "--output-ckpt", str(out), "--workers", "1", "--no-progress"]
    assert main(args) == 0
    shard = sorted(src.glob("*.safetensors"))[1]
    st = shard.stat()
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # rewritten since (same bytes)
    capsys.readouterr()
    assert main(args) == 1
    err = capsys.readouterr().err
    assert f"source {shard.name} changed" in err and "a finished cast of other inputs" in err


@pytest.mark.parametrize("tamper", ["scale", "nibble"])
def test_verify_fails_loudly_on_a_wrong_output(source, tmp_path, monkeypatch, capsys, tamper):
    real = convert_mod.cast_mxfp4_to_nvfp4
    done = []

    def faulty(weights, **kw):  # a cast bug: one value of the first matrix is off, stats still claim exactness
        outs, stats = real(weights, **kw)
        if not done:
            done.append(1)
            o = outs[0]
            if tamper == "scale":
                s = o.scale.clone()
                s[0, 0] = (s[0, 0].float() * 2).to(torch.float8_e4m3fn)
                outs[0] = type(o)(o.packed, s, o.scale_2)
            else:
                p = o.packed.clone()
                p[0, 0] ^= 0x01
                outs[0] = type(o)(p, o.scale, o.scale_2)
        return outs, stats

    monkeypatch.setattr(convert_mod, "cast_mxfp4_to_nvfp4", faulty)
    out = tmp_path / "bad"
    capsys.readouterr()
    rc = main(["--source_ckpt", str(source), "--output_ckpt", str(out), "--verify", "--workers", "1", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 1 and "--verify FAILED" in err
    assert not (out / "config.json").exists() and not (out / "cast_report.json").exists()


@pytest.mark.parametrize("m", [-135, -20, -1, 0, 5])
def test_verify_scale_table_matches_torch_e4m3(m):
    from k3nvfp4.checkpoint.verify import e4m3_pow2_table

    bits, valid = e4m3_pow2_table(2.0**m)
    decoded = torch.from_numpy(bits).view(torch.float8_e4m3fn).to(torch.float64)
    want = torch.exp2(torch.arange(256, dtype=torch.float64) - 127 - m)
    v = torch.from_numpy(valid)
    assert torch.equal(decoded[v], want[v])
    in_range = (want >= 2.0**-9) & (want <= 2.0**8) & (torch.arange(256) != 255)
    assert torch.equal(v, in_range)
    assert e4m3_pow2_table(3.0) is None and e4m3_pow2_table(float("nan")) is None


def test_pool_workers_write_the_same_bytes(source, cast_run, tmp_path):
    """The spawn pool path (worker processes, progress queue) gives the in-process result."""
    import os

    from k3nvfp4.checkpoint.convert import CastOptions, run_cast

    ref, _ = cast_run
    out = tmp_path / "pool"
    rep = run_cast(CastOptions(source=source, output=out, verify=True, workers=3, progress=True,
                               main_process_works=False))
    assert all(r["pid"] != os.getpid() for r in rep["per_shard"])
    assert rep["verify"]["mismatches"] == 0 and rep["verify"]["blocks"] == rep["stats"]["blocks"]
    skip = {"cast_report.json"}
    assert {k: v for k, v in _tree_hash(out).items() if k not in skip} == {
        k: v for k, v in _tree_hash(ref).items() if k not in skip
    }


@pytest.mark.parametrize("m", [-135, -20, 0, 5])
def test_verify_pair_table_accepts_exactly_the_scale_pairs(m):
    """--verify's uint16 pair check: a block's two E4M3 bytes, read as one uint16, equal the
    table entry iff both bytes are the E4M3 of 2^(k - m); out-of-window bytes match nothing."""
    from k3nvfp4.checkpoint.verify import e4m3_pair_table

    table = e4m3_pair_table(2.0**m)
    want = torch.exp2(torch.arange(256, dtype=torch.float64) - 127 - m)
    in_range = ((want >= 2.0**-9) & (want <= 2.0**8) & (torch.arange(256) != 255)).numpy()
    e4m3 = want.to(torch.float8_e4m3fn).view(torch.uint8).numpy().astype(np.uint32)  # exact in range (oracle: torch)
    assert np.array_equal(table[in_range], e4m3[in_range] * 0x0101)
    assert (table[~in_range] > 0xFFFF).all()
    # every possible pair against every E8M0 byte: exactly one accepted pair per in-window byte
    pairs = np.arange(1 << 16, dtype=np.uint16)
    hits = table[:, None] == pairs[None, :]
    assert np.array_equal(hits.sum(1), in_range.astype(int))
    assert e4m3_pair_table(3.0) is None


@pytest.mark.parametrize("use_memcmp", [True, False])
def test_verify_byte_compare_sees_a_difference_anywhere(use_memcmp):
    from k3nvfp4.checkpoint import verify

    if use_memcmp:
        assert verify._MEMCMP is not None  # Linux: libc is always there
    n = 2 * verify._CMP_CHUNK + 12345
    a = np.random.default_rng(0).integers(0, 256, n).astype(np.uint8)
    assert verify._equal_bytes(a, a.copy(), use_memcmp=use_memcmp)
    for pos in (0, verify._CMP_CHUNK - 1, verify._CMP_CHUNK, n - 1):
        b = a.copy()
        b[pos] ^= 0x80
        assert not verify._equal_bytes(a, b, use_memcmp=use_memcmp), pos
        assert not verify._equal_bytes(a[pos:], b[pos:], use_memcmp=use_memcmp), pos  # unaligned starts
    assert not verify._equal_bytes(a, a[:-1], use_memcmp=use_memcmp)
    assert verify._equal_bytes(a[:0], a[:0], use_memcmp=use_memcmp)


@pytest.mark.parametrize("scale_2", [2.0**-5, 2.0**-135, 2.0**100])
def test_verify_sample_decoders_match_the_format_codecs(scale_2):
    """--verify's table-driven full dequantization of the sample gives the same float32 bits
    as formats.dequantize_mxfp4 / dequantize_nvfp4 (every byte, every E8M0, every E4M3)."""
    from k3nvfp4.checkpoint.verify import dequantize_rows_mxfp4, dequantize_rows_nvfp4
    from k3nvfp4.kernels import formats

    rng = np.random.default_rng(0)
    packed = np.tile(np.arange(256, dtype=np.uint8), (16, 8))[:, rng.permutation(2048)]  # [16, 2048]
    e8m0 = np.arange(16 * 128, dtype=np.int64).reshape(16, 128) % 255  # no NaN byte
    e8m0 = e8m0.astype(np.uint8)
    e4m3 = (np.arange(16 * 256, dtype=np.int64).reshape(16, 256) % 256).astype(np.uint8)
    e4m3[(e4m3 & 0x7F) == 0x7F] = 0x38  # NaN codes -> 1.0
    ref_mx = formats.dequantize_mxfp4(torch.from_numpy(packed), torch.from_numpy(e8m0)).numpy()
    ref_nv = formats.dequantize_nvfp4(torch.from_numpy(packed), torch.from_numpy(e4m3).view(torch.float8_e4m3fn),
                                      torch.tensor(scale_2, dtype=torch.float32)).numpy()
    assert np.array_equal(dequantize_rows_mxfp4(packed, e8m0).view(np.int32), ref_mx.view(np.int32))
    assert np.array_equal(dequantize_rows_nvfp4(packed, e4m3, scale_2).view(np.int32), ref_nv.view(np.int32))


def test_summary_says_what_out_of_window_blocks_are():
    """Blocks outside the 17-binade window that stayed exact (all-zero blocks) are not reported as
    a contradiction of a 100% bit-exact cast."""
    from k3nvfp4.checkpoint.convert import _window_line

    s = {"blocks": 10_000, "exact_blocks": 10_000, "out_of_range_blocks": 707, "zero_exponent_blocks": 707}
    assert _window_line(s) == ("707 blocks re-quantized: 707 still exact (all-zero blocks, 707 with exponent 0, "
                               "are exact in any scale), 0 lossy")
    assert _window_line({**s, "exact_blocks": 9_990}).endswith("697 still exact (all-zero blocks, 707 with exponent 0, "
                                                               "are exact in any scale), 10 lossy")
    assert _window_line({**s, "out_of_range_blocks": 0}) == "none: every block cast in closed form"


def test_progress_bars_end_at_100_percent_in_a_log(source, tmp_path, capsys):
    """Not a terminal (captured stderr, as in a log file): every bar's last line reads 100%, the
    verify bar too (its byte total is an estimate for the groups verified after the cast)."""
    import re

    out = tmp_path / "out"
    assert main(["--source-ckpt", str(source), "--output-ckpt", str(out), "--workers", "1", "--verify"]) == 0
    err = capsys.readouterr().err
    lines = [ln for ln in re.split(r"[\r\n]+", err) if re.match(r"\s*(cast|verify):", ln)]
    assert lines, err[-2000:]
    last = {}
    for ln in lines:
        last[ln.split(":", 1)[0].strip()] = ln
    assert set(last) <= {"cast", "verify"} and "cast" in last
    for name, ln in last.items():
        assert "100%" in ln, (name, ln)
