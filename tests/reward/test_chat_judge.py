"""`ChatJudge` over the OpenAI-style chat API (unirl/reward/chat.py), against a real HTTP server: the
reward server serving the committed VQA base at /v1/chat/completions (`ChatModel`). Scores equal
the VLM's first-token probabilities computed here from one forward; greedy replies equal a decode
written out here; errors name the server and the sample; a dead server is never a 0 score."""

from __future__ import annotations

import json
import socket
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from unirl.models.qwen_vl import QwenVLConfig
from unirl.reward import LocalRewardBackend
from unirl.reward.chat import ChatJudge, ChatModel, JudgeError, decode_data_url, image_data_url
from unirl.reward.server import RewardServer
from unirl.types.reward import RewardRequest
from worlds.shapes.world import parse_prompt, render

BASE = "checkpoints/shapes_vqa"
VLM = QwenVLConfig(pretrained_path=BASE)
PROMPTS = ["a red circle", "two green triangles", "a blue square"]
QUESTION = "is there a {prompt}?"


@pytest.fixture(scope="module")
def chat_model() -> ChatModel:
    return ChatModel(VLM)


@pytest.fixture(scope="module")
def server(chat_model):
    with RewardServer(None, chat=chat_model) as s:
        yield s


def images_of(prompts: list[str], seed: int = 0) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    return torch.stack([torch.from_numpy(render(parse_prompt(p), rng=rng)).permute(2, 0, 1) for p in prompts])


def request(prompts: list[str], images: torch.Tensor) -> RewardRequest:
    return RewardRequest(sample_ids=[f"s{i}" for i in range(len(prompts))], prompts=prompts, images=images)


def next_token_logp(
    model: ChatModel, image: torch.Tensor, prompt: str, prefix_ids: list[int]
) -> torch.Tensor:
    """log_softmax of the VLM's next-token logits after `prompt` and `prefix_ids`, from one
    unpadded sequence built here: the prompt with its image tokens, then the prefix."""
    bundle = model.bundle
    text, pixels, grid = bundle.prepare("<image>" + prompt, [image.permute(1, 2, 0).numpy()], "t")
    ids = bundle.tokenizer(text, add_special_tokens=False)["input_ids"] + prefix_ids
    input_ids = torch.tensor([ids])
    mask = torch.ones_like(input_ids)
    inputs = {"input_ids": input_ids, "attention_mask": mask, "pixel_values": pixels, "image_grid_thw": grid}
    inputs["position_ids"] = bundle.positions(input_ids, mask, grid)
    with torch.no_grad():
        return F.log_softmax(bundle.model(**inputs).logits[0, -1].float(), dim=-1)


def test_data_url_round_trips_the_pixels():
    image = images_of(PROMPTS[:1])[0]
    assert np.array_equal(decode_data_url(image_data_url(image)), image.permute(1, 2, 0).numpy())


def test_prob_score_is_the_first_token_probability_of_the_answer(chat_model, server):
    """mode prob = the summed probability of the top-k first tokens that start "yes", from a
    forward written out here; the server's log-probs are the model's to float rounding."""
    images = images_of(PROMPTS)
    judge = ChatJudge(server.url, "shapes_vqa", question=QUESTION, top_logprobs=20, concurrency=3)
    got = judge(request(PROMPTS, images))
    tok = chat_model.bundle.tokenizer
    for i, prompt in enumerate(PROMPTS):
        logp = next_token_logp(chat_model, images[i], QUESTION.format(prompt=prompt), [])
        top = logp.topk(20)
        want = sum(
            float(v.exp())
            for v, t in zip(top.values, top.indices, strict=True)
            if tok.decode([int(t)]).strip() and "yes".startswith(tok.decode([int(t)]).strip().lower())
        )
        assert abs(float(got[i]) - want) < 1e-5, (prompt, float(got[i]), want)
    assert got.dtype == torch.float32 and got.shape == (3,)


def test_the_served_answer_is_the_greedy_decode(chat_model, server):
    """content = argmax decoding token by token until EOS, written out here with full forwards."""
    image = images_of(["two green triangles"])[0]
    question = "how many triangles?"
    tok = chat_model.bundle.tokenizer
    ids: list[int] = []
    for _ in range(6):
        nxt = int(next_token_logp(chat_model, image, question, ids).argmax())
        if nxt == tok.eos_token_id:
            break
        ids.append(nxt)
    body = {
        "model": "shapes_vqa",
        "max_tokens": 6,
        "logprobs": True,
        "top_logprobs": 2,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": image_data_url(image)}},
                    {"type": "text", "text": question},
                ],
            }
        ],
    }
    answer = post(server.url + "/v1/chat/completions", body)
    choice = answer["choices"][0]
    assert choice["message"]["content"] == tok.decode(ids)
    assert choice["finish_reason"] == "stop" and answer["usage"]["completion_tokens"] == len(ids)
    assert len(choice["logprobs"]["content"]) == len(ids) + 1  # the EOS step too
    first = choice["logprobs"]["content"][0]
    assert first["top_logprobs"][0]["token"] == first["token"] and len(first["top_logprobs"]) == 2


def test_score_mode_parses_the_rating(server, chat_model):
    """mode score: the reply's first number / max_score; the tiny VQA base answers counts."""
    images = images_of(["two green triangles"])
    judge = ChatJudge(server.url, "shapes_vqa", question="how many triangles?", mode="score", max_score=4)
    reply = post(server.url + "/v1/chat/completions", judge.body(images[0], "two green triangles"))
    count = float(reply["choices"][0]["message"]["content"])
    assert float(judge(request(["two green triangles"], images))[0]) == pytest.approx(count / 4)
    no_number = ChatJudge(server.url, "shapes_vqa", question="is there a red circle?", mode="score")
    with pytest.raises(JudgeError, match=r"sample 's0'.*holds no rating in \[0, 10\]"):
        no_number(request(["a red circle"], images_of(["a red circle"])))


def test_the_judge_scores_in_the_reward_server_as_locally(server):
    """A judge run as a component of another reward server scores what it scores in process."""
    images = images_of(PROMPTS)
    judge = ChatJudge(server.url, "shapes_vqa", question=QUESTION)
    local = LocalRewardBackend({"judge": judge}).score(request(PROMPTS, images)).components["judge"]
    from unirl.reward import RemoteRewardBackend

    with RewardServer(LocalRewardBackend({"judge": judge})) as outer:
        remote = RemoteRewardBackend(outer.url).score(request(PROMPTS, images)).components["judge"]
    assert torch.equal(local, remote)


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_server_that_is_down_fails_when_built_naming_it():
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(
        JudgeError, match=rf"judge server {url}/v1/models gave no answer after 2 attempt\(s\)"
    ):
        ChatJudge(url, "m", max_retries=1, backoff_s=0.01, timeout_s=2)


def test_a_model_the_server_does_not_serve_is_named(server):
    with pytest.raises(JudgeError, match=r"does not serve model 'gpt-4o'.*\['shapes_vqa'\]"):
        ChatJudge(server.url, "gpt-4o")


class Flaky(BaseHTTPRequestHandler):
    """Answers /v1/models, then 503 for the first `fail` chat calls, then a fixed completion."""

    fail = 0
    calls = 0
    logprobs = True

    def log_message(self, *args):  # quiet
        pass

    def _send(self, status: int, body: dict) -> None:
        raw = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def do_GET(self):
        self._send(200, {"data": [{"id": "m"}]})

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        type(self).calls += 1
        if type(self).calls <= type(self).fail:
            self._send(503, {"error": {"message": "overloaded"}})
            return
        top = [
            {"token": "Yes", "logprob": float(np.log(0.6))},
            {"token": " yes", "logprob": float(np.log(0.1))},
            {"token": "No", "logprob": float(np.log(0.3))},
        ]
        logprobs = {"content": [{"token": "Yes", "logprob": top[0]["logprob"], "top_logprobs": top}]}
        self._send(
            200,
            {
                "choices": [
                    {"message": {"content": "Yes"}, "logprobs": logprobs if type(self).logprobs else None}
                ]
            },
        )


@pytest.fixture()
def flaky():
    Flaky.fail, Flaky.calls, Flaky.logprobs = 0, 0, True
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Flaky)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def test_case_and_space_variants_of_the_answer_add_up_and_5xx_is_retried(flaky):
    Flaky.fail = 2
    judge = ChatJudge(flaky, "m", max_retries=2, backoff_s=0.01)
    got = judge(request(["x"], images_of(["a red circle"])))
    assert float(got[0]) == pytest.approx(0.7) and Flaky.calls == 3


def test_retries_spent_fail_the_step_naming_server_and_sample_never_a_zero(flaky):
    Flaky.fail = 10
    judge = ChatJudge(flaky, "m", max_retries=1, backoff_s=0.01)
    with pytest.raises(
        JudgeError, match=r"gave no answer after 2 attempt\(s\).*HTTP 503: overloaded.*sample 's0'"
    ):
        judge(request(["x"], images_of(["a red circle"])))


def test_an_answer_without_logprobs_is_an_error_in_prob_mode(flaky):
    Flaky.logprobs = False
    with pytest.raises(JudgeError, match="carries no top_logprobs"):
        ChatJudge(flaky, "m")(request(["x"], images_of(["a red circle"])))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"mode": "vote"}, "mode must be one of"),
        ({"question": "is it {color}?"}, "must name only {prompt}"),
        ({"top_logprobs": 50}, "top_logprobs must be in 1..20"),
        ({"url": "localhost:8000"}, "url must be http"),
        ({"api_key_env": "UNIRL_TEST_UNSET_KEY"}, "not set or empty"),
    ],
)
def test_bad_settings_are_refused_naming_the_key(kwargs, match):
    args = {"url": "http://127.0.0.1:1", "model": "m", "check_server": False} | kwargs
    with pytest.raises(ValueError, match=match):
        ChatJudge(**args)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda b: b | {"model": "other"}, "serves 'shapes_vqa', not 'other'"),
        (lambda b: b | {"temperature": 0.7}, "decodes greedily"),
        (lambda b: b | {"max_tokens": 1000}, "max_tokens must be an int in 1..64"),
        (
            lambda b: {
                **b,
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "http://x/a.png"}}],
                    }
                ],
            },
            "fetches no URLs",
        ),
        (lambda b: b | {"messages": []}, "give one user message"),
    ],
)
def test_bodies_the_server_cannot_answer_are_400_naming_the_field(server, mutate, match):
    body = {"model": "shapes_vqa", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(urllib.error.HTTPError) as e:
        post(server.url + "/v1/chat/completions", mutate(body))
    assert e.value.code == 400
    assert match in json.loads(e.value.read())["error"]["message"]
