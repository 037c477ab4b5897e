"""triton_situ on the MXFP4 release itself (no cast), through SGLang 0.5.23's own Kimi-K3 class.

The synthetic compressed-tensors ``mxfp4-pack-quantized`` checkpoint (NOT cast) goes through the
user-facing model-class self-check (k3nvfp4.sglang_ext.model_check) with ``--moe-runner-backend
triton_situ``: SGLang picks ``Mxfp4MoEMethod`` for the routed experts, the plugin's hooks on it
(sglang_ext/hooks_mxfp4.py) keep the checkpoint's unpadded shapes, prepare the kernels' layout
with ``NVFP4MoEWeights.from_mxfp4`` and route ``apply`` to the runner. Checked: every tensor
lands with its exact bytes, the quant method of every linear, one MoE block forward (Triton
interpreter) against the plain-torch MXFP4 reference, and the equality with the NVFP4 path on
the cast of the same checkpoint: bit-identical kernel weights and bit-identical block output.
TP2 (two processes over gloo), which splits each expert's I across the ranks through the
release's 32-wide E8M0 scale blocks. EP2 is not repeated here: it hands each rank whole experts,
which is the same for both layouts, and tests/test_model_class.py runs it on the cast.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from k3nvfp4.checkpoint.synthetic import write_synthetic_checkpoint

from model_check_helpers import MOE_LAYERS, RSF, SHAPE, cast_checkpoint, index_names, run_python, run_selfcheck

_DRIVER = """
import json, os, sys
from pathlib import Path
from k3nvfp4.sglang_ext.model_check.run import CheckOptions, run_checks
mx, cast, out = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
runs = run_checks([CheckOptions(mx), CheckOptions(mx, routed_scaling_factor=None),
                   CheckOptions(cast, routed_scaling_factor=None)])
# The FP4 tensor-core modes: the plugin reads K3NVFP4_ACT_QUANT when it prepares a layer's weights,
# so one process checks each mode in turn; a marker line on stderr opens each mode's log. The
# load line that names the mode is logged once per process: re-armed as in a fresh process.
from k3nvfp4.sglang_ext import backend_triton
for mode, ckpt in MODE_RUNS:
    os.environ["K3NVFP4_ACT_QUANT"] = mode
    backend_triton._logged_active = False
    print(f"{MODE_MARK}{mode}", file=sys.stderr, flush=True)
    runs += run_checks([CheckOptions(mx if ckpt == "mxfp4" else cast, num_layers=2)])
    del os.environ["K3NVFP4_ACT_QUANT"]
print(MODE_MARK + "end", file=sys.stderr, flush=True)
out.write_text(json.dumps(runs))
"""
# (K3NVFP4_ACT_QUANT, checkpoint) of test_fp4_tensor_core_modes_through_the_model_class
MODE_RUNS = (("mxfp8", "mxfp4"), ("nvfp4", "cast"))
MODE_MARK = "### k3nvfp4 test: act_quant "


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("k3mxfp4")
    src = write_synthetic_checkpoint(root / "mxfp4", **SHAPE)
    return {"mxfp4": src, "cast": cast_checkpoint(src, root / "nvfp4")}


@pytest.fixture(scope="module")
def single(ckpts, tmp_path_factory) -> dict:
    """One process: the MXFP4 checkpoint (factor 2.5, then the checkpoint's 1.0), then its cast, then
    the FP4 tensor-core modes (MODE_RUNS), each with its part of the log."""
    tmp = tmp_path_factory.mktemp("mx-single")
    out = tmp / "runs.json"
    driver = f"MODE_RUNS = {MODE_RUNS!r}\nMODE_MARK = {MODE_MARK!r}\n" + _DRIVER
    proc = run_python(tmp, ["-c", driver, str(ckpts["mxfp4"]), str(ckpts["cast"]), str(out)])
    assert proc.returncode == 0, (proc.stdout[-6000:], proc.stderr[-6000:])
    mx, mx_rsf1, cast_rsf1, *mode_runs = json.loads(out.read_text())
    logs = proc.stderr.split(MODE_MARK)[1:]  # "<mode>\n<its log>" per mode, then "end"
    assert [x.split("\n", 1)[0] for x in logs] == [m for m, _ in MODE_RUNS] + ["end"], proc.stderr[-6000:]
    modes = {m: (run, log) for (m, _), run, log in zip(MODE_RUNS, mode_runs, logs)}
    return {"mx": mx, "r": mx["ranks"][0], "mx_rsf1": mx_rsf1, "cast_rsf1": cast_rsf1, "modes": modes}


def test_mxfp4_release_serves_through_the_model_class(single, ckpts):
    assert single["mx"]["ok"], single["mx"]["problems"]
    r = single["r"]
    assert r["model_class"] == "KimiK3ForConditionalGeneration" and r["moe_runner_backend"] == "triton_situ"
    assert r["quant_config"] == "CompressedTensorsConfig" and r["expert_format"] == "compressed-tensors MXFP4"
    t = r["tensors"]
    assert t["landed_names"] == index_names(ckpts["mxfp4"]) and t["skipped"] == []
    p = r["params"]
    assert p["mismatches"] == 0 and p["unplanned"] == []
    assert p["expert_checks"] == len(MOE_LAYERS) * SHAPE["num_experts"]
    # Every parameter filled from the checkpoint: no bias or input scales, and no KV-cache scale
    # parameters (compressed-tensors without a kv_cache_scheme creates none).
    assert p["defaults"] == []
    for info in r["moe_layers"].values():
        assert info["kernel_weights"] and info["modelopt_params_freed"] and info["runner_backend"] == "triton_situ"
        assert info["intermediate_per_rank"] == SHAPE["intermediate_size"]  # not padded for another kernel


def test_quant_method_per_linear(single):
    q = single["r"]["quant"]
    by_role = q["by_role"]
    assert by_role["routed experts"] == {"Mxfp4MoEMethod": len(MOE_LAYERS)}
    for role in ("attention", "shared experts", "dense MLP", "latent projections"):
        assert set(by_role[role]) == {"UnquantizedLinearMethod"}, role
    assert set(by_role["lm_head"]) == {"UnquantizedEmbeddingMethod"}  # compressed-tensors' choice for ParallelLMHead
    assert not any(e["quantized"] for e in q["entries"] if e["role"] != "routed experts")
    # Control: with the ignore list emptied and every Linear targeted, compressed-tensors would
    # quantize every linear the model class asked about: the ignore globs keep them BF16.
    ctl = q["control_by_role"]
    for role in ("attention", "shared experts", "dense MLP"):
        assert ctl[role]["asked"] > 0 and ctl[role]["quantized_without_excludes"] == ctl[role]["asked"], role
    # A "Linear" target does not reach ParallelLMHead (an embedding class): lm_head stays BF16 anyway.
    assert ctl["lm_head"]["asked"] == 1 and ctl["lm_head"]["quantized_without_excludes"] == 0


def test_moe_block_forward_matches_the_mxfp4_reference(single):
    f = single["r"]["forward"]
    assert f["prefix"] == "language_model.model.layers.1.mlp" and f["routed_scaling_factor"] == RSF
    assert f["err"] <= 1.5e-2 and f["max_err"] <= 3e-2, f  # measured 6.3e-3
    assert f["err_scaling_applied_0x"] > 0.3 and f["err_scaling_applied_2x"] > 0.3, f
    # Mxfp4MoEMethod: SGLang leaves the factor out of the top-k weights, the runner applies it.
    assert not f["scaling_in_topk_weights"] and abs(f["weights_mean_sum"] - 1.0) < 1e-2
    assert f["routing_bad_tokens"] == 0 and f["weights_max_rel_err"] < 1e-2


def test_equal_to_the_nvfp4_path_on_the_cast(single):
    """Same checkpoint, read directly and cast: the kernels get weights of identical value (the
    nibbles and every in-window block scale bit for bit; the cast re-quantizes the all-zero
    blocks' E8M0 0 to another scale, test_layout checks that block by block), and the block
    output is bit-identical (checkpoint routed_scaling_factor 1.0: SGLang applies a factor at
    different points for the two quant methods)."""
    mx, cast = single["mx_rsf1"], single["cast_rsf1"]
    assert mx["ok"] and cast["ok"], (mx["problems"], cast["problems"])
    (mr,), (cr,) = mx["ranks"], cast["ranks"]
    assert cr["expert_format"] == "ModelOpt NVFP4" and mr["expert_format"] == "compressed-tensors MXFP4"
    values = {n: i["kernel_values_sha256"] for n, i in mr["moe_layers"].items()}
    assert values == {n: i["kernel_values_sha256"] for n, i in cr["moe_layers"].items()}
    assert len(set(values.values())) == len(MOE_LAYERS)
    assert mr["forward"]["out_sha256"] == cr["forward"]["out_sha256"]
    assert mr["forward"]["err"] <= 1.5e-2


def test_tp2_on_mxfp4(ckpts, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mx-parallel")
    (tp,) = run_selfcheck(tmp, "parallel", "--model", str(ckpts["mxfp4"]), "--parallel", "2x1")["runs"]
    names = set(index_names(ckpts["mxfp4"]))
    E, I = SHAPE["num_experts"], SHAPE["intermediate_size"]
    per_rank = dict(local_experts=E, intermediate_per_rank=I // 2, moe_tp_size=2)
    assert tp["ok"], tp["problems"]
    ranks = tp["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1] and (tp["tp_size"], tp["ep_size"]) == (2, 1)
    for r in ranks:
        for info in r["moe_layers"].values():
            assert {k: info[k] for k in per_rank} == per_rank, info
        assert r["params"]["mismatches"] == 0 and r["forward"]["err"] <= 1.5e-2
    assert set().union(*(r["tensors"]["landed_names"] for r in ranks)) == names
    assert ranks[0]["forward"]["out_sha256"] == ranks[1]["forward"]["out_sha256"]


@pytest.mark.parametrize("act_quant", [m for m, _ in MODE_RUNS])
def test_fp4_tensor_core_modes_through_the_model_class(single, act_quant):
    """K3NVFP4_ACT_QUANT selects the FP4 tensor-core mode (decomposed here, in the interpreter): the
    layer loads FP4MMAWeights, logs the mode, and the block output stays within the mode's
    quantization tolerance of the unquantized-activation reference, and visibly quantized
    (mxfp8 on the release, nvfp4 on the cast; two layers)."""
    from k3nvfp4.sglang_ext.model_check.forward import ACT_QUANT_TOL

    run, log = single["modes"][act_quant]
    assert run["ok"], run["problems"]
    f = run["ranks"][0]["forward"]
    assert f["act_quant"] == act_quant and f["tolerance"] == ACT_QUANT_TOL[act_quant]
    assert 1e-3 < f["err"] <= ACT_QUANT_TOL[act_quant], f  # quantized activations, within the mode's bound
    assert f"activation quantization {act_quant}" in log
    assert run["ranks"][0]["num_hidden_layers"] == 2
