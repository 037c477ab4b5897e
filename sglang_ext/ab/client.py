"""Minimal OpenAI chat-completions client on the standard library only.

Non-streaming requests, retries with exponential backoff on connection errors, timeouts and
HTTP 5xx; no retry on 4xx or on a malformed 200 (retrying would not change them)."""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from .errors import EndpointDown, EndpointTimeout, MalformedResponse, ServerError


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
    latency_s: float


def parse_completion(body: Any, *, where: str, latency_s: float = 0.0) -> Completion:
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
    )


class ChatClient:
    """Client of one OpenAI-compatible server (one A/B arm).

    retries: extra attempts after the first; the wait before attempt n+1 is backoff_s * 2**n.
    """

    def __init__(self, name: str, base_url: str, *, timeout_s: float = 3600.0, retries: int = 3,
                 backoff_s: float = 1.0) -> None:
        self.name = name
        self.base_url = normalize_base_url(base_url)
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s

    def _request(self, method: str, path: str, payload: dict | None = None) -> Any:
        url = self.base_url + path
        where = f"arm '{self.name}' ({url})"
        data = None if payload is None else json.dumps(payload).encode()
        last: Exception | None = None
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            req = urllib.request.Request(url, data=data, method=method,
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                    raw = resp.read()
            except urllib.error.HTTPError as e:
                detail = e.read()[:300].decode(errors="replace")
                if 500 <= e.code < 600:
                    last = ServerError(f"{where}: HTTP {e.code} after {attempt + 1} attempt(s): {detail}")
                    continue
                raise ServerError(f"{where}: HTTP {e.code}: {detail}") from None
            except (TimeoutError, socket.timeout):
                last = self._timeout(where, attempt)
                continue
            except urllib.error.URLError as e:
                if isinstance(e.reason, (TimeoutError, socket.timeout)):
                    last = self._timeout(where, attempt)
                else:
                    last = EndpointDown(f"{where}: cannot connect ({e.reason}) after {attempt + 1} "
                                        "attempt(s); is the server running?")
                continue
            except (ConnectionError, OSError) as e:  # reset / refused raised outside URLError
                last = EndpointDown(f"{where}: connection failed ({e!r}) after {attempt + 1} attempt(s)")
                continue
            try:
                return json.loads(raw)
            except ValueError:
                snippet = raw[:200].decode(errors="replace")
                raise MalformedResponse(f"{where}: response is not JSON: {snippet!r}") from None
        assert last is not None
        raise last

    def _timeout(self, where: str, attempt: int) -> EndpointTimeout:
        return EndpointTimeout(f"{where}: no answer within --timeout {self.timeout_s:g} s ({attempt + 1} attempt(s))")

    def models(self) -> list[str]:
        """GET /v1/models -> served model ids (also a reachability check)."""
        body = self._request("GET", "/v1/models")
        try:
            return [str(m["id"]) for m in body["data"]]
        except (KeyError, TypeError):
            raise MalformedResponse(f"arm '{self.name}' ({self.base_url}/v1/models): no 'data' list of models") from None

    def chat(self, payload: dict) -> Completion:
        """POST /v1/chat/completions (non-streaming) and parse choices[0]."""
        t0 = time.perf_counter()
        body = self._request("POST", "/v1/chat/completions", dict(payload, stream=False))
        return parse_completion(body, where=f"arm '{self.name}' ({self.base_url}/v1/chat/completions)",
                                latency_s=time.perf_counter() - t0)
