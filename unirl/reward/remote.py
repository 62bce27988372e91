"""`RemoteRewardBackend`: score through a reward server (`python -m unirl.reward.server`) by URL."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from annotated_types import Ge, Gt

from unirl.reward.base import RewardBackend
from unirl.reward.http import JsonHttp, check_http_url, env_secret, error_of
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
        url = check_http_url(url, "a reward server (python -m unirl.reward.server)")
        if token_env is not None and token_file is not None:
            raise ValueError("give the reward server's token by token_env or token_file, not both")
        token = None
        if token_env is not None:
            token = env_secret(
                "token_env",
                token_env,
                "export it with the reward server's token, or set token_env: null for a server without one",
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
        if image_encoding not in ("raw", "png"):
            raise ValueError(f"image_encoding must be 'raw' or 'png', got {image_encoding!r}")
        self.url = url
        self.image_encoding = image_encoding
        self._http = JsonHttp(
            url,
            {"Authorization": f"Bearer {token}"} if token else {},
            timeout_s,
            max_retries,
            backoff_s,
            RemoteRewardError,
            "reward server",
            "Is `python -m unirl.reward.server` running there?",
        )
        self._info: dict[str, Any] | None = None

    def __repr__(self) -> str:  # the token stays out of logs
        return f"RemoteRewardBackend(url={self.url!r})"

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

    def _call(self, method: str, path: str, body: bytes | None, req: RewardRequest | None) -> Any:
        """The JSON answer of one request (`JsonHttp.call`), errors naming the samples."""
        return self._http.call(
            method, path, body, lambda url, status, raw: self._describe(url, status, raw, req), _samples(req)
        )

    def _describe(self, url: str, status: int, raw: bytes, req: RewardRequest | None) -> str:
        message = f"reward server {url} answered HTTP {status}: {error_of(raw)}"
        try:
            index = json.loads(raw).get("sample_index")
        except (ValueError, AttributeError):
            index = None
        if req is not None and isinstance(index, int) and 0 <= index < len(req):
            message += f" [sample {req.sample_ids[index]!r}, prompt {req.prompts[index][:80]!r}]"
        else:
            message += _samples(req)
        return message


def _samples(req: RewardRequest | None) -> str:
    if req is None:
        return ""
    shown = ", ".join(repr(s) for s in req.sample_ids[:4])
    return f" (scoring {len(req)} sample(s): {shown}{', ...' if len(req) > 4 else ''})"
