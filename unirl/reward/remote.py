"""`RemoteRewardBackend`: score through a reward server (`python -m unirl.reward.server`) by URL."""

from __future__ import annotations

import http.client
import json
import os
import threading
import time
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from annotated_types import Ge, Gt

from unirl.reward.base import RewardBackend
from unirl.reward.service import RewardError
from unirl.reward.wire import WireError, decode_response, encode_request
from unirl.types.reward import RewardRequest, RewardResponse


class RemoteRewardError(RewardError):
    """The reward server answered an error, or gave no answer within the timeout and retries."""


class RemoteRewardBackend(RewardBackend):
    """A `RewardBackend` whose scorers run in a reward server; usable wherever a
    `LocalRewardBackend` is (same `RewardResponse`, same per-component metrics).

    Args:
        url: the server's base URL, `http(s)://host:port` (a path prefix is kept).
        token_env: name of an environment variable holding the server's bearer token.
        token_file: a file holding it (stripped). At most one of the two; neither: no
            token (a loopback server started without one). The token is read here,
            so a missing variable or file fails when the recipe is validated.
        timeout_s: seconds to wait for connecting and for each read of one attempt.
        max_retries: further attempts after a connection error, a timeout or a 5xx
            answer; a 4xx answer is never retried (the request is at fault).
        backoff_s: sleep before retry k (1-based) is `backoff_s * 2**(k - 1)`.
        image_encoding: `raw` (uint8 bytes: no encoding cost, 4/3 of the pixels on the
            wire) or `png` (lossless, smaller for smooth images, ~45 ms per 512x512 image
            to encode on one CPU core): png pays off on slow links only.

    The first call fetches `GET /v1/info` (the weights and the server's body limit);
    `score(req)` then posts `req` (schema: `unirl.reward.wire`) and returns the
    server's unweighted [B] fp32 components. Each calling thread keeps one HTTP
    connection alive. A body over the server's limit, an error answer (naming the
    URL, the HTTP status, and the sample id and prompt when the server names a
    sample), weights that change mid-run, or no answer after `max_retries + 1`
    attempts raises `RemoteRewardError` (a `RewardError`: the trainer stops the step
    naming it). Against a server that accepts connections and never answers, one
    request gives up after about `(max_retries + 1) * timeout_s + backoff_s *
    (2**max_retries - 1)` seconds.
    """

    def __init__(
        self,
        url: str,
        token_env: str | None = None,
        token_file: str | None = None,
        timeout_s: Annotated[float, Gt(0)] = 60.0,
        max_retries: Annotated[int, Ge(0)] = 3,
        backoff_s: Annotated[float, Ge(0)] = 0.5,
        image_encoding: Literal["raw", "png"] = "raw",
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
            raise ValueError(
                f"url must be http(s)://host:port of a reward server (python -m unirl.reward.server), got {url!r}"
            )
        if token_env is not None and token_file is not None:
            raise ValueError("give the reward server's token by token_env or token_file, not both")
        token = None
        if token_env is not None:
            token = os.environ.get(token_env, "").strip()
            if not token:
                raise ValueError(
                    f"token_env={token_env!r} names an environment variable that is not set or empty; "
                    "export it with the reward server's token, or set token_env: null for a server without one"
                )
        if token_file is not None:
            try:
                with open(token_file) as f:
                    token = f.read().strip()
            except OSError as e:
                raise ValueError(
                    f"token_file={token_file!r} cannot be read ({e.strerror}); write the token there"
                ) from None
            if not token:
                raise ValueError(f"token_file={token_file!r} is empty; write the reward server's token there")
        if not (timeout_s > 0 and max_retries >= 0 and backoff_s >= 0):
            raise ValueError(
                f"need timeout_s > 0, max_retries >= 0, backoff_s >= 0; got {timeout_s}, {max_retries}, {backoff_s}"
            )
        if image_encoding not in ("raw", "png"):
            raise ValueError(f"image_encoding must be 'raw' or 'png', got {image_encoding!r}")
        self.url = url.rstrip("/")
        self.timeout_s, self.max_retries, self.backoff_s = (
            float(timeout_s),
            int(max_retries),
            float(backoff_s),
        )
        self.image_encoding = image_encoding
        parts = urlsplit(self.url)
        self._https, self._host, self._port = parts.scheme == "https", parts.hostname, parts.port
        self._prefix = parts.path
        self._headers = {"Content-Type": "application/json"}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self._info: dict[str, Any] | None = None
        self._local = threading.local()  # one kept-alive connection per calling thread

    def __repr__(self) -> str:  # the token stays out of logs
        return f"RemoteRewardBackend(url={self.url!r})"

    def __getstate__(self) -> dict[str, Any]:  # connections do not travel
        return {k: v for k, v in self.__dict__.items() if k != "_local"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._local = threading.local()

    @property
    def weights(self) -> dict[str, float]:
        return dict(self._server_info(None)["weights"])

    def score(self, req: RewardRequest) -> RewardResponse:
        limit = self._server_info(req)["max_body_bytes"]
        body = json.dumps(encode_request(req, self.image_encoding)).encode()
        if len(body) > limit:
            raise RemoteRewardError(
                f"reward server {self.url} takes request bodies up to {limit} bytes (its --max-body-mb); "
                f"this one is {len(body)}{_samples(req)}: raise the server's limit, or use "
                "image_encoding: png (smaller for smooth images)"
            )
        answer = self._call("POST", "/v1/score", body, req)
        try:
            resp, weights = decode_response(answer, len(req))
        except WireError as e:
            raise RemoteRewardError(
                f"reward server {self.url}/v1/score answered a malformed response: {e}"
            ) from None
        if weights != self._info["weights"]:
            raise RemoteRewardError(
                f"reward server {self.url} changed its weights mid-run: {self._info['weights']} -> {weights}; "
                "restart the run against one server configuration"
            )
        return resp

    def _server_info(self, req: RewardRequest | None) -> dict[str, Any]:
        """`GET /v1/info` once: the weights and the body limit."""
        if self._info is None:
            answer = self._call("GET", "/v1/info", None, req)
            weights = answer.get("weights") if isinstance(answer, dict) else None
            limit = answer.get("max_body_bytes") if isinstance(answer, dict) else None
            if not isinstance(weights, dict) or not isinstance(limit, int):
                raise RemoteRewardError(
                    f"reward server {self.url}/v1/info answered no weights and body limit: {answer!r:.200}"
                )
            self._info = {"weights": {str(k): float(v) for k, v in weights.items()}, "max_body_bytes": limit}
        return self._info

    # ---- transport ----------------------------------------------------------------------------

    def _exchange(self, method: str, path: str, body: bytes | None) -> tuple[int, bytes]:
        """(status, body) of one HTTP exchange on this thread's kept-alive connection. A reused
        connection the server closed meanwhile is replaced once, silently; other errors raise."""
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

    def _call(self, method: str, path: str, body: bytes | None, req: RewardRequest | None) -> Any:
        """The JSON answer of one request, retried on connection errors, timeouts and 5xx."""
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
                last = f"HTTP {status}: {_error_of(raw)}"
                continue
            if status >= 400:
                raise RemoteRewardError(self._describe(url, status, raw, req))
            try:
                return json.loads(raw)
            except ValueError:
                raise RemoteRewardError(f"reward server {url} answered non-JSON: {raw[:200]!r}") from None
        raise RemoteRewardError(
            f"reward server {url} gave no answer after {self.max_retries + 1} attempt(s) in "
            f"{time.perf_counter() - started:.1f} s (timeout_s={self.timeout_s:g}, max_retries={self.max_retries}); "
            f"last: {last}{_samples(req)}. Is `python -m unirl.reward.server` running there?"
        )

    def _describe(self, url: str, status: int, raw: bytes, req: RewardRequest | None) -> str:
        message = f"reward server {url} answered HTTP {status}: {_error_of(raw)}"
        try:
            index = json.loads(raw).get("sample_index")
        except (ValueError, AttributeError):
            index = None
        if req is not None and isinstance(index, int) and 0 <= index < len(req):
            message += f" [sample {req.sample_ids[index]!r}, prompt {req.prompts[index][:80]!r}]"
        else:
            message += _samples(req)
        return message


def _error_of(raw: bytes) -> str:
    """The `error` of a JSON error body, else the start of the body."""
    try:
        body = json.loads(raw)
    except ValueError:
        return raw[:200].decode("utf-8", "replace") or "(no message)"
    return str(body.get("error", body)) if isinstance(body, dict) else str(body)


def _samples(req: RewardRequest | None) -> str:
    if req is None:
        return ""
    shown = ", ".join(repr(s) for s in req.sample_ids[:4])
    return f" (scoring {len(req)} sample(s): {shown}{', ...' if len(req) > 4 else ''})"
