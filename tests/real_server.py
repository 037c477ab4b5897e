"""Real SGLang servers in tests, on CPU: tiny checkpoints, the launch, readiness, and teardown.

Test helper, never product code. Every server is started with the documented command,
``python -P -m k3nvfp4.sglang_ext.cpu_server`` (the production launch for one node plus the CPU
flags, environment and workarounds; it execs ``sglang.launch_server``, so the subprocess is the
server), in its own process group on 127.0.0.1, and stopped by that group's id, also when a test
fails.
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from k3nvfp4.sglang_ext.cpu.tokenizer import SPECIALS, TINY_VOCAB, write_tiny_tokenizer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The hand-built Llama of write_tiny_llama: where each part lives in its residual stream (64 dims).
_MARK_ORDINARY, _MARK_USER, _MARK_ASSISTANT, _MARK_ANSWER = 0, 1, 2, 3  # which kind of token is current
_CODE = slice(4, 48)  # an ordinary token's random code (its bigram identity)
_PHASE_COS, _PHASE_SIN = 48, 49  # what layer 0's attention writes
_HIDDEN, _HEAD_DIM = 64, 16
BIGRAM_LOGIT_STD = 4.0  # spread of the logits after an ordinary token
DESIGNED_GAP = 20.0  # how far every other token lies below the designed ones
# The letters' logits after "Answer:" (within +-19): large enough that at the A/B's sampling
# temperature (0.6, top_p 0.95) the top letter alone is sampled except within a few degrees of
# a quadrant's edge (6% of phases; 10% with turn_letters=60). SGLang's per-request seed is used
# only under --enable-deterministic-inference, which refuses the CPU's torch_native attention:
# sampled seeds are not reproducible on CPU, so it is the model that makes their answers so.
LETTER_SCALE = 12.0
PHASE_AMPLITUDE = 3.0  # the RoPE score's amplitude (cos / sin of the distance in radians)
PHASE_OFFSET = math.log(42)  # a constant score: |f_cos|, |f_sin| reach tanh(A / 2) at a distance of 42
# Letter -> the direction (degrees) of the prompt's phase it answers: the quadrants' middles.
_LETTER_DIRECTIONS = {"A": 45.0, "B": 135.0, "C": 225.0, "D": 315.0}


def write_tiny_llama(out: Path, *, seed: int = 0, perturb_lm_head: float = 0.0, turn_letters: float = 0.0) -> Path:
    """A 2-layer Llama (hidden 64, bf16) over the tiny tokenizer, built by hand (not trained): to
    any chat prompt it writes an answer line, "Answer: X", X one of A-D set by the prompt, then a
    seeded random chain of words. Deterministic for a given ``seed``.

    Residual stream: dims 0-3 mark the current token (an ordinary one: 2 in dim 0; <|user|>,
    <|assistant|>, "Answer:": 8 in dim 1, 2, 3), dims 4-47 hold an ordinary token's random code,
    dims 48-49 take layer 0's attention; every embedding has norm 8 (RMS 1, so the norms, all
    ones, leave it as it is). Every weight not named here is zero: layer 1 and both MLPs add
    nothing. lm_head reads the final norm's output:
    - after <|assistant|> (every chat prompt ends with it): "Answer:", every other token
      DESIGNED_GAP below;
    - after "Answer:": a letter, every other token DESIGNED_GAP below. Which letter, layer 0
      decides: its four heads look from "Answer:" at <|user|> (the prompt's first token, the
      only one with a key and a value) through RoPE's 1 rad/position pair, with scores
      +-A cos d + c (heads 0, 2) and +-A sin d + c (heads 1, 3), d the distance in positions,
      A = PHASE_AMPLITUDE, c = PHASE_OFFSET (on the slowest pair: under 0.2 rad within 512
      positions); the d other tokens score 0. Head 0 minus head 2, f_cos = s(A cos d + c - ln d)
      - s(-A cos d + c - ln d) (s the logistic function), has the sign of cos d, f_sin that of
      sin d; letter X's logit is LETTER_SCALE sqrt(2) (f_cos, f_sin) . (cos, sin)(its direction
      in _LETTER_DIRECTIONS + ``turn_letters`` degrees), so the letter is the quadrant of d mod
      2 pi: A for the first. The words of a real question are <unk> here (but a lone A-D), and
      only <|user|> is looked at, so a question shows through its length: d is the user
      message's length in tokens plus 2, and a word more turns it by 1 rad (57 degrees);
    - after any other token: BIGRAM_LOGIT_STD (g_next . code_current / |code|) for the words
      w000..w239, g seeded normal vectors: a random bigram chain, with peaked next-token
      distributions; letters, "Answer:" and the specials DESIGNED_GAP below (EOS too: every
      completion runs to max_tokens, as the timeout and kill tests need).

    ``perturb_lm_head`` adds seeded (seed + 1) normal noise to every lm_head weight, sized to
    move each logit by perturb_lm_head * BIGRAM_LOGIT_STD (std): with 0.1 a second arm writes
    "Answer:" and a letter as the first does, and follows its chains for a few words.
    ``turn_letters`` turns the letters' directions: with 60 a second arm answers as the first
    where d mod pi/2 is over 60 degrees (about a third of prompts), the letter before (D for A)
    elsewhere."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    n = write_tiny_tokenizer(out)
    ids = {t: i for i, t in enumerate(TINY_VOCAB)}
    cfg = LlamaConfig(vocab_size=n, hidden_size=_HIDDEN, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      bos_token_id=0, eos_token_id=1, tie_word_embeddings=False, torch_dtype="bfloat16")
    model = LlamaForCausalLM(cfg)
    mark = {ids["<|user|>"]: _MARK_USER, ids["<|assistant|>"]: _MARK_ASSISTANT, ids["Answer:"]: _MARK_ANSWER}
    letters = {ids[x]: x for x in _LETTER_DIRECTIONS}
    specials = {ids[t] for t in SPECIALS}
    big, small = math.sqrt(_HIDDEN), 2.0  # a mark's value; the ordinary mark's (the code takes the rest)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0 if "norm" in name else 0.0)
        emb = model.model.embed_tokens.weight
        code = torch.randn(n, _CODE.stop - _CODE.start, generator=g)
        code *= math.sqrt(_HIDDEN - small ** 2) / code.norm(dim=1, keepdim=True)
        for t in range(n):
            if t in mark:
                emb[t, mark[t]] = big
            else:
                emb[t, _MARK_ORDINARY], emb[t, _CODE] = small, code[t]
        # Layer 0: keys and values from <|user|> only, queries from "Answer:" only; x sqrt(head_dim)
        # undoes the attention's 1/sqrt(head_dim). In a head, RoPE pairs dims (i, i + 8) at
        # 10000^(-i/8) rad/position: pair 0 turns 1 rad/position, pair 7 0.0003.
        att, hd = model.model.layers[0].self_attn, _HEAD_DIM
        for kv in (0, 1):
            att.k_proj.weight[kv * hd + 0, _MARK_USER] = 1 / big
            att.k_proj.weight[kv * hd + 7, _MARK_USER] = 1 / big
            att.v_proj.weight[kv * hd + 0, _MARK_USER] = 1 / big
        amp, off = math.sqrt(hd) * PHASE_AMPLITUDE / big, math.sqrt(hd) * PHASE_OFFSET / big
        # (head, query dim, sign): q . R(-d) k with k = (1, 0) in pair 0 is q0 cos d - q8 sin d.
        for head, dim, sign in ((0, 0, 1), (1, 8, -1), (2, 0, -1), (3, 8, 1)):
            att.q_proj.weight[head * hd + dim, _MARK_ANSWER] = sign * amp
            att.q_proj.weight[head * hd + 7, _MARK_ANSWER] = off
        att.o_proj.weight[_PHASE_COS, 0 * hd], att.o_proj.weight[_PHASE_COS, 2 * hd] = 1.0, -1.0
        att.o_proj.weight[_PHASE_SIN, 1 * hd], att.o_proj.weight[_PHASE_SIN, 3 * hd] = 1.0, -1.0
        # lm_head, on the final norm's output (the embedding plus f_cos, f_sin, RMS about 1).
        w = model.lm_head.weight
        gap = DESIGNED_GAP
        for t in range(n):
            if t != ids["Answer:"]:
                w[t, _MARK_ASSISTANT] = -gap / big
            if t not in letters:
                w[t, _MARK_ANSWER] = -gap / big
            if t in specials or t in letters or t == ids["Answer:"]:
                w[t, _MARK_ORDINARY] = -gap / small
            else:  # a word
                w[t, _CODE] = BIGRAM_LOGIT_STD / math.sqrt(_HIDDEN - small ** 2) * torch.randn(
                    _CODE.stop - _CODE.start, generator=g)
        for t, x in letters.items():
            a = math.radians(_LETTER_DIRECTIONS[x] + turn_letters)
            w[t, _PHASE_COS], w[t, _PHASE_SIN] = (LETTER_SCALE * math.sqrt(2) * f(a) for f in (math.cos, math.sin))
        if perturb_lm_head:
            noise = torch.Generator().manual_seed(seed + 1)
            w += perturb_lm_head * BIGRAM_LOGIT_STD / big * torch.randn(w.shape, generator=noise)
    model = model.to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    return out


def server_command(model_path: Path, port: int, *, backend: str = "triton_situ", extra: tuple = ()) -> list[str]:
    """The documented CPU server command (k3nvfp4.sglang_ext.cpu_server) on 127.0.0.1; ``extra``
    goes to sglang.launch_server after ``--``."""
    return [sys.executable, "-P", "-m", "k3nvfp4.sglang_ext.cpu_server", "--model", str(model_path),
            "--moe-runner-backend", backend, "--host", "127.0.0.1", "--port", str(port), "--", *extra]


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

    @staticmethod
    def stop_all(servers: "list[SGLangServer]") -> None:
        """Stop several servers at once: SIGTERM to every one first, then wait for each. SGLang's
        launcher takes about 5 s to exit after SIGTERM (its SIGQUIT handler sleeps before its
        crash diagnostics), so one after the other that is 5 s per server."""
        for server in servers:
            server.kill(signal.SIGTERM)
        for server in servers:
            server.stop()

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
