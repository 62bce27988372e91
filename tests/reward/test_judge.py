"""`VLMJudge` (unirl/reward/judge.py) on the committed VQA base: each answer's probability against
a forward written out here, batching, aggregation, the shapes world's questions, the reward server,
and its errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from unirl.models.qwen import QwenConfig
from unirl.models.qwen_vl import QwenVLConfig
from unirl.reward import LocalRewardBackend, RemoteRewardBackend
from unirl.reward.judge import VLMJudge, vqascore_question
from unirl.reward.server import RewardServer, ServerConfig
from unirl.types.reward import RewardRequest
from worlds.shapes.vqa import ANSWERS, JudgeQuestions, prompt_questions
from worlds.shapes.world import SceneSpec, ShapeSpec, parse_prompt, render

BASE = QwenVLConfig(pretrained_path="checkpoints/shapes_vqa")
PROMPTS = ["a red circle left of a blue square", "two green triangles", "a blue square and a red circle"]


@pytest.fixture(scope="module")
def judge() -> VLMJudge:
    return VLMJudge(BASE, questions=JudgeQuestions(), batch_size=5)


def scene_images(prompts: list[str], seed: int = 0) -> torch.Tensor:
    """[B, 3, 32, 32] uint8 renders of each prompt's own scene."""
    rng = np.random.default_rng(seed)
    return torch.stack([torch.from_numpy(render(parse_prompt(p), rng=rng)).permute(2, 0, 1) for p in prompts])


def request(prompts: list[str], images: torch.Tensor) -> RewardRequest:
    return RewardRequest(sample_ids=[f"s{i}" for i in range(len(prompts))], prompts=prompts, images=images)


def test_questions_of_a_shapes_prompt_are_what_the_strict_verdict_checks():
    assert prompt_questions(parse_prompt("two green triangles")) == [
        ("is there a green triangle?", "yes"),
        ("how many triangles?", "2"),
    ]
    assert prompt_questions(parse_prompt("a red circle and a blue circle")) == [
        ("is there a red circle?", "yes"),
        ("is there a blue circle?", "yes"),
        ("how many circles?", "2"),
    ]
    spec = SceneSpec(
        "position", [ShapeSpec("red", "circle"), ShapeSpec("blue", "square")], relation="left of"
    )
    assert prompt_questions(spec)[-1] == ("is the red circle left of the blue square?", "yes")
    assert len(prompt_questions(spec)) == 5
    assert vqascore_question("a red circle", {}) == [('does this image show "a red circle"?', "yes")]


def test_answer_probability_equals_the_forward_written_out(judge):
    """P(answer + EOS | image, question) from one hand-built, unpadded sequence: the prompt with
    its image tokens, then the answer's tokens and the EOS, teacher-forced."""
    images = scene_images(PROMPTS[:1])
    question, answer = "how many circles?", "1"
    got = judge.answer_probs(images, [(0, question, answer)])
    bundle = judge.bundle
    text, pixels, grid = bundle.prepare("<image>" + question, [images[0].permute(1, 2, 0).numpy()], "t")
    tok = bundle.tokenizer
    prompt_ids = tok(text, add_special_tokens=False)["input_ids"]
    answer_ids = tok(answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    ids = torch.tensor([prompt_ids + answer_ids])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        logits = bundle.model(
            input_ids=ids,
            attention_mask=mask,
            pixel_values=pixels,
            image_grid_thw=grid,
            position_ids=bundle.positions(ids, mask, grid),
        ).logits[0]
    logp = torch.log_softmax(logits.double(), dim=-1)
    want = sum(float(logp[len(prompt_ids) - 1 + k, t]) for k, t in enumerate(answer_ids))
    assert got.shape == (1,) and float(got[0]) == pytest.approx(np.exp(want), rel=1e-4)


def test_the_answers_of_one_question_are_disjoint_events(judge):
    """Distinct answers each followed by EOS are disjoint sequences: their probabilities sum to at most 1."""
    images = scene_images(PROMPTS[:1])
    probs = judge.answer_probs(images, [(0, "how many circles?", a) for a in sorted(ANSWERS)])
    assert torch.all(probs > 0) and float(probs.sum()) <= 1.0 + 1e-5


def test_scores_aggregate_the_questions_and_do_not_depend_on_batching(judge):
    images = scene_images(PROMPTS)
    req = request(PROMPTS, images)
    scores = judge(req)
    asked = [(i, q, a) for i, p in enumerate(PROMPTS) for q, a in prompt_questions(parse_prompt(p))]
    one_by_one = VLMJudge(BASE, questions=JudgeQuestions(), batch_size=1)
    probs = one_by_one.answer_probs(images, asked)
    k, want_product, want_mean = 0, [], []
    for p in PROMPTS:
        n = len(prompt_questions(parse_prompt(p)))
        want_product.append(float(probs[k : k + n].prod()))
        want_mean.append(float(probs[k : k + n].mean()))
        k += n
    assert scores.dtype == torch.float32 and scores.shape == (3,)
    torch.testing.assert_close(scores, torch.tensor(want_product), rtol=1e-4, atol=1e-7)
    mean = VLMJudge(BASE, questions=JudgeQuestions(), aggregate="mean")(req)
    torch.testing.assert_close(mean, torch.tensor(want_mean), rtol=1e-4, atol=1e-7)


def test_the_reward_server_scores_like_the_local_backend(judge, monkeypatch):
    images = scene_images(PROMPTS)
    req = request(PROMPTS, images)
    local = LocalRewardBackend({"judge": judge})
    with RewardServer(LocalRewardBackend({"judge": judge}), "tok", ServerConfig(port=0)) as server:
        monkeypatch.setenv("UNIRL_TEST_JUDGE_TOKEN", "tok")
        remote = RemoteRewardBackend(server.url, token_env="UNIRL_TEST_JUDGE_TOKEN")
        got = remote.score(req).components["judge"]
    assert torch.equal(got, local.score(req).components["judge"])


def test_bad_input_is_named(judge, tmp_path):
    with pytest.raises(ValueError, match="aggregate must be one of"):
        VLMJudge(BASE, aggregate="max")
    with pytest.raises(ValueError, match="batch_size must be an int >= 1"):
        VLMJudge(BASE, batch_size=0)
    with pytest.raises(ValueError, match=r"VLMJudge model: model.pretrained_path.*nope"):
        VLMJudge(QwenVLConfig(pretrained_path=str(tmp_path / "nope")))
    with pytest.raises(ValueError, match=r"is not a vision-language model config"):
        VLMJudge("checkpoints/shapes_vqa")  # a bare directory: give the model's config
    with pytest.raises(ValueError, match=r"is not a vision-language model config"):
        VLMJudge(QwenConfig(pretrained_path="checkpoints/arith_lm"))
    with pytest.raises(ValueError, match=r"threads must be an int >= 1 or null"):
        VLMJudge(BASE, threads=0)
    with pytest.raises(ValueError, match="questions must be callable"):
        VLMJudge(BASE, questions="how many?")
    text_only = tmp_path / "text_only"
    text_only.mkdir()
    (text_only / "config.json").write_text('{"model_type": "qwen3"}')
    with pytest.raises(ValueError, match="holds a text-only model"):
        VLMJudge(QwenVLConfig(pretrained_path=str(text_only)))
    with pytest.raises(ValueError, match=r"sample 's0'.*cannot parse prompt 'a purple blob'"):
        judge(request(["a purple blob"], scene_images(PROMPTS[:1])))
    texts = RewardRequest(sample_ids=["t0"], prompts=["a red circle"], texts=["yes"])
    with pytest.raises(ValueError, match="VLMJudge needs images"):
        judge(texts)


def test_an_offloaded_judge_scores_on_its_device_and_rests_in_host_memory(judge):
    """`offload`: the model is on `device` while it scores (a hook records it) and in host memory
    after; the scores are the resident judge's. On a CPU-only machine only the bookkeeping runs."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    offloaded = VLMJudge(BASE, questions=JudgeQuestions(), batch_size=5, device=device, offload=True)
    ran_on = []
    offloaded.bundle.model.register_forward_pre_hook(
        lambda m, a: ran_on.append(next(m.parameters()).device.type)
    )
    req = request(PROMPTS, scene_images(PROMPTS))
    got = offloaded(req)
    assert set(ran_on) == {device} and next(offloaded.bundle.model.parameters()).device.type == "cpu"
    torch.testing.assert_close(got, judge(req).to(got.device), rtol=1e-5, atol=1e-6)
