"""The SGLang launch command for Kimi-K3 with this project's plugin: one source of truth.

The launch blocks of README.md, docs/serving.md and docs/ab.md (``README_FILES``), ``k3nvfp4-ab
serve --print-launch`` and ``python -m k3nvfp4.sglang_ext.launch`` are all generated here
(tests/test_launch_command.py checks every block against it). The flags are the model card's
2-node TP16 command; what changes for ``triton_situ`` is the backend, and the model card's
patches become environment variables the plugin reads:

- ``K3NVFP4_LOAD_TIMEOUT_S=3600``: SGLang's 480 s unbalanced-loading timeout aborts a 1.6 TB load
  on network storage (the model card's requirement 3).
- ``--dist-timeout 3600``: marlin's NVFP4 repack of 247k expert matrices outlasts NCCL's 600 s
  (requirement 4); kept for triton_situ too (its layout preparation also runs at load).
- ``--mamba-full-memory-ratio 7.21``, ``--disable-flashinfer-autotune`` and the multithreaded
  loader: as the model card deploys it.

    python -P -m k3nvfp4.sglang_ext.launch                     # TP16 over 2 nodes, triton_situ
    python -P -m k3nvfp4.sglang_ext.launch --backend marlin --ep 16 --model-path /models/k3
    python -P -m k3nvfp4.sglang_ext.launch --write-readme .    # regenerate the documents' blocks
"""

from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import dataclass, field

# The model card's per-node network environment (its cluster's interface and HCA names).
MULTI_NODE_ENV = (
    "export SGLANG_HOST_IP=$(ip -o -4 addr show ens1 | awk '{print $4}' | cut -d/ -f1)",
    "export GLOO_SOCKET_IFNAME=ens1 NCCL_SOCKET_IFNAME=ens1",
    "export NCCL_IB_HCA=mlx5_0,mlx5_1,mlx5_2,mlx5_3,mlx5_4,mlx5_9,mlx5_12,mlx5_13",
    "export NCCL_IB_GID_INDEX=7 NCCL_IB_DISABLE=0 NCCL_NVLS_ENABLE=0 NCCL_CROSS_NIC=0",
    "export PATH=/path/to/venv/bin:$PATH",
)
# torch_reference: the plugin's plain-torch MoE (slow, exact), the reference arm of accuracy A/Bs.
BACKENDS = ("triton_situ", "marlin", "torch_reference")


@dataclass(frozen=True)
class LaunchSpec:
    """One server: checkpoint, MoE backend, parallelism, nodes, port.

    tp: tensor-parallel size (16: the K3 checkpoint does not fit 8 GPUs); ep: expert-parallel
    size (None: no EP); nnodes: nodes the tp ranks span (the command is the same on each, only
    ${NODE_RANK} differs); load_timeout_s: K3NVFP4_LOAD_TIMEOUT_S."""

    model_path: str = "/path/to/kimi-k3-nvfp4"
    backend: str = "triton_situ"
    tp: int = 16
    ep: int | None = None
    nnodes: int = 2
    host: str = "0.0.0.0"
    port: int = 30000
    load_timeout_s: int = 3600
    extra_args: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend={self.backend!r}: expected one of {', '.join(BACKENDS)}")
        for name in ("tp", "nnodes", "load_timeout_s"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")
        if self.ep is not None and (self.ep < 1 or self.tp % self.ep):
            raise ValueError(f"ep={self.ep}: must divide tp={self.tp}")
        if self.tp % self.nnodes:
            raise ValueError(f"nnodes={self.nnodes}: must divide tp={self.tp} (the same GPUs per node)")


def server_args(spec: LaunchSpec) -> list[list[str]]:
    """sglang.launch_server's arguments, one line (group of flags) per list."""
    par = ["--tp-size", str(spec.tp)] + (["--ep-size", str(spec.ep)] if spec.ep else [])
    if spec.nnodes > 1:
        par += ["--nnodes", str(spec.nnodes), "--node-rank", "${NODE_RANK}"]
    lines = [["--model-path", spec.model_path], ["--trust-remote-code"], par]
    if spec.nnodes > 1:
        lines.append(["--dist-init-addr", "${HEAD_IP}:20000"])
    lines += [
        ["--moe-runner-backend", spec.backend],
        ["--mem-fraction-static", "0.85"],
        ["--mamba-full-memory-ratio", "7.21"],
        ["--disable-flashinfer-autotune"],
        ["--watchdog-timeout", "3600", "--dist-timeout", "3600"],
        ["--reasoning-parser", "kimi_k3", "--tool-call-parser", "kimi_k3"],
        ["--model-loader-extra-config", '{"enable_multithread_load": true}'],
    ]
    if spec.extra_args:
        lines.append(list(spec.extra_args))
    lines.append(["--host", spec.host, "--port", str(spec.port)])
    return lines


def _quote(arg: str) -> str:
    # ${VARS} stay unquoted so that the shell expands them; everything else as shlex would.
    return arg if arg.startswith("${") else shlex.quote(arg)


def environment(spec: LaunchSpec) -> list[str]:
    """The export lines before the command."""
    env = list(MULTI_NODE_ENV) if spec.nnodes > 1 else []
    return env + [f"export K3NVFP4_LOAD_TIMEOUT_S={spec.load_timeout_s}"]


def launch_command(spec: LaunchSpec, *, with_env: bool = True) -> str:
    """The whole launch, as a shell snippet: the environment, then the command, one flag group
    per line."""
    body = " \\\n  ".join(" ".join(_quote(a) for a in line) for line in server_args(spec))
    cmd = "python -m sglang.launch_server \\\n  " + body
    return ("\n".join(environment(spec)) + "\n\n" + cmd) if with_env else cmd


def one_line(spec: LaunchSpec) -> str:
    """The same launch on one line, environment inline (for logs and --print-launch)."""
    env = [f"K3NVFP4_LOAD_TIMEOUT_S={spec.load_timeout_s}", "SGLANG_PLUGINS=k3nvfp4"]
    args = [_quote(a) for line in server_args(spec) for a in line]
    return " ".join(env + ["python", "-m", "sglang.launch_server", *args])


# The documents' generated launch blocks: marker name -> spec. Each block sits between
# ``<!-- launch:NAME:begin -->`` and ``<!-- launch:NAME:end -->`` in the one file README_FILES
# names for it; tests/test_launch_command.py keeps every block equal to what is generated here
# (`python -P -m k3nvfp4.sglang_ext.launch --write-readme .` regenerates them).
README_BLOCKS = {
    "nvfp4": LaunchSpec(),
    "ep16": LaunchSpec(ep=16),
    "mxfp4-release": LaunchSpec(model_path="/path/to/kimi-k3-mxfp4-release"),
}
PRINT_LAUNCH_EXAMPLE = {"model_path": "/models/kimi-k3-nvfp4"}  # docs/ab.md's `serve --print-launch` example
BLOCK_NAMES = (*README_BLOCKS, "print-launch")
# File (relative to the repository root) -> the blocks it holds; every name of BLOCK_NAMES once.
README_FILES = {
    "README.md": ("nvfp4",),
    "docs/serving.md": ("ep16", "mxfp4-release"),
    "docs/ab.md": ("print-launch",),
}


# The serve A/B's two arms and their ports (`k3nvfp4-ab serve --print-launch`).
AB_PORTS = {"marlin": 30000, "triton_situ": 30001}


def ab_launch_commands(model_path: str = "/path/to/kimi-k3-nvfp4", *, tp: int = 16, ep: int | None = None,
                       nnodes: int = 2, host: str = "0.0.0.0", extra_args: str = "") -> dict[str, str]:
    """The two sglang launch commands the serve A/B expects: one server per MoE backend, the
    production launch (k3nvfp4.sglang_ext.launch) of the same checkpoint, differing only in
    --moe-runner-backend and the port. extra_args is appended to both. Both load the k3nvfp4
    plugin: it registers triton_situ, and with SGLang 0.5.23 it is also what lets NVFP4 marlin
    past the activation assert for situ."""
    extra = tuple(shlex.split(extra_args))
    return {name: one_line(LaunchSpec(model_path, name, tp, ep, nnodes, host, port, extra_args=extra))
            for name, port in AB_PORTS.items()}


def readme_block(name: str) -> str:
    """The fenced block between ``<!-- launch:NAME:begin -->`` and ``<!-- launch:NAME:end -->``."""
    if name == "print-launch":
        return "```bash\n" + "\n".join(ab_launch_commands(**PRINT_LAUNCH_EXAMPLE).values()) + "\n```\n"
    return "```bash\n" + launch_command(README_BLOCKS[name]) + "\n```\n"


def markers(name: str) -> tuple[str, str]:
    """The begin line (with its newline) and the end marker of block ``name``."""
    return f"<!-- launch:{name}:begin -->\n", f"<!-- launch:{name}:end -->"


def block_text(text: str, name: str) -> str | None:
    """What ``text`` holds between the markers of block ``name`` (None: no markers)."""
    begin, end = markers(name)
    if begin not in text or end not in text.split(begin, 1)[1]:
        return None
    return text.split(begin, 1)[1].split(end, 1)[0]


def write_readme(repo_root=".") -> list:
    """Regenerate every launch block in every file of ``README_FILES`` under ``repo_root``.
    Returns the files rewritten. A missing file, or a file without the markers of one of its
    blocks, stops with a message naming both, before any file is written."""
    from pathlib import Path

    from k3nvfp4.common.files import write_text_atomic

    texts = {}
    for rel, names in README_FILES.items():
        path = Path(repo_root) / rel
        if not path.is_file():
            raise SystemExit(f"{path}: not found (--write-readme takes the repository root)")
        text = path.read_text()
        for name in names:
            begin, end = markers(name)
            if block_text(text, name) is None:
                raise SystemExit(f"{path}: markers {begin.strip()} / {end} not found")
            head, rest = text.split(begin, 1)
            _, tail = rest.split(end, 1)
            text = head + begin + readme_block(name) + end + tail
        texts[path] = text
    for path, text in texts.items():
        write_text_atomic(path, text)
    return list(texts)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m k3nvfp4.sglang_ext.launch",
                                description="Print the SGLang launch command for Kimi-K3 with this plugin.")
    d = LaunchSpec()
    p.add_argument("--model-path", default=d.model_path, help=f"checkpoint (default: {d.model_path})")
    p.add_argument("--backend", default=d.backend, choices=BACKENDS, help=f"MoE backend (default: {d.backend})")
    p.add_argument("--tp", type=int, default=d.tp, help=f"tensor-parallel size (default: {d.tp})")
    p.add_argument("--ep", type=int, default=None, help="expert-parallel size (default: none)")
    p.add_argument("--nnodes", type=int, default=d.nnodes, help=f"nodes (default: {d.nnodes})")
    p.add_argument("--port", type=int, default=d.port, help=f"port (default: {d.port})")
    p.add_argument("--one-line", action="store_true", help="one line, environment inline")
    p.add_argument("--write-readme", metavar="REPO", nargs="?", const=".", default=None,
                   help=f"regenerate the launch blocks of {', '.join(README_FILES)} under this "
                        "repository root (default: the current directory) and exit")
    args = p.parse_args(argv)
    if args.write_readme is not None:
        for path in write_readme(args.write_readme):
            print(f"updated {path}")
        return 0
    try:
        spec = LaunchSpec(args.model_path, args.backend, args.tp, args.ep, args.nnodes, port=args.port)
    except ValueError as e:
        p.error(str(e))
    print(one_line(spec) if args.one_line else launch_command(spec))
    return 0


if __name__ == "__main__":
    sys.exit(main())
