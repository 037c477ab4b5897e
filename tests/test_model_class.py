"""Both checkpoints through SGLang 0.5.23's own Kimi-K3 model class and loader path: the cast
(ModelOpt NVFP4) and the MXFP4 release itself (compressed-tensors, not cast).

What runs is the user-facing self-check, ``python -P -m k3nvfp4.sglang_ext.selfcheck --model
CKPT`` (k3nvfp4.sglang_ext.model_check), in fresh processes as a user would start it:
ModelConfig from the checkpoint's config.json with ``--moe-runner-backend triton_situ``, SGLang's
quant config (exclude globs rewritten by the model's name mapper), the EntryClass
``KimiK3ForConditionalGeneration``, SGLang's weight iterator into ``load_weights`` with every
weight loader instrumented, ``postprocess_weights``, and one MoE block's forward (Triton
interpreter) against the plain-torch dequantized reference with routed_scaling_factor 2.5.
The CPU obstacles it works around are named in k3nvfp4/sglang_ext/model_check/sglang_path.py
(CUDA streams created in the model's __init__, SGLang's argument resolution asking for an
accelerator, pynccl/custom all-reduce for several ranks).

The synthetic checkpoint is loaded whole: language model and vision tower + projector. Two
controls prove the check fails where it must, naming exactly the culprits: a copy of the cast with
one tensor renamed (SGLang's loader skips unknown names without a word), and SGLang itself
patched, in that process only, to load expert 3's gate weights into the up half and back (a
silent misread).

The release: SGLang picks ``Mxfp4MoEMethod`` for the routed experts, the plugin's hooks on it
(sglang_ext/hooks_mxfp4.py) keep the checkpoint's unpadded shapes, prepare the kernels' layout
with ``NVFP4MoEWeights.from_mxfp4`` and route ``apply`` to the runner. Checked: every tensor lands
with its exact bytes, the quant method of every linear, the block forward against the plain-torch
MXFP4 reference, and the equality with the NVFP4 path on the cast of the same checkpoint:
bit-identical kernel weights and bit-identical block output. Then the FP4 tensor-core modes
(K3NVFP4_ACT_QUANT) through the same class.

TP2 and EP2 of both checkpoints build on CPU (two processes over gloo) and are checked the same
way; on the release TP2 splits each expert's I through its 32-wide E8M0 scale blocks.

Three SGLang processes in all (about 14 CPU-s of imports each, plus the interpreter forwards):
the single-rank driver runs every one-rank check through the library API (run_checks), so it can
hold the patched control too; TP2 and EP2 of both checkpoints through the command line, one
launch of two rank processes."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from k3nvfp4.checkpoint.synthetic import write_synthetic_checkpoint

from model_check_helpers import MOE_LAYERS, RSF, SHAPE, cast_checkpoint, index_names, run_python, run_selfcheck

# The "broken" copy: one tensor under a name SGLang does not know.
RENAMED = "language_model.model.layers.2.self_attn.o_proj.weight"
RENAMED_TO = "language_model.model.layers.2.self_attn.o_prj.weight"
SWAPPED_EXPERT = 3  # the misread control: SGLang loads this expert's w1 as w3 and w3 as w1


def _corrupt(good: Path, out: Path) -> Path:
    """Copy of ``good`` with RENAMED stored as RENAMED_TO."""
    shutil.copytree(good, out)
    index_path = out / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = index["weight_map"].pop(RENAMED)
    tensors = load_file(str(out / shard))
    tensors[RENAMED_TO] = tensors.pop(RENAMED)
    save_file(tensors, str(out / shard), metadata={"format": "pt"})
    index["weight_map"][RENAMED_TO] = shard
    index_path.write_text(json.dumps(index, indent=2))
    return out


# The single-rank driver (one process: SGLang's import is ~14 CPU-s): the cast, the broken copy,
# the --trim-a-log cast built with its first 2 layers only; the release (factor 2.5, then the
# checkpoint's 1.0) and the cast at 1.0; the FP4 tensor-core modes (MODE_RUNS: the plugin reads
# K3NVFP4_ACT_QUANT when it prepares a layer's weights, so one process checks each mode in turn, a
# marker line on stderr opening each mode's log; the load line that names the mode is logged once
# per process: re-armed as in a fresh process); last, the cast again with SGLang's expert name
# mapping patched to swap SWAPPED_EXPERT's gate and up (the patch stays for the rest of the process).
_DRIVER = """
import json, os, sys
from pathlib import Path
from k3nvfp4.sglang_ext.model_check.run import CheckOptions, run_checks
padded, broken, trimmed, mx = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4])
out, swapped = Path(sys.argv[5]), int(sys.argv[6])
runs = run_checks([CheckOptions(padded), CheckOptions(broken), CheckOptions(trimmed, num_layers=2),
                   CheckOptions(mx), CheckOptions(mx, routed_scaling_factor=None),
                   CheckOptions(padded, routed_scaling_factor=None)])
from k3nvfp4.sglang_ext import backend_triton
for mode, ckpt in MODE_RUNS:
    os.environ["K3NVFP4_ACT_QUANT"] = mode
    backend_triton._logged_active = False
    print(f"{MODE_MARK}{mode}", file=sys.stderr, flush=True)
    runs += run_checks([CheckOptions(mx if ckpt == "mxfp4" else padded, num_layers=2)])
    del os.environ["K3NVFP4_ACT_QUANT"]
print(MODE_MARK + "end", file=sys.stderr, flush=True)
from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
mapping = FusedMoE.make_expert_params_mapping
swap = {"w1": "w3", "w3": "w1"}
FusedMoE.make_expert_params_mapping = lambda *a, **k: [
    (p, w, e, swap.get(s, s) if e == swapped else s) for p, w, e, s in mapping(*a, **k)]
runs += run_checks([CheckOptions(padded)])
out.write_text(json.dumps(runs))
"""
# (K3NVFP4_ACT_QUANT, checkpoint) of test_fp4_tensor_core_modes_through_the_model_class
MODE_RUNS = (("mxfp8", "mxfp4"), ("nvfp4", "cast"))
MODE_MARK = "### k3nvfp4 test: act_quant "


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("k3model")
    src = write_synthetic_checkpoint(root / "mxfp4", **SHAPE)
    padded = cast_checkpoint(src, root / "nvfp4")
    trimmed = cast_checkpoint(src, root / "nvfp4-trimmed", "--trim-a-log")
    return {"mxfp4": src, "padded": padded, "trimmed": trimmed, "broken": _corrupt(padded, root / "nvfp4-broken")}


@pytest.fixture(scope="module")
def single(ckpts, tmp_path_factory) -> dict:
    """One process, one rank: every one-rank check of both checkpoints (_DRIVER), each mode's log
    part split by its marker line."""
    tmp = tmp_path_factory.mktemp("single")
    out = tmp / "single.json"
    driver = f"MODE_RUNS = {MODE_RUNS!r}\nMODE_MARK = {MODE_MARK!r}\n" + _DRIVER
    proc = run_python(tmp, ["-c", driver, str(ckpts["padded"]), str(ckpts["broken"]), str(ckpts["trimmed"]),
                            str(ckpts["mxfp4"]), str(out), str(SWAPPED_EXPERT)])
    assert proc.returncode == 0, (proc.stdout[-6000:], proc.stderr[-6000:])
    good, broken, trimmed, mx, mx_rsf1, cast_rsf1, *mode_runs, misread = json.loads(out.read_text())
    logs = proc.stderr.split(MODE_MARK)[1:]  # "<mode>\n<its log>" per mode, then "end"
    assert [x.split("\n", 1)[0] for x in logs] == [m for m, _ in MODE_RUNS] + ["end"], proc.stderr[-6000:]
    modes = {m: (run, log) for (m, _), run, log in zip(MODE_RUNS, mode_runs, logs)}
    return {"good": good, "good_rank": good["ranks"][0], "broken": broken, "trimmed": trimmed, "misread": misread,
            "mx": mx, "r": mx["ranks"][0], "mx_rsf1": mx_rsf1, "cast_rsf1": cast_rsf1, "modes": modes}


@pytest.fixture(scope="module")
def trimmed_truncated(single) -> dict:
    """The --trim-a-log cast, built with only its first 2 layers (SGLang's num_hidden_layers override)."""
    return single["trimmed"]


@pytest.fixture(scope="module")
def parallel(ckpts, tmp_path_factory) -> dict:
    """TP2 then EP2 (TP2 x EP2) of the cast, then of the release, in one launch of two rank
    processes over gloo (the command line's --model repeated)."""
    tmp = tmp_path_factory.mktemp("parallel")
    tp, ep, mx_tp, mx_ep = run_selfcheck(tmp, "parallel", "--model", str(ckpts["padded"]), "--model",
                                         str(ckpts["mxfp4"]), "--parallel", "2x1,2x2")["runs"]
    return {"tp": tp, "ep": ep, "mx_tp": mx_tp, "mx_ep": mx_ep}


# --- one rank ------------------------------------------------------------------------------


def test_sglang_path_and_model_class(single):
    r = single["good_rank"]
    assert single["good"]["ok"], single["good"]["problems"]
    assert r["model_class"] == "KimiK3ForConditionalGeneration"  # the EntryClass the architectures select
    assert r["model_loader"] == "ModelOptModelLoader"  # DefaultModelLoader's load path for pre-quantized ModelOpt
    assert r["quant_config"] == "ModelOptFp4Config" and r["moe_runner_backend"] == "triton_situ"
    assert r["overrides"] == {"routed_scaling_factor": RSF} and r["num_hidden_layers"] == 4


def test_every_tensor_lands_vision_included(single, ckpts):
    r = single["good_rank"]
    names = index_names(ckpts["padded"])
    t = r["tensors"]
    assert t["skipped"] == [] and t["not_produced_by_iterator"] == []
    assert t["checkpoint"] == t["produced_by_iterator"] == t["landed"] == len(names)
    assert t["landed_names"] == names
    vision = [n for n in names if n.startswith(("vision_tower.", "mm_projector."))]
    assert len(vision) == 2 + 6 * 2 + 1 + 3  # patch embed + pos emb, 2 blocks x 6, final norm, projector
    assert "vision_tower.patch_embed.proj.weight" in vision and "vision_tower.encoder.blocks.1.wqkv.weight" in vision
    # SGLang copies MLA's q_a / kv_a straight into fused_qkv_a_proj_with_mqa (no weight_loader).
    assert t["landed_without_weight_loader"] == [f"language_model.model.layers.3.self_attn.{p}.weight"
                                                 for p in ("kv_a_proj_with_mqa", "q_a_proj")]  # fmt: skip


def test_every_parameter_holds_the_checkpoint_bytes(single):
    p = single["good_rank"]["params"]
    assert p["mismatches"] == 0 and p["unplanned"] == []
    assert p["expert_checks"] == len(MOE_LAYERS) * SHAPE["num_experts"]
    # Parameters the W4A16 checkpoint leaves at SGLang's initial values: MoE input scales and the
    # MLA KV-cache scales, nothing else.
    expected_defaults = {f"language_model.model.layers.{n}.mlp.experts.w{k}_input_scale" for n in MOE_LAYERS for k in (13, 2)}
    expected_defaults |= {f"language_model.model.layers.3.self_attn.attn_{a}.{s}_scale" for a in ("mqa", "mha") for s in "kv"}
    assert set(p["defaults"]) == expected_defaults
    for info in single["good_rank"]["moe_layers"].values():
        assert info["kernel_weights"] and info["modelopt_params_freed"] and info["runner_backend"] == "triton_situ"


def test_quant_methods_and_exclude_control(single):
    q = single["good_rank"]["quant"]
    by_role = q["by_role"]
    assert by_role["routed experts"] == {"ModelOptNvFp4FusedMoEMethod": len(MOE_LAYERS)}
    for role in ("attention", "shared experts", "dense MLP", "latent projections", "lm_head"):
        assert set(by_role[role]) == {"UnquantizedLinearMethod"}, role
    assert by_role["embedding"] == {"UnquantizedEmbeddingMethod": 1}
    assert by_role["vision"] == {"none (torch.nn.Linear)": 10}  # plain nn.Linear, outside any quant config
    assert not any(e["quantized"] for e in q["entries"] if e["role"] != "routed experts")
    # Control: with exclude_modules emptied, every linear the model class asked the quant config
    # about would be quantized; the globs are what keeps them BF16.
    ctl = q["control_by_role"]
    for role in ("attention", "shared experts", "dense MLP", "lm_head"):
        assert ctl[role]["asked"] > 0 and ctl[role]["quantized_without_excludes"] == ctl[role]["asked"], role
    assert ctl["shared experts"]["asked"] == ctl["shared experts"]["linears"] == 2 * len(MOE_LAYERS)
    # What no glob can change: built without a quant config by the model class.
    kda_layers = (0, 1, 2)
    expected_not_asked = {f"language_model.model.layers.{n}.self_attn.qkv_conv1d" for n in kda_layers}
    expected_not_asked |= {f"language_model.model.layers.{n}.mlp.routed_expert_{d}_proj" for n in MOE_LAYERS for d in ("down", "up")}
    expected_not_asked |= {"language_model.model.embed_tokens"}
    assert {n for n in q["not_asked"] if not n.startswith(("vision_tower", "mm_projector"))} == expected_not_asked
    assert ctl["attention"]["asked"] == ctl["attention"]["linears"] - len(kda_layers)
    kv = single["good_rank"]["kv_cache"]
    assert [(k["k_scale"], k["v_scale"]) for k in kv] == [(1.0, 1.0)] * 2  # MLA layer 3: mqa and mha


def test_moe_block_forward_matches_reference(single):
    f = single["good_rank"]["forward"]
    assert f["prefix"] == "language_model.model.layers.1.mlp" and f["dtype"] == "bfloat16"
    assert f["routed_scaling_factor"] == RSF
    # bf16 block through the interpreter vs the fp32 reference: measured 6.1e-3.
    assert f["err"] <= 1.5e-2 and f["max_err"] <= 3e-2, f
    # The same reference with the factor applied 0 or 2 times is far off: applied exactly once.
    assert f["err_scaling_applied_0x"] > 0.3 and f["err_scaling_applied_2x"] > 0.3, f
    assert f["routing_exact_tokens"] == f["tokens"] == 8 and f["routing_bad_tokens"] == 0
    assert abs(f["weights_mean_sum"] - RSF) < 1e-2 and f["weights_max_rel_err"] < 1e-2  # in TopK's weights
    # Realistic magnitudes: RMS-1 hidden states give an O(1) block output, both parts contributing.
    assert 0.3 < f["out_rms"] < 3 and f["routed_rms"] > 0.2 and f["shared_rms"] > 0.2, f


def test_a_log_padded_form(single):
    forms = single["good_rank"]["a_log"]
    assert [a["form"] for a in forms] == ["padded"] * 3 and all(a["padding_zero"] for a in forms)
    assert all(a["stored"] == 8 and a["num_heads"] == 6 for a in forms)


def test_a_log_trimmed_form_and_truncated_model(trimmed_truncated, ckpts):
    run = trimmed_truncated
    assert run["ok"], run["problems"]
    (r,) = run["ranks"]
    assert [(a["form"], a["stored"]) for a in r["a_log"]] == [("trimmed", 6)] * 3
    assert r["num_hidden_layers"] == 2 and r["overrides"]["num_hidden_layers"] == 2
    names = index_names(ckpts["trimmed"])
    beyond = [n for n in names if (m := re.search(r"\.layers\.(\d+)\.", n)) and int(m.group(1)) >= 2]
    t = r["tensors"]
    assert t["beyond_truncated_model"] == len(beyond) > 0 and t["skipped"] == []
    assert t["landed_names"] == sorted(set(names) - set(beyond))
    assert {f"language_model.model.layers.{n}.self_attn.A_log" for n in (0, 1)} <= set(t["landed_names"])
    assert t["shards_read"] <= t["shards"] == SHAPE["num_shards"]
    assert r["forward"]["err"] <= 1.5e-2


def test_skipped_tensor_is_caught(single):
    broken = single["broken"]
    assert not broken["ok"]
    (r,) = broken["ranks"]
    assert r["tensors"]["skipped"] == [RENAMED_TO]  # SGLang skipped it without a word
    assert r["params"]["unplanned"] == [RENAMED]  # its parameter kept SGLang's initial memory
    assert r["params"]["mismatches"] == 0
    # Only the culprits are named: skipped, landed on no rank, and the parameter it should fill.
    probs = broken["problems"]
    assert len(probs) == 3 and sum(RENAMED_TO in p for p in probs) == 2 and sum(RENAMED in p for p in probs) == 1, probs


def test_misread_expert_is_caught(single):
    misread = single["misread"]
    assert not misread["ok"]
    (r,) = misread["ranks"]
    e = SWAPPED_EXPERT
    bad = r["params"]["mismatch_details"]
    assert [b["param"] for b in bad] == [f"language_model.model.layers.{n}.mlp.experts[expert {e} -> local {e}]"
                                         for n in MOE_LAYERS]  # fmt: skip
    for b in bad:  # gate and up rows swapped: w13 bytes and block scales differ, w2 and scale_2 do not
        assert "w13_weight:" in b["problem"] and "w13_weight_scale:" in b["problem"]
        assert "w2_weight" not in b["problem"] and "scale_2" not in b["problem"]
    assert r["tensors"]["skipped"] == [] and r["params"]["unplanned"] == []
    # Tokens routed to expert 3 in layer 1 see swapped gate and up: the forward fails too.
    f = r["forward"]
    assert f["err"] > f["tolerance"] and any("forward" in p for p in misread["problems"]), f


# --- the MXFP4 release, one rank -------------------------------------------------------------


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


# --- two ranks ------------------------------------------------------------------------------


@pytest.mark.parametrize("ckpt", ["padded", "mxfp4"])
def test_tp2_and_ep2(parallel, ckpts, ckpt):
    """The cast and the release under TP2 (each expert's I split; the release through its 32-wide
    E8M0 scale blocks) and EP2 (whole experts per rank)."""
    names = set(index_names(ckpts[ckpt]))
    E, I = SHAPE["num_experts"], SHAPE["intermediate_size"]
    # the checkpoint's tensors per expert (cast: w1 / w2 / w3 x weight, weight_scale, weight_scale_2)
    per_expert = sum(".layers.1.block_sparse_moe.experts.0." in n for n in names)
    assert per_expert == (9 if ckpt == "padded" else 6)
    prefix = "" if ckpt == "padded" else "mx_"
    for mode, per_rank in (("tp", dict(local_experts=E, intermediate_per_rank=I // 2, moe_tp_size=2, moe_ep_size=1)),
                           ("ep", dict(local_experts=E // 2, intermediate_per_rank=I, moe_tp_size=1, moe_ep_size=2))):
        run = parallel[prefix + mode]
        assert run["ok"], (ckpt, mode, run["problems"])
        assert run["checkpoint"] == str(ckpts[ckpt])
        assert (run["tp_size"], run["ep_size"]) == ((2, 1) if mode == "tp" else (2, 2))
        ranks = run["ranks"]
        assert [r["rank"] for r in ranks] == [0, 1]
        for r in ranks:
            assert r["expert_format"] == ("ModelOpt NVFP4" if ckpt == "padded" else "compressed-tensors MXFP4")
            for info in r["moe_layers"].values():
                assert {k: info[k] for k in per_rank} == per_rank, (ckpt, mode, info)
            assert r["params"]["mismatches"] == 0 and r["tensors"]["skipped"] == []
            assert r["params"]["expert_checks"] == len(MOE_LAYERS) * per_rank["local_experts"]
            assert r["forward"]["err"] <= 1.5e-2 and r["forward"]["err_scaling_applied_0x"] > 0.3
        if mode == "ep":
            # Each rank holds its contiguous half of the experts; together every tensor landed.
            assert {r["moe_layers"]["language_model.model.layers.1.mlp.experts"]["moe_ep_rank"] for r in ranks} == {0, 1}
            for r in ranks:
                assert r["tensors"]["experts_of_other_ranks"] == len(MOE_LAYERS) * (E // 2) * per_expert
        assert set().union(*(r["tensors"]["landed_names"] for r in ranks)) == names
        # SGLang's all-reduce gives both ranks the same block output.
        assert ranks[0]["forward"]["out_sha256"] == ranks[1]["forward"]["out_sha256"]


# --- argument errors (no SGLang import needed) -----------------------------------------------


def test_cli_rejects_bad_arguments(tmp_path, capsys):
    from k3nvfp4.sglang_ext import selfcheck

    with pytest.raises(SystemExit) as e:
        selfcheck.main(["--model", str(tmp_path / "missing")])
    assert e.value.code == 2 and "no config.json" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(SystemExit, match="tp must be a positive multiple of ep"):
        selfcheck.main(["--model", str(tmp_path), "--parallel", "2x3"])


def test_reference_dequant_matches_the_formats_codec():
    """The self-check's hand-written NVFP4 decoder agrees with the package's codec."""
    from k3nvfp4.kernels import formats
    from k3nvfp4.sglang_ext.model_check.reference import dequant_nvfp4

    g = torch.Generator().manual_seed(3)
    packed = torch.randint(0, 256, (8, 32), dtype=torch.uint8, generator=g)
    scale = torch.randint(0, 0x7F, (8, 4), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
    s2 = torch.tensor(2.0**-7)
    assert torch.equal(dequant_nvfp4(packed, scale, s2), formats.dequantize_nvfp4(packed, scale, s2).float())
