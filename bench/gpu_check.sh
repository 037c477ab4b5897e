#!/usr/bin/env bash
# One prepared GPU check (H200 machine: python3.12, torch 2.11, triton 3.6, no sglang, no network).
#
#   bench/gpu_check.sh            # run everything (about 5-7 minutes on an H200)
#   bench/gpu_check.sh --dry-run  # shim + import check, print the planned steps, run nothing on the GPU
#   bench/gpu_check.sh --cpu-rehearsal  # every step on tiny shapes in the Triton interpreter (no GPU needed)
#
# Makes the package importable WITHOUT pip (a PYTHONPATH shim: k3nvfp4/{common,kernels,checkpoint,sglang_ext,demo}
# symlinked to this checkout), then runs, each step time-boxed with `timeout` and the script going on
# after a failure:
#   1. env       nvidia-smi, versions, import check
#   2. tests_gpu pytest -m gpu (GPU tests of the suite; files that need sglang fail to collect: recorded)
#   3. tune_tp16 / 4. tune_ep16   k3nvfp4-tune on the K3 TP16 / EP16 shards, small space, time-boxed
#   4b. tune_e4m3  k3nvfp4-tune --mode e4m3 (the Hopper W4A8 mode) on TP16, MXFP4 weights (the bench's e4m3
#                arm reads the file it writes: dtype=w4a8_e4m3_b32), small space, time-boxed
#   5. marlin_lib  SGLang's marlin MoE library (bench/peers/marlin, libk3marlin.so, built on the CPU machine
#                with sglang + nvcc and CARRIED here: carry build/peers/marlin/lib): its build info (nvcc
#                version, arch), CUDA driver/runtime, exports, argument checks. --cpu-rehearsal builds it first.
#   5b. bench    bench/bench_moe.py with the configs just tuned (K3NVFP4_MOE_CONFIG_DIR), marlin arm included, the
#                Hopper W4A8 mode (e4m3, its tuned configs: checked against its reference, timed beside W4A16
#                and marlin), and
#                FlashInfer's SiTU MoE where it runs (SM90 W4A16 on ep16; not available with the reason otherwise:
#                not installed, its MoE module not prebuilt - no JIT build inside this step's limit)
#   5c. graph    bench/bench_graph.py: launches per call, CUDA-graph capture + replay at M = 1..64 on TP16/EP16,
#                replay == eager, replay time per call (target <= 15 us at M = 1 on TP16)
#   6. sass      bench/sass_report.py for the installed Triton (offline compile, no GPU needed): the static
#                issue-bound ceiling of each point, put beside the measured bandwidth in summary.json
#   7. tests_kernels  the kernels' CPU-suite files, on CUDA tensors (no interpreter there)
# Worst case (every step at its limit) about 9.5 minutes (570 s); typically less.
# Writes under $OUT (default ./gpu_out): summary.json (each step's exit status and time, test counts,
# headline figures), gpu_check.log (all output), moe-<device>.json/.png, tuned_configs.json
# ({config file name: content}; names hold '=' and ',', which the device tool does not bring back),
# extras.tgz (per-step logs, junit XML, tuner reports, the tuned JSON files under their real names).
# Exit status: 0 all steps passed, 1 some step failed, 3 no GPU (after the import check).
#   5d. prep     bench/bench_prep.py on CUDA: the load-time preparation of one K3 TP16 layer (GB/s, peak memory)
# Step limits (seconds) can be overridden: T_TESTS_GPU T_TESTS_KERNELS T_TUNE T_TUNE_E4M3 T_BENCH T_GRAPH T_PREP
# T_SASS T_MARLIN_LIB. Their sum stays 570 s (the device tool allows 600 s per command): tune_e4m3's
# 30 s came from graph (90 -> 75) and sass (45 -> 30).
# GRAPH_MODES: the modes bench_graph.py captures (default w4a16).
set -u
set -o pipefail

DRY_RUN=0
REHEARSAL=0
case "${1:-}" in
    --dry-run) DRY_RUN=1 ;;
    --cpu-rehearsal) REHEARSAL=1 ;;  # every step, on tiny shapes in the interpreter (plumbing check)
    "") ;;
    *) echo "usage: $0 [--dry-run | --cpu-rehearsal]" >&2; exit 2 ;;
esac

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=${OUT:-$REPO/gpu_out}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
WORK=$(mktemp -d /tmp/k3nvfp4_gpu_check.XXXXXX)
trap 'rm -rf "$WORK"' EXIT  # scratch only: everything kept is under $OUT
LOG=$OUT/gpu_check.log
STEPS=$WORK/steps.tsv
: >"$LOG"
: >"$STEPS"
T_TESTS_GPU=${T_TESTS_GPU:-75}
T_TESTS_KERNELS=${T_TESTS_KERNELS:-40}
T_TUNE=${T_TUNE:-35}
T_TUNE_E4M3=${T_TUNE_E4M3:-30}
T_BENCH=${T_BENCH:-130}
T_PREP=${T_PREP:-30}
T_GRAPH=${T_GRAPH:-75}
T_SASS=${T_SASS:-30}
T_MARLIN_LIB=${T_MARLIN_LIB:-30}
T0=$(date +%s)

log() { echo "$*" | tee -a "$LOG"; }

# step NAME LIMIT_S CMD...: run time-boxed, output to console + log + per-step log; record status.
step() {
    local name=$1 limit=$2
    shift 2
    log ""
    log "=== [$name] (limit ${limit}s) $*"
    local start=$(date +%s)
    timeout -k 10 "$limit" "$@" 2>&1 | tee "$WORK/$name.log" | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    local secs=$(($(date +%s) - start))
    [ "$rc" = 124 ] || [ "$rc" = 137 ] && log "--- [$name] TIMED OUT after ${limit}s"
    log "--- [$name] exit $rc in ${secs}s"
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$secs" "$limit" >>"$STEPS"
}

# ---- 0. import shim: the package without pip ------------------------------------------------
SHIM=$WORK/shim
mkdir -p "$SHIM/k3nvfp4"
for sub in common kernels checkpoint sglang_ext demo; do ln -s "$REPO/$sub" "$SHIM/k3nvfp4/$sub"; done
export PYTHONPATH=$SHIM${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1 PYTHONDONTWRITEBYTECODE=1
export MPLBACKEND=Agg
cd "$REPO"

write_summary() {  # write_summary STATUS_WORD
    "$PY" -P - "$STEPS" "$OUT" "$WORK" "$1" "$DRY_RUN" "$(($(date +%s) - T0))" <<'PYEOF' 2>&1 | tee -a "$LOG"
import glob, json, os, sys, xml.etree.ElementTree as ET
steps_path, out, work, status, dry, elapsed = sys.argv[1:7]
steps = []
for line in open(steps_path):
    name, rc, secs, limit = line.rstrip("\n").split("\t")
    steps.append({"name": name, "exit": int(rc), "seconds": int(secs), "limit_s": int(limit),
                  "timed_out": rc in ("124", "137")})
summary = {"status": status, "dry_run": dry == "1", "elapsed_s": int(elapsed), "steps": steps, "tests": {}}
for xml in sorted(glob.glob(os.path.join(work, "junit-*.xml"))):
    try:
        root = ET.parse(xml).getroot()
        suite = root if root.tag == "testsuite" else root.find("testsuite")
        summary["tests"][os.path.basename(xml)[6:-4]] = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    except Exception as e:
        summary["tests"][os.path.basename(xml)] = f"unreadable: {e}"
env = os.path.join(work, "env.json")
if os.path.exists(env):
    summary["env"] = json.load(open(env))
configs = {}
for p in sorted(glob.glob(os.path.join(work, "configs", "*.json"))):
    configs[os.path.basename(p)] = json.load(open(p))
if configs:
    json.dump(configs, open(os.path.join(out, "tuned_configs.json"), "w"), indent=1)
summary["tuned_config_files"] = {k: sorted(v, key=int) for k, v in configs.items()}
head = []
for p in glob.glob(os.path.join(out, "moe-*.json")):
    r = json.load(open(p))
    summary["bench_errors"] = r.get("errors", [])
    summary["bench_checks"] = {k: v.get("check") for k, v in r.get("shapes", {}).items()}
    summary["measured_ceilings"] = r.get("measured_ceilings")
    summary["targets"] = r.get("targets", [])
    summary["bench_marlin"] = {"status": r.get("other_implementations", {}).get("sglang_marlin_nvfp4"),
                               "checks": {k: v.get("marlin") for k, v in r.get("shapes", {}).items()}}
    summary["bench_flashinfer"] = {"status": r.get("other_implementations", {}).get("flashinfer"),
                                   "checks": {k: v.get("flashinfer") for k, v in r.get("shapes", {}).items()}}
    on_gpu = "cpu" not in str(r.get("device", "")).lower()

    def fig(v, nd):  # a rounded figure, or None where there is none (no GPU: CPU wall clock is no figure)
        return round(v, nd) if on_gpu and isinstance(v, (int, float)) and v == v else None

    for pt in r.get("points", []):
        o = pt.get("ours", {})
        m = pt.get("sglang_marlin_nvfp4")
        f = pt.get("flashinfer")
        head.append({"shape": pt["shape"], "M": pt["M"], "us": fig(o.get("time_us"), 1),
                     "pct_bw": fig(o.get("pct_bw"), 1), "TFLOPs": fig(o.get("TFLOPs"), 1),
                     "speedup_vs_bf16": fig(pt.get("speedup_vs_bf16"), 2), "error": pt.get("error"),
                     "marlin_us": fig(m["time_us"], 1) if isinstance(m, dict) else None,
                     "speedup_vs_marlin": fig(pt.get("x_vs_marlin"), 2),
                     "flashinfer_us": fig(f["time_us"], 1) if isinstance(f, dict) else None,
                     "speedup_vs_flashinfer": fig(pt.get("x_vs_flashinfer"), 2),
                     # the Hopper W4A8 mode (e4m3) in the same run: its time, W4A16 / e4m3, marlin / e4m3
                     "e4m3_us": fig(e4["time_us"], 1) if isinstance(e4 := pt.get("act_quant_e4m3"), dict)
                     and "time_us" in e4 else None,
                     "e4m3_error": e4.get("error") if isinstance(e4, dict) else e4,
                     "w4a16_over_e4m3": fig(e4.get("x_vs_w4a16"), 2) if isinstance(e4, dict) else None,
                     "marlin_over_e4m3": fig(e4.get("x_vs_marlin"), 2) if isinstance(e4, dict) else None,
                     # the E4M3 tables its weights took, and the normal one against the full one (first M)
                     "e4m3_tables": e4.get("tables") if isinstance(e4, dict) else None,
                     "e4m3_tables_agree": e4.get("tables_agree") if isinstance(e4, dict) else None,
                     # GEMM2 on 8 warps / on 4 at the 64-token pick (last M): the model says > 1
                     "e4m3_gemm2_w8_over_w4": fig(e4.get("gemm2_warps", {}).get("w8_over_w4"), 2)
                     if isinstance(e4, dict) else None})
gp = os.path.join(out, "graph.json")
if os.path.exists(gp):
    g = json.load(open(gp))
    summary["graph"] = {"passed": g.get("passed"), "device": g.get("device"), "tp16_M1_replay_us": g.get("tp16_M1_replay_us"),
                        "tp16_M1_meets_target": g.get("tp16_M1_meets_target"), "errors": len(g.get("errors", [])),
                        "points": [{k: (round(p[k], 1) if isinstance(p.get(k), float) else p.get(k))
                                    for k in ("shape", "M", "launches", "replay_us", "replay_warm_us", "eager_us",
                                              "replay_equals_eager")} for p in g.get("points", [])]}
ml = os.path.join(out, "marlin-lib.json")
if os.path.exists(ml):
    lib = json.load(open(ml))
    key = (lib.get("build") or {}).get("key") or {}
    summary["marlin_lib"] = {"build_id": lib["build"].get("build_id"), "nvcc": key.get("nvcc_version"),
                             "arch": key.get("arch"), "sglang": key.get("sglang_version"),
                             "cuda_driver": lib.get("cuda_driver"), "cuda_runtime": lib.get("cuda_runtime"),
                             "size_bytes": lib.get("linkage", {}).get("size_bytes"), "failures": lib.get("failures")}
# the static model's predicted time (sass_report, same configs) beside the measured one
model_path = os.path.join(out, "perf-model.json")
if os.path.exists(model_path):
    pred = {(r["shard"], r["M"]): r.get("time_us") for r in json.load(open(model_path)).get("rows", [])
            if r.get("device") == "H200"}
    for h in head:
        h["predicted_us"] = pred.get((h["shape"], h["M"]))
summary["bench"] = head
json.dump(summary, open(os.path.join(out, "summary.json"), "w"), indent=1)
print("\n==== gpu_check summary (" + status + f", {elapsed}s) ====")
for s in steps:
    print(f"{s['name']:<15} exit {s['exit']:>3} {s['seconds']:>4}s / {s['limit_s']}s" + ("  TIMED OUT" if s["timed_out"] else ""))
for k, v in summary["tests"].items():
    print(f"pytest {k}: {v}")
def na(v, unit=""):
    return "n/a" if v is None else f"{v}{unit}"


for h in head:
    print(f"{h['shape']:<5} M={h['M']:>6} {na(h['us'], ' us'):>12} {na(h['pct_bw'], '%'):>6} of HBM "
          f"{na(h['TFLOPs'], ' TFLOP/s'):>14}, speedup vs bf16 {na(h['speedup_vs_bf16'])}"
          + (f" (model predicts {h['predicted_us']} us)" if h.get("predicted_us") else "")
          + (f" | marlin {na(h['marlin_us'], ' us')}, speedup vs marlin {na(h['speedup_vs_marlin'])}"
             if h.get("marlin_us") is not None or h.get("speedup_vs_marlin") is not None else "")
          + (f" | flashinfer {na(h['flashinfer_us'], ' us')}, speedup vs flashinfer {na(h['speedup_vs_flashinfer'])}"
             if h.get("flashinfer_us") is not None or h.get("speedup_vs_flashinfer") is not None else "")
          + (f"  ERROR {h['error']}" if h["error"] else ""))
for t in summary.get("targets", []):
    print(f"target {t['target']}: {t['verdict']} ({t['measured']})")
graph_on_gpu = "cpu" not in str((summary.get("graph") or {}).get("device", "")).lower()
for p in (summary.get("graph") or {}).get("points", []):
    t = {k: (na(p.get(k), " us") if graph_on_gpu else "n/a") for k in ("replay_us", "replay_warm_us", "eager_us")}
    print(f"graph {p['shape']:<5} M={p['M']:>3}: {p['launches']} launches, replay {t['replay_us']} "
          f"(warm {t['replay_warm_us']}, eager {t['eager_us']}), replay == eager {p.get('replay_equals_eager')}")
if summary.get("marlin_lib"):
    print("marlin library:", summary["marlin_lib"])
if summary.get("bench_marlin"):
    print("marlin arm:", summary["bench_marlin"]["status"])
if summary.get("bench_flashinfer"):
    print("flashinfer arm:", summary["bench_flashinfer"]["status"])
    for k, v in (summary["bench_flashinfer"]["checks"] or {}).items():
        if isinstance(v, dict) and "normwise_error" in v:
            print(f"flashinfer check {k}: normwise error {v['normwise_error']:.3g} vs the reference (tol {v['tol']})")
if summary.get("measured_ceilings"):
    print("measured ceilings:", summary["measured_ceilings"])
PYEOF
}

finish() {  # finish STATUS_WORD EXIT_CODE
    write_summary "$1"
    mkdir -p "$WORK/extras"
    cp "$WORK"/*.log "$WORK"/*.xml "$WORK/extras/" 2>/dev/null
    cp -r "$WORK/configs" "$WORK/reports" "$WORK/extras/" 2>/dev/null
    tar -czf "$OUT/extras.tgz" -C "$WORK" extras 2>/dev/null
    log "outputs in $OUT: $(ls "$OUT" | tr '\n' ' ')"
    exit "$2"
}

# ---- 1. env ----------------------------------------------------------------------------------
step env 60 "$PY" -P -c "
import json, os, sys, torch, triton
import k3nvfp4.kernels as k
from k3nvfp4.kernels import fused_moe_nvfp4, NVFP4MoEWeights, fused_moe_nvfp4_reference
from k3nvfp4.kernels.tune import main as tune_main
cuda = torch.cuda.is_available()
env = {'python': sys.version.split()[0], 'torch': torch.__version__, 'triton': triton.__version__,
       'cuda': torch.version.cuda, 'gpu': torch.cuda.get_device_name() if cuda else None,
       'package_dir': os.path.dirname(k.__file__)}
if cuda:
    p = torch.cuda.get_device_properties(0)
    env.update(sms=p.multi_processor_count, mem_gib=round(p.total_memory / 2**30, 1), capability=list(torch.cuda.get_device_capability()))
json.dump(env, open('$WORK/env.json', 'w'))
print('import ok:', json.dumps(env))
"
if [ "$(tail -n1 "$STEPS" | cut -f2)" != 0 ]; then
    log "gpu_check: the package does not import through the shim ($SHIM); see above"
    finish import_failed 1
fi
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,memory.used --format=csv 2>&1 | tee -a "$LOG"

TUNE_TP="$PY -P -m k3nvfp4.kernels.tune --E 896 --H 3584 --I 192 --top-k 16 --batch-sizes 1,64,1024,16384 --space small --iters 20 --time-budget $((T_TUNE - 20)) --out-dir $WORK/configs --report $WORK/reports/tune_tp16.json --no-progress"
TUNE_EP="$PY -P -m k3nvfp4.kernels.tune --E 56 --global-experts 896 --H 3584 --I 3072 --top-k 16 --batch-sizes 1,64,1024,16384 --space small --iters 20 --time-budget $((T_TUNE - 20)) --out-dir $WORK/configs --report $WORK/reports/tune_ep16.json --no-progress"
TUNE_E4M3="$PY -P -m k3nvfp4.kernels.tune --mode e4m3 --E 896 --H 3584 --I 192 --top-k 16 --batch-sizes 1,64,16384 --space small --iters 20 --time-budget $((T_TUNE_E4M3 - 20)) --out-dir $WORK/configs --report $WORK/reports/tune_e4m3_tp16.json --no-progress"
BENCH="$PY bench/bench_moe.py --out-dir $OUT --time-budget $((T_BENCH - 40))"
SASS="$PY -P bench/sass_report.py --devices H200 --shards tp16,ep16 --no-peers --out $OUT/perf-model.json"
PREP="$PY -P bench/bench_prep.py --device cuda --shapes tp16 --paths nvfp4,mxfp4 --out $OUT/prep-cuda.json"
# W4A16 only by default: on Hopper the FP4 modes are a decomposed correctness path (pytest -m gpu
# covers them) and would not fit the step's limit; on Blackwell set GRAPH_MODES=w4a16,nvfp4,mxfp8.
GRAPH_MODES=${GRAPH_MODES:-w4a16}
GRAPH="$PY bench/bench_graph.py --modes $GRAPH_MODES --out $OUT/graph.json"
# The GPU machine has no sglang / nvcc: the library is only checked there (built on the CPU machine).
MARLIN_LIB="$PY -P bench/peers/marlin/selfcheck.py --json $OUT/marlin-lib.json"
# CPU-suite files of the kernels: on a GPU machine they run on CUDA tensors (no interpreter there).
KERNEL_TESTS=$(ls tests/test_tune.py tests/test_moe_config.py tests/test_routing.py tests/test_moe.py \
    tests/test_launches.py tests/test_layout.py tests/test_formats.py tests/test_cast.py tests/test_cast_triton.py tests/test_moe_checkpoint.py 2>/dev/null | tr '\n' ' ')
# Files holding GPU tests (marker gpu); those that import sglang fail to collect there: recorded.
GPU_TESTS=$(grep -l "pytest.mark.gpu" tests/test_*.py 2>/dev/null | tr '\n' ' ')

if [ "$REHEARSAL" = 1 ]; then
    # Same steps and files, tiny shapes, Triton interpreter: checks this script's plumbing on a CPU box.
    TUNE_TP="$PY -P -m k3nvfp4.kernels.tune --device cpu --E 4 --H 48 --I 32 --top-k 2 --batch-sizes 1,3 --space tiny --iters 1 --out-dir $WORK/configs --report $WORK/reports/tune_tp16.json --no-progress"
    TUNE_EP="$PY -P -m k3nvfp4.kernels.tune --device cpu --E 4 --global-experts 16 --H 48 --I 32 --top-k 4 --batch-sizes 2 --space tiny --iters 1 --out-dir $WORK/configs --report $WORK/reports/tune_ep16.json --no-progress"
    TUNE_E4M3="$PY -P -m k3nvfp4.kernels.tune --device cpu --mode e4m3 --E 2 --H 128 --I 128 --top-k 2 --batch-sizes 3 --space tiny --warmup 0 --iters 1 --out-dir $WORK/configs --report $WORK/reports/tune_e4m3_tp16.json --no-progress"
    BENCH="$PY bench/bench_moe.py --device cpu --shapes tiny-tp,tiny-ep --m-list 1,8 --quick --out-dir $OUT"
    SASS="$PY -P bench/sass_report.py --devices H200 --no-peers --shards tp16 --m-list 1 --out $OUT/perf-model.json"
    GRAPH="$PY bench/bench_graph.py --cpu-rehearsal --modes $GRAPH_MODES --m-list 1,8 --out $OUT/graph.json"
    PREP="$PY -P bench/bench_prep.py --device cpu --shapes tiny --paths nvfp4,mxfp4 --out $OUT/prep-cuda.json"
    # build (cached by source hash: ~3-4 min on 2 cores the first time, seconds after), then the same checks
    MARLIN_LIB="$PY -P bench/peers/marlin/build.py --check --json $OUT/marlin-lib.json"
    T_MARLIN_LIB=${T_MARLIN_LIB_BUILD:-900}
    KERNEL_TESTS="tests/test_tune.py"
fi
if [ "$DRY_RUN" = 1 ]; then
    log ""
    log "dry run: the import shim works; planned steps:"
    log "  tests_gpu     ($T_TESTS_GPU s): $PY -P -m pytest -q -m gpu $GPU_TESTS --continue-on-collection-errors"
    log "  tests_kernels ($T_TESTS_KERNELS s): $PY -P -m pytest -q -m 'not gpu' $KERNEL_TESTS"
    log "  tune_tp16     ($T_TUNE s): $TUNE_TP"
    log "  tune_ep16     ($T_TUNE s): $TUNE_EP"
    log "  tune_e4m3     ($T_TUNE_E4M3 s): $TUNE_E4M3"
    log "  marlin_lib    ($T_MARLIN_LIB s): $MARLIN_LIB"
    log "  bench         ($T_BENCH s): K3NVFP4_MOE_CONFIG_DIR=$WORK/configs $BENCH"
    log "  graph         ($T_GRAPH s): $GRAPH"
    log "  prep          ($T_PREP s): $PREP"
    log "  sass          ($T_SASS s): $SASS"
    finish dry_run 0
fi
if [ "$REHEARSAL" = 0 ] && [ "$("$PY" -P -c 'import torch; print(torch.cuda.is_available())')" != True ]; then
    log ""
    log "gpu_check: NO CUDA GPU visible to torch on this machine: the package imports, but there is nothing to"
    log "check here. Run it on the GPU machine, or use --dry-run to see the planned steps."
    finish no_gpu 3
fi

# ---- 2. GPU tests ------------------------------------------------------------------------------
# shellcheck disable=SC2086
step tests_gpu "$T_TESTS_GPU" "$PY" -P -m pytest -q -m gpu ${GPU_TESTS:-tests} -p no:cacheprovider \
    --continue-on-collection-errors --junitxml="$WORK/junit-gpu.xml"

# ---- 3-4. tuner on the K3 shards (small space, time-boxed; --time-budget stops it cleanly) ----
mkdir -p "$WORK/configs" "$WORK/reports"
# shellcheck disable=SC2086
step tune_tp16 "$T_TUNE" $TUNE_TP
# shellcheck disable=SC2086
step tune_ep16 "$T_TUNE" $TUNE_EP
# shellcheck disable=SC2086
step tune_e4m3 "$T_TUNE_E4M3" $TUNE_E4M3

# ---- 5. SGLang's marlin MoE library (the bench's marlin arm): build info, versions, checks -------
# shellcheck disable=SC2086
step marlin_lib "$T_MARLIN_LIB" $MARLIN_LIB

# ---- 5b. benchmark with the configs just tuned --------------------------------------------------
export K3NVFP4_MOE_CONFIG_DIR=$WORK/configs
# shellcheck disable=SC2086
step bench "$T_BENCH" $BENCH

# ---- 5c. launches per call and CUDA-graph replay at decode sizes (same configs) -------------------
# shellcheck disable=SC2086
step graph "$T_GRAPH" $GRAPH

# ---- 5d. load-time preparation of one K3 layer on the GPU (Triton layout kernels) -----------------
# shellcheck disable=SC2086
step prep "$T_PREP" $PREP

# ---- 6. static SASS figures of the configs just benchmarked (installed Triton; offline compile) ---
# shellcheck disable=SC2086
step sass "$T_SASS" env -u TRITON_INTERPRET $SASS

# ---- 7. the kernels' CPU-suite files, on the GPU (last: the least unique information) ----------
if [ -n "$KERNEL_TESTS" ]; then
    # shellcheck disable=SC2086
    step tests_kernels "$T_TESTS_KERNELS" "$PY" -P -m pytest -q --maxfail=5 -m "not gpu" -p no:cacheprovider $KERNEL_TESTS \
        --junitxml="$WORK/junit-kernels.xml"
fi

# a tuner exit 3 means "search cut short by --time-budget, configs written": not a failure here
if awk -F'\t' '$2 != 0 && !($1 ~ /^tune/ && $2 == 3) {bad=1} END {exit !bad}' "$STEPS"; then
    finish some_steps_failed 1
fi
finish ok 0
