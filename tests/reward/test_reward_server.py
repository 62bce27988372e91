"""The remote reward service: a real aiohttp server on an ephemeral loopback port (in a thread, or
the `python -m unirl.reward.server` command), the `RemoteRewardBackend` client against it."""

from __future__ import annotations

import base64
import copy
import http.client
import http.server
import json
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from urllib.parse import urlsplit

import pytest
import torch
from hydra import compose, initialize_config_dir

from tests.conftest import EXAMPLES, REPO
from unirl.config.validate import ConfigError, validate_recipe
from unirl.reward import (
    ColorTarget,
    ExactAnswer,
    FormatCheck,
    JpegIncompressibility,
    LocalRewardBackend,
    OverlongPenalty,
    RemoteRewardBackend,
    RemoteRewardError,
    RewardError,
    RewardService,
    TargetCharFraction,
)
from unirl.reward.server import RewardServer, ServerConfig
from unirl.reward.server import main as server_main
from unirl.reward.wire import SCHEMA, decode_request, encode_request
from unirl.types import LatentSegment, RewardRequest, RolloutTrack, TokenSegment

TOKEN = "s3cret-token"


def image_backend() -> LocalRewardBackend:
    return LocalRewardBackend(
        {"red": ColorTarget([1.0, 0.0, 0.0]), "jpeg": JpegIncompressibility(quality=90)}, {"jpeg": 0.01}
    )


def text_backend() -> LocalRewardBackend:
    return LocalRewardBackend(
        {
            "answer": ExactAnswer(extract="after:####", numeric=True),
            "format": FormatCheck(pattern="(?s).*#### .*"),
            "overlong": OverlongPenalty(max_length=12, buffer_length=4),
            "digits": TargetCharFraction(chars="0123456789"),
        },
        {"format": 0.1, "digits": 0.5},
    )


def image_request(n: int = 6, size: int = 16, seed: int = 0, prefix: str = "s") -> RewardRequest:
    g = torch.Generator().manual_seed(seed)
    return RewardRequest(
        sample_ids=[f"{prefix}{i}" for i in range(n)],
        prompts=[f"prompt {i}" for i in range(n)],
        images=torch.randint(0, 256, (n, 3, size, size), dtype=torch.uint8, generator=g),
        metadata=[{"group": i // 2, "tags": ["a", i]} for i in range(n)],
    )


def text_request(prefix: str = "t", answers: tuple = ("42", "7", "1,000", "5")) -> RewardRequest:
    texts = ["so #### 42", "#### 8", "the answer is #### $1,000", "no answer here at all"]
    return RewardRequest(
        sample_ids=[f"{prefix}{i}" for i in range(4)],
        prompts=["q"] * 4,
        texts=texts,
        metadata=[{"answer": a} for a in answers],
        response_lengths=[3, 2, 11, 15],
    )


@pytest.fixture(scope="module")
def image_server():
    with RewardServer(image_backend(), TOKEN, ServerConfig(port=0, max_body_mb=0.25)) as server:
        yield server


@pytest.fixture(scope="module")
def text_server():
    with RewardServer(text_backend(), TOKEN, ServerConfig(port=0, batch_window_ms=300)) as server:
        yield server


@pytest.fixture
def token_env(monkeypatch):
    monkeypatch.setenv("UNIRL_TEST_REWARD_TOKEN", TOKEN)
    return "UNIRL_TEST_REWARD_TOKEN"


def post(url: str, body: bytes, token: str | None = TOKEN, path: str = "/v1/score") -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url + path, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def health(url: str) -> dict:
    with urllib.request.urlopen(url + "/health", timeout=30) as answer:
        return json.loads(answer.read())


# ---- remote == local ---------------------------------------------------------------------------


@pytest.mark.parametrize("encoding", ["png", "raw"])
def test_remote_image_scores_equal_local_exactly(image_server, token_env, encoding):
    req = image_request()
    remote = RemoteRewardBackend(image_server.url, token_env=token_env, image_encoding=encoding)
    local = image_backend()
    got, want = remote.score(req).components, local.score(req).components
    assert set(got) == set(want) == {"red", "jpeg"}
    for name in want:
        assert got[name].dtype == torch.float32 and torch.equal(got[name], want[name]), name
    assert remote.weights == local.weights == {"red": 1.0, "jpeg": 0.01}


def test_remote_text_scores_equal_local_exactly(text_server, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    req = text_request()
    remote = RemoteRewardBackend(text_server.url, token_file=str(token_file))
    assert remote.weights == text_backend().weights  # fetched from /v1/info before any score
    got, want = remote.score(req).components, text_backend().score(req).components
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    # the hand values: answers 42 right, 8 != 7, 1000 right, none; lengths 3, 2 fine, 11 in the buffer
    assert got["answer"].tolist() == [1.0, 0.0, 1.0, 0.0]
    assert got["overlong"].tolist() == [0.0, 0.0, -0.75, -1.0]


def test_service_metrics_are_the_same_through_the_server(image_server, token_env):
    """RewardService on a track: identical rewards, components and per-component metrics."""
    req = image_request(n=4)
    tracks = []
    for backend in (image_backend(), RemoteRewardBackend(image_server.url, token_env=token_env)):
        segment = LatentSegment(
            latents=torch.zeros(4, 2, 4, 2, 2),
            positions=[0, 1],
            sigmas=torch.tensor([1.0, 0.0]),
            sde_indices=[0],
            log_probs=torch.zeros(4, 1),
            eta=0.7,
            guidance_scale=1.0,
        )
        track = RolloutTrack(
            name="diffusion",
            sample_ids=req.sample_ids,
            group_ids=["g0", "g0", "g1", "g1"],
            prompts=req.prompts,
            metadata=req.metadata,
            segment=segment,
            media=req.images,
        )
        tracks.append((RewardService(backend).score_and_attach(track), track))
    (local_metrics, local), (remote_metrics, remote) = tracks
    assert remote_metrics == local_metrics and "reward/jpeg/mean" in remote_metrics
    assert torch.equal(remote.rewards, local.rewards)
    assert torch.equal(
        remote.rewards, local.reward_components["red"] + 0.01 * local.reward_components["jpeg"]
    )


def test_wire_round_trip_is_exact_for_both_encodings():
    req = image_request(n=3, size=9)
    for encoding in ("png", "raw"):
        back = decode_request(json.loads(json.dumps(encode_request(req, encoding))))
        assert torch.equal(back.images, req.images) and back.metadata == req.metadata
        assert back.sample_ids == req.sample_ids and back.prompts == req.prompts
    text = text_request()
    back = decode_request(encode_request(text))
    assert (back.texts, back.response_lengths, back.images) == (text.texts, text.response_lengths, None)


def test_metadata_that_is_not_json_names_the_sample(image_server, token_env):
    req = image_request(n=2)
    req.metadata[1] = {"latent": torch.zeros(2)}
    with pytest.raises(ValueError, match="metadata of sample 's1' cannot be sent .* as JSON"):
        RemoteRewardBackend(image_server.url, token_env=token_env).score(req)


# ---- batching ----------------------------------------------------------------------------------


def concurrently(fns: list) -> list:
    """Run every fn at once (released by a barrier); their results or exceptions, in order."""
    barrier, out = threading.Barrier(len(fns)), [None] * len(fns)

    def run(i):
        barrier.wait()
        try:
            out[i] = fns[i]()
        except Exception as e:  # noqa: BLE001 - returned for the test to inspect
            out[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return out


def test_concurrent_requests_are_merged_and_each_gets_its_own_scores(text_server, token_env):
    """8 clients at once inside the 300 ms window: fewer scorer calls than requests, and every
    client gets exactly its local scores; a request that makes a scorer raise fails alone (422)."""
    remote = RemoteRewardBackend(text_server.url, token_env=token_env, max_retries=0)
    reqs = [text_request(prefix=f"c{k}-", answers=(str(40 + k), "8", "1000", "5")) for k in range(8)]
    reqs[5].metadata[2] = {}  # ExactAnswer: sample c5-2 has no answer key (a data bug)
    before = health(text_server.url)
    results = concurrently([lambda r=r: remote.score(r) for r in reqs])
    after = health(text_server.url)
    for k, (req, got) in enumerate(zip(reqs, results, strict=True)):
        if k == 5:
            assert isinstance(got, RemoteRewardError), got
            assert "HTTP 422" in str(got) and "'c5-2'" in str(got) and text_server.url in str(got)
            continue
        want = text_backend().score(req).components
        assert all(torch.equal(got.components[n], want[n]) for n in want), k
        assert got.components["answer"][0].item() == (1.0 if k == 2 else 0.0)  # only "42" is right
    assert after["requests"] - before["requests"] == 8
    merged_calls = after["scorer_calls"] - before["scorer_calls"] - 8  # the failed merge rescored 1 by 1
    assert merged_calls < 8, (before, after)


# ---- statuses: 401, 413, 400 -------------------------------------------------------------------


def good_body(n: int = 3, encoding: str = "raw") -> dict:
    return encode_request(image_request(n=n, size=8), encoding)


def test_missing_or_wrong_token_is_401_and_the_server_keeps_serving(image_server):
    body = json.dumps(good_body()).encode()
    for token in (None, "wrong", TOKEN + "x", ""):
        status, answer = post(image_server.url, body, token=token)
        assert status == 401 and "bearer token" in answer["error"] and TOKEN not in answer["error"]
    with pytest.raises(RemoteRewardError, match=r"HTTP 401.*'s0'"):
        RemoteRewardBackend(image_server.url, max_retries=3, backoff_s=10.0).score(
            image_request()
        )  # no retry
    assert post(image_server.url, body)[0] == 200
    assert health(image_server.url)["status"] == "ok"  # /health needs no token


def test_oversized_body_is_413_and_the_server_keeps_serving(image_server):
    big = json.dumps(good_body(n=64, encoding="raw") | {"pad": "x" * 300_000}).encode()  # > 0.25 MB
    status, answer = post(image_server.url, big)
    assert status == 413 and "limit of 262144 bytes" in answer["error"]
    # a chunked body has no Content-Length: aiohttp's client_max_size stops the read
    parts = urlsplit(image_server.url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    conn.putrequest("POST", "/v1/score")
    conn.putheader("Authorization", f"Bearer {TOKEN}")
    conn.putheader("Transfer-Encoding", "chunked")
    conn.endheaders()
    for _ in range(40):
        chunk = b"x" * 10_000
        conn.send(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
    conn.send(b"0\r\n\r\n")
    answer = conn.getresponse()
    assert answer.status == 413 and "limit" in json.loads(answer.read())["error"]
    conn.close()
    assert post(image_server.url, json.dumps(good_body()).encode())[0] == 200


def _mutate(body: dict, how: str) -> dict:
    body = copy.deepcopy(body)
    s1 = body["samples"][1]
    if how == "bad_base64":
        s1["image"]["data"] = "not base64!!"
    elif how == "wrong_shape":
        s1["image"]["shape"] = [3, 8, 9]
    elif how == "four_channels":
        s1["image"]["shape"] = [4, 8, 8]
    elif how == "wrong_dtype":
        s1["image"]["dtype"] = "float32"
    elif how == "missing_prompt":
        del s1["prompt"]
    elif how == "missing_image":
        del s1["image"]
    elif how == "unknown_field":
        s1["imgae"] = s1.pop("image")
    elif how == "bad_png":
        s1["image"] = {"encoding": "png", "data": base64.b64encode(b"\x89PNG not really").decode()}
    elif how == "metadata_not_object":
        s1["metadata"] = [1, 2]
    elif how == "other_size":
        s1["image"] = {
            "encoding": "raw",
            "dtype": "uint8",
            "shape": [3, 4, 4],
            "data": base64.b64encode(bytes(48)).decode(),
        }
    return body


MALFORMED = {
    "bad_base64": "samples[1].image.data (sample_id 's1'): invalid base64",
    "wrong_shape": "samples[1].image.data (sample_id 's1'): holds 192 bytes, shape [3, 8, 9] needs 216",
    "four_channels": "samples[1].image.shape (sample_id 's1'): must be [3, H, W]",
    "wrong_dtype": "samples[1].image.dtype (sample_id 's1'): must be 'uint8'",
    "missing_prompt": "samples[1].prompt (sample_id 's1'): missing",
    "missing_image": "samples[1].image (sample_id 's1'): a sample carries exactly one of image and text",
    "unknown_field": "samples[1].imgae (sample_id 's1'): unknown field",
    "bad_png": "samples[1].image.data (sample_id 's1'): not a readable PNG",
    "metadata_not_object": "samples[1].metadata (sample_id 's1'): must be a JSON object, got list",
    "other_size": "samples[1].image (sample_id 's1'): is [3, 4, 4] but samples[0] is [3, 8, 8]",
}


def test_a_body_over_the_servers_limit_fails_in_the_client_naming_the_limit(image_server, token_env):
    client = RemoteRewardBackend(image_server.url, token_env=token_env, image_encoding="raw")
    with pytest.raises(
        RemoteRewardError, match=r"takes request bodies up to 262144 bytes .* this one is \d+ \(scoring 64"
    ):
        client.score(image_request(n=64, size=32))
    assert client.score(image_request(n=2, size=32)).components["red"].shape == (2,)


def test_connections_are_kept_alive_and_a_restarted_server_is_reconnected(token_env):
    """One TCP connection serves a thread's requests; when the server restarts on the same port,
    the stale connection is replaced without spending a retry (max_retries=0)."""
    req = image_request(n=2)
    with RewardServer(image_backend(), TOKEN) as first:
        port = urlsplit(first.url).port
        client = RemoteRewardBackend(first.url, token_env=token_env, max_retries=0)
        client.score(req)
        conn = client._http._local.conn
        client.score(req)
        assert client._http._local.conn is conn and conn.sock is not None
    with RewardServer(image_backend(), TOKEN, ServerConfig(port=port)):
        got = client.score(req).components["red"]
    assert torch.equal(got, ColorTarget([1.0, 0.0, 0.0])(req))


@pytest.mark.parametrize("how", sorted(MALFORMED))
def test_malformed_sample_is_400_naming_the_sample_and_field(image_server, how):
    status, answer = post(image_server.url, json.dumps(_mutate(good_body(), how)).encode())
    assert status == 400, answer
    assert MALFORMED[how] in answer["error"], answer["error"]
    assert answer["sample_index"] == 1 and answer["sample_id"] == "s1"
    assert post(image_server.url, json.dumps(good_body()).encode())[0] == 200  # still serving


@pytest.mark.parametrize(
    "body, expected",
    [
        (b"{not json", "body: not JSON"),
        (
            json.dumps({"schema": "unirl.reward.v0", "samples": []}).encode(),
            "unsupported schema 'unirl.reward.v0'",
        ),
        (json.dumps({"samples": []}).encode(), "unsupported schema None"),
        (json.dumps({"schema": SCHEMA, "samples": []}).encode(), "samples: must be a non-empty list"),
        (json.dumps([1, 2]).encode(), "the body must be a JSON object"),
    ],
)
def test_malformed_body_is_400(image_server, body, expected):
    status, answer = post(image_server.url, body)
    assert status == 400 and expected in answer["error"], answer
    assert post(image_server.url, json.dumps(good_body()).encode())[0] == 200


def test_client_names_url_status_sample_and_prompt_of_a_400(token_env):
    """A server whose image limit the client's images exceed: its 400 names samples[0], and the
    client's error adds the URL, the status, the sample id and the prompt."""
    with RewardServer(image_backend(), TOKEN, ServerConfig(port=0, max_image_pixels=100)) as server:
        with pytest.raises(RemoteRewardError) as info:
            RemoteRewardBackend(server.url, token_env=token_env).score(image_request(size=16))
    msg = str(info.value)
    assert (
        f"{server.url}/v1/score answered HTTP 400" in msg and "16x16 exceeds the server's 100 pixels" in msg
    )
    assert "[sample 's0', prompt 'prompt 0']" in msg
    assert isinstance(info.value, RewardError)  # the trainer stops the step on it


# ---- retries, timeouts, a silent server --------------------------------------------------------


class CountingHandler(http.server.BaseHTTPRequestHandler):
    """Answers every POST with the server's `status` and counts them."""

    def do_POST(self):  # noqa: N802 - the http.server API
        self.server.hits += 1
        self.rfile.read(int(self.headers["Content-Length"]))
        body = json.dumps({"schema": SCHEMA, "error": f"status {self.server.status}"}).encode()
        self.send_response(self.server.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):  # noqa: N802 - /v1/info, as a reward server answers it
        body = json.dumps({"schema": SCHEMA, "weights": {"red": 1.0}, "max_body_bytes": 2**20}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def status_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), CountingHandler)
    server.hits, server.status = 0, 503
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def test_503_is_retried_with_backoff_and_400_is_not(status_server):
    url = f"http://127.0.0.1:{status_server.server_address[1]}"
    client = RemoteRewardBackend(url, max_retries=2, backoff_s=0.1, timeout_s=5)
    started = time.perf_counter()
    with pytest.raises(RemoteRewardError) as info:
        client.score(image_request(n=2))
    elapsed = time.perf_counter() - started
    assert status_server.hits == 3 and elapsed >= 0.1 + 0.2  # backoff 0.1 then 0.2
    assert "no answer after 3 attempt(s)" in str(info.value) and "HTTP 503" in str(info.value)
    assert url in str(info.value) and "'s0', 's1'" in str(info.value)
    status_server.hits, status_server.status = 0, 400
    with pytest.raises(RemoteRewardError, match="answered HTTP 400: status 400"):
        client.score(image_request(n=2))
    assert status_server.hits == 1


def test_a_crashing_scorer_is_500_and_retried_a_bounded_number_of_times(token_env):
    calls = []

    def crash(req):
        calls.append(len(req))
        raise RuntimeError("the reward model ran out of memory")

    with RewardServer(LocalRewardBackend({"crash": crash}), TOKEN) as server:
        client = RemoteRewardBackend(server.url, token_env=token_env, max_retries=1, backoff_s=0.01)
        with pytest.raises(
            RemoteRewardError, match="HTTP 500: the scorer crashed: RuntimeError: reward component"
        ):
            client.score(image_request(n=2))
        assert calls == [2, 2] and health(server.url)["errors"] == 2


def test_a_server_that_never_answers_fails_within_the_timeout_and_retries():
    """A socket that accepts connections and never answers (a hung server): the client raises
    after (max_retries + 1) timeouts plus the backoff, and does not hang."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept():
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except TimeoutError:
                pass

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    client = RemoteRewardBackend(url, timeout_s=0.5, max_retries=1, backoff_s=0.2)
    started = time.perf_counter()
    try:
        with pytest.raises(RemoteRewardError) as info:
            client.score(image_request(n=2))
    finally:
        elapsed = time.perf_counter() - started
        stop.set()
        thread.join()
        for conn in held:
            conn.close()
        listener.close()
    assert 2 * 0.5 + 0.2 <= elapsed < 2 * 0.5 + 0.2 + 3.0, elapsed
    msg = str(info.value)
    assert (
        f"{url}/v1/info gave no answer after 2 attempt(s)" in msg and "no answer within timeout_s=0.5" in msg
    )
    assert len(held) == 2


def test_a_hung_scorer_fails_the_score_within_the_timeout_and_the_server_recovers(token_env):
    """A reward server whose scorer hangs (info answers, scoring never does): the score call raises
    after its attempts; once the scorer is released the server answers again."""
    release, calls = threading.Event(), []

    def hung(req):
        calls.append(len(req))
        release.wait(timeout=60)
        return torch.zeros(len(req))

    with RewardServer(LocalRewardBackend({"hung": hung}), TOKEN) as server:
        client = RemoteRewardBackend(
            server.url, token_env=token_env, timeout_s=0.5, max_retries=1, backoff_s=0.1
        )
        started = time.perf_counter()
        with pytest.raises(RemoteRewardError) as info:
            client.score(image_request(n=3))
        elapsed = time.perf_counter() - started
        release.set()
        assert client.score(image_request(n=2)).components["hung"].tolist() == [0.0, 0.0]
    assert 2 * 0.5 + 0.1 <= elapsed < 2 * 0.5 + 0.1 + 3.0, elapsed
    msg = str(info.value)
    assert f"{server.url}/v1/score gave no answer after 2 attempt(s)" in msg and "timeout_s=0.5" in msg
    assert "(scoring 3 sample(s): 's0', 's1', 's2')" in msg


def test_no_server_at_all_names_the_url():
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = RemoteRewardBackend(f"http://127.0.0.1:{port}", max_retries=1, backoff_s=0.01, timeout_s=2)
    with pytest.raises(
        RemoteRewardError, match=rf"127.0.0.1:{port}/v1/info gave no answer after 2 attempt.*refused"
    ):
        _ = client.weights


# ---- configuration -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        ({"url": "ftp://127.0.0.1:8765"}, "url must be http(s)://host:port"),
        ({"url": "127.0.0.1:8765"}, "url must be http(s)://host:port"),
        ({"url": "http://:8765"}, "url must be http(s)://host:port"),
        ({"token_env": "UNIRL_NO_SUCH_VARIABLE"}, "token_env='UNIRL_NO_SUCH_VARIABLE' names an environment"),
        ({"token_file": "/nonexistent/token"}, "token_file='/nonexistent/token' cannot be read"),
        ({"token_env": "A", "token_file": "B"}, "token_env or token_file, not both"),
        ({"timeout_s": 0}, "need timeout_s > 0"),
    ],
)
def test_bad_client_config_fails_at_construction(kwargs, expected):
    with pytest.raises(ValueError) as info:
        RemoteRewardBackend(**({"url": "http://127.0.0.1:8765"} | kwargs))
    assert expected in str(info.value)


REMOTE_RECIPES = ["diffusion/tiny_sd3_flowgrpo_remote_reward", "llm/tiny_lm_grpo_remote_reward"]


@pytest.mark.parametrize("name", REMOTE_RECIPES)
def test_remote_recipes_are_validated_before_ray(name, tmp_path):
    def problems(*overrides):
        with initialize_config_dir(config_dir=EXAMPLES, version_base=None):
            cfg = compose(name, overrides=list(overrides))
        with pytest.raises(ConfigError) as info:
            validate_recipe(cfg)
        return str(info.value)

    msg = problems("reward.backend.url=ftp://reward-host:8765")
    assert "reward.backend" in msg and "url must be http(s)://host:port" in msg and "ftp://reward-host" in msg
    msg = problems("reward.backend.token_env=UNIRL_NO_SUCH_VARIABLE")
    assert (
        "reward.backend" in msg
        and "'UNIRL_NO_SUCH_VARIABLE' names an environment variable that is not set" in msg
    )
    msg = problems(f"reward.backend.token_file={tmp_path}/missing")
    assert "reward.backend" in msg and "cannot be read" in msg
    msg = problems("reward.backend.image_encoding=jpeg", "reward.backend.max_retries=-1")
    assert "reward.backend.image_encoding" in msg and "reward.backend.max_retries" in msg


# ---- the command -------------------------------------------------------------------------------


def test_one_command_serves_a_recipes_reward(tmp_path, token_env):
    """`python -m unirl.reward.server --config <recipe>` serves the recipe's reward block; the bound
    URL is printed, the token is not."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "unirl.reward.server",
            "--config",
            "examples/diffusion/tiny_sd3_flowgrpo.yaml",
            "--port",
            "0",
            "--token-file",
            str(token_file),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert "serving ['redness']" in line and TOKEN not in line, line
        url = line.strip().rsplit(" on ", 1)[1]
        assert url.startswith("http://127.0.0.1:")
        req = image_request(n=3)
        got = RemoteRewardBackend(url, token_env=token_env).score(req).components
        assert torch.equal(got["redness"], ColorTarget([1.0, 0.0, 0.0])(req))
    finally:
        proc.terminate()
        out = proc.communicate(timeout=30)[0]
    assert TOKEN not in out


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--host", "0.0.0.0"], "binding 0.0.0.0 without a token"),
        (["--config", "pyproject.toml"], "pyproject.toml: cannot be read as YAML"),
        (["--config", "examples/transport/ray.yaml"], "names no reward backend"),
        (["--max-batch", "0"], "max_batch must be >= 1"),
    ],
)
def test_the_command_refuses_bad_settings(args, expected, monkeypatch, capsys):
    monkeypatch.delenv("UNIRL_REWARD_TOKEN", raising=False)
    monkeypatch.chdir(REPO)
    config = [] if "--config" in args else ["--config", "examples/llm/tiny_lm_grpo.yaml"]
    assert server_main([*config, *args, "--port", "0"]) == 2
    assert expected in capsys.readouterr().err


def test_text_track_scores_with_response_lengths_through_the_server(text_server, token_env):
    """RewardService builds a text request from a TokenSegment's lengths; the server gets them."""
    req = text_request()
    segment = TokenSegment(
        prompt_ids=[torch.zeros(2, dtype=torch.long)] * 4,
        response_ids=[torch.zeros(n, dtype=torch.long) for n in req.response_lengths],
        log_probs=[torch.zeros(n) for n in req.response_lengths],
    )
    track = RolloutTrack(
        name="ar",
        sample_ids=req.sample_ids,
        group_ids=["g"] * 4,
        prompts=req.prompts,
        metadata=req.metadata,
        segment=segment,
        texts=req.texts,
    )
    RewardService(RemoteRewardBackend(text_server.url, token_env=token_env)).score_and_attach(track)
    assert track.reward_components["overlong"].tolist() == [0.0, 0.0, -0.75, -1.0]
