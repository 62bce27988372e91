"""CPU tests of text rewards: the request's text contract, the text scorers, and the service on a text track."""

from __future__ import annotations

import math

import pytest
import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import OmegaConf

from unirl.reward import (
    ColorTarget,
    ExactAnswer,
    FormatCheck,
    JpegCompressibility,
    LocalRewardBackend,
    OverlongPenalty,
    RewardError,
    RewardService,
    TargetCharFraction,
)
from unirl.types import LatentSegment, RewardRequest, RolloutTrack, TokenSegment

TEXT_YAML = """
reward:
  _target_: unirl.reward.service.RewardService
  backend:
    _target_: unirl.reward.base.LocalRewardBackend
    components:
      answer: {_target_: unirl.reward.local.text.ExactAnswer, extract: "after:####", numeric: true}
      format: {_target_: unirl.reward.local.text.FormatCheck, pattern: "(?s).*#### .*", mode: fullmatch}
      overlong: {_target_: unirl.reward.local.text.OverlongPenalty, max_length: 4, buffer_length: 2}
    weights: {answer: 1.0, format: 0.5, overlong: 1.0}
"""


def text_request(texts: list[str], metadata=None, lengths=None) -> RewardRequest:
    n = len(texts)
    return RewardRequest(
        sample_ids=[f"s{i}" for i in range(n)],
        prompts=[""] * n,
        texts=texts,
        metadata=metadata or [],
        response_lengths=lengths,
    )


def image_request(batch: int = 2) -> RewardRequest:
    return RewardRequest(
        sample_ids=[f"s{i}" for i in range(batch)],
        prompts=[""] * batch,
        images=torch.zeros(batch, 3, 4, 4, dtype=torch.uint8),
    )


def text_track(texts: list[str] | None, response_lengths: list[int], metadata=None) -> RolloutTrack:
    batch = len(response_lengths)
    segment = TokenSegment(
        prompt_ids=[torch.tensor([1, 2]) for _ in range(batch)],
        response_ids=[torch.arange(n) for n in response_lengths],
        log_probs=[torch.zeros(n) for n in response_lengths],
    )
    return RolloutTrack(
        name="ar",
        sample_ids=[f"s{i}" for i in range(batch)],
        group_ids=["g0"] * batch,
        prompts=["q"] * batch,
        metadata=metadata or [{} for _ in range(batch)],
        segment=segment,
        texts=texts,
    )


# --- RewardRequest -----------------------------------------------------------------------------


def test_request_needs_exactly_one_modality():
    with pytest.raises(ValueError, match="exactly one of images and texts, got neither"):
        RewardRequest(sample_ids=["a"], prompts=[""])
    with pytest.raises(ValueError, match="exactly one of images and texts, got both"):
        RewardRequest(
            sample_ids=["a"], prompts=[""], images=torch.zeros(1, 3, 2, 2, dtype=torch.uint8), texts=["x"]
        )


def test_request_checks_text_lengths():
    with pytest.raises(ValueError, match="2 strings"):
        RewardRequest(sample_ids=["a", "b"], prompts=["", ""], texts=["x"])
    with pytest.raises(ValueError, match="2 texts but 1 response_lengths"):
        text_request(["x", "y"], lengths=[3])
    with pytest.raises(ValueError, match="'s1'.*int >= 0"):
        text_request(["x", "y"], lengths=[3, -1])
    with pytest.raises(ValueError, match="2 sample_ids but 1 metadata"):
        text_request(["x", "y"], metadata=[{}])
    with pytest.raises(ValueError, match="response_lengths belongs to text"):
        RewardRequest(
            sample_ids=["a"],
            prompts=[""],
            images=torch.zeros(1, 3, 2, 2, dtype=torch.uint8),
            response_lengths=[1],
        )
    assert len(text_request(["x", "y"], lengths=[1, 2])) == 2


# --- scorers -----------------------------------------------------------------------------------


def test_exact_answer_extractors():
    meta = [{"answer": "42"}] * 4
    texts = ["think\n42\n\n", "so 41\n", "", "42 is it\nno"]
    assert ExactAnswer()(text_request(texts, meta)).tolist() == [1.0, 0.0, 0.0, 0.0]

    boxed = ["x \\boxed{1} then \\boxed{ 42 }", "\\boxed{\\frac{1}{2}}", "\\boxed{42", "no box"]
    meta_boxed = [{"answer": "42"}, {"answer": "\\frac{1}{2}"}, {"answer": "42"}, {"answer": "42"}]
    assert ExactAnswer(extract="boxed")(text_request(boxed, meta_boxed)).tolist() == [1.0, 1.0, 0.0, 0.0]

    gsm = ["#### 7\nsteps #### 42 \nbye", "answer: 42", "####42"]
    assert ExactAnswer(extract="after:####")(text_request(gsm, meta[:3])).tolist() == [1.0, 0.0, 1.0]

    regex = ["Answer: 5. Answer: 42.", "answer: 42", "Answer: 42"]
    scores = ExactAnswer(extract=r"Answer: (\d+)")(text_request(regex, meta[:3]))
    assert scores.tolist() == [1.0, 0.0, 1.0]
    assert scores.dtype == torch.float32


def test_exact_answer_numeric_and_non_string_reference():
    meta = [{"answer": 1000}, {"answer": "0.5"}, {"answer": 3}, {"answer": 3}]
    texts = ["1,000", "0.50", "three", "3.0"]
    assert ExactAnswer(numeric=True)(text_request(texts, meta)).tolist() == [1.0, 1.0, 0.0, 1.0]
    # string compare: "3.0" != "3", "1,000" != "1000"
    assert ExactAnswer()(text_request(texts, meta)).tolist() == [0.0, 0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="'s0'.*not a number"):
        ExactAnswer(numeric=True)(text_request(["1"], [{"answer": "n/a"}]))


def test_exact_answer_missing_key_names_sample_and_key():
    req = text_request(["1", "2"], [{"answer": "1"}, {"solution": "2"}])
    with pytest.raises(ValueError, match=r"'s1'.*'answer'.*keys: \['solution'\]"):
        ExactAnswer()(req)
    with pytest.raises(ValueError, match=r"'s0'.*'answer'"):
        ExactAnswer()(text_request(["1"]))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"extract": "(unclosed"}, r"reward\.backend\.components\.<name>\.extract is not a valid regex"),
        ({"extract": r"(\d+) (\d+)"}, r"\.extract must be .* exactly one group.*2 groups"),
        ({"extract": "after:"}, r"\.extract 'after:' needs a marker"),
        ({"answer_key": ""}, r"\.answer_key"),
        ({"numeric": "yes"}, r"\.numeric"),
    ],
)
def test_exact_answer_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ExactAnswer(**kwargs)


def test_format_check():
    texts = ["<a>1</a>", "x <a>1</a>", "<a>\n</a>", ""]
    req = text_request(texts)
    assert FormatCheck(r"<a>.*</a>")(req).tolist() == [1.0, 0.0, 0.0, 0.0]
    assert FormatCheck(r"<a>.*</a>", mode="search")(req).tolist() == [1.0, 1.0, 0.0, 0.0]
    assert FormatCheck(r"(?s)<a>.*</a>")(req).tolist() == [1.0, 0.0, 1.0, 0.0]
    with pytest.raises(ValueError, match=r"\.pattern is not a valid regex"):
        FormatCheck("[")
    with pytest.raises(ValueError, match=r"\.mode must be"):
        FormatCheck("a", mode="match")


def test_overlong_penalty_matches_dapo():
    # max 10, buffer 4, factor 2: free up to 6, then (6 - L) / 4 * 2, -2 beyond 10.
    lengths = [0, 6, 7, 8, 10, 11, 100]
    scores = OverlongPenalty(max_length=10, buffer_length=4, factor=2.0)(
        text_request(["x"] * 7, lengths=lengths)
    )
    assert scores.dtype == torch.float32
    assert scores.tolist() == pytest.approx([0.0, 0.0, -0.5, -1.0, -2.0, -2.0, -2.0])


def test_overlong_penalty_errors():
    with pytest.raises(ValueError, match="needs response_lengths"):
        OverlongPenalty(max_length=4, buffer_length=2)(text_request(["ab"]))
    with pytest.raises(ValueError, match=r"\.buffer_length \(5\) must be <= max_length \(4\)"):
        OverlongPenalty(max_length=4, buffer_length=5)
    with pytest.raises(ValueError, match=r"\.max_length must be an int >= 1"):
        OverlongPenalty(max_length=0, buffer_length=1)
    with pytest.raises(ValueError, match=r"\.factor must be a finite number > 0"):
        OverlongPenalty(max_length=4, buffer_length=2, factor=math.inf)


def test_target_char_fraction():
    scores = TargetCharFraction(chars="0123456789")(text_request(["a1b2", "777", "", "xyz"]))
    assert scores.tolist() == pytest.approx([0.5, 1.0, 0.0, 0.0])
    with pytest.raises(ValueError, match=r"\.chars must be a non-empty string"):
        TargetCharFraction(chars="")


@pytest.mark.parametrize(
    "scorer",
    [
        ExactAnswer(),
        FormatCheck("a"),
        OverlongPenalty(max_length=4, buffer_length=2),
        TargetCharFraction("a"),
    ],
)
def test_text_scorers_reject_images(scorer):
    with pytest.raises(
        ValueError, match=f"{type(scorer).__name__} needs text, but the request carries images"
    ):
        scorer(image_request())


@pytest.mark.parametrize("scorer", [ColorTarget(), JpegCompressibility()])
def test_image_scorers_reject_text(scorer):
    with pytest.raises(
        ValueError, match=f"{type(scorer).__name__} needs images, but the request carries text"
    ):
        scorer(text_request(["a", "b"]))


# --- the service on a text track ---------------------------------------------------------------


def test_service_scores_text_track_from_yaml():
    service = instantiate(OmegaConf.create(TEXT_YAML).reward, _convert_="all")
    texts = ["work\n#### 42", "#### 41", "no marker"]
    track = text_track(texts, response_lengths=[2, 3, 5], metadata=[{"answer": "42"}] * 3)
    metrics = service.score_and_attach(track)

    # answer [1, 0, 0]; format [1, 1, 0]; overlong (free <= 2, then (2 - L) / 2, -1 beyond 4) [0, -0.5, -1]
    assert track.reward_components["answer"].tolist() == [1.0, 0.0, 0.0]
    assert track.reward_components["format"].tolist() == [1.0, 1.0, 0.0]
    assert track.reward_components["overlong"].tolist() == [0.0, -0.5, -1.0]
    assert track.rewards.tolist() == pytest.approx([1.5, 0.0, -1.0])
    assert metrics["reward/mean"] == pytest.approx(0.5 / 3)


def test_service_passes_segment_lengths_and_texts():
    seen: list[RewardRequest] = []

    def record(req):
        seen.append(req)
        return torch.zeros(len(req))

    RewardService(LocalRewardBackend({"r": record})).score_and_attach(text_track(["ab", "c"], [4, 1]))
    assert seen[0].texts == ["ab", "c"] and seen[0].response_lengths == [4, 1] and seen[0].images is None


def test_service_nan_on_text_names_samples_and_attaches_nothing():
    backend = LocalRewardBackend({"judge": lambda req: torch.tensor([0.0, math.nan, 1.0, math.inf])})
    track = text_track(["a", "b", "c", "d"], [1, 1, 1, 1])
    with pytest.raises(
        RewardError, match=r"'judge' is nan for sample 's1'.*'ar'.*2 non-finite.*also sample\(s\) \['s3'\]"
    ):
        RewardService(backend).score_and_attach(track)
    assert track.rewards is None and track.reward_components == {}


def test_service_scorer_error_on_text_names_component_and_sample():
    service = RewardService(LocalRewardBackend({"answer": ExactAnswer()}))
    track = text_track(["1", "2"], [1, 1], metadata=[{"answer": "1"}, {}])
    with pytest.raises(ValueError, match=r"'answer' failed: sample 's1'.*lacks key 'answer'"):
        service.score_and_attach(track)
    assert track.rewards is None


def test_service_track_without_media_or_texts_or_with_both():
    service = RewardService(LocalRewardBackend({"r": lambda req: torch.zeros(len(req))}))
    with pytest.raises(ValueError, match="'ar' has no media and no texts"):
        service.score_and_attach(text_track(None, [1, 1]))
    both = text_track(["a", "b"], [1, 1])
    both.media = torch.zeros(2, 3, 2, 2, dtype=torch.uint8)
    with pytest.raises(ValueError, match="'ar' has both media and texts"):
        service.score_and_attach(both)
    short = text_track(["a"], [1, 1])
    with pytest.raises(ValueError, match="track 'ar' cannot be scored: .*2 strings"):
        service.score_and_attach(short)


def test_text_track_without_token_segment_has_no_lengths():
    seen: list[RewardRequest] = []
    track = text_track(["a"], [1])
    track.segment = LatentSegment(
        latents=torch.zeros(1, 2, 4, 2, 2),
        positions=[0, 1],
        sigmas=torch.tensor([1.0, 0.0]),
        sde_indices=[0],
        log_probs=torch.zeros(1, 1),
        eta=0.7,
        guidance_scale=1.0,
    )
    RewardService(LocalRewardBackend({"r": lambda req: seen.append(req) or torch.zeros(1)})).score_and_attach(
        track
    )
    assert seen[0].response_lengths is None


def test_hydra_config_error_carries_the_component_key():
    cfg = OmegaConf.create(TEXT_YAML)
    cfg.reward.backend.components.format.pattern = "["
    with pytest.raises(
        InstantiationException,
        match=r"(?s)\.pattern is not a valid regex.*full_key: reward\.backend\.components\.format",
    ):
        instantiate(cfg.reward, _convert_="all")


def test_random_reward_is_a_function_of_seed_and_sample_id_only():
    """The control scorer ignores the content: same ids give the same draws for images or text,
    another seed gives independent draws, and draws look uniform on [0, 1)."""
    from unirl.reward.local import RandomReward

    ids = [f"r0/g{i // 4}::sample:{i % 4}" for i in range(400)]
    texts = RewardRequest(sample_ids=ids, prompts=["p"] * 400, texts=["x"] * 400)
    images = RewardRequest(
        sample_ids=ids, prompts=["p"] * 400, images=torch.zeros(400, 3, 2, 2, dtype=torch.uint8)
    )
    a, b, c = RandomReward(0)(texts), RandomReward(0)(images), RandomReward(1)(texts)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert a.dtype == torch.float32 and float(a.min()) >= 0 and float(a.max()) < 1
    assert abs(float(a.mean()) - 0.5) < 0.05 and abs(float(torch.corrcoef(torch.stack([a, c]))[0, 1])) < 0.15
    with pytest.raises(ValueError, match="RandomReward seed must be an int"):
        RandomReward("0")
