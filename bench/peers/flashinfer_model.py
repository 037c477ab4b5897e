"""FlashInfer 0.7.2's SM90 CUTLASS MoE from MXFP4 weights under the project's static performance
model: the W4A16 path (x bf16, :func:`flashinfer_call`) and the W4A8 one (x FP8,
``use_wfp4afp8_humming``, :func:`flashinfer_w4a8_call`).

One ``cutlass_fused_moe(..., use_w4_group_scaling=True)`` call is 11 launches (flashinfer_sass:
3 sort kernels, permute, strides, a work-tile map and the grouped GEMM per GEMM, the activation,
finalize). Each grouped GEMM runs, in the model, the fastest of the measured tiles, its
autotuner's whole 1x1x1-cluster list (flashinfer_sass.TILES: 64 weight rows x 16, 32, 64 or 128
tokens x K 128, 256 or 512, the untuned default the first, 64x16x128; and COOPERATIVE_TILES, 128
and 256 rows): what an autotuner that profiles every candidate finds at best, in the peer's
favour.
An expert with X local pairs is ceil(rows / tile rows) x ceil(X / tokens) tiles of K / tile K loop
passes, on a persistent grid (one ~205 KiB CTA per SM). Bytes: nibbles + one E8M0 per 32 (0.53125
per weight). The nine small kernels are charged a launch, an HBM latency and their bytes.

The cooperative tiles (flashinfer_sass.COOPERATIVE_TILES: 128 x 64 to 256 x 256 rows x tokens,
both consumer warpgroups on one tile) are counted the same way, one program per tile. Not
modelled: the pingpong overlap of two consumer warpgroups (counted as one program per tile), the
spills' local-memory traffic (their instructions are in the loop's count), the first and last K
tile outside the SASS loop.

The W4A8 path runs the same 11 launches (runMoe takes the same branches): the permute also
quantizes each expanded row to E4M3 with one fp32 scale per row, the activation writes the
intermediate in E4M3 the same way, and both grouped GEMMs run FP8 wgmma
(``QGMMA...E4M3.E4M3``) at the device's dense FP8 rate. Its tactic is taken per GEMM as the
fastest the model predicts among the measured kernels the binding admits for that GEMM's K
(flashinfer_sass.W4A8_VARIANTS: the W4A16 peer's 28 tiles, pingpong and cooperative, whose
cooperative CTA runs one tile with both consumer warpgroups, and Humming's two single-warpgroup
kernels): what an autotuner that profiles every candidate would find at best, so the comparison
favours the peer. Not measured: the 2x1, 1x2 and 2x2 clusters, Humming's other single-warpgroup
tiles.
"""

from __future__ import annotations

from typing import Any

from k3nvfp4.kernels import perf_model as pm
from peers.flashinfer_sass import is_single_warpgroup


# Bytes per activation element entering a grouped GEMM: bf16 (W4A16) or E4M3 (W4A8; its one fp32
# scale per row is left out, 4 B per row of thousands).
_ACT_BYTES = {"bf16": 2, "e4m3": 1}


def _gemm(device: pm.Device, statics: dict[str, Any], shard: pm.Shard, gemm: str, M: int,
          routing: pm.RoutingEstimate, a: pm.Assumptions, act: str = "bf16") -> pm.KernelPrediction:
    H, I = shard.hidden, shard.intermediate
    tile = statics["tile"]
    rows, K = (2 * I, H) if gemm == "gemm1" else (H, I)
    row_tiles = -(-rows // tile["M"])
    passes = -(-K // tile["K"])
    tiles = row_tiles * routing.blocks  # routing at block_m = tile N (tokens)
    warps = statics["num_warps"]
    if statics.get("shared_bytes") is None:
        raise RuntimeError(f"tile {tile}: its shared memory is unknown ({statics.get('shared_bytes_note', 'no probe')})")
    # All loop warps' instructions of one pass (4 consumer + 1 producer), spread over the CTA's
    # warps so that LoopCost's instructions x warps is the pass's total.
    per_pass = statics["warp_instr_per_weight"] * statics["weights_per_iteration"]
    cost = pm.LoopCost(per_pass / warps, warps, statics["registers"], statics["shared_bytes"], statics["local_bytes"])
    bpw = statics["bytes_per_weight"]
    useful = routing.active_experts * rows * K
    tokens = routing.local_pairs
    x = _ACT_BYTES[act]
    # GEMM1: the (expanded) tokens in, its bf16 gate/up rows out; GEMM2: the intermediate in, bf16 rows out.
    other = (M * H * x + tokens * 2 * I * 2) if gemm == "gemm1" else (tokens * I * x + tokens * H * 2)
    stores = tokens * 2 * I * 2 if gemm == "gemm1" else tokens * H * 2
    return pm.predict_kernel(
        device, name=f"flashinfer {gemm}", config=f"{tile['M']}x{tile['N']}x{tile['K']} {tile['schedule']}"
        + (f" {statics['kernel_type']}" if is_single_warpgroup(statics.get("kernel_type", "warp_specialized")) else ""),
        cost=cost, programs_launched=device.sms, programs_active=tiles, iterations_per_program=passes,
        iterations_total=tiles * passes, weights_per_iteration=tile["M"] * tile["K"], useful_weights=useful,
        useful_passes=routing.blocks * rows * K, weight_bytes=useful * bpw, other_bytes=other, store_bytes=stores,
        stage_bytes=tile["M"] * tile["K"] * bpw, stages=tile["stages"],
        mma_flops=2.0 * tiles * passes * tile["M"] * tile["K"] * tile["N"], assumptions=a,
        mma_peak_flops=device.mma_fp8_flops if act == "e4m3" else None,
    )


def _require_multiples_of_128(shard: pm.Shard) -> None:
    if shard.hidden % 128 or shard.intermediate % 128:
        raise RuntimeError(f"needs H % 128 == 0 and I % 128 == 0 (isProfileShapeSupported); "
                           f"this shard has H = {shard.hidden}, I = {shard.intermediate}")


def flashinfer_call(device: pm.Device, statics: list[dict[str, Any]], shard: pm.Shard, M: int,
                    a: pm.Assumptions = pm.DEFAULT_ASSUMPTIONS) -> pm.CallPrediction:
    """One cutlass_fused_moe call under the model (statics: flashinfer_sass.flashinfer_rows()),
    each GEMM at the fastest measured tile (:func:`_fastest`). Raises RuntimeError where FlashInfer
    cannot run the shard (H and I must be multiples of 128)."""
    _require_multiples_of_128(shard)
    kernels, notes = zip(*(_fastest(device, statics, shard, g, M, a, "bf16") for g in ("gemm1", "gemm2")))
    routing = pm.expected_routing(shard, M, statics[0]["tile"]["N"])
    launches = statics[0]["launches_per_call"] - 2
    pairs = routing.local_pairs
    small_bytes = (2 * pairs * shard.hidden * 2  # permute: rows gathered in, expanded out
                   + pairs * 2 * shard.intermediate * 2 + pairs * shard.intermediate * 2  # activation
                   + pairs * shard.hidden * 2 + M * shard.hidden * 2)  # finalize
    fixed = launches * (a.launch_s + a.hbm_latency_s) + small_bytes / device.hbm_copy_bytes_per_s
    return pm.CallPrediction("flashinfer", device.name, shard.name, M, list(kernels), routing, fixed, launches,
                             notes=list(notes))


def _fastest(device: pm.Device, statics: list[dict[str, Any]], shard: pm.Shard, gemm: str, M: int,
             a: pm.Assumptions, act: str) -> tuple[pm.KernelPrediction, str]:
    """GEMM1 or GEMM2 at the fastest launchable measured kernel the binding admits for it
    (:func:`admits`; the token routing at each kernel's token tile), and a note naming it."""
    options = [_gemm(device, st, shard, gemm, M, pm.expected_routing(shard, M, st["tile"]["N"]), a, act=act)
               for st in statics if admits(st, gemm, shard)]
    launchable = [k for k in options if k.launchable]
    if not launchable:
        raise RuntimeError(f"no measured kernel is admitted for {gemm} (K = "
                           f"{shard.hidden if gemm == 'gemm1' else shard.intermediate})")
    best = min(launchable, key=lambda k: k.time_s)
    return best, f"{gemm}: {best.config} (fastest of {len(launchable)} admitted)"


def admits(statics: dict[str, Any], gemm: str, shard: pm.Shard) -> bool:
    """Whether the binding runs this measured kernel for GEMM1 / GEMM2 of the shard: its K tile
    divides the GEMM's K (isProfileShapeSupported) and, for Humming's single-warpgroup kernels,
    K lies in the kernel's range (PREFILL K <= 384, ROLLING above)."""
    K = shard.hidden if gemm == "gemm1" else shard.intermediate
    rows = 2 * shard.intermediate if gemm == "gemm1" else shard.hidden
    lo, hi = statics.get("min_k"), statics.get("max_k")
    return (K % statics["tile"]["K"] == 0 and rows % statics["tile"]["M"] == 0
            and (lo is None or K >= lo) and (hi is None or K <= hi))


def flashinfer_w4a8_call(device: pm.Device, statics: list[dict[str, Any]], shard: pm.Shard, M: int,
                         a: pm.Assumptions = pm.DEFAULT_ASSUMPTIONS) -> pm.CallPrediction:
    """One ``cutlass_fused_moe(..., use_wfp4afp8_humming=True)`` call under the model (statics:
    flashinfer_sass.flashinfer_w4a8_rows()): each GEMM at the fastest admitted measured kernel
    (:func:`admits`), FP8 MMA, E4M3 activations; the permute and the activation write E4M3. Raises
    RuntimeError where FlashInfer cannot run the shard (H and I must be multiples of 128) or no
    measured kernel is admitted."""
    _require_multiples_of_128(shard)
    kernels, notes = zip(*(_fastest(device, statics, shard, g, M, a, "e4m3") for g in ("gemm1", "gemm2")))
    routing = pm.expected_routing(shard, M, 16)
    launches = statics[0]["launches_per_call"] - 2
    pairs = routing.local_pairs
    H, I = shard.hidden, shard.intermediate
    small_bytes = (pairs * H * (2 + 1)  # permute: bf16 rows gathered in, E4M3 rows out
                   + pairs * 2 * I * 2 + pairs * I * 1  # activation: bf16 in, E4M3 out
                   + pairs * H * 2 + M * H * 2)  # finalize
    fixed = launches * (a.launch_s + a.hbm_latency_s) + small_bytes / device.hbm_copy_bytes_per_s
    return pm.CallPrediction("flashinfer w4a8", device.name, shard.name, M, list(kernels), routing, fixed,
                             launches, notes=list(notes))
