"""bench/peers/flashinfer_sass.py: static SASS measurement of FlashInfer's SM90 W4A16 MoE grouped GEMM.

Fast (no nvcc build): the translation unit FlashInfer's own generator writes names the BF16 x MXFP4
pingpong launcher of the tile; the JIT flags are read from FlashInfer's module generator; the
mangled-name parser, the demangled-type extraction and the probe parser; the loop measurement on
hand-written SASS (real HGMMAs vs ptxas's no-op commit placeholders, the producer's TMA loop);
the launch sources name kernels defined in the installed sources; missing inputs raise
RuntimeError with the reason.
The real nvcc build and measurement of every tile of TILES (~3 min on 2 cores the first time,
cached under build/peers/flashinfer/) is a peer build: `bench/sass_report.py --check` runs it and
checks its rows (bench/report_check.py), not `make test`.
"""

from __future__ import annotations

import pathlib
import re
import sys

import pytest

BENCH = pathlib.Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

from peers import flashinfer_sass as fs  # noqa: E402


def _package() -> pathlib.Path:
    pkg = fs._find_package("flashinfer")
    if pkg is None:
        pytest.skip("flashinfer (flashinfer-python) is not installed")
    return pkg


# The 64x16x128 GEMM kernel of FlashInfer 0.7.2 built with nvcc 13.0 (what flashinfer_rows measures).
MANGLED_64x16x128 = (
    "_ZN7cutlass13device_kernelINS_4gemm6kernel33GemmUniversalPrecomputedSchedulerINS1_17GroupProblemShapeIN4cute5"
    "tupleIJiiiEEEEENS1_10collective28CollectiveMmaArrayMixedInputINS1_49MainloopSm90ArrayTmaGmmaWarpSpecialized"
    "MixedInputILi24ENS6_IJNS5_1CILi1EEESD_SD_EEENS1_40KernelPtrArrayTmaWarpSpecializedPingpongEEENS6_IJNSC_ILi64EEE"
    "NSC_ILi16EEENSC_ILi128EEEEEENS6_IJNS_12float_e2m1_tENS_13float_ue8m0_tEEEEPNS6_IJlSD_NSC_ILi0EEEEEENS_10bfloat16"
    "_tESQ_NS5_8TiledMMAINS5_8MMA_AtomIJNS5_4SM904GMMA27MMA_64x16x16_F32BF16BF16_RSILNSV_5MajorE0ELSX_0ELNSV_7ScaleIn"
    "E1ELSY_1EEEEEENS5_6LayoutISE_NS6_IJSO_SO_SO_EEEEENS6_IJNS5_10UnderscoreES14_S14_EEEEENS5_13SM90_TMA_LOADEvNT_6"
    "ParamsE"
)


def test_parse_kernel_name():
    info = fs.parse_kernel_name(MANGLED_64x16x128)
    assert info == {"schedule": "pingpong", "tile": (64, 16, 128), "stages": 24,
                    "mma_atom": "MMA_64x16x16_F32BF16BF16_RS", "atom_mnk": (64, 16, 16), "scale_mode": "post_mma",
                    "structure": "warp_specialized",
                    "weight_type": "float_e2m1_t", "scale_type": "float_ue8m0_t"}
    k256 = MANGLED_64x16x128.replace("NSC_ILi128EEEEEE", "NSC_ILi256EEEEEE").replace("MixedInputILi24E",
                                                                                      "MixedInputILi12E")
    assert fs.parse_kernel_name(k256)["tile"] == (64, 16, 256)
    assert fs.parse_kernel_name(k256)["stages"] == 12
    # The tile-map kernel of the same cubin and non-mixed-input kernels are not the GEMM.
    assert fs.parse_kernel_name("_ZN12tensorrt_llm7kernels19cutlass_kernels_oss6detail38build_precomputed_work_"
                                "tile_map_kernelILi64ELi16ELi1ELi1ELb0ELb0EEEvv") is None
    assert fs.parse_kernel_name("_ZN6sglang6device10marlin_moe6MarlinI13__nv_bfloat16EEvv") is None


# The W4A8 (MXFP4 x FP8, pre-MMA E8M0 scale) 64x16x128 kernel, same build, up to its MMA atom.
MANGLED_W4A8_64x16x128 = (
    "_ZN7cutlass13device_kernelINS_4gemm6kernel33GemmUniversalPrecomputedSchedulerINS1_17GroupProblemShapeIN4cute5"
    "tupleIJiiiEEEEENS1_10collective28CollectiveMmaArrayMixedInputINS1_57MainloopSm90ArrayTmaGmmaWarpSpecialized"
    "MixedInputPreScaleILi31ENS6_IJNS5_1CILi1EEESD_SD_EEENS1_40KernelPtrArrayTmaWarpSpecializedPingpongEEENS6_IJNSC_"
    "ILi64EEENSC_ILi16EEENSC_ILi128EEEEEENS6_IJNS_12float_e2m1_tENS_13float_ue8m0_tEEEEPNS6_IJlSD_NSC_ILi0EEEEEENS_"
    "12float_e4m3_tESQ_NS5_8TiledMMAINS5_8MMA_AtomIJNS5_4SM904GMMA30MMA_64x16x32_F32E4M3E4M3_RS_TN"
)


def test_parse_w4a8_kernel_name():
    """The FP8 kernel: the PreScale mainloop (31 stages) and the QGMMA-class E4M3 x E4M3 atom, K = 32."""
    assert fs.parse_kernel_name(MANGLED_W4A8_64x16x128) == {
        "schedule": "pingpong", "tile": (64, 16, 128), "stages": 31, "scale_mode": "pre_mma",
        "structure": "warp_specialized",
        "mma_atom": "MMA_64x16x32_F32E4M3E4M3_RS", "atom_mnk": (64, 16, 32),
        "weight_type": "float_e2m1_t", "scale_type": "float_ue8m0_t"}


def test_qgmma_counts_as_an_mma():
    from k3nvfp4.kernels.offline import sass

    text = ("\t\tFunction : k\n"
            "        /*0100*/                   QGMMA.64x16x32.F32.E4M3.E4M3 R24, R32, gdesc[UR12], R24, gsb0 ;\n"
            "        /*0110*/                   HGMMA.64x8x16.F16 RZ, gdesc[URZ], RZ, !UPT, gsb0 ;\n")
    real, placeholder = sass.parse_sass(text)["k"]
    assert fs.is_real_hgmma(real) and not fs.is_real_hgmma(placeholder)


def test_kernel_type_and_probe_text():
    dem = ("void cutlass::device_kernel<cutlass::gemm::kernel::G<cute::tuple<int, int>, cute::C<64> > >"
           "(cutlass::gemm::kernel::G<cute::tuple<int, int>, cute::C<64> >::Params)")
    t = fs.kernel_type_of(dem)
    assert t == "cutlass::gemm::kernel::G<cute::tuple<int, int>, cute::C<64> >"
    text = fs.probe_unit(t)
    assert f"using K3Kernel = {t};" in text
    assert re.findall(r'#include "([^"]+)"', text) == [fs._INL_INCLUDE]
    assert "K3Kernel::SharedStorageSize" in text
    assert fs._probe_values({"_Z13k3nvfp4_probeILi208896ELi384EEvv": []}) == (208896, 384)
    assert fs._probe_values({"_Z3foov": []}) is None


def test_generated_unit_names_the_launcher():
    pkg = _package()
    gen = fs.load_generator(pkg)
    for tile in fs.TILES:
        text = fs.translation_unit(gen, tile)
        # Only FlashInfer's own launcher is included, from the installed package.
        includes = re.findall(r'#include "([^"]+)"', text)
        assert includes == [fs._INL_INCLUDE]
        assert (pkg / fs._NV / includes[0]).is_file()
        insts = re.findall(r"template void (\w+)<(.*?)> \(", text, re.S)
        assert len(insts) == 1
        name, args = insts[0]
        assert name == "sm90_generic_mixed_moe_gemm_kernelLauncher"
        args = " ".join(args.split())
        m, n, k = tile
        expect = ("__nv_bfloat16, SafeFP4, __nv_bfloat16, tensorrt_llm::cutlass_extensions::EpilogueOpDefault, "
                  f"cute::Shape<cute::Int<{m}>, cute::Int<{n}>, cute::Int<{k}>>, "
                  "cute::Shape<cute::Int<1>, cute::Int<1>, cute::Int<1>>, "
                  "cutlass::gemm::KernelTmaWarpSpecializedPingpong, cutlass::epilogue::TmaWarpSpecializedCooperative, "
                  "cutlass::WeightOnlyQuantOp::FINEGRAINED_SCALE_ONLY")
        # No scale-mode argument: the launcher's default kPostMma, FlashInfer's W4A16 (BF16) choice.
        assert args == expect
        assert "GroupedGemmInput<__nv_bfloat16, SafeFP4, __nv_bfloat16, __nv_bfloat16>inputs" in text
    assert fs.translation_unit(gen, fs.TILES[0]) != fs.translation_unit(gen, fs.TILES[-1])
    # The W4A8 peer (use_wfp4afp8_humming): FP8 activations, the pre-MMA E8M0 scale mode named.
    text = fs.translation_unit(gen, fs.TILES[0], "e4m3")
    (name, args), = re.findall(r"template void (\w+)<(.*?)> \(", text, re.S)
    assert name == "sm90_generic_mixed_moe_gemm_kernelLauncher"
    args = " ".join(args.split())
    assert args.startswith("__nv_fp8_e4m3, SafeFP4, __nv_bfloat16, ")
    assert args.endswith("cutlass::WeightOnlyQuantOp::FINEGRAINED_SCALE_ONLY, "
                         "cutlass::gemm::collective::MixedInputScaleMode::kPreMmaE8M0")
    assert "GroupedGemmInput<__nv_fp8_e4m3, SafeFP4, __nv_bfloat16, __nv_bfloat16>inputs" in text
    with pytest.raises(ValueError, match="act 'fp16'"):
        fs.translation_unit(gen, fs.TILES[0], "fp16")
    # Humming's single-warpgroup decode kernels: their own launcher, one per K regime.
    for kernel_type, regime in (("single_warpgroup_rolling", "SINGLE_WARPGROUP_ROLLING"),
                                ("single_warpgroup_prefill", "SINGLE_WARPGROUP_PREFILL")):
        text = fs.translation_unit(gen, (128, 16, 128), "e4m3", kernel_type)
        (name, args), = re.findall(r"template void (\w+)<(.*?)> \(", text, re.S)
        assert name == "sm90_generic_mixed_moe_small_k_kernelLauncher"
        assert " ".join(args.split()).endswith(f"MixedInputScaleMode::kPreMmaE8M0, "
                                               f"tensorrt_llm::cutlass_extensions::MainloopScheduleType::{regime}")
        assert "GroupedGemmInput<__nv_fp8_e4m3, SafeFP4, __nv_bfloat16, __nv_bfloat16>inputs" in text
    # The cooperative 128-row tiles: the warp-specialized launcher on the cooperative schedule.
    text = fs.translation_unit(gen, (128, 128, 128), "e4m3", "cooperative")
    (name, args), = re.findall(r"template void (\w+)<(.*?)> \(", text, re.S)
    assert name == "sm90_generic_mixed_moe_gemm_kernelLauncher"
    assert "cutlass::gemm::KernelTmaWarpSpecializedCooperative, " in " ".join(args.split())
    assert "(cooperative)" in text.splitlines()[1]
    with pytest.raises(RuntimeError, match="0 bf16 x e2m1 pingpong operations"):
        fs.translation_unit(gen, (64, 24, 128))
    with pytest.raises(RuntimeError, match="0 e4m3 x e2m1 cooperative operations"):
        fs.translation_unit(gen, (64, 64, 128), "e4m3", "cooperative")  # 64-row tiles are pingpong only


FUSED_MOE_PY = '''
def gen_cutlass_fused_moe_sm90_module(use_fast_build: bool = False) -> JitSpec:
    nvcc_flags = sm90a_nvcc_flags + [
        "-DCOMPILE_HOPPER_TMA_GROUPED_GEMMS",
        "-DENABLE_FP8_BLOCK_SCALE" if is_cuda_version_at_least("12.8") else "",
        "-DENABLE_FP4",
    ]
    if _h20():
        nvcc_flags.append("-DFLASHINFER_SM90_MOE_PREBUILT_D_DESCRIPTOR=1")
'''
CORE_PY = '''
common_nvcc_flags = [
    "-DFLASHINFER_ENABLE_FP8_E8M0",
]
sm90a_nvcc_flags = [
    "-gencode=arch=compute_90a,code=sm_90a",
] + common_nvcc_flags
'''


def test_read_module_flags_on_text():
    assert fs.read_module_flags(FUSED_MOE_PY, CORE_PY, "13.0.88") == [
        "-gencode=arch=compute_90a,code=sm_90a", "-DFLASHINFER_ENABLE_FP8_E8M0",
        "-DCOMPILE_HOPPER_TMA_GROUPED_GEMMS", "-DENABLE_FP8_BLOCK_SCALE", "-DENABLE_FP4"]
    assert "-DENABLE_FP8_BLOCK_SCALE" not in fs.read_module_flags(FUSED_MOE_PY, CORE_PY, "12.6")
    with pytest.raises(RuntimeError, match="gen_cutlass_fused_moe_sm90_module"):
        fs.read_module_flags("", CORE_PY, "13.0")


def test_read_module_flags_from_installed_flashinfer():
    pkg = _package()
    flags = fs.read_module_flags((pkg / "jit/fused_moe.py").read_text(), (pkg / "jit/core.py").read_text(), "13.0")
    for f in ("-gencode=arch=compute_90a,code=sm_90a", "-DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED",
              "-DCOMPILE_HOPPER_TMA_GEMMS", "-DCOMPILE_HOPPER_TMA_GROUPED_GEMMS", "-DENABLE_BF16", "-DENABLE_FP8",
              "-DENABLE_FP8_BLOCK_SCALE", "-DENABLE_FP4", "-DUSING_OSS_CUTLASS_MOE_GEMM",
              "-DCUTLASS_ENABLE_GDC_FOR_SM90=1", "-DCUTLASS_MIXED_GEMM_FP4_FP8_PREPROCESSED_SIGNS=1"):
        assert f in flags
    assert not any("PREBUILT_D_DESCRIPTOR" in f for f in flags)  # H20 (78 SMs) only


def test_launch_sources_name_installed_kernels():
    pkg = _package()
    assert len(fs.LAUNCH_SOURCES) == 11
    for entry in fs.LAUNCH_SOURCES:
        paths = re.findall(r"(data/\S+\.(?:cuh|h|inl))", entry)
        assert paths, entry
        for p in paths:
            assert (pkg / p).is_file(), p
        kernel = entry.split(" ")[0].rstrip(":")
        if not kernel.startswith("cutlass::"):
            text = "".join((pkg / p).read_text() for p in paths)
            assert re.search(rf"__global__\s+(?:__launch_bounds__\([^)]*\)\s+)?void\s+{kernel}\b", text), kernel


def _sass(consumer_real: int = 8, placeholders: int = 5, expect_tx: int = 1, spills: int = 0) -> str:
    """cuobjdump-style SASS: an outer tile loop around the consumer k-tile loop (with ``spills``
    pairs of local-memory store and load in it), and a producer loop."""
    lines, addr = [], 0x100

    def emit(text: str) -> int:
        nonlocal addr
        lines.append(f"        /*{addr:04x}*/                   {text} ;")
        addr += 0x10
        return addr - 0x10

    emit("USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xe8")
    outer = emit("IMAD.MOV.U32 R2, RZ, RZ, R3")
    head = emit("WARPGROUP.ARRIVE")
    for i in range(consumer_real):
        emit(f"HGMMA.64x16x16.F32.BF16 R40, R{56 + 4 * i}, gdesc[UR16], R40, gsb0")
        emit("HMUL2.BF16_V2 R27, R27, 8.50705917302346158658e+37, 8.50705917302346158658e+37")
        emit("LOP3.LUT R4, R4, 0x80008000, RZ, 0xc0, !PT")
    for _ in range(placeholders):
        emit("HGMMA.64x8x16.F16 RZ, gdesc[URZ], RZ, !UPT, gsb0")
    for _ in range(32):
        emit("FFMA.FTZ R23, R40, R9, R23")
    for i in range(spills):
        emit(f"STL [R1+0x{8 * i:x}], R40")
        emit(f"LDL R41, [R1+0x{8 * i:x}]")
    emit(f"@P0 BRA 0x{head:x}")
    emit(f"@P1 BRA 0x{outer:x}")
    emit("USETMAXREG.DEALLOC.CTAPOOL 0x28")
    phead = emit("SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR42+0x32c00], R48")
    for _ in range(expect_tx):
        emit("SYNCS.ARRIVE.TRANS64 RZ, [UR8], R3")
    emit("UTMALDG.2D [UR8], [UR4]")
    emit("UTMALDG.3D [UR16], [UR6]")
    emit("UIADD3 UR4, UR4, 0x1, URZ")
    emit(f"@P0 BRA 0x{phead:x}")
    emit("EXIT")
    return "\t\tFunction : k\n" + "\n".join(lines) + "\n"


def test_measure_on_handwritten_sass():
    from k3nvfp4.kernels.offline import sass

    instrs = sass.parse_sass(_sass())["k"]
    assert fs.setmaxnreg(instrs) == {"consumer": 232, "producer": 40}
    m = fs.measure(instrs, (64, 16, 128), (64, 16, 16))
    n_consumer = 1 + 8 * 3 + 5 + 32 + 1
    n_producer = 6
    assert m["real_hgmma"] == 8 and m["placeholders"] == 5
    assert m["stats"].instructions == n_consumer and m["producer_stats"].instructions == n_producer
    assert m["weights"] == 64 * 128
    assert m["per_weight"] == pytest.approx((4 * n_consumer + n_producer) / 8192)
    assert m["consumer_per_weight"] == pytest.approx(4 * n_consumer / 8192)
    assert m["scale_ffma"] == 32 and m["convert_hmul2"] == 8
    assert m["spill_ops"] == 0 and m["per_weight_without_spills"] == m["per_weight"]
    assert "expected 64/64 x K/16 = 8" in m["mapping"]
    # Spill stores and loads in the loop: counted as instructions, and named apart.
    m = fs.measure(sass.parse_sass(_sass(spills=3))["k"], (64, 16, 128), (64, 16, 16))
    assert m["spill_ops"] == 6 and m["stats"].instructions == n_consumer + 6
    assert m["per_weight"] == pytest.approx((4 * (n_consumer + 6) + n_producer) / 8192)
    assert m["per_weight_without_spills"] == pytest.approx((4 * n_consumer + n_producer) / 8192)

    with pytest.raises(RuntimeError, match="expected 8 HGMMA"):
        fs.measure(sass.parse_sass(_sass(consumer_real=7))["k"], (64, 16, 128), (64, 16, 16))
    with pytest.raises(RuntimeError, match="2 expect-tx arrives"):
        fs.measure(sass.parse_sass(_sass(expect_tx=2))["k"], (64, 16, 128), (64, 16, 16))
    with pytest.raises(RuntimeError, match="is not one warpgroup MMA"):
        fs.measure(instrs, (64, 16, 128), (64, 8, 16))


def test_measure_a_cooperative_tile_on_handwritten_sass():
    """The cooperative schedule (both consumer warpgroups on one 128-row tile, 64 rows each): the
    same per-warp loop counts twice over the tile's 128 x K weights, and the tile's MMAs are both
    warpgroups'. In a 256-row tile each warpgroup's 128 rows are two 64-row atoms: its loop must
    hold twice the k-tile's MMAs per warp; pingpong stays one atom of rows per tile."""
    from k3nvfp4.kernels.offline import sass

    instrs = sass.parse_sass(_sass())["k"]
    m = fs.measure(instrs, (128, 16, 128), (64, 16, 16), cooperative=True)
    n_consumer, n_producer = 1 + 8 * 3 + 5 + 32 + 1, 6
    assert m["weights"] == 128 * 128 and m["real_hgmma"] == 2 * 8
    assert m["per_weight"] == pytest.approx((2 * 4 * n_consumer + n_producer) / (128 * 128))
    assert m["consumer_per_weight"] == pytest.approx(4 * n_consumer / (64 * 128))
    assert "both consumer warpgroups" in m["mapping"]
    with pytest.raises(RuntimeError, match="expected 16 HGMMA"):
        fs.measure(instrs, (256, 16, 128), (64, 16, 16), cooperative=True)
    big = fs.measure(sass.parse_sass(_sass(consumer_real=16))["k"], (256, 16, 128), (64, 16, 16), cooperative=True)
    n_big = 1 + 16 * 3 + 5 + 32 + 1
    assert big["weights"] == 256 * 128 and big["real_hgmma"] == 2 * 16
    assert big["per_weight"] == pytest.approx((2 * 4 * n_big + n_producer) / (256 * 128))
    assert big["consumer_per_weight"] == pytest.approx(4 * n_big / (128 * 128))
    assert "128 rows each" in big["mapping"] and "expected 128/64 x K/16 = 16" in big["mapping"]
    with pytest.raises(RuntimeError, match="is not whole warpgroup MMAs on each half"):
        fs.measure(instrs, (192, 16, 128), (128, 16, 16), cooperative=True)
    with pytest.raises(RuntimeError, match="is not one warpgroup MMA"):
        fs.measure(instrs, (128, 16, 128), (64, 16, 16))


def test_missing_inputs_raise_with_reason(monkeypatch):
    from k3nvfp4.kernels.offline import sass

    monkeypatch.setattr(fs, "_find_package", lambda name: None)
    with pytest.raises(RuntimeError, match="flashinfer .* is not installed"):
        fs.find_sources(("nvcc", "13.0"))

    def no_tool(name):
        raise FileNotFoundError(f"{name}: not bundled with this Triton")

    monkeypatch.setattr(sass, "tool", no_tool)
    with pytest.raises(RuntimeError, match="cuobjdump: not bundled"):
        fs.flashinfer_rows()
