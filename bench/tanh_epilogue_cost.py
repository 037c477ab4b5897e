#!/usr/bin/env python3
"""Static cost of the accurate tanh in GEMM1's epilogue (issue 26, item 6): SASS instructions of
the W4A16 GEMM1 kernel outside its hot K loop (the epilogue runs once per output element), with
the kernels' tanh (moe_details/activation.py: odd polynomial below 0.75, exp form above) and with
the exp-only form it replaced ((1 - e) / (1 + e), e = exp(-2|x|), which cancels near 0), on a
decode and a prefill config, sm90 and sm100, compiled offline (no GPU):

    TRITON_INTERPRET= .venv/bin/python -P bench/tanh_epilogue_cost.py
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile

EXP_ONLY = '''
import triton
import triton.language as tl


@triton.jit
def _tanh(x):
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)
'''

MEASURE = r'''
import json, sys
if sys.argv[1] == "exp_only":
    sys.path.insert(0, sys.argv[2])
    import exp_only_tanh
    from k3nvfp4.kernels.moe_details import activation
    activation._tanh = exp_only_tanh._tanh  # gated_act resolves _tanh when it is compiled
from k3nvfp4.kernels.moe_details.config import MoEConfig
from k3nvfp4.kernels.offline import compile as cc, sass
CONFIGS = {"decode bm16 swap bn32 bk256 w2": MoEConfig(block_m=16, swap_ab=True, block_n1=32, block_k1=256, num_warps1=2),
           "prefill bm128 noswap bn64 bk128 w8": MoEConfig(block_m=128, swap_ab=False, block_n1=64, block_k1=128,
                                                           num_warps1=8, num_stages1=3)}
out = {}
for arch in (90, 100):
    for name, cfg in CONFIGS.items():
        c = cc.compile_gemm("gemm1", cfg, 3584, 192, 16, arch)
        ins = next(iter(sass.disassemble(c.asm["cubin"]).values()))
        loop = sass.hot_loop(ins).size
        regs = next(iter(sass.resource_usage(c.asm["cubin"]).values())).registers
        out[f"sm{arch} {name}"] = {"instructions": len(ins), "loop": loop, "outside_loop": len(ins) - loop, "registers": regs}
print(json.dumps(out))
'''


def main() -> int:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = {}
    with tempfile.TemporaryDirectory() as d:
        (pathlib.Path(d) / "exp_only_tanh.py").write_text(EXP_ONLY)
        for variant in ("accurate", "exp_only"):
            # A cache of its own per variant: the two compiles differ only in a callee's source.
            proc = subprocess.run([sys.executable, "-P", "-c", MEASURE, variant, d], capture_output=True, text=True,
                                  env={**env, "TRITON_CACHE_DIR": str(pathlib.Path(d) / f"cache-{variant}")})
            if proc.returncode:
                print(proc.stderr[-3000:], file=sys.stderr)
                return 1
            res[variant] = json.loads(proc.stdout.strip().splitlines()[-1])
    print("| GEMM1 config | registers exp-only / accurate | outside the loop exp-only / accurate | added per output (per thread) | added / program's instructions |")
    print("|---|---|---|---|---|")
    for key, new in res["accurate"].items():
        old = res["exp_only"][key]
        bm, bn, warps = (int(key.split(" bm")[1].split()[0]), int(key.split(" bn")[1].split()[0]),
                         int(key.split(" w")[-1]))
        per_thread = bm * bn / (32 * warps)
        steps = 3584 // int(key.split(" bk")[1].split()[0])
        added = new["outside_loop"] - old["outside_loop"]
        total = steps * new["loop"] + new["outside_loop"]
        print(f"| {key} | {old['registers']} / {new['registers']} | {old['outside_loop']} / {new['outside_loop']} | "
              f"{added / per_thread:.1f} | {added / total:.1%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
