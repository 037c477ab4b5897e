"""Issue 38's static target points under both readings of the model's open question: do a
kernel's stores and fp32 reductions count against the in-flight limit like its loads?

``perf_model.Assumptions.stores_in_flight`` True is what every figure of the static report uses
(bench/sass_report.py): a kernel streams all its bytes at min(copy bandwidth, bytes in flight /
latency), where the bytes in flight are its weight stages. False: only its loads wait on the
latency, its stores (the intermediate, split-K partials, the top-k sum's rows or atomics, the
output) only take copy bandwidth. No GPU has decided it (docs/w4a8.md, "Built (2026-12-07)";
bench_moe's gemm2_warps times one of its consequences). This script predicts every target point
(EP16 / TP16, M <= 64 and >= 4096, both checkpoints, both E4M3 tables) under both, from the
committed static report (bench/results/perf-model.json) with its configs as shipped (each
heuristic's pick, made under the report's reading):

- e4m3 and W4A16: each row's config and its GEMMs' compiled loops (instructions, registers,
  shared memory, spills) through the family's call model;
- FlashInfer's W4A16 and W4A8: the report's measured kernels (its statics); marlin from SGLang's
  sources where they build here (build/peers/marlin; else its column says why not).

Under the report's reading every time must come out as the report's (checked: a stale report or a
model change since it was written is an error, not a figure).

    python -P bench/inflight_sensitivity.py            # the table, to stdout
    python -P bench/inflight_sensitivity.py --write    # also bench/results/inflight-sensitivity.json

A target is robust when it is met (or missed) under both readings.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import pathlib
import sys
from dataclasses import replace

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

import w4a8_rows  # noqa: E402

TARGET_M = (1, 4, 16, 64, 4096, 16384)
RESULT = REPO / "bench" / "results" / "inflight-sensitivity.json"
READINGS = {"stores count": True, "loads only": False}


def _peer_calls(report: dict, marlin: bool) -> dict:
    """{peer section: call(shard, M, assumptions) -> CallPrediction} of the peers that can be
    predicted here; a peer that cannot maps to the reason (a str). marlin: build (or reuse) SGLang's
    marlin instantiations with nvcc (minutes the first time, bench/peers/marlin_sass.py)."""
    from k3nvfp4.kernels import perf_model as pm
    from peers import flashinfer_model as fm

    out: dict = {}
    for sec, call in (("flashinfer", fm.flashinfer_call), ("flashinfer_w4a8", fm.flashinfer_w4a8_call)):
        statics = report.get(sec, {}).get("statics")
        out[sec] = ((lambda shard, M, a, call=call, statics=statics: call(pm.H200, statics, shard, M, a))
                    if statics else f"no statics in {RESULT.parent / 'perf-model.json'}")
    if not marlin:
        out["marlin"] = "not computed (--no-marlin)"
        return out
    try:
        from peers.marlin_model import marlin_call
        from peers.marlin_sass import marlin_statics

        ms = marlin_statics(90, str(REPO / "build" / "peers" / "marlin"))
        out["marlin"] = lambda shard, M, a: marlin_call(pm.H200, ms, shard, M, a)
    except Exception as e:  # no nvcc / SGLang sources here: said, not hidden
        out["marlin"] = f"not computed: {type(e).__name__}: {str(e)[:200]}"
    return out


def _loop_costs(row: dict) -> dict:
    """{"gemm1": LoopCost, "gemm2": LoopCost} of a report row's compiled GEMMs."""
    from k3nvfp4.kernels.perf_model import LoopCost

    return {kind: LoopCost(k["instructions_per_iteration"], k["num_warps"], k["registers"], k["shared_bytes"],
                           k["local_bytes"]) for kind, k in zip(("gemm1", "gemm2"), row["kernels"])}


def _same(what: str, us: float, report_us: float) -> None:
    if abs(us - report_us) > 1e-3 * report_us + 0.05:
        raise RuntimeError(f"{what}: {us:.2f} us under the report's reading, the report has {report_us:.2f} us: "
                           "rerun bench/sass_report.py --write-readme (the report predates a model change)")


def points(report: dict, marlin: bool = True) -> list[dict]:
    """Every target point under both readings: e4m3 / W4A16 and e4m3 / each peer of its checkpoint
    (w4a8_rows.peers_of), whether it meets its target (w4a8_rows's bounds). marlin: whether to
    build SGLang's marlin kernels to predict it (:func:`_peer_calls`)."""
    from k3nvfp4.kernels import perf_model as pm
    from k3nvfp4.kernels.moe_details.call_model import our_call
    from k3nvfp4.kernels.moe_details.config import MoEConfig
    from k3nvfp4.kernels.moe_details.layout import E5M3_16, E8M0_32
    from k3nvfp4.kernels.moe_w4a8_details.call_model import w4a8_call
    from k3nvfp4.kernels.moe_w4a8_details.config import W4A8Config

    peers = _peer_calls(report, marlin)
    w4a16 = {(r["checkpoint"], r["shard"], r["M"]): r for r in report["rows"] if r.get("device") == "H200"}
    e4m3 = {(r["checkpoint"], r["table"], r["shard"], r["M"]): r for r in report["e4m3"]["rows"]}
    peer_rows = {(sec, r["shard"], r["M"]): r for sec in w4a8_rows.PEER_LABEL
                 for r in report.get(sec, {}).get("rows", []) if "time_us" in r}
    out = []
    for ckpt, fmt in (("nvfp4", E5M3_16), ("mxfp4", E8M0_32)):
        wb = w4a8_rows.CHECKPOINT_BLOCK[ckpt]
        for table in w4a8_rows.TABLES:
            for sname in w4a8_rows.TARGET_SHARDS:
                shard = pm.K3_SHARDS[sname]
                for M in TARGET_M:
                    bound = w4a8_rows.PREFILL_RATIO if M >= w4a8_rows.PREFILL_M else w4a8_rows.DECODE_RATIO
                    er, wr = e4m3[(ckpt, table, sname, M)], w4a16[(ckpt, sname, M)]
                    e_cfg = W4A8Config.from_dict({k: v for k, v in er["config"].items() if k != "label"})
                    w_cfg = MoEConfig(**wr["config"])
                    e_costs, w_costs = _loop_costs(er), _loop_costs(wr)
                    p = {"checkpoint": ckpt, "table": table, "shard": sname, "M": M, "bound": bound,
                         "e4m3_config": e_cfg.label(), "readings": {}}
                    for reading, flag in READINGS.items():
                        a = replace(pm.DEFAULT_ASSUMPTIONS, stores_in_flight=flag)
                        e = w4a8_call(pm.H200, shard, M, e_cfg, e_costs, wb, a).time_s
                        w = our_call(pm.H200, shard, M, w_cfg, w_costs, a, fmt=fmt).time_s
                        if flag == pm.DEFAULT_ASSUMPTIONS.stores_in_flight:
                            _same(f"e4m3 {ckpt} {table} {sname} M={M}", e * 1e6, er["time_us"])
                            _same(f"W4A16 {ckpt} {sname} M={M}", w * 1e6, wr["time_us"])
                        r = {"e4m3_us": round(e * 1e6, 1), "w4a16_us": round(w * 1e6, 1),
                             "e4m3_over_w4a16": round(e / w, 4), "e4m3_over_peers": {}}
                        for sec in w4a8_rows.peers_of(ckpt):
                            call = peers.get(sec)
                            if isinstance(call, str) or call is None:
                                r["e4m3_over_peers"][sec] = call or "no call"
                                continue
                            try:
                                t = call(shard, M, a).time_s
                            except RuntimeError:  # the peer does not run this shard (the report says why)
                                continue
                            if flag == pm.DEFAULT_ASSUMPTIONS.stores_in_flight and (sec, sname, M) in peer_rows:
                                _same(f"{sec} {sname} M={M}", t * 1e6, peer_rows[(sec, sname, M)]["time_us"])
                            r["e4m3_over_peers"][sec] = round(e / t, 4)
                        ratios = [v for v in r["e4m3_over_peers"].values() if isinstance(v, float)]
                        r["met"] = r["e4m3_over_w4a16"] <= bound and (M < w4a8_rows.PREFILL_M
                                                                     or all(v < 1.0 for v in ratios))
                        p["readings"][reading] = r
                    p["robust"] = len({r["met"] for r in p["readings"].values()}) == 1
                    out.append(p)
    return out


def markdown(pts: list[dict]) -> list[str]:
    names = list(READINGS)
    lines = [f"| ckpt | table | shard | M | bound | e4m3 / W4A16: {' / '.join(names)} | "
             f"e4m3 / each peer: {' / '.join(names)} | met: {' / '.join(names)} |", "|---" * 8 + "|"]
    for p in pts:
        rs = [p["readings"][n] for n in names]
        secs = rs[0]["e4m3_over_peers"]
        peer = ", ".join(f"{' / '.join(_f(r['e4m3_over_peers'].get(s)) for r in rs)} ({w4a8_rows.PEER_LABEL[s]})"
                         for s in secs) or "-"
        lines.append(f"| {p['checkpoint']} | {p['table']} | {p['shard']} | {p['M']} | {p['bound']} | "
                     f"{' / '.join(_f(r['e4m3_over_w4a16']) for r in rs)} | {peer} | "
                     f"{' / '.join('yes' if r['met'] else 'no' for r in rs)} |")
    return lines


def _f(v) -> str:
    return f"{v:.2f}" if isinstance(v, float) else "n/a"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--write", action="store_true", help=f"also write {RESULT.relative_to(REPO)}")
    p.add_argument("--report", default=str(RESULT.parent / "perf-model.json"),
                   help="the static report whose peer statics are used (default: the committed one)")
    p.add_argument("--no-marlin", action="store_true", help="do not build SGLang's marlin kernels (its column: n/a)")
    args = p.parse_args(argv)
    try:
        report = json.loads(pathlib.Path(args.report).read_text())
    except (OSError, ValueError) as e:
        print(f"--report {args.report}: cannot read the static report: {e}", file=sys.stderr)
        return 2
    pts = points(report, marlin=not args.no_marlin)
    print("\n".join(markdown(pts)))
    changed = [p for p in pts if not p["robust"]]
    met = {n: sum(p["readings"][n]["met"] for p in pts) for n in READINGS}
    print("\nmet: " + ", ".join(f"{n} {k} of {len(pts)}" for n, k in met.items())
          + f"; {len(changed)} point(s) change their verdict with the reading")
    if args.write:
        import triton

        RESULT.write_text(json.dumps({"device": "H200 (static model)", "date": _dt.date.today().isoformat(),
                                      "versions": {"triton": triton.__version__}, "met": met, "points": pts},
                                     indent=1) + "\n")
        print(f"wrote {RESULT.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
