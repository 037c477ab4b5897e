"""The serve A/B's httpx client: which failures are retried, the backoff schedule, the bound on
requests in flight per arm, and the early stop that cancels the rest.

Servers: ``httpx.MockTransport`` (httpx's own in-process transport: real requests and
responses, no network) where a failure must be exact (a reset, a timeout, a 429), and real
sockets on 127.0.0.1 (tests/ab_fake_server.py, a raw socket that hangs up) where the network
path matters. Nothing of the client itself is replaced.
"""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import threading

import httpx
import pytest

from ab_fake_server import FakeServer, completion
from k3nvfp4.sglang_ext.ab import cli, serve
from k3nvfp4.sglang_ext.ab.client import ChatClient
from k3nvfp4.sglang_ext.ab.errors import ABError, EndpointDown, EndpointTimeout, ServerError


def _ok(text="Answer: 7", prompt_tokens=11):
    body = completion(text)
    body["usage"]["prompt_tokens"] = prompt_tokens
    return httpx.Response(200, json=body)


def _script(*steps):
    """A MockTransport handler answering step i on request i: a status code (with a body), an
    httpx exception to raise, or a Response."""
    seen = []

    def handle(request: httpx.Request):
        seen.append(request)
        step = steps[min(len(seen), len(steps)) - 1]
        if isinstance(step, Exception):
            raise step
        if isinstance(step, int):
            return httpx.Response(step, text=f"status {step}")
        return step

    return handle, seen


@pytest.fixture
def waits(monkeypatch):
    """The backoff waits the client asks for (asyncio.sleep's arguments), without waiting them."""
    asked, real_sleep = [], asyncio.sleep

    async def sleep(delay, *a, **kw):
        asked.append(delay)
        await real_sleep(0)

    monkeypatch.setattr(asyncio, "sleep", sleep)
    return asked


@pytest.mark.parametrize("failure", [502, 503, httpx.ConnectError("refused"), httpx.ReadTimeout("slow"),
                                     httpx.RemoteProtocolError("Server disconnected without sending a response."),
                                     httpx.ReadError("connection reset")],
                         ids=["502", "503", "connect", "read-timeout", "disconnect", "reset"])
def test_retried_failures_back_off_exponentially(failure, waits):
    handle, seen = _script(failure, failure, failure, _ok())
    c = ChatClient("a", "http://arm-a:1", retries=3, backoff_s=0.25, transport=httpx.MockTransport(handle))
    comp = c.chat({"model": "m", "messages": []})
    assert comp.content == "Answer: 7" and comp.attempts == 4 and len(seen) == 4
    assert comp.prompt_tokens == 11 and comp.completion_tokens == 3
    assert waits == [0.25, 0.5, 1.0]  # backoff_s * 2**(n-1) before attempt n+1
    assert all(json.loads(r.content)["stream"] is False for r in seen)


@pytest.mark.parametrize("failure, error, message", [
    (503, ServerError, r"^arm 'b' \(http://arm-b:1/v1/chat/completions\): HTTP 503 after 3 attempt\(s\): status 503$"),
    (httpx.ConnectError("[Errno 111] Connection refused"), EndpointDown,
     r"cannot connect \(\[Errno 111\] Connection refused\) after 3 attempt\(s\); is the server running\?"),
    (httpx.ReadError("reset by peer"), EndpointDown, r"connection failed \(ReadError: reset by peer\) after 3 attempt\(s\)"),
    (httpx.ConnectTimeout("timed out"), EndpointTimeout, r"no answer within --timeout 7 s \(3 attempt\(s\)\)"),
    (httpx.WriteTimeout("timed out"), EndpointTimeout, r"no answer within --timeout 7 s \(3 attempt\(s\)\)"),
])
def test_exhausted_retries_raise_the_last_failure(failure, error, message, waits):
    handle, seen = _script(failure)
    c = ChatClient("b", "http://arm-b:1/v1/", retries=2, backoff_s=1.0, timeout_s=7,
                   transport=httpx.MockTransport(handle))
    with pytest.raises(error, match=message):
        c.chat({"messages": []})
    assert len(seen) == 3 and waits == [1.0, 2.0]


@pytest.mark.parametrize("status", [400, 401, 404, 408, 409, 422, 429])
def test_4xx_is_never_retried(status, waits):
    # 408 / 409 / 429 included: the openai client would retry those (test_openai_client_retries_4xx).
    handle, seen = _script(httpx.Response(status, text="context length exceeded"), _ok())
    c = ChatClient("b", "http://arm-b:1", retries=3, backoff_s=0.01, transport=httpx.MockTransport(handle))
    with pytest.raises(ServerError, match=rf"^arm 'b' \(http://arm-b:1/v1/chat/completions\): HTTP {status}: "
                                          "context length exceeded$"):
        c.chat({"messages": []})
    assert len(seen) == 1 and waits == []


def test_malformed_200_is_not_retried(waits):
    handle, seen = _script(httpx.Response(200, text="<html>proxy</html>"), _ok())
    c = ChatClient("a", "http://arm-a:1", retries=3, transport=httpx.MockTransport(handle))
    with pytest.raises(ABError, match=r"response is not JSON: '<html>proxy</html>'"):
        c.chat({"messages": []})
    assert len(seen) == 1 and waits == []


def test_a_server_that_hangs_up_is_retried_then_named(waits):
    """Real sockets: a listener that accepts and closes without answering (what a server killed
    mid-request looks like to the client) is retried, then reported as a failed connection (a
    clean close or a reset, as the kernel delivers it: RemoteProtocolError or ReadError)."""
    lst = socket.create_server(("127.0.0.1", 0))
    accepted = []

    def serve_forever():
        while True:
            try:
                conn, _ = lst.accept()
            except OSError:
                return
            accepted.append(1)
            conn.recv(65536)
            conn.close()

    threading.Thread(target=serve_forever, daemon=True).start()
    try:
        c = ChatClient("b", f"http://127.0.0.1:{lst.getsockname()[1]}", retries=1, backoff_s=0.01, timeout_s=10)
        with pytest.raises(EndpointDown, match=r"^arm 'b' .*: connection failed \((RemoteProtocolError|ReadError): .*\) after 2 attempt"):
            c.chat({"messages": []})
    finally:
        lst.close()
    assert len(accepted) == 2 and waits == [0.01]


def test_openai_client_retries_4xx():
    """Why the A/B does not use the openai client's retries: it retries a 429 (and 408 / 409),
    which the A/B must not (a rejected request does not change by asking again), and picks its own
    waits. Against a real socket server answering 429."""
    openai = pytest.importorskip("openai")
    with FakeServer(lambda p: (429, {"error": {"message": "slow down"}}, 0)) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=1, timeout=10)
        with pytest.raises(openai.RateLimitError):
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        assert len(s.payloads) == 2  # retried; ChatClient sends it once (test_4xx_is_never_retried)


def _jobs(clients, n):
    return [(c, {"model": "m", "messages": [{"role": "user", "content": f"q{i}"}]}, (c.name, 0, f"p{i}"))
            for c in clients for i in range(n)]


def test_requests_in_flight_are_bounded(capsys):
    """--concurrency 3: at most 3 requests in flight over both arms (the bound of the thread pool
    the urllib client had, so the servers see the batches they saw), started in job order; every
    request answered once; the status line counts requests and tokens per arm."""
    state = {"in_flight": 0, "peak": 0, "order": []}

    def arm(name):
        async def handle(request):
            state["in_flight"] += 1
            state["peak"] = max(state["peak"], state["in_flight"])
            q = json.loads(request.content)["messages"][0]["content"]
            state["order"].append((name, q))
            await asyncio.sleep(0.01)  # let the other requests pile up
            state["in_flight"] -= 1
            return _ok(f"Answer: {q}")
        return ChatClient(name, f"http://{name}:1", transport=httpx.MockTransport(handle))

    clients = [arm("a"), arm("b")]
    jobs = _jobs(clients, 7)
    out = {}
    serve._run_all(jobs, 3, False, out)
    assert state["peak"] == 3
    assert state["order"][:3] == [("a", "q0"), ("a", "q1"), ("a", "q2")]  # FIFO: the first three jobs first
    assert sorted(out) == sorted(k for _, _, k in jobs)
    assert all(out[(n, 0, f"p{i}")].content == f"Answer: q{i}" for n in "ab" for i in range(7))
    err = capsys.readouterr().err.strip().splitlines()[-1]  # LogProgress's final line (no terminal)
    assert err.startswith("requests: 14 of 14 req (100%)") and err.endswith("(done)")
    assert " | a " in err and " | b " in err and err.count("req/s") == 3 and err.count("tok/s") == 2


def test_per_arm_rates_keep_three_significant_digits():
    """Issue 40, seen on two K3 CPU servers: 2 requests and 4 tokens in 90 s read
    "0.02 req/s 0.0 tok/s" (fixed decimals); the per-arm rates read as the bar's own rate does."""
    from k3nvfp4.sglang_ext.ab.client import Completion

    rates = serve._ArmRates(["reference", "triton_situ"])
    rates.t0 -= 90.0
    comp = Completion(content="", reasoning_content="w001 w002", finish_reason="length", tokens=None,
                      completion_tokens=2, latency_s=80.0)
    rates.add("reference", comp)
    line = rates.add("reference", comp)
    # 2 / 90 = 0.0222..., 4 / 90 = 0.0444...; the clock moved by microseconds since t0 was set back.
    assert line == "reference 0.0222 req/s 0.0444 tok/s | triton_situ 0 req/s 0 tok/s", line


def test_first_error_cancels_the_rest_and_keeps_what_was_answered():
    """Jobs a0 b0 a1 b1 ..., --concurrency 3. Arm a answers two requests, then hangs; arm b answers
    its first request HTTP 400 once a hangs, and hangs after that. The run stops with b's error at
    once: every request in flight is cancelled (not waited for), queued ones never start, and a's
    two answers are kept."""
    st = {"a": {"seen": 0, "cancelled": 0}, "b": {"seen": 0, "cancelled": 0}}
    a_hangs = asyncio.Event()  # binds to the run's loop on first use

    async def hang(arm):
        try:
            await asyncio.Event().wait()  # never answers
        except asyncio.CancelledError:
            st[arm]["cancelled"] += 1
            raise

    async def handle_a(request):
        st["a"]["seen"] += 1
        if st["a"]["seen"] <= 2:
            return _ok()
        a_hangs.set()
        await hang("a")

    async def handle_b(request):
        st["b"]["seen"] += 1
        if st["b"]["seen"] == 1:
            await a_hangs.wait()
            return httpx.Response(400, text="bad request")
        await hang("b")

    a = ChatClient("a", "http://a:1", transport=httpx.MockTransport(handle_a))
    b = ChatClient("b", "http://b:1", retries=3, transport=httpx.MockTransport(handle_b))
    jobs = [j for pair in zip(_jobs([a], 5), _jobs([b], 5)) for j in pair]
    out = {}
    with pytest.raises(ServerError, match=r"^arm 'b' \(http://b:1/v1/chat/completions\): HTTP 400: bad request$"):
        serve._run_all(jobs, 3, False, out)
    assert sorted(out) == [("a", 0, "p0"), ("a", 0, "p1")]
    # a0, a1 answered, a2 hangs; b0 fails, b1 and b2 (which took b0's slot) hang: all cancelled;
    # a3, a4, b3, b4 never started.
    assert st == {"a": {"seen": 3, "cancelled": 1}, "b": {"seen": 3, "cancelled": 2}}


def test_cli_without_httpx_names_the_package(tmp_path, capsys, monkeypatch):
    """A core install (no httpx): the CLI imports and --help works; serve fails in one line
    naming the package to install, before touching the output directory."""
    monkeypatch.setitem(sys.modules, "httpx", None)  # `import httpx` raises ImportError
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "--help"])
    assert e.value.code == 0
    capsys.readouterr()
    rc = cli.main(["serve", "--arm", "a=http://127.0.0.1:9", "--arm", "b=http://127.0.0.1:9", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1
    assert err.startswith("k3nvfp4-ab serve: error: the serve A/B needs the httpx package") and "pip install" in err
    assert not (tmp_path / "o").exists()
