"""The Hopper W4A8 mode ("e4m3", kernels/moe_w4a8.py) against the independent float64 oracle
(tests/w4a8_oracle.py: numpy + ml_dtypes, no k3nvfp4 code), in the interpreter or on a GPU.

The chain of derived bounds, each stage checked on what the kernels stored:
1. the tokens' E4M3 bytes and fp32 scales per 128 columns equal the oracle's bit for bit (same
   IEEE fp32 divisions, RNE);
2. the intermediate: the oracle's float64 GEMM1 of (1) and the oracle's weights, float64 SiTU, cast
   to fp32 and quantized per 128 columns; the kernel's fp32 GEMM1 and SiTU differ from it by a few
   fp32 ulps, so each group scale agrees within 2^-18 relative, and an element may differ only
   where that moved it across an E4M3 rounding boundary: by at most one E4M3 step (2^-3 of its
   binade, or 2^-9 x scale below the normals), and rarely (asserted: at most 1 % of elements);
3. GEMM2 + the top-k sum: the oracle's float64 GEMM2 of the KERNEL's intermediate, x routing
   weights, summed, x routed scale: within the fp32 summation bound (n + 16) x 2^-24 x the sum of
   |terms| (n = I products per output, every E4M3 x E4M3 product exact in fp32);
4. end to end against the whole oracle (expert_w4a8 per slot, combined): (3)'s bound plus the
   float64 GEMM2 of |kernel intermediate - oracle intermediate| (bounded by (2)).
Cases: out-of-window weight blocks (re-encoded, counted, warned), outlier and zero weight rows,
tokens over 12 binades with an outlier column and a zero row, a SiTU-saturating token (the
intermediate's scales stay below the SiTU bound / 448), dropped slots, split-K and both top-k sums.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import w4a8_oracle as orc
from k3nvfp4.kernels import fused_moe_nvfp4
from k3nvfp4.kernels.activation import K3_SITU
from k3nvfp4.kernels.moe_details.weights import MXFP4MoETensors
from k3nvfp4.kernels.moe_fp4_details.weights import cast_mxfp4_moe
from k3nvfp4.kernels.moe_w4a8 import W4A8Config, W4A8MoEWeights, run_w4a8
from k3nvfp4.kernels.moe_w4a8_reference import fused_moe_w4a8_reference

DEV = "cuda" if torch.cuda.is_available() else "cpu"
E, H, I, M, K = 3, 192, 192, 6, 3  # H, I = 128 + 64: each row's last scale group is 64 wide
BETA, LB = 4.0, 25.0
U = 2.0**-24


def _mxfp4_layer(seed: int, deep_blocks: bool) -> MXFP4MoETensors:
    """Random MXFP4 experts: exponents around 2^-6 (outputs O(1)), one outlier row per matrix (x2^10),
    one all-zero row per matrix, and (deep_blocks) 5 % of blocks 5..35 binades below their row's
    largest: inside the 14-binade window at offsets -6..-8 (E4M3 subnormals, so both matrices take
    the full E4M3 table), and below it (re-encoded: to nonzero codes from 15..17 binades below, to
    zeros further down)."""
    g = np.random.default_rng(seed)
    out = []
    for n, k in ((2 * I, H), (H, I)):
        packed = g.integers(0, 256, (E, n, k // 2), dtype=np.uint8)
        e8 = g.integers(118, 124, (E, n, k // 32)).astype(np.int64)
        if deep_blocks:
            e8 = np.where(g.random(e8.shape) < 0.05, 118 - g.integers(0, 31, e8.shape), e8)
        e8[:, 5] += 10  # an outlier row
        packed[:, 7] = 0x80  # a zero row (signed zeros)
        out += [torch.from_numpy(packed), torch.from_numpy(e8.astype(np.uint8))]
    return MXFP4MoETensors(out[0], out[1], out[2], out[3])


def _tokens(seed: int) -> torch.Tensor:
    """fp32 [M, H]: Student-t-ish rows with RMS over 2^[-6, 6], an outlier column (x100), a zero row
    and one token large enough to saturate SiTU."""
    g = np.random.default_rng(seed)
    x = g.standard_t(5, (M, H)) * np.ldexp(1.0, g.integers(-6, 7, (M, 1)))
    x[:, 17] *= 100.0
    x[2] = 0.0
    x[4] *= 2.0**12 / np.abs(x[4]).max()
    return torch.from_numpy(x.astype(np.float32))


def _routing(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = np.random.default_rng(seed)
    ids = np.stack([g.permutation(E)[:K] for _ in range(M)]).astype(np.int32)
    ids[1, 2] = -1  # a dropped slot (expert on another rank)
    tw = g.random((M, K)).astype(np.float32) + 0.1
    return torch.from_numpy(tw), torch.from_numpy(ids)


def _oracle_weights(mx: MXFP4MoETensors) -> tuple[list, list]:
    w13 = [orc.w4a8_from_mxfp4(mx.w13[e].numpy(), mx.w13_e8m0[e].numpy()) for e in range(E)]
    w2 = [orc.w4a8_from_mxfp4(mx.w2[e].numpy(), mx.w2_e8m0[e].numpy()) for e in range(E)]
    return w13, w2


def _e4m3_step(v: np.ndarray) -> np.ndarray:
    """One E4M3 step at |v| (in the scaled domain): 2^(e - 3) for |v| in [2^e, 2^(e+1)), 2^-9 below 2^-6."""
    a = np.abs(v)
    _, e = np.frexp(np.where(a > 0, a, 1.0))
    return np.where(a >= 2.0**-6, np.ldexp(1.0, e - 4), 2.0**-9)


@pytest.fixture(scope="module")
def layer():
    mx = _mxfp4_layer(7, deep_blocks=True)
    with pytest.warns(UserWarning, match=r"E2M1 blocks lie more than 14 binades below"):
        w = W4A8MoEWeights.from_mxfp4(*mx)
    return mx, w, _oracle_weights(mx)


def _check_against_oracle(run, x, tw, ids, w13o, w2o, scale: float, out_eps: float) -> None:
    out = run.out.float().cpu().numpy().astype(np.float64)
    xf = x.float().numpy()
    # 1. the tokens, bit for bit
    xo = orc.quantize_e4m3_groups(xf, 128, "fp32")
    assert np.array_equal(run.act_q.cpu().view(torch.uint8).numpy(), xo.bits)
    assert np.array_equal(run.act_scales.cpu().numpy(), xo.scales)
    xd = xo.dequantize()
    # 2. the intermediate, row by row in the kernel's sorted order
    sorted_ids = run.routing.sorted_pair_ids.cpu().numpy()
    num_padded = int(run.routing.num_padded.cpu())
    bm = run.config.block_m
    block_expert = run.routing.block_expert_ids.cpu().numpy()
    iq = orc.e4m3_values(run.inter_q.cpu().view(torch.uint8).numpy())
    isc = run.inter_scales.cpu().numpy().astype(np.float64)
    inter_k = iq * np.repeat(isc, 128, axis=1)[:, :I]
    y_ref = np.zeros((M, H))  # oracle GEMM2 of the kernel's intermediate
    y_abs = np.zeros((M, H))
    y_orc = np.zeros((M, H))  # the whole oracle
    y_gap = np.zeros((M, H))  # GEMM2 of |kernel intermediate - oracle intermediate|
    seen, flips, elems = set(), 0, 0
    for row in range(num_padded):
        pair = int(sorted_ids[row])
        if pair >= M * K:
            continue
        t, j = divmod(pair, K)
        e = int(block_expert[row // bm])
        assert int(ids[t, j]) == e
        seen.add(pair)
        h = xd[t:t + 1] @ w13o[e].dequantize().T
        a = orc.situ(h[:, :I], h[:, I:], BETA, LB).astype(np.float32)
        ao = orc.quantize_e4m3_groups(a, 128, "fp32")
        assert np.allclose(isc[row], ao.scales[0], rtol=2.0**-18, atol=0), (row, isc[row], ao.scales[0])
        # the SiTU bound holds every group's amax (an all-zero group has scale 1)
        zero_group = np.abs(np.pad(a[0], (0, 64))).reshape(-1, 128).max(axis=1) == 0
        assert ((isc[row] <= orc.situ_bound(BETA, LB) / 448) | (zero_group & (isc[row] == 1))).all()
        inter_o = ao.dequantize()[0]
        diff = np.abs(inter_k[row] - inter_o)
        step = _e4m3_step(ao.dequantize()[0] / np.repeat(ao.scales[0], 128)[:I]) * np.repeat(ao.scales[0], 128)[:I]
        assert (diff <= step * (1 + 2.0**-17) + 2.0**-17 * np.abs(inter_o)).all(), row
        flips += int((diff > 2.0**-17 * np.abs(inter_o)).sum())
        elems += I
        w2d = w2o[e].dequantize()
        y_ref[t] += tw[t, j] * (inter_k[row] @ w2d.T)
        y_abs[t] += tw[t, j] * (np.abs(inter_k[row]) @ np.abs(w2d).T)
        y_orc[t] += tw[t, j] * (inter_o @ w2d.T)
        y_gap[t] += tw[t, j] * (diff @ np.abs(w2d).T)
    assert seen == {t * K + j for t in range(M) for j in range(K) if 0 <= ids[t, j] < E}
    assert flips <= 0.01 * elems, (flips, elems)
    # 3. GEMM2 + top-k sum on the kernel's intermediate: fp32 summation bound, + the output's rounding
    bound3 = (I + 16) * U * y_abs * scale + out_eps * np.abs(y_ref * scale)
    assert (np.abs(out - y_ref * scale) <= bound3).all()
    # 4. end to end against the whole oracle
    assert (np.abs(out - y_orc * scale) <= bound3 + y_gap * scale + out_eps * np.abs(y_orc * scale)).all()
    assert np.abs(y_orc).max() > 1.0  # a real output, not zeros
    assert (out[2] == 0).all()  # the zero token


CONFIGS = {
    "heuristic": None,
    "split-k": W4A8Config(block_k1=64, block_k2=64, split_k1=3, split_k2=2),
    "atomic": W4A8Config(block_m=32, block_n2=128, block_k1=64, block_k2=64, atomic_reduce=True),
    # the prefill picks' shape: 64 tokens, GEMM1 on 8 warps, GEMM2 on one warpgroup
    "prefill": W4A8Config(block_m=64, block_n2=128, block_k1=64, block_k2=64, num_warps1=8, num_warps2=4,
                          atomic_reduce=True),
}


def test_each_gemm_launches_with_its_own_warps(layer, monkeypatch):
    """fused_moe_w4a8 launches GEMM1 with config.num_warps1 and GEMM2 with num_warps2 (the
    interpreter ignores warps, so the launches are watched, not timed)."""
    from k3nvfp4.kernels import moe_w4a8

    seen = {}

    class Watch:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            def launch(*args, **kw):
                seen[self.name] = (kw["num_warps"], kw["num_stages"])
                return self.kernel[grid](*args, **kw)
            return launch

    moe_w4a8.check_w4a8_supported(torch.device(DEV))  # before the watch hides the interpreter's kernels
    monkeypatch.setattr(moe_w4a8, "check_w4a8_supported", lambda device: None)
    for name in ("w4a8_gemm1_kernel", "w4a8_gemm2_kernel"):
        monkeypatch.setattr(moe_w4a8._k, name, Watch(name, getattr(moe_w4a8._k, name)))
    _, w, _ = layer
    x, (tw, ids) = _tokens(5), _routing(5)
    cfg = CONFIGS["prefill"]
    run_w4a8(x.to(DEV), w.to(DEV), tw.to(DEV), ids.to(DEV), config=cfg)
    assert seen == {"w4a8_gemm1_kernel": (8, cfg.num_stages), "w4a8_gemm2_kernel": (4, cfg.num_stages)}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_kernels_match_the_oracle(layer, name):
    mx, w, (w13o, w2o) = layer
    assert w.out_of_window > 0 and 0 < w.rounded <= w.out_of_window
    assert w.out_of_window == sum(m.out_of_window for m in w13o + w2o)
    assert (w.w13_table, w.w2_table) == ("full", "full")  # the re-encoded blocks sit at offset -8
    x = _tokens(11)
    tw, ids = _routing(11)
    run = run_w4a8(x.to(DEV), w.to(DEV), tw.to(DEV), ids.to(DEV), activation=K3_SITU, routed_scaling_factor=2.5,
                   config=CONFIGS[name])
    _check_against_oracle(run, x, tw.numpy(), ids.numpy(), w13o, w2o, 2.5, 0.0)
    # the zero output column of the zero w2 row
    assert (run.out[:, 7] == 0).all()


def test_bf16_tokens_through_the_entry_point_and_the_torch_reference(layer):
    """bf16 tokens through fused_moe_nvfp4 (the weights pick the mode): the oracle with the
    output's bf16 rounding (2^-8 relative on a GPU; one bf16 ulp, 2^-7, in the interpreter, whose
    fp32 -> bf16 cast truncates: docs/facts.md#triton), and the plain-torch reference (same
    quantization, the kernels' summation order) within a bf16 ulp."""
    mx, w, (w13o, w2o) = layer
    x = _tokens(12).to(torch.bfloat16)
    tw, ids = _routing(12)
    run = run_w4a8(x.to(DEV), w.to(DEV), tw.to(DEV), ids.to(DEV))
    _check_against_oracle(run, x.float(), tw.numpy(), ids.numpy(), w13o, w2o, 1.0, 2.0**-8 if DEV == "cuda" else 2.0**-7)
    got = fused_moe_nvfp4(x.to(DEV), w.to(DEV), tw.to(DEV), ids.to(DEV)).cpu()
    assert torch.equal(got, run.out.cpu())
    ref = fused_moe_w4a8_reference(x, w, tw, ids)
    assert float((got.float() - ref.float()).abs().max()) <= 2.0**-7 * float(ref.float().abs().max())


def test_modelopt_source_equals_the_mxfp4_source_in_window():
    """Power-of-two NVFP4 (the cast of an MXFP4 layer with every block inside the window): the same
    weight values as the MXFP4 preparation (offsets per 16, scale_2 in the row factor), and the
    kernels' output matches the oracle built from the MXFP4 tensors."""
    mx = _mxfp4_layer(8, deep_blocks=False)
    mo = cast_mxfp4_moe(*mx)
    w = W4A8MoEWeights.from_modelopt(*mo)
    assert w.block == 16 and w.out_of_window == 0
    # every block within 6 binades of its row's largest: both GEMMs take the normal E4M3 table
    assert (w.w13_table, w.w2_table) == ("normal", "normal")
    w13o, w2o = _oracle_weights(mx)
    m13, m2 = w.matrices()
    for e in range(E):
        assert np.array_equal(m13.dequantize()[e].numpy(), w13o[e].dequantize())
        assert np.array_equal(m2.dequantize()[e].numpy(), w2o[e].dequantize())
    x = _tokens(13)
    tw, ids = _routing(13)
    run = run_w4a8(x.to(DEV), w.to(DEV), tw.to(DEV), ids.to(DEV), config=CONFIGS["split-k"])
    _check_against_oracle(run, x, tw.numpy(), ids.numpy(), w13o, w2o, 1.0, 0.0)


def test_each_gemm_takes_its_own_matrix_table():
    """w13 within 6 binades per row (the normal E4M3 table), w2 with blocks at offsets -6..-8 (the
    full one): each GEMM expands with its own matrix's table, checked against the oracle (GEMM2
    with the normal table would get the subnormal entries wrong, tests/test_e4m3_expand.py)."""
    flat, deep = _mxfp4_layer(10, deep_blocks=False), _mxfp4_layer(10, deep_blocks=True)
    mx = MXFP4MoETensors(flat.w13, flat.w13_e8m0, deep.w2, deep.w2_e8m0)
    with pytest.warns(UserWarning, match=r"w2: \d+ of"):
        w = W4A8MoEWeights.from_mxfp4(*mx)
    assert (w.w13_table, w.w2_table) == ("normal", "full")
    w13o, w2o = _oracle_weights(mx)
    assert {m.table for m in w13o} == {"normal"} and "full" in {m.table for m in w2o}
    x = _tokens(14)
    tw, ids = _routing(14)
    run = run_w4a8(x.to(DEV), w.to(DEV), tw.to(DEV), ids.to(DEV), config=CONFIGS["atomic"])
    _check_against_oracle(run, x, tw.numpy(), ids.numpy(), w13o, w2o, 1.0, 0.0)
    # weights that claim the normal table below its range are refused at construction
    with pytest.raises(ValueError, match=r"w2_table = 'normal' but w2_offsets go down to -\d"):
        __import__("dataclasses").replace(w, w2_table="normal")


def test_preparation_refuses_what_it_cannot_expand():
    mx = _mxfp4_layer(9, deep_blocks=False)
    mo = cast_mxfp4_moe(*mx)
    bad = mo.w2_scale.clone()
    bad[1, 3, 2] = torch.tensor(0.75).to(torch.float8_e4m3fn)  # not a power of two
    with pytest.raises(ValueError, match=r"w2 \(E4M3 block scales\): 1 E4M3 block scales are not powers of two"):
        W4A8MoEWeights.from_modelopt(mo.w13, mo.w13_scale, mo.w13_scale_2, mo.w2, bad, mo.w2_scale_2)
    deep = _mxfp4_layer(9, deep_blocks=True)
    with pytest.raises(ValueError, match=r"w13: \d+ E2M1 blocks lie more than 14 binades below"):
        W4A8MoEWeights.from_mxfp4(*deep, out_of_window="refuse")
    with pytest.raises(ValueError, match="intermediate size I = 96 not a multiple of 64|I = 96"):
        W4A8MoEWeights.from_mxfp4(mx.w13[:, :192], mx.w13_e8m0[:, :192], mx.w2[:, :, :48], mx.w2_e8m0[:, :, :3])


def test_config_check_names_the_field():
    with pytest.raises(ValueError, match="config.block_n1 = 64 must be a power of two multiple of 128"):
        W4A8Config(block_n1=64).check(H, I)
    with pytest.raises(ValueError, match="config.block_k2 = 128 must be 64 or 128 and divide 192"):
        W4A8Config().check(H, I)
    with pytest.raises(ValueError, match=r"config.num_warps2 = 2 must be 4 or 8"):
        W4A8Config(block_k2=64, num_warps2=2).check(H, I)
    cfg = W4A8Config.heuristic(E, H, I, K, M)
    cfg.check(H, I)
    assert cfg.block_k1 == 64 and cfg.block_k2 == 64


def test_config_file_entries_round_trip_and_read_the_one_warp_count_of_older_files():
    """A tuned-file entry round-trips; an entry written before GEMM2 had warps of its own carries one
    "num_warps", read as both GEMMs'; any other unknown key is refused by name."""
    cfg = W4A8Config(block_m=64, num_warps1=8, num_warps2=4, atomic_reduce=True)
    assert W4A8Config.from_dict(cfg.to_dict()) == cfg
    old = {k: v for k, v in cfg.to_dict().items() if k not in ("num_warps1", "num_warps2")} | {"num_warps": 8}
    assert W4A8Config.from_dict(old) == W4A8Config(block_m=64, num_warps1=8, num_warps2=8, atomic_reduce=True)
    with pytest.raises(ValueError, match=r"unknown keys \['warps'\]"):
        W4A8Config.from_dict(cfg.to_dict() | {"warps": 4})
    assert cfg.tile("gemm1").num_warps == 8 and cfg.tile("gemm2").num_warps == 4


def test_heuristic_picks_measured_tiles_that_launch_without_spills():
    """W4A8Config.heuristic chooses by the static model among measured sm90 tiles (cost table
    sections "w4a8 e4m3/16" and "/32", each also with the normal E4M3 table): never an unmeasured
    or spilling tile, a config that passes check(), larger token blocks at prefill than at decode;
    without a section, the shape rule."""
    from k3nvfp4.kernels import perf_model as pm
    from k3nvfp4.kernels.costs import tile_cost
    from k3nvfp4.kernels.moe_w4a8_details.config import COST_ARCH, GEMM2_WARPS, TOKEN_TILES, shape_rule

    for wb in (16, 32):
        for tables in (("full", "full"), ("normal", "normal"), ("normal", "full")):
            for s in ("tp16", "ep16", "tp8"):
                sh = pm.K3_SHARDS[s]
                picks = {}
                for M in (1, 64, 4096, 16384):
                    c = W4A8Config.heuristic(sh.local_experts, sh.hidden, sh.intermediate, sh.top_k, M,
                                             num_global_experts=sh.global_experts, weight_block=wb, tables=tables)
                    c.check(sh.hidden, sh.intermediate)
                    assert (c.block_m, c.num_warps1) in TOKEN_TILES and c.num_warps2 in GEMM2_WARPS[c.block_m] and c in {
                        __import__("dataclasses").replace(b, split_k1=c.split_k1, split_k2=c.split_k2)
                        for b in W4A8Config.candidates(sh.hidden, sh.intermediate)}
                    for kind, table in zip(("gemm1", "gemm2"), tables):
                        cost = tile_cost(c.tile(kind), COST_ARCH, W4A8Config.cost_mode(wb, table))
                        assert cost is not None and cost.local_bytes == 0, (s, M, c, kind, table)
                    picks[M] = c
                assert picks[1].block_m == 16 and picks[16384].block_m >= picks[1].block_m
    big = shape_rule(384, 3584, 3072, 8, 4096)
    assert big.block_m == 64 and big.block_k1 == 64 and big.block_k2 == 128 and big.split_k1 == 1
    assert big.num_warps1 == 8 and big.num_warps2 == 4
    with pytest.raises(ValueError, match="weight_block: expected one of"):
        W4A8Config.cost_mode(8)
    with pytest.raises(ValueError, match="table: expected one of"):
        W4A8Config.cost_mode(16, "subnormal")


def test_gemm2_takes_one_warpgroup_at_64_tokens():
    """GEMM2's operand (<= 128 rows of H) fits one warpgroup at 64 tokens. Measured on sm90 (the
    cost table, every section and GEMM2 tile at 64 tokens), its 4-warp loop costs fewer
    warp-instructions per weight than the 8-warp one and fits more CTAs per SM, so the heuristic's
    64-token picks run GEMM1 on 8 warps (its 256-row accumulators) and GEMM2 on 4."""
    from k3nvfp4.kernels import perf_model as pm
    from k3nvfp4.kernels.costs import Tile, tile_cost
    from k3nvfp4.kernels.moe_w4a8_details.config import COST_ARCH

    for mode in W4A8Config.cost_modes():
        for bn in (64, 128):
            for bk in (64, 128):
                for atomic in (False, True):
                    c4, c8 = (tile_cost(Tile("gemm2", 64, True, bn, bk, w, 3, atomic), COST_ARCH, mode) for w in (4, 8))
                    where = (mode, bn, bk, atomic)
                    assert c4.instructions_per_iteration * 4 < 0.9 * c8.instructions_per_iteration * 8, where
                    ctas = [pm.occupancy(pm.H200, c.registers, 32 * w, c.shared_bytes)[0] for c, w in ((c4, 4), (c8, 8))]
                    assert ctas[0] > ctas[1] >= 1, where
    picked = 0
    for wb in (16, 32):
        for tables in (("full", "full"), ("normal", "normal")):
            for s in ("ep16", "tp16", "ep8", "tp8"):
                sh = pm.K3_SHARDS[s]
                c = W4A8Config.heuristic(sh.local_experts, sh.hidden, sh.intermediate, sh.top_k, 16384,
                                         num_global_experts=sh.global_experts, weight_block=wb, tables=tables)
                if c.block_m == 64:
                    assert (c.num_warps1, c.num_warps2) == (8, 4), (wb, tables, s, c)
                    picked += 1
    assert picked >= 12


def test_large_call_routing_path_silu_and_empty_batch(layer, monkeypatch):
    """The path above the one-launch routing (align_routing_triton's kernels + quant_rows_kernel),
    forced on a small call: the same bits as the one-launch path (the top-k sum is in slot order
    whatever the sorted order), which the oracle checks. SiLU: the plain-torch reference (same
    quantization) within 1e-3 (SiTU would be far off). M = 0: an empty output, no launch."""
    from k3nvfp4.kernels import moe_w4a8
    from k3nvfp4.kernels.activation import GatedActivation

    mx, w, (w13o, w2o) = layer
    x = _tokens(14)
    tw, ids = _routing(14)
    small = run_w4a8(x, w, tw, ids).out
    monkeypatch.setattr(moe_w4a8, "small_routing_launch", lambda *a, **k: None)
    run = run_w4a8(x, w, tw, ids)
    assert torch.equal(run.out, small)
    _check_against_oracle(run, x, tw.numpy(), ids.numpy(), w13o, w2o, 1.0, 0.0)
    silu = GatedActivation.silu()
    got = fused_moe_nvfp4(x[:3] * 0.01, w, tw[:3], ids[:3], activation=silu)
    ref = fused_moe_w4a8_reference(x[:3] * 0.01, w, tw[:3], ids[:3], activation=silu)
    # (1e-3, not fp32 noise: on a GPU another summation order may flip an intermediate element by one E4M3 step)
    assert float((got - ref).abs().max()) <= 1e-3 * float(ref.abs().max()) and float(ref.abs().max()) > 0
    empty = fused_moe_nvfp4(x[:0], w, tw[:0], ids[:0])
    assert empty.shape == (0, H)


def test_k_steps_of_128_read_the_fragment_order_like_steps_of_64():
    """GEMM1 and GEMM2 at K steps of 128 (two 64-K steps of the fragment-order words per iteration,
    one promotion per activation group: what the heuristic picks where H or I allows) on a layer
    whose H and I are multiples of 128: the same output as at K steps of 64 up to fp32 rounding,
    and both within the reference's fp32 rounding."""
    g = np.random.default_rng(3)
    E2, H2, I2, M2 = 2, 256, 256, 5
    mats = []
    for n, k in ((2 * I2, H2), (H2, I2)):
        mats += [torch.from_numpy(g.integers(0, 256, (E2, n, k // 2), dtype=np.uint8)),
                 torch.from_numpy(g.integers(118, 124, (E2, n, k // 32)).astype(np.uint8))]
    w = W4A8MoEWeights.from_mxfp4(*mats)
    x = torch.from_numpy(g.standard_normal((M2, H2)).astype(np.float32))
    ids = torch.from_numpy(np.stack([g.permutation(E2) for _ in range(M2)]).astype(np.int32))
    tw = torch.from_numpy(g.random((M2, E2)).astype(np.float32) + 0.1)
    ref = fused_moe_w4a8_reference(x, w, tw, ids).double()
    outs = {}
    for bk in (64, 128):
        cfg = W4A8Config(block_m=16, block_k1=bk, block_k2=bk)
        outs[bk] = run_w4a8(x.to(DEV), w.to(DEV), tw.to(DEV), ids.to(DEV), config=cfg).out.double().cpu()
    scale = ref.abs().max()
    assert scale > 0.1
    for bk, out in outs.items():
        assert (out - ref).abs().max() <= 1e-5 * scale, (bk, float((out - ref).abs().max() / scale))
    assert (outs[128] - outs[64]).abs().max() <= 1e-5 * scale
