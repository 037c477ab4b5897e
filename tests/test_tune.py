"""k3nvfp4-tune: shape derivation, search space, files, and the whole pipeline end to end.

Without a GPU the end-to-end test runs the tuner in the Triton interpreter (--device cpu) on
tiny shapes; with one it runs the same test on the GPU (--device cuda).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import k3nvfp4.kernels.moe as moe
from k3nvfp4.kernels import tune
from k3nvfp4.kernels.target import current_device_name
from k3nvfp4.kernels.moe_details.config import (
    CONFIG_DIR_ENV,
    MoEConfig,
    config_file_name,
    get_moe_config,
    load_moe_configs,
    load_tuned_configs,
)
from k3nvfp4.kernels.moe_w4a8_details.config import W4A8Config
from k3nvfp4.kernels.tune_details.modes import TUNED_MODES

K3_TEXT_CONFIG = {
    "hidden_size": 7168,
    "num_experts": 896,
    "num_experts_per_token": 16,
    "moe_intermediate_size": 3072,
    "routed_expert_hidden_size": 3584,
}


@pytest.fixture
def k3_config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "kimi_k3", "text_config": K3_TEXT_CONFIG}))
    return path


def test_shape_from_k3_config_tp16_and_ep16(k3_config):
    tp = tune.shape_from_model_config(k3_config, tp_size=16)
    assert (tp.E, tp.H, tp.I, tp.top_k, tp.global_experts) == (896, 3584, 192, 16, 896)
    ep = tune.shape_from_model_config(k3_config, tp_size=16, ep_size=16)
    assert (ep.E, ep.H, ep.I, ep.top_k, ep.global_experts) == (56, 3584, 3072, 16, 896)
    ep32 = tune.shape_from_model_config(k3_config, tp_size=32, ep_size=32)
    assert (ep32.E, ep32.I) == (28, 3072)


def test_cli_ep_size_alone_means_tp_equals_ep(k3_config):
    args = tune.build_parser().parse_args(["--model-config", str(k3_config), "--ep-size", "16"])
    shape = tune._resolve_shape(args, tune.build_parser())
    assert (shape.E, shape.I) == (56, 3072)


def test_shape_from_config_errors_name_the_problem(tmp_path, k3_config):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"text_config": {k: v for k, v in K3_TEXT_CONFIG.items() if k != "moe_intermediate_size"}}))
    with pytest.raises(SystemExit, match="moe_intermediate_size"):
        tune.shape_from_model_config(bad)
    with pytest.raises(SystemExit, match="not found"):
        tune.shape_from_model_config(tmp_path / "missing.json")
    with pytest.raises(SystemExit, match="ep-size"):
        tune.shape_from_model_config(k3_config, tp_size=16, ep_size=3)  # 16 % 3
    with pytest.raises(SystemExit, match="multiple of 16"):
        tune.shape_from_model_config(k3_config, tp_size=128)  # 3072 / 128 = 24


def test_search_spaces_are_valid_and_centered_on_the_heuristic():
    shape = tune.TuneShape(896, 3584, 192, 16, 896)
    for M in (1, 64, 4096):
        base = tune.base_config("default", shape, M)
        assert base == MoEConfig.heuristic(896, 3584, 192, 16, M)
        for space in ("small", "default", "wide"):
            for stage in tune.stages(space):
                cands = tune._expand_stage(stage, base)
                assert cands, (space, stage)
                assert len(set(cands)) == len(cands)
                for c in cands:
                    assert isinstance(c, MoEConfig)
                    assert c.swap_ab is False or c.block_m <= 64  # swap-AB up to 64 tokens (sass report)
    # block_m ladder around the heuristic's block_m=16 (decode): 16 and 32, each with and without swap_ab
    bm = tune._expand_stage({"block_m": ["~"]}, tune.base_config("default", shape, 1))
    assert sorted((c.block_m, c.swap_ab) for c in bm) == [(16, False), (16, True), (32, False), (32, True)]
    tiny = tune._expand_stage(tune.stages("tiny")[0], tune.base_config("tiny", shape, 1))
    assert [c.block_n1 for c in tiny] == [16, 32]


def test_coverage_order_spans_the_range_first():
    sizes = [1, 4, 16, 64, 256, 1024, 4096, 16384]
    order = tune.coverage_order(sizes)
    assert sorted(order) == sizes
    assert order[:3] == [1, 16384, 64]
    assert tune.coverage_order([3, 1]) == [1, 3]


def test_atomic_write_and_partial_key_mismatch(tmp_path):
    path = tmp_path / "x.partial.json"
    key = {"E": 1}
    tune.write_json_atomic(path, {"version": 1, "key": key, "results": {"1": {"complete": True}, "2": {"complete": False}}})
    assert [p.name for p in tmp_path.iterdir()] == ["x.partial.json"]  # no temp file left behind
    assert tune.load_partial(path, key) == {"1": {"complete": True}}  # unfinished entries are redone
    assert tune.load_partial(path, {"E": 2}) == {}
    path.write_text("{not json")
    assert tune.load_partial(path, key) == {}


def test_routing_is_realistic():
    shape = tune.TuneShape(E=56, H=64, I=32, top_k=16, global_experts=896)
    tw, ids = tune.problem_routing(512, shape, "cpu", seed=3)
    assert tw.dtype == torch.float32 and ids.dtype == torch.int32 and ids.shape == (512, 16)
    torch.testing.assert_close(tw.sum(-1), torch.ones(512))
    assert ((ids >= -1) & (ids < 56)).all()
    local = ids[ids >= 0]
    # about top_k * E / G = 1 local route per token, and the load is skewed (hot experts)
    assert 0.3 < local.numel() / 512 < 3.0
    counts = torch.bincount(local.long(), minlength=56).float()
    assert counts.max() > 3 * counts.mean()
    # distinct experts per token in the global routing
    _, gids = tune.problem_routing(64, tune.TuneShape(896, 64, 32, 16, 896), "cpu", seed=4)
    assert all(len(set(r.tolist())) == 16 for r in gids)


def test_cli_rejects_bad_arguments(capsys):
    with pytest.raises(SystemExit) as e:
        tune.main(["--E", "4", "--H", "48", "--I", "32", "--top-k", "2", "--batch-sizes", "1,x", "--device", "cpu"])
    assert e.value.code == 2 and "--batch-sizes" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        tune.main(["--E", "4", "--H", "40", "--I", "32", "--top-k", "2", "--device", "cpu"])  # H % 16
    assert e.value.code == 2 and "multiple of 16" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        tune.main(["--E", "4", "--device", "cpu"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:  # the e4m3 mode's kernels step K by 64
        tune.main(["--mode", "e4m3", "--E", "4", "--H", "96", "--I", "128", "--top-k", "2", "--device", "cpu"])
    assert e.value.code == 2 and "--mode e4m3 needs H and I multiples of 64 (H = 96, I = 128)" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_cli_without_gpu_says_so(capsys):
    assert tune.main(["--E", "4", "--H", "48", "--I", "32", "--top-k", "2"]) == 2
    assert "--device cpu" in capsys.readouterr().err


def _wrong_when_wide(real):
    """fused_moe_nvfp4 that returns instantly with a wrong result for block_n1=32 configs:
    the fastest candidate of the tiny space, and it must never be chosen."""

    def fake(x, weights, tw, ids, *, config=None, out=None, **kw):
        if config is not None and config.block_n1 == 32:
            out.zero_()
            return out
        return real(x, weights, tw, ids, config=config, out=out, **kw)

    return fake


def test_candidate_failures_are_skipped_with_a_note(monkeypatch):
    def broken(x, weights, tw, ids, *, config=None, out=None, **kw):
        if config.block_n1 == 16:
            raise RuntimeError("out of resource: shared memory")
        out.zero_()
        return out

    monkeypatch.setattr(moe, "fused_moe_nvfp4", broken)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = tune.TuneShape(4, 48, 32, 2, 4)
    weights = tune.problem_weights(shape, device)
    best, tried, complete = tune.tune_batch_size(
        3, shape, weights, "tiny", tune.Timer(device, 0, 1), device=device, dtype=torch.float32,
        activation="situ", tol=1e-4, seed=0, expert_offset=0, max_configs=None, deadline=None, progress=False,
    )  # fmt: skip
    assert best is None and complete
    notes = {c.config.block_n1: c.note for c in tried}
    assert notes[16].startswith("skipped: RuntimeError: out of resource")
    assert notes[32].startswith("wrong result")


def test_unlaunchable_configs_are_dropped_before_they_run(monkeypatch):
    """A config the launch check rejects is recorded with its reason and never run or timed."""
    ran = []

    def record(x, weights, tw, ids, *, config=None, out=None, **kw):
        ran.append(config.block_n1)
        return real(x, weights, tw, ids, config=config, out=out, **kw)

    real = moe.fused_moe_nvfp4
    monkeypatch.setattr(moe, "fused_moe_nvfp4", record)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = tune.TuneShape(4, 48, 32, 2, 4)
    weights = tune.problem_weights(shape, device)
    spills = lambda cfg: "gemm1 spills 64 bytes of local memory per thread (sm_90)" if cfg.block_n1 == 32 else None  # noqa: E731
    best, tried, _ = tune.tune_batch_size(
        3, shape, weights, "tiny", tune.Timer(device, 0, 1), device=device, dtype=torch.float32,
        activation="situ", tol=1e-4, seed=0, expert_offset=0, max_configs=None, deadline=None, progress=False,
        launch_check=spills,
    )  # fmt: skip
    by_bn = {c.config.block_n1: c for c in tried}
    assert by_bn[32].note == "skipped: gemm1 spills 64 bytes of local memory per thread (sm_90)"
    assert by_bn[32].time_s is None and 32 not in ran
    assert best is not None and best.config.block_n1 == 16 and 16 in ran


def test_offline_launch_check_measures_real_compiles():
    """The tuner's launch check compiles offline for sm90 (no GPU) and rejects a config whose
    shared memory exceeds the H200's 227 KiB per block (GEMM1 bm128 noswap bn64 bk256 at 3
    stages: 266,240 B with 1-byte block scales (270,336 with the former bf16 ones: 2 buffered
    stages x 2,048 B of scales), which Triton would refuse at launch) and one that spills registers, and
    passes a shipped decode config; for the e4m3 mode, passes its decode tile and rejects GEMM1's
    64-token tile on 4 warps, whose accumulators spill (8 warps take it: docs/w4a8.md)."""
    import os
    import subprocess
    import sys

    code = (
        "from k3nvfp4.kernels.tune import TuneShape, offline_launch_check;"
        "from k3nvfp4.kernels.moe_details.config import MoEConfig;"
        "check = offline_launch_check(TuneShape(56, 3584, 3072, 16, 896), 90);"
        "ok = MoEConfig(block_m=16, swap_ab=True, block_n1=64, block_k1=256, num_warps1=4);"
        "big = MoEConfig(block_m=128, swap_ab=False, block_n1=64, block_k1=256, num_warps1=8, num_stages1=3);"
        "spill = MoEConfig(block_m=64, swap_ab=True, block_n1=32, block_k1=256, num_warps1=2);"
        "print(repr(check(ok)));print(check(big));print(check(spill));"
        # the e4m3 mode's configs through the same check (its own compile, compile_w4a8)
        "from k3nvfp4.kernels.moe_w4a8_details.config import W4A8Config;"
        "check8 = offline_launch_check(TuneShape(56, 3584, 3072, 16, 896), 90, mode='e4m3');"
        "print(repr(check8(W4A8Config(block_m=16, num_warps1=4))));"
        "print(check8(W4A8Config(block_m=64, num_warps1=4)))"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode != 0 and "ptxas" in proc.stderr.lower() and "not found" in proc.stderr.lower():
        pytest.skip(f"Triton's offline compile is unavailable: {proc.stderr[-300:]}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    ok, big, spill, ok8, spill8 = proc.stdout.strip().splitlines()
    assert ok == "None"
    assert big == "gemm1 cannot launch on H200: shared memory 266240 B > 232448 B per block", big
    assert spill.startswith("gemm1 spills ") and spill.endswith("bytes of local memory per thread (sm_90)"), spill
    assert ok8 == "None"
    assert spill8.startswith("gemm1 spills ") and spill8.endswith("bytes of local memory per thread (sm_90)"), spill8


def test_tune_end_to_end_resume_and_lookup(tmp_path, monkeypatch, capsys):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    E, H, I, k = 4, 48, 32, 2
    out_dir = tmp_path / "configs"
    argv = ["--device", device, "--E", str(E), "--H", str(H), "--I", str(I), "--top-k", str(k),
            "--batch-sizes", "1,3", "--space", "tiny", "--warmup", "0", "--iters", "1",
            "--out-dir", str(out_dir), "--report", str(tmp_path / "report.json"), "--no-progress"]  # fmt: skip
    monkeypatch.setattr(moe, "fused_moe_nvfp4", _wrong_when_wide(moe.fused_moe_nvfp4))
    device_name = current_device_name() if device == "cuda" else "cpu"
    final = out_dir / config_file_name(E, H, I, device_name)
    partial = final.with_name(final.name + tune.PARTIAL_SUFFIX)

    # Run 1 is interrupted while tuning M=3: M=1 is kept in the partial file, no final file yet.
    real_tune_batch_size = tune.tune_batch_size
    calls: list[int] = []

    def interrupted(M, *a, **kw):
        calls.append(M)
        if M == 3:
            raise KeyboardInterrupt
        return real_tune_batch_size(M, *a, **kw)

    monkeypatch.setattr(tune, "tune_batch_size", interrupted)
    assert tune.main(argv) == 130
    assert calls == [1, 3]
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"k3nvfp4-tune: interrupted; 1 batch size(s) done so far are kept in {partial} (1 of them in this run); "
        "the same command resumes")
    assert not final.exists() and partial.is_file()
    saved = json.loads(partial.read_text())["results"]
    assert set(saved) == {"1"} and saved["1"]["complete"]

    # Run 2 (same command) resumes: only M=3 is tuned.
    calls.clear()
    monkeypatch.setattr(tune, "tune_batch_size", lambda M, *a, **kw: (calls.append(M), real_tune_batch_size(M, *a, **kw))[1])
    capsys.readouterr()
    assert tune.main(argv) == 0
    assert calls == [3]
    # Stderr is not a terminal: plain status lines, no bar (no carriage return, no nested bar's
    # cursor-movement codes); the final one says the one batch size left is done.
    err = capsys.readouterr().err
    assert "\r" not in err and "\x1b" not in err, repr(err[-300:])
    assert [ln for ln in err.splitlines() if ln.startswith("tuning: ")][-1].startswith(
        "tuning: 1 of 1 batch sizes (100%)") and err.rstrip().endswith("| M=3 (done)"), err
    assert final.is_file() and not partial.exists()
    assert sorted(p.name for p in out_dir.iterdir()) == [final.name]

    # The file parses with the run-time loader; the fast wrong config never won.
    tuned = load_moe_configs(E, H, I, device_name, directory=out_dir)
    expected = dataclasses.replace(tune.base_config("tiny", None, 1), block_n1=16)
    assert tuned == {1: expected, 3: expected}
    report = json.loads((tmp_path / "report.json").read_text())["results"]
    for m in ("1", "3"):
        by_n1 = {c["config"]["block_n1"]: c for c in report[m]["tried"]}
        assert by_n1[32]["note"].startswith("wrong result") and by_n1[32]["time_us"] is None
        assert by_n1[16]["time_us"] > 0 and by_n1[16]["error"] <= 1e-4 * (1 if device == "cpu" else 200)

    # get_moe_config finds it through the environment variable (nearest batch size), and the
    # tuned entry differs from what the heuristic would have given.
    monkeypatch.setenv(CONFIG_DIR_ENV, str(out_dir))
    assert get_moe_config(E, H, I, k, 10, device_name=device_name) == tuned[3]
    assert tuned[3] != MoEConfig.heuristic(E, H, I, k, 10)


def test_e4m3_search_spaces_hold_valid_configs_around_its_heuristic():
    """--mode e4m3 searches W4A8Config (never MoEConfig) around W4A8Config.heuristic; every stage
    leaves configs that the mode can run at K3's EP16 and TP16 shards."""
    for shape in (tune.TuneShape(56, 3584, 3072, 16, 896), tune.TuneShape(896, 3584, 192, 16, 896)):
        for M in (1, 64, 4096):
            base = tune.base_config("default", shape, M, mode="e4m3")
            assert base == W4A8Config.heuristic(shape.E, shape.H, shape.I, 16, M, num_global_experts=896,
                                                weight_block=32)
            for space in ("small", "default", "wide"):
                for stage in tune.stages(space, mode="e4m3"):
                    cands = tune._expand_stage(stage, base)
                    assert cands and all(isinstance(c, W4A8Config) for c in cands), (space, stage)
                    valid = [c for c in cands if TUNED_MODES["e4m3"].invalid(c, shape) is None]
                    assert valid, (shape, space, stage)
    tiles = tune._expand_stage(tune.stages("small", "e4m3")[0], tune.base_config("small", shape, 1, "e4m3"))
    assert sorted((c.block_m, c.num_warps1) for c in tiles) == [(16, 4), (32, 4), (64, 8)]
    assert TUNED_MODES["e4m3"].invalid(W4A8Config(block_k2=128), shape) == "config.block_k2 = 128 must be 64 or 128 and divide 192"


def test_e4m3_mode_tunes_into_its_own_file_and_its_calls_read_it(tmp_path, monkeypatch):
    """k3nvfp4-tune --mode e4m3 (interpreter on CPU): every candidate is checked against
    fused_moe_w4a8_reference (the fast wrong config never wins), the file is named for the mode
    and weight block (a W4A16 lookup of the shape finds nothing), and a W4A8 call without a
    config runs the tuned config, not the heuristic's."""
    from k3nvfp4.kernels.moe_w4a8 import run_w4a8

    device = "cuda" if torch.cuda.is_available() else "cpu"
    E, H, I, k = 2, 128, 128, 2
    out_dir = tmp_path / "configs"
    argv = ["--device", device, "--mode", "e4m3", "--E", str(E), "--H", str(H), "--I", str(I), "--top-k", str(k),
            "--batch-sizes", "3", "--space", "tiny", "--warmup", "0", "--iters", "1", "--out-dir", str(out_dir),
            "--report", str(tmp_path / "report.json"), "--no-progress"]  # fmt: skip
    real = moe.fused_moe_nvfp4

    def wrong_when_wide(x, weights, tw, ids, *, config=None, out=None, **kw):
        assert isinstance(config, W4A8Config)
        if config.block_n2 == 128:  # instant and wrong: the fastest candidate, never to be chosen
            return out.zero_()
        return real(x, weights, tw, ids, config=config, out=out, **kw)

    monkeypatch.setattr(moe, "fused_moe_nvfp4", wrong_when_wide)
    assert tune.main(argv) == 0
    device_name = current_device_name() if device == "cuda" else "cpu"
    name = config_file_name(E, H, I, device_name, "w4a8_e4m3_b32")
    assert sorted(p.name for p in out_dir.iterdir()) == [name]
    tuned = load_tuned_configs(name, W4A8Config, out_dir)
    assert tuned == {3: tune.base_config("tiny", None, 3, "e4m3")}
    tried = {c["config"]["block_n2"]: c for c in json.loads((tmp_path / "report.json").read_text())["results"]["3"]["tried"]}
    assert tried[128]["note"].startswith("wrong result") and tried[128]["time_us"] is None
    assert tried[64]["time_us"] > 0 and tried[64]["error"] <= 1e-2
    assert load_moe_configs(E, H, I, device_name, directory=out_dir) is None

    monkeypatch.setattr(moe, "fused_moe_nvfp4", real)
    monkeypatch.setenv(CONFIG_DIR_ENV, str(out_dir))
    shape = tune.TuneShape(E, H, I, k, E)
    weights = tune.problem_weights(shape, device, mode="e4m3")
    x = torch.randn(3, H, device=device)
    tw, ids = tune.problem_routing(3, shape, device)
    assert tuned[3] != W4A8Config.heuristic(E, H, I, k, 3, weight_block=32)
    assert run_w4a8(x, weights, tw, ids).config == tuned[3]
    monkeypatch.delenv(CONFIG_DIR_ENV)
    assert run_w4a8(x, weights, tw, ids).config == W4A8Config.heuristic(E, H, I, k, 3, weight_block=32)


def test_bench_moe_smoke(tmp_path):
    """bench/bench_moe.py end to end on a tiny EP-style shape (interpreter on CPU): the
    correctness check runs before timing and the JSON holds the figures of every point."""
    import pathlib
    import subprocess
    import sys

    script = pathlib.Path(__file__).resolve().parent.parent / "bench" / "bench_moe.py"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cmd = [sys.executable, str(script), "--device", device, "--shapes", "tiny-ep", "--m-list", "8",
           "--quick", "--no-plot", "--out-dir", str(tmp_path)]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    (result_file,) = tmp_path.glob("moe-*.json")
    result = json.loads(result_file.read_text())
    check = result["shapes"]["tiny-ep"]["check"]
    assert check["ok"] and check["ours_normwise_error"] <= check["tol"]
    assert check["baseline_normwise_error"] < 3e-2
    (point,) = result["points"]
    assert point["M"] == 8 and "error" not in point
    assert 0 < point["valid_routes"] <= 8 * 4 and 0 < point["distinct_experts"] <= 4
    H, I = 48, 32
    # the kernel layout reads one byte per 16-weight block scale, as ModelOpt's E4M3 scales
    per_expert = (2 * I * H // 2 + 2 * I * H // 16 + 8) + (H * I // 2 + H * I // 16 + 4)
    per_expert_modelopt = (2 * I * H // 2 + 2 * I * H // 16 + 8) + (H * I // 2 + H * I // 16 + 4)
    act_bytes = 4 if device == "cpu" else 2  # fp32 activations in the interpreter, bf16 on a GPU
    acts = 2 * 8 * H * act_bytes + 8 * 4 * 8
    assert point["bytes"] == point["distinct_experts"] * per_expert + acts
    assert point["bytes_modelopt"] == point["distinct_experts"] * per_expert_modelopt + acts
    assert point["flops"] == 2 * point["valid_routes"] * 3 * I * H
    assert point["ours"]["time_us"] > 0 and point["bf16"]["impl"] == "torch._grouped_mm"
    assert result["other_implementations"]["sglang_marlin_nvfp4"].startswith("not available")
    # FlashInfer's MoE (SM90 W4A16, MXFP4): H = 48 is no multiple of 128, and without CUDA it does not run.
    fi = result["other_implementations"]["flashinfer"]["tiny-ep"]
    assert fi.startswith("not available: ") and point["flashinfer"] == fi and "x_vs_flashinfer" not in point
    if device == "cpu":
        assert fi == "not available: the FlashInfer arm runs on a CUDA GPU only (--device cpu)"
    assert point["bytes_mxfp4"] == point["distinct_experts"] * (2 * I * H // 2 + 2 * I * H // 32 + H * I // 2 + H * I // 32) + acts


def test_tuner_never_writes_into_the_installed_package(tmp_path, monkeypatch):
    """Without --out-dir and $K3NVFP4_MOE_CONFIG_DIR the tuner writes to the per-user directory
    ($XDG_CONFIG_HOME/k3nvfp4/moe_configs), with the package's configs folder read-only; the
    kernels then find the file there, and a shipped file of another shape is still read."""
    import stat

    from k3nvfp4.kernels.moe_details import config as cfgmod

    device = "cuda" if torch.cuda.is_available() else "cpu"
    E, H, I, k = 4, 48, 32, 2
    shipped = tmp_path / "site-packages" / "k3nvfp4" / "kernels" / "configs"
    shipped.mkdir(parents=True)
    other = MoEConfig(block_m=16, block_n1=32)
    (shipped / config_file_name(8, 64, 64, "dev")).write_text(json.dumps({"1": other.to_dict()}))
    shipped.chmod(stat.S_IRUSR | stat.S_IXUSR)  # what a system-wide install looks like to a user
    monkeypatch.setattr(cfgmod, "DEFAULT_CONFIG_DIR", shipped)
    monkeypatch.delenv(CONFIG_DIR_ENV, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    user = tmp_path / "xdg" / "k3nvfp4" / "moe_configs"
    assert cfgmod.config_dir() == user and cfgmod.config_dirs() == (user, shipped)
    argv = ["--device", device, "--E", str(E), "--H", str(H), "--I", str(I), "--top-k", str(k), "--batch-sizes", "1",
            "--space", "tiny", "--warmup", "0", "--iters", "1", "--no-progress"]
    try:
        assert tune.main(argv) == 0
        device_name = current_device_name() if device == "cuda" else "cpu"
        assert sorted(p.name for p in shipped.iterdir()) == [config_file_name(8, 64, 64, "dev")]
        assert sorted(p.name for p in user.iterdir()) == [config_file_name(E, H, I, device_name)]
        tuned = load_moe_configs(E, H, I, device_name)
        assert tuned is not None and get_moe_config(E, H, I, k, 1, device_name=device_name) == tuned[1]
        assert get_moe_config(8, 64, 64, 2, 1, device_name="dev") == other  # the shipped file, read last
    finally:
        shipped.chmod(stat.S_IRWXU)
