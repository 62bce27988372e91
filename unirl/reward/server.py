"""The remote reward service: serve any reward backend over HTTP (aiohttp), one command.

    python -m unirl.reward.server --config <yaml> [--chat-model DIR] [--host 127.0.0.1] [--port 8765]
        [--token-file FILE] [--max-batch 64] [--batch-window-ms 0] [--max-body-mb 64]

`<yaml>` names the backend the way a recipe does: a whole recipe (its
`reward.backend` is served), a `backend:` node, a backend node with a `_target_`
(e.g. `unirl.reward.LocalRewardBackend`), or plain `components:` + `weights:` (a
`LocalRewardBackend`). Endpoints (schema: `unirl.reward.wire`):

- `POST /v1/score`: score one request; 200 with every component's [B] scores and
  the weights. 400 malformed (the message names the sample and field), 401 bad or
  missing bearer token, 413 body over `--max-body-mb`, 422 a scorer rejected the
  data (its `ValueError`, e.g. a sample without the answer key), 500 a scorer
  crashed. Every error is a JSON body with `error`; the server keeps serving.
- `GET /v1/info`: `weights` (component name -> weight) and `max_body_bytes`.
- `POST /v1/chat/completions`, `GET /v1/models` (with `--chat-model DIR`, a local VLM directory;
  `--config` may then be left out): the OpenAI-style chat API a judge (`unirl.reward.chat.ChatJudge`)
  asks, answered greedily by `unirl.reward.chat.ChatModel`; 400 for a body it cannot answer, with
  the OpenAI error shape `{"error": {"message", "type"}}`.
- `GET /health` (no token): `status`, `schema`, and counters (`requests`,
  `samples`, `scorer_calls`, `errors`).

Security: the server binds loopback by default. With a token (`--token-file`, or
the `UNIRL_REWARD_TOKEN` environment variable) every scoring request needs
`Authorization: Bearer <token>`, compared in constant time; the token is never
printed or logged. Binding a non-loopback address without a token is refused.
No pickle: requests and answers are JSON.

Batching (`unirl.reward.batching.Batcher`): requests that wait while the scorer
is busy, or arrive within `--batch-window-ms`, are scored in one call of up to
`--max-batch` samples; `--max-batch 1` turns merging off.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import ipaddress
import json
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Annotated, Any

from aiohttp import web
from annotated_types import Interval
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from unirl.distributed.cores import apply_thread_count, govern_threads
from unirl.reward.base import LocalRewardBackend, RewardBackend
from unirl.reward.batching import Batcher
from unirl.reward.chat import ChatModel
from unirl.reward.wire import SCHEMA, WireError, decode_request, encode_response
from unirl.types.constraints import AtLeastOne, NonNegative, Positive, check_fields

log = logging.getLogger("unirl.reward.server")

TOKEN_ENV = "UNIRL_REWARD_TOKEN"
DEFAULT_PORT = 8765


@dataclass
class ServerConfig:
    """How the server listens and batches.

    Attributes:
        host: address to bind; loopback unless a token is set.
        port: TCP port; 0 picks a free one (the bound URL is `RewardServer.url`).
        max_batch: most samples one scorer call gets when requests are merged (>= 1).
        batch_window_ms: how long the first waiting request waits for others to join
            (0: no waiting, merge only what queued while the scorer was busy).
        max_body_mb: largest request body; a larger one gets 413.
        max_image_pixels: largest H x W of one image (checked before decoding a PNG).
    """

    host: str = "127.0.0.1"
    port: Annotated[int, Interval(ge=0, le=65535)] = DEFAULT_PORT
    max_batch: AtLeastOne = 64
    batch_window_ms: NonNegative = 0.0
    max_body_mb: Positive = 64.0
    max_image_pixels: AtLeastOne = 4096 * 4096

    def __post_init__(self) -> None:
        check_fields(self)

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * 2**20)


def is_loopback(host: str) -> bool:
    """True for `localhost` and loopback addresses (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def read_token(token_file: str | None, env: str = TOKEN_ENV) -> str | None:
    """The server's token: the stripped contents of `token_file`, else `$env`, else None (no auth)."""
    if token_file is not None:
        with open(token_file) as f:
            token = f.read().strip()
        if not token:
            raise ValueError(f"token file {token_file!r} is empty; write the token into it")
        return token
    return os.environ.get(env) or None


def load_backend(path: str) -> RewardBackend:
    """Build the backend a YAML names: a recipe's `reward.backend`, a `backend:` node, a `_target_`
    node, or plain `components` + `weights` (a `LocalRewardBackend`)."""
    try:
        node: Any = OmegaConf.load(path)
    except Exception as e:  # noqa: BLE001 - a missing file or bad YAML, reported with the path
        raise ValueError(f"{path}: cannot be read as YAML ({type(e).__name__}: {e})") from None
    for key in ("reward", "backend"):  # a recipe -> its reward -> the reward's backend
        if isinstance(node, DictConfig) and key in node:
            node = node[key]
    if not isinstance(node, DictConfig) or ("_target_" not in node and "components" not in node):
        raise ValueError(
            f"{path}: names no reward backend; give a recipe (reward.backend), a backend node with a "
            "_target_, or components: + weights:"
        )
    try:
        if "_target_" in node:
            backend = instantiate(node, _convert_="all")
        else:
            plain = OmegaConf.to_container(node, resolve=True)
            backend = LocalRewardBackend(
                instantiate(plain["components"], _convert_="all"), plain.get("weights")
            )
    except Exception as e:  # noqa: BLE001 - Hydra wraps the scorer's own error; name the file
        cause = e.__cause__ or e
        raise ValueError(
            f"{path}: the reward backend cannot be built ({type(cause).__name__}: {cause})"
        ) from None
    if not isinstance(backend, RewardBackend):
        raise ValueError(f"{path}: builds a {type(backend).__name__}, not a RewardBackend (score + weights)")
    return backend


# ---- the application ------------------------------------------------------------------------


def _error(status: int, message: str, **extra: Any) -> web.Response:
    return web.json_response({"schema": SCHEMA, "error": message, **extra}, status=status)


def build_app(
    backend: RewardBackend | None, token: str | None, config: ServerConfig, chat: ChatModel | None = None
) -> web.Application:
    """The aiohttp application serving `backend` and/or the chat model `chat` (routes and
    statuses: the module docstring)."""
    if backend is None and chat is None:
        raise ValueError(
            "the reward server needs a backend (--config) or a chat model (--chat-model), or both"
        )
    expected = None if token is None else f"Bearer {token}".encode()
    counters = {"requests": 0, "samples": 0, "errors": 0}
    weights = backend.weights if backend is not None else {}
    batcher_key = web.AppKey("batcher", Batcher)

    @web.middleware
    async def authorize(request: web.Request, handler):
        if expected is not None and request.path != "/health":
            given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
            if not hmac.compare_digest(given, expected):
                counters["errors"] += 1
                what = "no" if not given else "a wrong"
                return _error(
                    401,
                    f"{what} bearer token: send 'Authorization: Bearer <token>' with the server's token "
                    f"(--token-file or {TOKEN_ENV})",
                    headers={"WWW-Authenticate": "Bearer"},
                )
        return await handler(request)

    async def score(request: web.Request) -> web.Response:
        counters["requests"] += 1
        too_large = (
            f"request body over the server's limit of {config.max_body_bytes} bytes (--max-body-mb "
            f"{config.max_body_mb:g}); send fewer samples per request or PNG images"
        )
        if request.content_length is not None and request.content_length > config.max_body_bytes:
            counters["errors"] += 1
            return _error(413, f"{request.content_length} bytes: {too_large}")
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            counters["errors"] += 1
            return _error(413, too_large)
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            counters["errors"] += 1
            return _error(400, f"body: not JSON ({e})", field="body")
        try:
            req = decode_request(body, config.max_image_pixels)
        except WireError as e:
            counters["errors"] += 1
            return web.json_response(e.to_json(), status=400)
        try:
            resp = await request.app[batcher_key].score(req)
        except ValueError as e:  # a scorer's data error: the request is at fault, retrying cannot help
            counters["errors"] += 1
            return _error(422, f"{type(e).__name__}: {e}")
        except Exception as e:  # noqa: BLE001 - answer, log and keep serving
            counters["errors"] += 1
            log.exception("scoring %d sample(s) failed", len(req))
            return _error(500, f"the scorer crashed: {type(e).__name__}: {e}")
        counters["samples"] += len(req)
        return web.json_response(encode_response(resp, weights))

    async def info(request: web.Request) -> web.Response:
        return web.json_response(
            {
                "schema": SCHEMA,
                "weights": {n: float(w) for n, w in weights.items()},
                "max_body_bytes": config.max_body_bytes,
            }
        )

    async def chat_completions(request: web.Request) -> web.Response:
        counters["requests"] += 1
        try:
            body = await request.json()
            answer = await asyncio.get_running_loop().run_in_executor(None, chat.complete, body)
        except (ValueError, UnicodeDecodeError) as e:  # ChatRequestError, or a body that is not JSON
            counters["errors"] += 1
            return web.json_response(
                {"error": {"message": str(e), "type": "invalid_request_error"}}, status=400
            )
        except Exception as e:  # noqa: BLE001 - answer, log and keep serving
            counters["errors"] += 1
            log.exception("a chat completion failed")
            return web.json_response(
                {"error": {"message": f"{type(e).__name__}: {e}", "type": "server_error"}}, status=500
            )
        counters["samples"] += 1
        return web.json_response(answer)

    async def models(request: web.Request) -> web.Response:
        return web.json_response(chat.models())

    async def health(request: web.Request) -> web.Response:
        calls = request.app[batcher_key].scorer_calls if batcher_key in request.app else 0
        return web.json_response({"status": "ok", "schema": SCHEMA, **counters, "scorer_calls": calls})

    async def start_batcher(app: web.Application) -> None:
        # the scorer's thread keeps its torch threads at the cores other processes leave free
        app[batcher_key] = Batcher(
            backend,
            config.max_batch,
            config.batch_window_ms / 1000.0,
            initializer=govern_threads,
            before_each=apply_thread_count,
        )
        app[batcher_key].start()

    async def stop_batcher(app: web.Application) -> None:
        await app[batcher_key].stop()

    app = web.Application(middlewares=[authorize], client_max_size=config.max_body_bytes)
    if backend is not None:
        app.router.add_post("/v1/score", score)
        app.router.add_get("/v1/info", info)
        app.on_startup.append(start_batcher)
        app.on_cleanup.append(stop_batcher)
    if chat is not None:
        app.router.add_post("/v1/chat/completions", chat_completions)
        app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    return app


def _check_bind(host: str, token: str | None) -> None:
    if token is None and not is_loopback(host):
        raise ValueError(
            f"binding {host} without a token would let anyone who reaches it use the reward server; "
            f"pass --token-file FILE or set {TOKEN_ENV}, or bind 127.0.0.1"
        )


async def _start(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0]
    shown = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
    return runner, f"http://{shown}:{bound[1]}"


class RewardServer:
    """The service on a background thread with its own event loop (tests, benchmarks, notebooks).

    `start()` returns the bound URL (`config.port=0` picks a free port); `stop()`
    (or leaving the `with` block) shuts it down. `python -m unirl.reward.server`
    runs the same application in the foreground.
    """

    def __init__(
        self,
        backend: RewardBackend | None,
        token: str | None = None,
        config: ServerConfig | None = None,
        chat: ChatModel | None = None,
    ):
        self.config = config or ServerConfig(port=0)
        _check_bind(self.config.host, token)
        self.app = build_app(backend, token, self.config, chat)
        self.url: str | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="reward-server", daemon=True)
        self._runner: web.AppRunner | None = None

    def start(self) -> str:
        self._thread.start()
        future = asyncio.run_coroutine_threadsafe(
            _start(self.app, self.config.host, self.config.port), self._loop
        )
        self._runner, self.url = future.result(timeout=30)
        return self.url

    def stop(self) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=30)
            self._runner = None
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)
            self._loop.close()

    def __enter__(self) -> RewardServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


async def _serve_forever(app: web.Application, host: str, port: int, describe: str) -> None:
    runner, url = await _start(app, host, port)
    print(f"unirl reward server: {describe} on {url}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


CHAT_MODEL = "unirl.models.qwen_vl.QwenVLConfig"  # the model config of a --chat-model directory


def chat_model_config(path: str) -> Any:
    """The model config `--chat-model DIR` names: a Qwen-VL directory (`CHAT_MODEL`)."""
    import importlib

    module, name = CHAT_MODEL.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)(pretrained_path=path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m unirl.reward.server", description=__doc__.split("\n")[0])
    defaults = ServerConfig()
    parser.add_argument("--config", default=None, help="YAML naming the reward backend (a recipe works)")
    parser.add_argument(
        "--chat-model", default=None, help="a local VLM directory to serve at /v1/chat/completions (a judge)"
    )
    parser.add_argument("--chat-name", default=None, help="its model name (default: the directory's name)")
    parser.add_argument("--host", default=defaults.host, help="address to bind (default: loopback)")
    parser.add_argument("--port", type=int, default=defaults.port, help="TCP port; 0 picks a free one")
    parser.add_argument(
        "--token-file", default=None, help=f"file holding the bearer token (else ${TOKEN_ENV})"
    )
    parser.add_argument("--max-batch", type=int, default=defaults.max_batch, help="samples per merged call")
    parser.add_argument("--batch-window-ms", type=float, default=defaults.batch_window_ms)
    parser.add_argument("--max-body-mb", type=float, default=defaults.max_body_mb)
    parser.add_argument("--max-image-pixels", type=int, default=defaults.max_image_pixels)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        config = ServerConfig(
            host=args.host,
            port=args.port,
            max_batch=args.max_batch,
            batch_window_ms=args.batch_window_ms,
            max_body_mb=args.max_body_mb,
            max_image_pixels=args.max_image_pixels,
        )
        token = read_token(args.token_file)
        _check_bind(config.host, token)
        if args.config is None and args.chat_model is None:
            raise ValueError("give --config (a reward backend), --chat-model (a judge VLM), or both")
        backend = load_backend(args.config) if args.config else None
        chat = ChatModel(chat_model_config(args.chat_model), args.chat_name) if args.chat_model else None
    except (OSError, ValueError) as e:
        print(f"unirl reward server: {e}", file=sys.stderr)
        return 2
    auth = f"bearer token from {args.token_file or TOKEN_ENV}" if token else "no token (loopback only)"
    served = [f"{sorted(backend.weights)} (max batch {config.max_batch})"] if backend else []
    served += [f"chat model {chat.name!r} at /v1/chat/completions"] if chat else []
    describe = f"serving {' and '.join(served)} ({auth})"
    app = build_app(backend, token, config, chat)
    started = time.perf_counter()
    try:
        asyncio.run(_serve_forever(app, config.host, config.port, describe))
    except KeyboardInterrupt:
        print(f"unirl reward server: stopped after {time.perf_counter() - started:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
