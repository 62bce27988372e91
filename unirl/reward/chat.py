"""Judges over an OpenAI-style chat API: `ChatJudge` asks a served vision-language model about each
image through `POST /v1/chat/completions`; `ChatModel` answers that API for a local VLM directory
(the reward server's `--chat-model`), so a judge can be run and tested without a hub model.

The request `ChatJudge` sends for one sample (the body every OpenAI-compatible server takes,
`vllm serve` included):

    {"model": <model>, "temperature": 0, "max_tokens": 1 | <max_tokens>,
     "messages": [{"role": "user", "content": [
         {"type": "image_url", "image_url": {"url": "data:image/png;base64,<PNG of the image>"}},
         {"type": "text", "text": <question with {prompt} filled>}]}],
     "logprobs": true, "top_logprobs": <top_logprobs>}          (mode "prob" only)

Scores (both in [0, 1]):

    prob   P(the reply starts with the expected answer): the summed probability of the first
           generated token's `top_logprobs` entries whose text, stripped and lower-cased, is a
           non-empty prefix of `answer` ("Yes", " yes" and "y" all count for "yes"), the
           UnifiedReward / VQAScore yes-probability; an answer outside the top k adds nothing.
    score  the first number in the reply divided by `max_score` (a judge asked for a 0-10
           rating); a reply without a number, or one outside [0, max_score], is an error naming
           the sample and the reply.

Failures are never scores: a refused connection, a timeout or a 5xx answer is retried
(`max_retries`, exponential backoff) and then raises `JudgeError` (a `RewardError`: the trainer
stops the step naming the server and the sample); so do a 4xx answer, a reply without log-probs
in mode "prob" and a model the server does not serve.
"""

from __future__ import annotations

import base64
import io
import json
import math
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from annotated_types import Ge, Gt
from PIL import Image

from unirl.reward.http import JsonHttp, check_http_url, env_secret
from unirl.reward.service import RewardError
from unirl.types.reward import RewardRequest

MODES = ("prob", "score")
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


class JudgeError(RewardError):
    """A judge server could not be reached, refused a request or answered something unscorable."""


class ChatRequestError(ValueError):
    """A chat-completions body this server cannot answer (the reward server answers 400)."""


def image_data_url(image: torch.Tensor) -> str:
    """A `data:image/png;base64,...` URL of one [3, H, W] uint8 image (lossless)."""
    buf = io.BytesIO()
    Image.fromarray(image.permute(1, 2, 0).contiguous().cpu().numpy()).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def decode_data_url(url: str) -> np.ndarray:
    """uint8 [H, W, 3] of a `data:image/<png|jpeg|webp>;base64,...` URL; other URLs are refused
    (the server fetches nothing)."""
    head, _, data = url.partition(",")
    if not (head.startswith("data:image/") and head.endswith(";base64") and data):
        raise ChatRequestError(
            f"image_url {url[:40]!r}...: send the image inline as data:image/png;base64,<...> "
            "(this server fetches no URLs)"
        )
    try:
        return np.asarray(Image.open(io.BytesIO(base64.b64decode(data, validate=True))).convert("RGB"))
    except (ValueError, OSError) as e:
        raise ChatRequestError(f"image_url: not a base64 image ({e})") from None


class ChatJudge:
    """Scorer: `[B]` fp32 scores of `req.images` asked of a judge served over an OpenAI-style chat
    API (module docstring).

    Args:
        url: the server's base URL up to `/v1` excluded, e.g. `http://127.0.0.1:8000`.
        model: the served model name (`GET /v1/models` must list it).
        question: the question about each image; `{prompt}` is replaced by the sample's prompt.
        mode: "prob" (default) or "score".
        answer: mode "prob": the expected reply ("yes").
        top_logprobs: mode "prob": how many first-token alternatives the server returns (1..20).
        max_score: mode "score": the top of the rating scale.
        max_tokens: mode "score": tokens of the reply.
        concurrency: requests in flight at once (samples of a request are sent in parallel).
        timeout_s, max_retries, backoff_s: per attempt, and retries after a connection error,
            timeout or 5xx (`unirl.reward.http.JsonHttp`).
        api_key_env: an environment variable holding the server's API key (sent as a bearer
            token); None: none.
        check_server: ask the server for its models when built (so recipe validation fails
            before Ray on a server that is down or does not serve `model`); false when the
            server starts after the recipe is checked.
    """

    def __init__(
        self,
        url: str,
        model: str,
        question: str = 'does this image show "{prompt}"?',
        mode: Literal["prob", "score"] = "prob",
        answer: str = "yes",
        top_logprobs: Annotated[int, Ge(1)] = 5,
        max_score: Annotated[float, Gt(0)] = 10.0,
        max_tokens: Annotated[int, Ge(1)] = 8,
        concurrency: Annotated[int, Ge(1)] = 8,
        timeout_s: Annotated[float, Gt(0)] = 60.0,
        max_retries: Annotated[int, Ge(0)] = 3,
        backoff_s: Annotated[float, Ge(0)] = 0.5,
        api_key_env: str | None = None,
        check_server: bool = True,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"ChatJudge mode must be one of {MODES}, got {mode!r}")
        try:
            question.format(prompt="x")
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(
                f"ChatJudge question {question!r} must name only {{prompt}} (write {{{{ }}}} for a brace): {e!r}"
            ) from None
        if not answer.strip():
            raise ValueError("ChatJudge answer must have a non-space character")
        if not (1 <= top_logprobs <= 20):
            raise ValueError(
                f"ChatJudge top_logprobs must be in 1..20 (the OpenAI API's range), got {top_logprobs}"
            )
        if not (max_score > 0 and max_tokens >= 1 and concurrency >= 1):
            raise ValueError(
                f"ChatJudge needs max_score > 0, max_tokens >= 1, concurrency >= 1; got {max_score}, {max_tokens}, {concurrency}"
            )
        headers = {}
        if api_key_env is not None:
            key = env_secret(
                "ChatJudge api_key_env",
                api_key_env,
                "export the judge server's key, or set api_key_env: null",
            )
            headers["Authorization"] = f"Bearer {key}"
        self.url = check_http_url(url, "an OpenAI-style chat server (the part before /v1)")
        self.model, self.question, self.mode = model, question, mode
        self.answer, self.top_logprobs = answer.strip().lower(), top_logprobs
        self.max_score, self.max_tokens, self.concurrency = float(max_score), max_tokens, concurrency
        self._http = JsonHttp(
            self.url,
            headers,
            timeout_s,
            max_retries,
            backoff_s,
            JudgeError,
            "judge server",
            "Is the OpenAI-style server (vllm serve, or python -m unirl.reward.server --chat-model DIR) running there?",
        )
        self._checked = False
        if check_server:
            self.check_server()

    def __repr__(self) -> str:  # the key stays out of logs
        return f"ChatJudge(url={self.url!r}, model={self.model!r}, mode={self.mode!r})"

    def check_server(self) -> None:
        """Raise `JudgeError` unless the server answers `GET /v1/models` listing `model`."""
        answer = self._http.call("GET", "/v1/models", None)
        served = [m.get("id") for m in answer.get("data", [])] if isinstance(answer, dict) else []
        if self.model not in served:
            raise JudgeError(
                f"judge server {self.url} does not serve model {self.model!r} (GET /v1/models lists {served}); "
                "set the judge's model to one of those"
            )
        self._checked = True

    def body(self, image: torch.Tensor, prompt: str) -> dict[str, Any]:
        """The chat-completions body asking about one [3, H, W] uint8 image (module docstring)."""
        body: dict[str, Any] = {
            "model": self.model,
            "temperature": 0,
            "max_tokens": 1 if self.mode == "prob" else self.max_tokens,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": image_data_url(image)}},
                        {"type": "text", "text": self.question.format(prompt=prompt)},
                    ],
                }
            ],
        }
        if self.mode == "prob":
            body |= {"logprobs": True, "top_logprobs": self.top_logprobs}
        return body

    def score_answer(self, answer: Any, where: str) -> float:
        """The score of one chat-completions answer (module docstring); `where` names the sample."""
        try:
            choice = answer["choices"][0]
        except (KeyError, IndexError, TypeError):
            raise JudgeError(
                f"judge server {self.url}: {where}: the answer has no choices: {answer!r:.200}"
            ) from None
        if self.mode == "prob":
            try:
                top = choice["logprobs"]["content"][0]["top_logprobs"]
                pairs = [(str(t["token"]), float(t["logprob"])) for t in top]
            except (KeyError, IndexError, TypeError, ValueError):
                raise JudgeError(
                    f"judge server {self.url}: {where}: the answer carries no top_logprobs of its first token "
                    f"(mode 'prob' needs a server that returns log-probs): {choice!r:.200}"
                ) from None
            p = sum(
                math.exp(lp)
                for token, lp in pairs
                if token.strip() and self.answer.startswith(token.strip().lower())
            )
            return min(p, 1.0)
        text = str((choice.get("message") or {}).get("content") or "")
        found = NUMBER.search(text)
        if found is None or not (0.0 <= float(found.group()) <= self.max_score):
            raise JudgeError(
                f"judge server {self.url}: {where}: the reply {text!r:.120} holds no rating in [0, {self.max_score:g}]; "
                "ask for a number (question) or raise max_tokens"
            )
        return float(found.group()) / self.max_score

    def __call__(self, req: RewardRequest) -> torch.Tensor:
        """[B] fp32 scores in request order; up to `concurrency` requests in flight."""
        images = req.require_images("ChatJudge")
        if not self._checked:
            self.check_server()

        def one(i: int) -> float:
            where = f"sample {req.sample_ids[i]!r} (prompt {req.prompts[i][:60]!r})"
            body = json.dumps(self.body(images[i], req.prompts[i])).encode()
            answer = self._http.call("POST", "/v1/chat/completions", body, context=f" [{where}]")
            return self.score_answer(answer, where)

        with ThreadPoolExecutor(max_workers=max(1, min(self.concurrency, len(req)))) as pool:
            scores = list(pool.map(one, range(len(req))))
        return torch.tensor(scores, dtype=torch.float32)


class ChatModel:
    """`complete(body) -> answer`: OpenAI-style chat completions of a vision-language model, greedy.

    Takes one user message whose content is text parts and `image_url` parts (data URLs only);
    the images go first, each as an `<image>` placeholder, then the text joined by newlines: the
    tokens a supervised VQA base learned on (`TextBundle.pair_batch`, as `VLMJudge` asks).
    Decodes greedily up to `max_tokens` (at most `max_new_tokens`) or EOS; with `logprobs`, each
    generated token's log-prob and its `top_logprobs` alternatives (log_softmax of the logits).
    `temperature` must be 0 or absent and `n` 1: this server samples nothing. A body it cannot
    answer raises `ChatRequestError` naming the field. One request decodes at a time (a lock).

    Args:
        model: the vision-language model's config (`vision` True), e.g.
            `QwenVLConfig(pretrained_path="checkpoints/shapes_vqa")` (the server's `--chat-model DIR`).
        name: the model name clients ask for (default: the directory's base name).
        max_new_tokens: the largest `max_tokens` served.
    """

    def __init__(self, model: Any, name: str | None = None, max_new_tokens: int = 64) -> None:
        path = getattr(model, "pretrained_path", None)
        if getattr(model, "vision", False) is not True or not path:
            raise ValueError(
                f"the chat model must be a vision-language model read from a directory, got {model!r}"
            )
        problems = model.directory_problems()
        if problems:
            raise ValueError(f"--chat-model {path!r}: " + "; ".join(problems))
        self.name = name or os.path.basename(os.path.normpath(path))
        self.max_new_tokens = max_new_tokens
        self.bundle = model.build()
        self.bundle.model.eval().requires_grad_(False)
        self._lock = threading.Lock()

    def parse(self, body: Any) -> tuple[str, list[np.ndarray], int, int | None]:
        """(prompt, images, max_tokens, top_logprobs or None without logprobs) of a request body."""
        from unirl.models.causal_lm.family import IMAGE_PLACEHOLDER

        if not isinstance(body, dict):
            raise ChatRequestError("the body must be a JSON object")
        if body.get("model") != self.name:
            raise ChatRequestError(f"model: this server serves {self.name!r}, not {body.get('model')!r}")
        if body.get("temperature") not in (None, 0, 0.0) or body.get("n") not in (None, 1):
            raise ChatRequestError("temperature must be 0 and n 1: this server decodes greedily")
        messages = body.get("messages")
        if not (isinstance(messages, list) and len(messages) == 1 and isinstance(messages[0], dict)):
            raise ChatRequestError("messages: give one user message")
        if messages[0].get("role") != "user":
            raise ChatRequestError(f"messages[0].role must be 'user', got {messages[0].get('role')!r}")
        content = messages[0].get("content")
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(parts, list):
            raise ChatRequestError("messages[0].content must be a string or a list of parts")
        texts, images = [], []
        for k, part in enumerate(parts):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            elif kind == "image_url" and isinstance(part.get("image_url"), dict):
                images.append(decode_data_url(str(part["image_url"].get("url", ""))))
            else:
                raise ChatRequestError(
                    f"messages[0].content[{k}]: a part is {{type: text, text}} or {{type: image_url, image_url: {{url}}}}"
                )
        max_tokens = body.get("max_tokens", body.get("max_completion_tokens", 16))
        if not (isinstance(max_tokens, int) and 1 <= max_tokens <= self.max_new_tokens):
            raise ChatRequestError(
                f"max_tokens must be an int in 1..{self.max_new_tokens}, got {max_tokens!r}"
            )
        top = None
        if body.get("logprobs"):
            top = body.get("top_logprobs", 0)
            if not (isinstance(top, int) and 0 <= top <= 20):
                raise ChatRequestError(f"top_logprobs must be an int in 0..20, got {top!r}")
        return IMAGE_PLACEHOLDER * len(images) + "\n".join(texts), images, max_tokens, top

    def _token(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.bundle.tokenizer.decode([token_id])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    @torch.no_grad()
    def complete(self, body: Any) -> dict[str, Any]:
        """The chat.completion answer of one body (class docstring)."""
        prompt, images, max_tokens, top = self.parse(body)
        tok, eos = self.bundle.tokenizer, self.bundle.tokenizer.eos_token_id
        generated: list[int] = []
        steps: list[dict[str, Any]] = []
        finish = "length"
        with self._lock:
            for _ in range(max_tokens):
                # the row is prompt + generated + EOS; the logits before the EOS label give the next token
                inputs, labels = self.bundle.pair_batch([(prompt, tok.decode(generated), images)], "chat")
                last = int((labels[0] != -100).nonzero()[-1])
                logp = F.log_softmax(self.bundle.model(**inputs).logits[0, last - 1].float(), dim=-1)
                nxt = int(logp.argmax())
                if top is not None:
                    entry = self._token(nxt, float(logp[nxt]))
                    values, ids = logp.topk(top)
                    entry["top_logprobs"] = [
                        self._token(int(i), float(v)) for v, i in zip(values, ids, strict=True)
                    ]
                    steps.append(entry)
                if nxt == eos:
                    finish = "stop"
                    break
                generated.append(nxt)
        prompt_tokens = int(inputs["attention_mask"].sum()) - len(generated) - 1
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": tok.decode(generated)},
            "finish_reason": finish,
            "logprobs": {"content": steps} if top is not None else None,
        }
        return {
            "id": f"chatcmpl-{time.time_ns():x}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.name,
            "choices": [choice],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": len(generated),
                "total_tokens": prompt_tokens + len(generated),
            },
        }

    def models(self) -> dict[str, Any]:
        """The `GET /v1/models` answer."""
        return {"object": "list", "data": [{"id": self.name, "object": "model", "owned_by": "unirl"}]}
