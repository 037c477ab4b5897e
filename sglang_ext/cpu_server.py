"""SGLang's real server on CPU with this plugin, for trying the MoE backends and the server A/B
without a GPU (a synthetic Kimi-K3 checkpoint, or any small model SGLang serves on CPU).

    python -P -m k3nvfp4.checkpoint.synthetic --out /tmp/k3 --hidden 64 --intermediate 64
    python -P -m k3nvfp4.sglang_ext.cpu_server --model /tmp/k3 --moe-runner-backend triton_situ --port 30001
    python -P -m k3nvfp4.sglang_ext.cpu_server --model /tmp/k3 --moe-runner-backend torch_reference --print

It runs ``python -m sglang.launch_server`` (replacing this process, so the server keeps its pid)
with the production launch of k3nvfp4.sglang_ext.launch for one node plus:

- environment: ``SGLANG_USE_CPU_ENGINE=1`` (SGLang's CPU engine), ``SGLANG_PLUGINS=k3nvfp4``,
  ``TRITON_INTERPRET=1`` (Triton kernels, the plugin's and SGLang's, run in Triton's
  interpreter), ``TORCHDYNAMO_DISABLE=1`` unless set (SGLang's torch.compile'd functions run
  eagerly instead of compiling C++ on their first calls), ``K3NVFP4_SGLANG_CPU=1`` and
  k3nvfp4/sglang_ext/cpu/pythonpath first on PYTHONPATH (the CPU workarounds and the sgl_kernel
  stand-in; k3nvfp4.sglang_ext.cpu);
- CPU_FLAGS: CPU device, torch attention, no CUDA graphs, no warm-up request, a scheduler that
  sleeps while idle (it busy-polls otherwise: a core per idle server), a small KV pool;
- for a Kimi-K3 checkpoint (config.json model_type kimi_k3) K3_CPU_FLAGS, and a
  --tokenizer-path folder with the tiny word-level tokenizer and text processor
  (cpu/tokenizer.py; written once under $K3NVFP4_CACHE_DIR, default ~/.cache/k3nvfp4), unless
  --tokenizer-path is given.

Arguments after ``--`` go to sglang.launch_server last (a repeated flag: the later one wins).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import tempfile
from pathlib import Path

from ..common.cli import HelpFormatter
from .cpu import PYTHONPATH_DIR
from .launch import LaunchSpec, server_args

# The MoE backends that run without CUDA (marlin needs a GPU).
CPU_BACKENDS = ("triton_situ", "torch_reference")
# The CPU engine: CPU device, the torch attention backend, no CUDA graphs, no warm-up request,
# a small KV pool (the builder's --mem-fraction-static 0.85 is for GPUs; the later flag wins), and
# a scheduler that sleeps while idle: without --sleep-on-idle it polls its sockets in a busy loop,
# a whole core per idle server (measured: 30 CPU-s in 30 s idle), taken from the servers that work.
CPU_FLAGS = ("--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph",
             "--skip-server-warmup", "--sleep-on-idle", "--max-total-tokens", "4096", "--mem-fraction-static", "0.05")
# Kimi-K3 on the CPU engine, beyond CPU_FLAGS:
# - the KDA state cache without the extra buffer (sglang/srt/arg_groups/mamba_hook.py:120 asserts
#   GPU support for it; no_buffer requires the overlap scheduler off);
# - fp16: Triton's interpreter has no bf16 scalars ("InterpreterBuilder has no attribute
#   get_bf16" in SGLang's FLA kernels);
# - a fixed small KDA state pool (64 requests) and half the host as headroom: SGLang sizes its
#   pools from the host memory it sees free before and after loading, and with a fraction of
#   0.05 what another process takes meanwhile (a second server starting) leaves it "negative
#   memory" for the KDA state cache (kv_cache_configurator._handle_max_mamba_cache raises).
K3_CPU_FLAGS = ("--mamba-radix-cache-strategy", "no_buffer", "--disable-overlap-schedule", "--dtype", "float16",
                "--mem-fraction-static", "0.5", "--max-mamba-cache-size", "64")
TOKENIZER_DIR_NAME = "k3-cpu-tokenizer-v1"


def is_kimi_k3(model: Path) -> bool:
    """Whether ``model``'s config.json is a Kimi-K3 one (model_type kimi_k3)."""
    try:
        return json.loads((Path(model) / "config.json").read_text()).get("model_type") == "kimi_k3"
    except (OSError, ValueError, AttributeError):
        return False


def cache_dir() -> Path:
    """$K3NVFP4_CACHE_DIR, else $XDG_CACHE_HOME/k3nvfp4, else ~/.cache/k3nvfp4."""
    if os.environ.get("K3NVFP4_CACHE_DIR"):
        return Path(os.environ["K3NVFP4_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "k3nvfp4"


def k3_tokenizer_dir() -> Path:
    """The tiny K3 tokenizer folder in cache_dir(), written on first use (into a temporary folder
    beside it, then renamed: never seen half-written)."""
    from .cpu.tokenizer import write_k3_text_processor

    target = cache_dir() / TOKENIZER_DIR_NAME
    if (target / "processor_config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{TOKENIZER_DIR_NAME}.", dir=target.parent))
    try:
        write_k3_text_processor(tmp)
        os.rename(tmp, target)
    except OSError:
        if not (target / "processor_config.json").is_file():  # not a concurrent writer that won
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def server_command(model: Path, backend: str, *, port: int, host: str = "127.0.0.1",
                   tokenizer_path: Path | None = None, extra: tuple[str, ...] = ()) -> list[str]:
    """``python -m sglang.launch_server`` with the production arguments for one node, the CPU
    flags (and the K3 ones for a K3 checkpoint), --tokenizer-path when given, then ``extra``."""
    flags = CPU_FLAGS + (K3_CPU_FLAGS if is_kimi_k3(model) else ())
    if tokenizer_path is not None:
        flags += ("--tokenizer-path", str(tokenizer_path))
    spec = LaunchSpec(str(model), backend, tp=1, nnodes=1, host=host, port=port, extra_args=flags + tuple(extra))
    return [sys.executable, "-m", "sglang.launch_server"] + [a for line in server_args(spec) for a in line]


def server_env(base: dict[str, str] | None = None, *, load_timeout_s: int = LaunchSpec.load_timeout_s) -> dict[str, str]:
    """``base`` (default: this process's environment) plus what the CPU server needs."""
    env = dict(os.environ if base is None else base)
    env.update({"SGLANG_USE_CPU_ENGINE": "1", "SGLANG_PLUGINS": "k3nvfp4", "K3NVFP4_SGLANG_CPU": "1",
                "TRITON_INTERPRET": "1", "K3NVFP4_LOAD_TIMEOUT_S": env.get("K3NVFP4_LOAD_TIMEOUT_S", str(load_timeout_s)),
                "PYTHONPATH": os.pathsep.join([str(PYTHONPATH_DIR), *filter(None, [env.get("PYTHONPATH")])])})
    # SGLang's torch.compile'd functions (the MoE top-k, the sampler) would compile C++ through
    # inductor on their first calls on CPU: ~10 s of a server's start and ~4 s of its first request
    # (measured, one K3 server alone on 2 cores). Eager runs the same ops; a user's own value wins.
    env.setdefault("TORCHDYNAMO_DISABLE", "1")
    return env


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(prog="python -P -m k3nvfp4.sglang_ext.cpu_server", formatter_class=HelpFormatter,
                                description="Start SGLang's server on CPU with the k3nvfp4 plugin (a synthetic "
                                            "Kimi-K3 checkpoint, or any small model SGLang serves on CPU).",
                                epilog="Arguments after -- go to sglang.launch_server last.")
    p.add_argument("--model", type=Path, required=True, help="checkpoint folder (with config.json)")
    p.add_argument("--moe-runner-backend", choices=CPU_BACKENDS, default="triton_situ",
                   help="the plugin's MoE backend (marlin needs a GPU)")
    p.add_argument("--port", type=int, default=30000, help="port")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--tokenizer-path", type=Path, default=None,
                   help="tokenizer folder (default for a Kimi-K3 checkpoint: the tiny tokenizer and text processor, "
                        "written once under $K3NVFP4_CACHE_DIR or ~/.cache/k3nvfp4; otherwise the model's own)")
    p.add_argument("--print", action="store_true", help="print the environment and command, start nothing")
    args = p.parse_args(argv)
    if not (args.model / "config.json").is_file():
        p.error(f"--model {args.model}: no config.json there (a checkpoint folder is expected)")
    if not 0 < args.port < 65536:
        p.error(f"--port {args.port}: expected 1..65535")
    if args.tokenizer_path is not None and not args.tokenizer_path.is_dir():
        p.error(f"--tokenizer-path {args.tokenizer_path}: not a folder")
    tokenizer = args.tokenizer_path or (k3_tokenizer_dir() if is_kimi_k3(args.model) else None)
    cmd = server_command(args.model, args.moe_runner_backend, port=args.port, host=args.host,
                         tokenizer_path=tokenizer, extra=tuple(extra))
    env = server_env()
    if args.print:
        for k in ("SGLANG_USE_CPU_ENGINE", "SGLANG_PLUGINS", "K3NVFP4_SGLANG_CPU", "TRITON_INTERPRET",
                  "TORCHDYNAMO_DISABLE", "K3NVFP4_LOAD_TIMEOUT_S", "PYTHONPATH"):
            print(f"export {k}={shlex.quote(env[k])}")
        print(shlex.join(cmd))
        return 0
    sys.stdout.flush()
    os.execvpe(cmd[0], cmd, env)  # the server replaces this process (same pid and process group)


if __name__ == "__main__":
    sys.exit(main())
