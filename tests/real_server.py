"""Real SGLang servers in tests, on CPU: tiny checkpoints, the launch, readiness, and teardown.

Test helper, never product code. ``python -m sglang.launch_server`` (SGLang 0.5.23) runs as a
subprocess with the arguments of the project's command builder (k3nvfp4.sglang_ext.launch) for
one node, plus the CPU flags below; the fixture directory ``tests/fixtures/sglang_cpu`` goes on
its PYTHONPATH (the sgl_kernel stand-in; see its docstring). Every server is started in its own
process group on 127.0.0.1 and stopped by that group's id, also when a test fails.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

FIXTURE_DIR = Path(__file__).resolve().parent / "fixtures" / "sglang_cpu"
# The CPU engine (SGLANG_USE_CPU_ENGINE=1): CPU device, the torch attention backend, no CUDA
# graphs, no warm-up request, and a small KV pool (the builder's --mem-fraction-static 0.85 is
# for GPUs; the later flag wins).
CPU_FLAGS = ("--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph",
             "--skip-server-warmup", "--max-total-tokens", "4096", "--mem-fraction-static", "0.05")
# Kimi-K3 (synthetic) on the CPU engine, beyond CPU_FLAGS: the KDA state cache without the
# extra buffer (sglang/srt/arg_groups/mamba_hook.py:120 asserts GPU support for it; no_buffer
# requires the overlap scheduler off), and fp16 (Triton's interpreter has no bf16 scalars:
# "InterpreterBuilder has no attribute get_bf16" in SGLang's FLA kernels).
K3_CPU_FLAGS = ("--mamba-radix-cache-strategy", "no_buffer", "--disable-overlap-schedule", "--dtype", "float16")
# Several K3 servers starting at once on one host (tests/test_real_server_k3.py). SGLang sizes its
# pools from the host memory it sees free before and after loading; with the CPU_FLAGS fraction
# (0.05) what another server takes meanwhile leaves it "negative memory" for the KDA state cache
# (kv_cache_configurator._handle_max_mamba_cache raises). Half the host as headroom, and a fixed
# small KDA state pool, so that the pool is not sized from that half.
K3_SHARED_HOST_FLAGS = ("--mem-fraction-static", "0.5", "--max-mamba-cache-size", "64")
WORDS = tuple(f"w{i:03d}" for i in range(240))  # the tiny tokenizer's words: distinct, readable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_tiny_tokenizer(out: Path) -> int:
    """A word-level tokenizer over WORDS (unknown words -> <unk>) with a chat template; returns
    the vocabulary size. Every token decodes to a distinct string, so top_logprobs keys do not
    collide."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>"]
    vocab = {t: i for i, t in enumerate(specials + list(WORDS))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(specials)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = ("{% for m in messages %}{% if m['role'] == 'user' %}<|user|> {{ m['content'] }} "
                          "{% else %}<|assistant|> {{ m['content'] }} </s> {% endif %}{% endfor %}"
                          "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    fast.save_pretrained(out)
    return len(vocab)


def write_k3_text_processor(out: Path) -> Path:
    """A --tokenizer-path directory for the synthetic K3 checkpoint: the tiny tokenizer (its 245
    ids fit the synthetic vocabulary of 256) and the test-only text processor SGLang's Kimi-K3
    multimodal processor needs (tests/fixtures/sglang_cpu/k3_processor)."""
    import shutil

    out.mkdir(parents=True, exist_ok=True)
    write_tiny_tokenizer(out)
    shutil.copy(FIXTURE_DIR / "k3_processor" / "processing_tiny_k3.py", out)
    (out / "processor_config.json").write_text(json.dumps(
        {"processor_class": "TinyK3Processor", "auto_map": {"AutoProcessor": "processing_tiny_k3.TinyK3Processor"}}))
    return out


def write_tiny_llama(out: Path, *, seed: int = 0, perturb_lm_head: float = 0.0) -> Path:
    """A random 2-layer Llama (hidden 64) in bf16 with the tiny tokenizer. Its lm_head is scaled
    up so that next-token distributions are peaked (random logits are nearly uniform, and any
    perturbation would flip every argmax); perturb_lm_head adds noise of that size relative to
    lm_head's spread (seeded), so that a second arm agrees with the first on some greedy tokens
    and not on others."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    vocab = write_tiny_tokenizer(out)
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      bos_token_id=0, eos_token_id=1, tie_word_embeddings=False, torch_dtype="bfloat16")
    model = LlamaForCausalLM(cfg)
    w = model.lm_head.weight.data
    w *= 40.0
    if perturb_lm_head:
        g = torch.Generator().manual_seed(seed + 1)
        w += perturb_lm_head * w.std() * torch.randn(w.shape, generator=g)
    model = model.to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    return out


def server_command(model_path: Path, port: int, *, backend: str = "triton_situ", extra: tuple = ()) -> list[str]:
    """The production launch (k3nvfp4.sglang_ext.launch.server_args) for one node on 127.0.0.1,
    plus CPU_FLAGS and ``extra``."""
    from k3nvfp4.sglang_ext.launch import LaunchSpec, server_args

    spec = LaunchSpec(str(model_path), backend, tp=1, nnodes=1, host="127.0.0.1", port=port,
                      extra_args=CPU_FLAGS + tuple(extra))
    return [sys.executable, "-m", "sglang.launch_server"] + [a for line in server_args(spec) for a in line]


class ServerFailed(RuntimeError):
    """The server exited or did not become ready; the message carries its log's tail."""


class SGLangServer:
    """One ``sglang.launch_server`` subprocess: ``with SGLangServer(...) as s: s.url``."""

    def __init__(self, model_path: Path, log_path: Path, *, backend: str = "triton_situ", extra: tuple = (),
                 env: dict | None = None, ready_timeout_s: float = 180.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = server_command(model_path, self.port, backend=backend, extra=extra)
        self.log_path = log_path
        self.ready_timeout_s = ready_timeout_s
        self.env = dict(os.environ)
        self.env.update({"SGLANG_USE_CPU_ENGINE": "1", "SGLANG_PLUGINS": "k3nvfp4", "K3NVFP4_TEST_SGLANG_CPU": "1",
                         "PYTHONPATH": os.pathsep.join([str(FIXTURE_DIR), *filter(None, [os.environ.get("PYTHONPATH")])])})
        self.env.update(env or {})
        self.proc: subprocess.Popen | None = None

    def start(self) -> "SGLangServer":
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        return self

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def wait_ready(self) -> "SGLangServer":
        """Poll GET /v1/models until it answers 200; raise ServerFailed if the process exits or
        the deadline passes."""
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerFailed(f"sglang.launch_server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/v1/models", timeout=2) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise ServerFailed(f"no answer on {self.url}/v1/models within {self.ready_timeout_s:g} s:\n{self.log_tail()}")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the whole process group (the server, its scheduler and detokenizer)."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def stop(self) -> None:
        if self.proc is None:
            return
        self.kill(signal.SIGTERM)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.kill(signal.SIGKILL)
            self.proc.wait(timeout=15)
        try:  # children that outlived the leader (same group)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._log.close()

    def __enter__(self) -> "SGLangServer":
        self.start()
        try:
            return self.wait_ready()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()

    def chat(self, payload: dict, timeout_s: float = 120.0) -> dict:
        """POST /v1/chat/completions; the decoded JSON body."""
        req = urllib.request.Request(self.url + "/v1/chat/completions", data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return json.loads(r.read())
