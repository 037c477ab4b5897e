"""The prepared weights choose the kernels (kernels/modes.py): each mode's weights are prepared
once from the checkpoint tensors by that mode alone, the one entry point fused_moe_nvfp4 runs the
mode its weights were prepared for, and a forward in one mode runs no other mode's preparation
code (every other preparation function is made to raise while it runs)."""

from __future__ import annotations

import pytest
import torch

from k3nvfp4.kernels import fused_moe_nvfp4, fused_moe_nvfp4_reference
from k3nvfp4.kernels.activation import K3_SITU
from k3nvfp4.kernels.modes import MODE_NAMES, MODES, kernel_mode, mode_of
from k3nvfp4.kernels.moe_details.weights import ModelOptMoETensors, MXFP4MoETensors, NVFP4MoEWeights
from k3nvfp4.kernels.moe_fp4_details import weights as fp4_weights
from k3nvfp4.kernels.moe_fp4_details.weights import FP4MMAWeights
from k3nvfp4.kernels.moe_fp4_reference import fused_moe_fp4_reference
from k3nvfp4.kernels.moe_w4a8_details import weights as w4a8_weights
from k3nvfp4.kernels.moe_w4a8_details.weights import W4A8MoEWeights
from k3nvfp4.kernels.moe_w4a8_reference import fused_moe_w4a8_reference
from k3nvfp4.kernels.testing import random_mxfp4_tensors, random_routing

DEV = "cuda" if torch.cuda.is_available() else "cpu"
E, H, I, M, K = 3, 64, 64, 4, 2
REFERENCES = {"none": fused_moe_nvfp4_reference, "nvfp4": fused_moe_fp4_reference, "mxfp8": fused_moe_fp4_reference,
              "e4m3": fused_moe_w4a8_reference}


def _raise(name: str):
    def fail(*args, **kwargs):
        raise AssertionError(f"{name} ran: another mode's preparation code")
    return fail


# Every preparation function of every mode, by the mode that owns it. FP4MMAWeights.from_modelopt
# and from_mxfp4 serve both FP4 modes (act_quant picks); recover_e8m0 is mxfp8's own, the cast
# from MXFP4 nvfp4's own. The e4m3 mode (Hopper W4A8) prepares with W4A8MoEWeights and prep.py's
# functions (imported into its weights module).
PREPARATION = {
    "none": [(NVFP4MoEWeights, "from_modelopt"), (NVFP4MoEWeights, "from_mxfp4"), (NVFP4MoEWeights, "to_modelopt")],
    "nvfp4": [(fp4_weights, "cast_mxfp4_moe")],
    "mxfp8": [(fp4_weights, "recover_e8m0")],
    "e4m3": [(W4A8MoEWeights, "from_modelopt"), (W4A8MoEWeights, "from_mxfp4"),
             (w4a8_weights, "prepare_w4a8_from_nvfp4"), (w4a8_weights, "prepare_w4a8_from_mxfp4")],
}
FP4_SHARED = [(FP4MMAWeights, "from_modelopt"), (FP4MMAWeights, "from_mxfp4")]


def _forbid_all_but(monkeypatch, mode: str) -> None:
    for owner, fns in PREPARATION.items():
        if owner != mode:
            for obj, name in fns:
                monkeypatch.setattr(obj, name, _raise(f"{owner}: {name}"))
    if mode not in ("nvfp4", "mxfp8"):
        for obj, name in FP4_SHARED:
            monkeypatch.setattr(obj, name, _raise(f"fp4: {name}"))


@pytest.fixture(scope="module")
def case():
    mx = MXFP4MoETensors(*random_mxfp4_tensors(E, H, I, seed=4))
    mo = fp4_weights.cast_mxfp4_moe(*mx)  # the cast's ModelOpt tensors: both sources of one layer
    g = torch.Generator().manual_seed(4)
    x = torch.randn(M, H, generator=g)
    tw, ids = random_routing(M, K, E, seed=4)
    return mx, mo, x, tw, ids


@pytest.mark.parametrize("source", ["modelopt", "mxfp4"])
@pytest.mark.parametrize("mode", MODE_NAMES)
def test_each_mode_prepares_and_runs_alone(monkeypatch, case, mode, source):
    mx, mo, x, tw, ids = case
    tensors = mo if source == "modelopt" else mx
    # the reference of this mode, on weights prepared before anything is forbidden
    w_ref = MODES[mode].prepare(tensors)
    ref = REFERENCES[mode](x, w_ref, tw, ids, activation=K3_SITU)
    _forbid_all_but(monkeypatch, mode)
    if not (mode == "nvfp4" and source == "mxfp4"):  # only the W4A4 mode casts (its own preparation)
        monkeypatch.setattr(fp4_weights, "cast_mxfp4_moe", _raise("the cast"))
    w = MODES[mode].prepare(tensors)  # the mode's own preparation only
    assert mode_of(w) is MODES[mode] and isinstance(w, MODES[mode].weights_type)
    # the forward: nothing is prepared or converted at call time, not even the mode's own
    for obj, name in PREPARATION[mode] + (FP4_SHARED if mode in ("nvfp4", "mxfp8") else []):
        monkeypatch.setattr(obj, name, _raise(f"{mode}: {name} at call time"))
    got = fused_moe_nvfp4(x.to(DEV), w.to(DEV), tw.to(DEV), ids.to(DEV), activation=K3_SITU)
    tol = 1e-6 if mode != "none" else 1e-5
    assert float((got.cpu() - ref).abs().max()) <= tol * float(ref.abs().max()), mode


def test_a_mode_name_nobody_knows_is_refused():
    with pytest.raises(ValueError, match="act_quant: expected one of none, nvfp4, mxfp8, e4m3, got 'fp8'"):
        kernel_mode("fp8")
    with pytest.raises(TypeError, match="weights: expected prepared MoE weights"):
        mode_of(ModelOptMoETensors(*[torch.zeros(1)] * 6))
    with pytest.raises(TypeError, match="weights: expected prepared MoE weights"):
        fused_moe_nvfp4(torch.zeros(1, H), ModelOptMoETensors(*[torch.zeros(1)] * 6), torch.ones(1, 1),
                        torch.zeros(1, 1, dtype=torch.int32))


@pytest.mark.parametrize("mode", MODE_NAMES)
def test_plugin_prepares_each_mode_from_the_checkpoint_tensors(monkeypatch, case, mode):
    """sglang_ext.act_quant.kernel_weights_for_mode (the plugin's load step, ModelOpt and MXFP4
    layers alike) runs the selected mode's preparation and no other."""
    from k3nvfp4.sglang_ext.act_quant import kernel_weights_for_mode

    mx, mo, *_ = case
    _forbid_all_but(monkeypatch, mode)
    if mode != "nvfp4":
        monkeypatch.setattr(fp4_weights, "cast_mxfp4_moe", _raise("the cast"))
    for tensors in (mo, mx):
        w = kernel_weights_for_mode(tensors, mode, "layer")
        assert mode_of(w) is MODES[mode]


def test_plugin_logs_the_e4m3_matrices_that_take_the_full_table(case, caplog):
    """The e4m3 load step names, per layer, each matrix whose blocks force the slower full E4M3
    table (one w2 block 12 binades below its row's largest), and logs nothing for normal ones."""
    import logging

    from k3nvfp4.sglang_ext.act_quant import kernel_weights_for_mode

    mx, *_ = case
    with caplog.at_level(logging.INFO, logger="k3nvfp4.sglang_ext.act_quant"):
        w = kernel_weights_for_mode(mx, "e4m3", "model.layers.3.mlp.experts")
    assert (w.w13_table, w.w2_table) == ("normal", "normal")
    assert "full E4M3 table" not in caplog.text
    e2 = mx.w2_e8m0.clone()
    row, top = e2[1, 5], int(e2[1, 5].max())
    row[1], row[0] = top, top - 12
    with caplog.at_level(logging.INFO, logger="k3nvfp4.sglang_ext.act_quant"):
        w = kernel_weights_for_mode(MXFP4MoETensors(mx.w13, mx.w13_e8m0, mx.w2, e2), "e4m3",
                                    "model.layers.4.mlp.experts")
    assert (w.w13_table, w.w2_table) == ("normal", "full")
    assert "'model.layers.4.mlp.experts': w2 take(s) the full E4M3 table" in caplog.text


def test_each_mode_names_the_cost_sections_its_config_reads():
    """A mode's cost_modes are the sections its config class's heuristic looks up, and each has
    measured rows in the generated table (a mode without them would plan on nothing)."""
    from k3nvfp4.kernels import cost_table
    from k3nvfp4.kernels.moe_details.layout import E5M3_16, E8M0_32

    measured = {mode for (_v, _arch, mode) in cost_table.COSTS}
    assert MODES["none"].cost_modes == tuple(MODES["none"].config_type.cost_mode(f) for f in (E5M3_16, E8M0_32))
    for name in ("nvfp4", "mxfp8"):
        assert MODES[name].cost_modes == (MODES[name].config_type.cost_mode(name),)
    assert MODES["e4m3"].cost_modes == tuple(MODES["e4m3"].config_type.cost_mode(b, t) for b in (16, 32)
                                             for t in ("full", "normal"))
    assert MODES["e4m3"].cost_modes == ("w4a8 e4m3/16", "w4a8 e4m3/16 normal", "w4a8 e4m3/32", "w4a8 e4m3/32 normal")
    for mode in MODES.values():
        assert set(mode.cost_modes) <= measured, (mode.name, mode.cost_modes)
