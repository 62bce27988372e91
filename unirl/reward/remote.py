"""`RemoteRewardBackend`: score through a reward server (`python -m unirl.reward.server`) by URL."""

from __future__ import annotations

import http.client
import json
import os
import time
import urllib.error
import urllib.request
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
        image_encoding: `png` (lossless, smaller) or `raw` (uint8 bytes, no encoding).

    `score(req)` returns the server's unweighted [B] fp32 components; `weights` are
    the server's (fetched from `GET /v1/info` if asked before the first score). A
    server whose weights change mid-run, an error answer (naming the URL, the HTTP
    status, and the sample id and prompt when the server names a sample), or no
    answer after `max_retries + 1` attempts raises `RemoteRewardError` (a
    `RewardError`, so the trainer stops the step naming it). One call takes at
    most about `(max_retries + 1) * timeout_s + backoff_s * (2**max_retries - 1)`
    seconds against a server that accepts connections but never answers.
    """

    def __init__(
        self,
        url: str,
        token_env: str | None = None,
        token_file: str | None = None,
        timeout_s: Annotated[float, Gt(0)] = 60.0,
        max_retries: Annotated[int, Ge(0)] = 3,
        backoff_s: Annotated[float, Ge(0)] = 0.5,
        image_encoding: Literal["png", "raw"] = "png",
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
        if image_encoding not in ("png", "raw"):
            raise ValueError(f"image_encoding must be 'png' or 'raw', got {image_encoding!r}")
        self.url = url.rstrip("/")
        self.timeout_s, self.max_retries, self.backoff_s = (
            float(timeout_s),
            int(max_retries),
            float(backoff_s),
        )
        self.image_encoding = image_encoding
        self._headers = {"Content-Type": "application/json"}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self._weights: dict[str, float] | None = None

    def __repr__(self) -> str:  # the token stays out of logs
        return f"RemoteRewardBackend(url={self.url!r})"

    @property
    def weights(self) -> dict[str, float]:
        if self._weights is None:
            answer = self._call("GET", "/v1/info", None, None)
            weights = answer.get("weights") if isinstance(answer, dict) else None
            if not isinstance(weights, dict):
                raise RemoteRewardError(
                    f"reward server {self.url}/v1/info answered no weights: {answer!r:.200}"
                )
            self._weights = {str(k): float(v) for k, v in weights.items()}
        return dict(self._weights)

    def score(self, req: RewardRequest) -> RewardResponse:
        body = json.dumps(encode_request(req, self.image_encoding)).encode()
        answer = self._call("POST", "/v1/score", body, req)
        try:
            resp, weights = decode_response(answer, len(req))
        except WireError as e:
            raise RemoteRewardError(
                f"reward server {self.url}/v1/score answered a malformed response: {e}"
            ) from None
        if self._weights is not None and weights != self._weights:
            raise RemoteRewardError(
                f"reward server {self.url} changed its weights mid-run: {self._weights} -> {weights}; "
                "restart the run against one server configuration"
            )
        self._weights = weights
        return resp

    # ---- transport ----------------------------------------------------------------------------

    def _call(self, method: str, path: str, body: bytes | None, req: RewardRequest | None) -> Any:
        """The JSON answer of one request, retried on connection errors, timeouts and 5xx."""
        url, started, last = self.url + path, time.perf_counter(), ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            request = urllib.request.Request(url, data=body, headers=self._headers, method=method)
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as answer:
                    raw = answer.read()
            except urllib.error.HTTPError as e:
                error = _error_body(e)
                if e.code < 500:
                    raise RemoteRewardError(self._describe(url, e.code, error, req)) from None
                last = f"HTTP {e.code}: {error.get('error', '')}"
                continue
            except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
                reason = getattr(e, "reason", e)
                if isinstance(reason, TimeoutError):
                    last = f"no answer within timeout_s={self.timeout_s:g} s"
                else:
                    last = f"{type(reason).__name__}: {reason}"
                continue
            try:
                return json.loads(raw)
            except ValueError:
                raise RemoteRewardError(f"reward server {url} answered non-JSON: {raw[:200]!r}") from None
        raise RemoteRewardError(
            f"reward server {url} gave no answer after {self.max_retries + 1} attempt(s) in "
            f"{time.perf_counter() - started:.1f} s (timeout_s={self.timeout_s:g}, max_retries={self.max_retries}); "
            f"last: {last}{_samples(req)}. Is `python -m unirl.reward.server` running there?"
        )

    def _describe(self, url: str, status: int, error: dict[str, Any], req: RewardRequest | None) -> str:
        message = f"reward server {url} answered HTTP {status}: {error.get('error', '(no message)')}"
        index = error.get("sample_index")
        if req is not None and isinstance(index, int) and 0 <= index < len(req):
            message += f" [sample {req.sample_ids[index]!r}, prompt {req.prompts[index][:80]!r}]"
        else:
            message += _samples(req)
        return message


def _error_body(e: urllib.error.HTTPError) -> dict[str, Any]:
    try:
        body = json.loads(e.read())
    except (ValueError, OSError):
        return {"error": e.reason}
    return body if isinstance(body, dict) else {"error": str(body)}


def _samples(req: RewardRequest | None) -> str:
    if req is None:
        return ""
    shown = ", ".join(repr(s) for s in req.sample_ids[:4])
    return f" (scoring {len(req)} sample(s): {shown}{', ...' if len(req) > 4 else ''})"
