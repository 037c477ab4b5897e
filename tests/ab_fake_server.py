"""A fake OpenAI chat-completions server and the canned two-arm A/B the serve tests share
(tests/test_ab_serve.py, tests/test_ab_plots_optional.py): a real http.server on 127.0.0.1
(ephemeral port), non-streaming; the expected metric values are computed by hand in the tests."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeServer:
    """Chat-completions server; `respond(payload) -> (status, body, delay_s)`, body a dict or raw bytes."""

    def __init__(self, respond, model="k3-test"):
        self.respond, self.model, self.payloads = respond, model, []
        self.requests = []  # every request as "METHOD /path", the /v1/models check included
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):  # keep pytest output clean
                pass

            def _send(self, status, body):
                raw = body if isinstance(body, bytes) else json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def do_GET(self):
                outer.requests.append(f"GET {self.path}")
                if self.path == "/v1/models":
                    self._send(200, {"object": "list", "data": [{"id": outer.model, "object": "model"}]})
                else:
                    self._send(404, {"error": "not found"})

            def do_POST(self):
                outer.requests.append(f"POST {self.path}")
                payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.payloads.append(payload)
                status, body, delay = outer.respond(payload)
                if delay:
                    time.sleep(delay)
                try:
                    self._send(status, body)
                except (BrokenPipeError, ConnectionResetError):
                    pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self):
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def completion(content, tokens=None, finish="stop", reasoning="thinking about it"):
    """A chat.completion body; tokens = [(token, logprob, {alt: logprob})]."""
    choice = {"index": 0, "finish_reason": finish,
              "message": {"role": "assistant", "content": content, "reasoning_content": reasoning}}
    if tokens is not None:
        choice["logprobs"] = {"content": [
            {"token": t, "logprob": lp, "top_logprobs": [{"token": k, "logprob": v} for k, v in top.items()]}
            for t, lp, top in tokens]}
    return {"id": "x", "object": "chat.completion", "choices": [choice],
            "usage": {"completion_tokens": len(tokens or []) or 3}}


PROMPTS = [
    {"id": "mc-1", "kind": "mc", "question": "Q-one?", "choices": ["a", "b", "c", "d"], "answer": "B"},
    {"id": "mc-2", "kind": "mc", "question": "Q-two?", "choices": ["a", "b", "c", "d"], "answer": "C"},
    {"id": "ar-1", "kind": "arith", "question": "What is 17*23?", "answer": "391"},
]

X = -4.0  # logprob of the runner-up token "x" in the simple positions


def pos(tok, lp, **extra):
    return (tok, lp, {tok: lp, "x": X, **extra})


# Greedy (seed 0) token streams; see test_serve_end_to_end for the hand-computed metrics.
GREEDY = {
    "marlin": {
        "Q-one": completion("Answer: B", [pos("Answer", -0.1), pos(":", -0.2), pos(" B", -0.3)]),
        "Q-two": completion("Answer: C", [pos("Answer", -0.1), pos(":", -0.2), (" C", -0.4, {" C": -0.4, " D": -1.5})]),
        "17*23": completion("", [("Let", -0.5, {"Let": -0.5})], finish="length"),
    },
    "triton_situ": {
        "Q-one": completion("Answer: B", [pos("Answer", -0.1), pos(":", -0.25), pos(" B", -0.3)]),
        "Q-two": completion("Answer: D", [pos("Answer", -0.1), pos(":", -0.2), (" D", -0.5, {" D": -0.5, " C": -1.0})]),
        "17*23": completion("Answer: 391", [("Answer", -0.2, {"Answer": -0.2}), (":", -0.1, {":": -0.1}),
                                            (" 391", -0.1, {" 391": -0.1})]),
    },
}
SAMPLED = {  # seed 1
    "marlin": {"Q-one": "Answer: B", "Q-two": "Answer: A", "17*23": "so Answer: 390"},
    "triton_situ": {"Q-one": "The answer is \\boxed{B}", "Q-two": "Answer: C", "17*23": "Answer: 391"},
}


def arm_responder(arm):
    def respond(payload):
        text = payload["messages"][0]["content"]
        key = next(k for k in GREEDY[arm] if k in text)
        if payload["temperature"] == 0.0:
            return 200, GREEDY[arm][key], 0
        return 200, completion(SAMPLED[arm][key]), 0
    return respond
