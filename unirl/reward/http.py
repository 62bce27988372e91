"""`JsonHttp`: JSON over HTTP(S) with kept-alive connections, timeouts and retries, for the clients
of a reward service (`RemoteRewardBackend`, `ChatJudge`), and the checks of their settings
(`check_http_url`, `env_secret`)."""

from __future__ import annotations

import http.client
import json
import os
import threading
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

Describe = Callable[[str, int, bytes], str]
"""(url, HTTP status, body) -> the message of a 4xx answer."""


def check_http_url(url: str, what: str) -> str:
    """`url` without a trailing slash; raises naming `what` unless it is http(s)://host[:port][/path]."""
    parts = urlsplit(url) if isinstance(url, str) else None
    if (
        parts is None
        or parts.scheme not in ("http", "https")
        or not parts.hostname
        or parts.query
        or parts.fragment
    ):
        raise ValueError(f"url must be http(s)://host:port of {what}, got {url!r}")
    return url.rstrip("/")


def env_secret(setting: str, name: str, fix: str) -> str:
    """The stripped value of the environment variable `name` (a key or token the recipe names by
    `setting`, e.g. "token_env"); a ValueError ending in `fix` when it is not set or empty."""
    value = os.environ.get(name, "").strip()
    if not value:
        raise ValueError(f"{setting}={name!r} names an environment variable that is not set or empty; {fix}")
    return value


def error_of(raw: bytes) -> str:
    """The `error` of a JSON error body (an OpenAI-style `{"error": {"message": ...}}` too), else
    the start of the body."""
    try:
        body = json.loads(raw)
    except ValueError:
        return raw[:200].decode("utf-8", "replace") or "(no message)"
    if not isinstance(body, dict):
        return str(body)
    error = body.get("error", body)
    return str(error.get("message", error)) if isinstance(error, dict) else str(error)


class JsonHttp:
    """Requests to one server: `call(method, path, body)` -> the decoded JSON answer.

    Args:
        url: the base URL (`check_http_url`); a path prefix is kept.
        headers: sent with every request (JSON content type added).
        timeout_s, max_retries, backoff_s: an attempt waits `timeout_s` for connecting and for each
            read; a connection error, a timeout or a 5xx answer is retried `max_retries` times,
            sleeping `backoff_s * 2**(k - 1)` before retry k; a 4xx answer is never retried.
        error: the exception type raised.
        server: how messages name the server (e.g. "reward server").
        hint: appended to the message when every attempt failed (how to start the server).

    Each calling thread keeps one connection alive (a reused connection the server closed is
    replaced once, silently). Pickles without its connections.
    """

    def __init__(
        self,
        url: str,
        headers: dict[str, str],
        timeout_s: float,
        max_retries: int,
        backoff_s: float,
        error: type[Exception],
        server: str,
        hint: str,
    ) -> None:
        if not (timeout_s > 0 and max_retries >= 0 and backoff_s >= 0):
            raise ValueError(
                f"need timeout_s > 0, max_retries >= 0, backoff_s >= 0; got {timeout_s}, {max_retries}, {backoff_s}"
            )
        self.url = url.rstrip("/")
        self.timeout_s, self.max_retries, self.backoff_s = (
            float(timeout_s),
            int(max_retries),
            float(backoff_s),
        )
        self.error, self.server, self.hint = error, server, hint
        parts = urlsplit(self.url)
        self._https, self._host, self._port, self._prefix = (
            parts.scheme == "https",
            parts.hostname,
            parts.port,
            parts.path,
        )
        self._headers = {"Content-Type": "application/json", **headers}
        self._local = threading.local()

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_local"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._local = threading.local()

    def call(
        self, method: str, path: str, body: bytes | None, describe: Describe | None = None, context: str = ""
    ) -> Any:
        """The JSON answer of one request, retried on connection errors, timeouts and 5xx; a 4xx
        raises `describe(url, status, body)` (default: the server's error), a non-JSON answer or
        the last failed attempt raises naming the server, the attempts and `context`."""
        url, started, last = self.url + path, time.perf_counter(), ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                status, raw = self._exchange(method, path, body)
            except TimeoutError:
                last = f"no answer within timeout_s={self.timeout_s:g} s"
                continue
            except (OSError, http.client.HTTPException) as e:
                last = f"{type(e).__name__}: {e}"
                continue
            if status >= 500:
                last = f"HTTP {status}: {error_of(raw)}"
                continue
            if status >= 400:
                raise self.error(
                    describe(url, status, raw)
                    if describe
                    else f"{self.server} {url} answered HTTP {status}: {error_of(raw)}{context}"
                )
            try:
                return json.loads(raw)
            except ValueError:
                raise self.error(f"{self.server} {url} answered non-JSON: {raw[:200]!r}") from None
        raise self.error(
            f"{self.server} {url} gave no answer after {self.max_retries + 1} attempt(s) in "
            f"{time.perf_counter() - started:.1f} s (timeout_s={self.timeout_s:g}, max_retries={self.max_retries}); "
            f"last: {last}{context}. {self.hint}"
        )

    def _exchange(self, method: str, path: str, body: bytes | None) -> tuple[int, bytes]:
        """(status, body) of one HTTP exchange on this thread's kept-alive connection."""
        for fresh in (False, True):
            conn = getattr(self._local, "conn", None)
            reused = conn is not None and not fresh
            if not reused:
                self._drop()
                kind = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
                conn = self._local.conn = kind(self._host, self._port, timeout=self.timeout_s)
            try:
                conn.request(method, self._prefix + path, body=body, headers=self._headers)
                answer = conn.getresponse()
                data = answer.read()
            except (ConnectionResetError, BrokenPipeError, http.client.RemoteDisconnected):
                self._drop()
                if reused:
                    continue
                raise
            except BaseException:
                self._drop()
                raise
            if answer.will_close:
                self._drop()
            return answer.status, data
        raise AssertionError("unreachable")

    def _drop(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
        self._local.conn = None
