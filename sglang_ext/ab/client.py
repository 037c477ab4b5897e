"""OpenAI chat-completions client of the server A/B, on ``httpx`` (async).

Why httpx and not the ``openai`` client (both come with SGLang's install): the A/B's retry rule
is "connection errors, timeouts and HTTP 5xx, with a wait of ``--backoff`` doubled each retry;
never a 4xx or a malformed 200". openai's built-in retries also retry 408, 409 and 429 (4xx) and
wait its own jittered 0.5 s .. 8 s (or the server's Retry-After); neither is configurable short of
``max_retries=0``, which leaves the loop to us anyway. Its typed responses also tuck SGLang's
extras (``reasoning_content``) away in ``model_extra``. httpx gives what a client must not
hand-roll: connection pooling with a bound per arm (``httpx.Limits``), per-operation timeouts
(connect / read / write, as urllib's socket timeout was), HTTP/1.1 keep-alive, async requests
that are cancelled cleanly when the run stops, and ``httpx.MockTransport`` for tests. httpx
retries nothing by itself (its transport's ``retries=`` redoes failed connects without our
backoff, so it is not used); the retry policy below is the A/B's own rule, a dozen lines.

Semantics (unchanged from the urllib client): non-streaming requests; ``timeout_s`` bounds each
network operation (connect, each read, each write), which for a non-streaming completion is the
wait for the answer; retries: extra attempts after the first, the wait before attempt n+1 is
``backoff_s * 2**(n-1)``; errors are :mod:`.errors` types whose messages name the arm and URL.

httpx is imported on first use, so the CLI imports without it and ``serve`` says which package
is missing (``pip install 'kimi-k3-nvfp4[ab]'``).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .errors import ABError, EndpointDown, EndpointTimeout, MalformedResponse, ServerError

if TYPE_CHECKING:
    import httpx

INSTALL_HINT = "pip install 'kimi-k3-nvfp4[ab]' (or pip install httpx)"


def _httpx():
    """The httpx module, or a one-line ABError naming the missing package."""
    try:
        import httpx
    except ImportError:
        raise ABError(f"the serve A/B needs the httpx package, which is not installed: {INSTALL_HINT}") from None
    return httpx


def require_httpx() -> None:
    """ABError naming the package when httpx is missing: checked before a run touches its
    output directory."""
    _httpx()


def normalize_base_url(url: str) -> str:
    """'http://h:p', 'http://h:p/' or 'http://h:p/v1' -> 'http://h:p' (no trailing slash)."""
    url = url.strip().rstrip("/")
    if url.endswith("/v1"):
        url = url[: -len("/v1")]
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"endpoint URL must start with http:// or https://, got {url!r}")
    return url


@dataclass
class TokenLogprob:
    """One generated token with its logprob and the returned top-k alternatives."""

    token: str
    logprob: float
    top: dict[str, float] = field(default_factory=dict)  # token -> logprob, at most top_logprobs entries


@dataclass
class Completion:
    """The parts of a chat completion the A/B uses."""

    content: str | None
    reasoning_content: str | None
    finish_reason: str | None
    tokens: list[TokenLogprob] | None  # None when the server returned no logprobs
    completion_tokens: int | None
    latency_s: float  # from the first attempt's start to the parsed answer (retry waits included)
    prompt_tokens: int | None = None  # the server's usage.prompt_tokens
    attempts: int = 1  # HTTP attempts this answer took (1 = no retry)
    started_s: float | None = None  # time.perf_counter() when the request was sent (None: not sent by ChatClient)


def _not_a_number(x: Any) -> str | None:
    """'null' or 'NaN' when ``x`` is how a server writes a logprob it computed as NaN, else None.
    SGLang turns a NaN logprob into JSON null; other servers write NaN or "nan"."""
    if x is None:
        return "null"
    if isinstance(x, float) and math.isnan(x) or isinstance(x, str) and x.strip().lower() == "nan":
        return "NaN"
    return None


def _check_logprobs(t: Any, i: int, where: str) -> None:
    """Raise MalformedResponse naming a null / NaN logprob of token ``i`` (or of one of its
    top_logprobs): the server computed NaN, which no later step can compare."""
    if not isinstance(t, dict):
        return
    what = _not_a_number(t.get("logprob", 0.0))
    if what:
        raise MalformedResponse(f"{where}: the logprob of token {i} ({t.get('token')!r}) is {what} "
                                "(the server computed NaN)")
    for j, a in enumerate(t.get("top_logprobs") or []):
        what = _not_a_number(a.get("logprob", 0.0)) if isinstance(a, dict) else None
        if what:
            raise MalformedResponse(f"{where}: top_logprobs[{j}] ({a.get('token')!r}) of token {i} is {what} "
                                    "(the server computed NaN)")


def parse_completion(body: Any, *, where: str, latency_s: float = 0.0, attempts: int = 1,
                     started_s: float | None = None) -> Completion:
    """Validate a decoded chat-completion body and extract choices[0]. Raises MalformedResponse."""
    if not isinstance(body, dict) or not isinstance(body.get("choices"), list) or not body["choices"]:
        keys = sorted(body) if isinstance(body, dict) else type(body).__name__
        raise MalformedResponse(f"{where}: response has no non-empty 'choices' list (got {keys})")
    choice = body["choices"][0]
    msg = choice.get("message") if isinstance(choice, dict) else None
    if not isinstance(msg, dict):
        raise MalformedResponse(f"{where}: choices[0] has no 'message' object")
    tokens = None
    lp = choice.get("logprobs")
    if isinstance(lp, dict) and isinstance(lp.get("content"), list):
        tokens = []
        for i, t in enumerate(lp["content"]):
            _check_logprobs(t, i, where)
            try:
                top = {str(a["token"]): float(a["logprob"]) for a in (t.get("top_logprobs") or [])}
                tokens.append(TokenLogprob(str(t["token"]), float(t["logprob"]), top))
            except (KeyError, TypeError, ValueError) as e:
                raise MalformedResponse(f"{where}: logprobs.content[{i}] is malformed ({e!r})") from None
    usage = body.get("usage") if isinstance(body.get("usage"), dict) else {}
    return Completion(
        content=msg.get("content"),
        reasoning_content=msg.get("reasoning_content"),
        finish_reason=choice.get("finish_reason"),
        tokens=tokens,
        completion_tokens=usage.get("completion_tokens"),
        latency_s=latency_s,
        prompt_tokens=usage.get("prompt_tokens"),
        attempts=attempts,
        started_s=started_s,
    )


@dataclass
class _Answer:
    body: Any
    attempts: int


class ChatClient:
    """Client of one OpenAI-compatible server (one A/B arm).

    retries: extra attempts after the first; the wait before attempt n+1 is backoff_s * 2**(n-1).
    transport: an httpx async transport to use instead of the network (tests: httpx.MockTransport).
    The async methods take an ``httpx.AsyncClient`` from :meth:`session` (one per arm and run, so
    connections are reused); :meth:`chat` and :meth:`models` are one-off synchronous calls.
    """

    def __init__(self, name: str, base_url: str, *, timeout_s: float = 3600.0, retries: int = 3,
                 backoff_s: float = 1.0, transport: "httpx.AsyncBaseTransport | None" = None) -> None:
        self.name = name
        self.base_url = normalize_base_url(base_url)
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.transport = transport

    def session(self, concurrency: int = 1) -> "httpx.AsyncClient":
        """An ``httpx.AsyncClient`` for this arm with at most ``concurrency`` connections.

        Timeouts: ``timeout_s`` for connect, each read and each write; none for waiting on a free
        connection of the pool (the caller bounds requests in flight to the pool's size, so a
        request queued behind others is not charged their time)."""
        httpx = _httpx()
        n = max(1, concurrency)
        return httpx.AsyncClient(
            base_url=self.base_url, transport=self.transport, follow_redirects=True,  # as urllib did
            timeout=httpx.Timeout(self.timeout_s, pool=None),
            limits=httpx.Limits(max_connections=n, max_keepalive_connections=n),
            headers={"Content-Type": "application/json"},
        )

    def _timeout(self, where: str, attempt: int) -> EndpointTimeout:
        return EndpointTimeout(f"{where}: no answer within --timeout {self.timeout_s:g} s ({attempt + 1} attempt(s))")

    async def request(self, http: "httpx.AsyncClient", method: str, path: str, payload: dict | None = None) -> _Answer:
        """One API call with the retry rule: connection errors, timeouts and 5xx are retried after
        the backoff; a 4xx (any non-5xx error status) and a 200 that is not JSON raise at once."""
        httpx = _httpx()
        url = self.base_url + path
        where = f"arm '{self.name}' ({url})"
        content = None if payload is None else json.dumps(payload).encode()
        last: ABError | None = None
        for attempt in range(self.retries + 1):
            if attempt:
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                resp = await http.request(method, path, content=content)
            except httpx.TimeoutException:  # connect, read, write (no pool timeout: see session)
                last = self._timeout(where, attempt)
                continue
            except httpx.ConnectError as e:
                last = EndpointDown(f"{where}: cannot connect ({e}) after {attempt + 1} attempt(s); "
                                    "is the server running?")
                continue
            except httpx.TransportError as e:  # reset / closed mid-answer, protocol errors
                last = EndpointDown(f"{where}: connection failed ({type(e).__name__}: {e}) after {attempt + 1} attempt(s)")
                continue
            if resp.status_code >= 300:
                detail = resp.content[:300].decode(errors="replace")
                if 500 <= resp.status_code < 600:
                    last = ServerError(f"{where}: HTTP {resp.status_code} after {attempt + 1} attempt(s): {detail}")
                    continue
                raise ServerError(f"{where}: HTTP {resp.status_code}: {detail}")
            try:
                return _Answer(json.loads(resp.content), attempt + 1)
            except ValueError:
                snippet = resp.content[:200].decode(errors="replace")
                raise MalformedResponse(f"{where}: response is not JSON: {snippet!r}") from None
        assert last is not None
        raise last

    async def amodels(self, http: "httpx.AsyncClient") -> list[str]:
        """GET /v1/models -> served model ids (also a reachability check)."""
        body = (await self.request(http, "GET", "/v1/models")).body
        try:
            return [str(m["id"]) for m in body["data"]]
        except (KeyError, TypeError):
            raise MalformedResponse(f"arm '{self.name}' ({self.base_url}/v1/models): no 'data' list of models") from None

    async def achat(self, http: "httpx.AsyncClient", payload: dict) -> Completion:
        """POST /v1/chat/completions (non-streaming) and parse choices[0]."""
        t0 = time.perf_counter()
        ans = await self.request(http, "POST", "/v1/chat/completions", dict(payload, stream=False))
        return parse_completion(ans.body, where=f"arm '{self.name}' ({self.base_url}/v1/chat/completions)",
                                latency_s=time.perf_counter() - t0, attempts=ans.attempts, started_s=t0)

    async def _once(self, method: str, *args):
        async with self.session() as http:
            return await getattr(self, method)(http, *args)

    def models(self) -> list[str]:
        """Synchronous :meth:`amodels` on a session of its own."""
        return asyncio.run(self._once("amodels"))

    def chat(self, payload: dict) -> Completion:
        """Synchronous :meth:`achat` on a session of its own."""
        return asyncio.run(self._once("achat", payload))
