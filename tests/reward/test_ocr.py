"""`OCRReward`: Flow-GRPO's OCR reward read by the real PP-OCRv4 weights of rapidocr-onnxruntime.

Words are rendered with Pillow's bundled font (no system font needed) in black on white; the
reward is checked against the formula computed by hand (1 - edit distance / target length)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont

from unirl.reward import LocalRewardBackend
from unirl.reward.local import OCRReward
from unirl.reward.local.ocr import ocr_score, quoted_text
from unirl.types.reward import RewardRequest

pytest.importorskip("rapidocr_onnxruntime", reason="the scorers extra: pip install -e '.[scorers]'")
pytest.importorskip("Levenshtein", reason="the scorers extra: pip install -e '.[scorers]'")

FONT = ImageFont.load_default(size=32)


def render(word: str, width: int = 224, height: int = 48) -> torch.Tensor:
    """[3, H, W] uint8: `word` in black on white."""
    image = Image.new("RGB", (width, height), "white")
    ImageDraw.Draw(image).text((8, 6), word, fill="black", font=FONT)
    return torch.from_numpy(np.array(image)).permute(2, 0, 1).contiguous()


def request(words: list[str], targets: list[str], **kw) -> RewardRequest:
    return RewardRequest(
        sample_ids=[f"s{i}" for i in range(len(words))],
        prompts=[f'a sign that says "{t}"' for t in targets],
        images=torch.stack([render(w) for w in words]),
        **kw,
    )


@pytest.fixture(scope="module")
def scorer() -> OCRReward:
    return OCRReward()


@pytest.mark.parametrize(
    "recognized, target, want",
    [
        ("HELLO", "hello", 1.0),  # case and spaces do not count
        ("CAT42", "CAT 42", 1.0),
        ("xx hello yy", "hello", 1.0),  # the target inside the reading
        ("helo", "hello", 1 - 1 / 5),  # one deletion
        ("jello", "hello", 1 - 1 / 5),  # one substitution
        ("", "sun", 0.0),  # nothing read
        ("a much longer unrelated reading", "sun", 0.0),  # distance capped at the target's length
        ("sn", "sun", 1 - 1 / 3),
    ],
)
def test_the_score_is_one_minus_the_capped_edit_distance(recognized, target, want) -> None:
    assert ocr_score(recognized, target) == pytest.approx(want)


def test_the_target_is_the_first_quoted_text() -> None:
    assert quoted_text('a neon sign that says "OPEN 24" above a door') == "OPEN 24"
    assert quoted_text('"A" and "B"') == "A"
    assert quoted_text("no quotes here") is None and quoted_text('one " quote') is None


def test_real_weights_read_rendered_words_exactly(scorer) -> None:
    words = ["HELLO", "CAT 42", "sun", "RL"]
    assert scorer(request(words, words)).tolist() == [1.0, 1.0, 1.0, 1.0]


def test_a_misspelling_scores_its_edit_distance_and_a_blank_scores_zero(scorer) -> None:
    req = request(["HELO", "SUN"], ["HELLO", "RAIN"])
    assert scorer(req).tolist() == pytest.approx([1 - 1 / 5, 1 - 3 / 4])  # sun -> rain: 3 edits
    blank = RewardRequest(
        ["b0"], ['a sign that says "HELLO"'], images=torch.full((1, 3, 48, 224), 255, dtype=torch.uint8)
    )
    assert scorer(blank).tolist() == [0.0]


def test_the_reading_keeps_ascii_unless_told_otherwise(scorer) -> None:
    """The wheel's recogniser (PP-OCRv4, Chinese + Latin) may read the blank after a short word
    as a CJK character; the reading keeps ASCII by default, all of it with ascii_only false."""
    images = torch.stack([render("HELO"), render("CAT")])
    assert scorer.read(images) == ["HELO", "CAT"]
    raw = OCRReward(ascii_only=False).read(images)
    assert [t.encode("ascii", "ignore").decode() for t in raw] == ["HELO", "CAT"]


def test_detection_then_recognition_reads_the_same(scorer) -> None:
    det = OCRReward(mode="det_rec")
    assert det(request(["CAT 42", "HELLO"], ["CAT 42", "HELLO"])).tolist() == [1.0, 1.0]
    assert det(
        RewardRequest(["b"], ['"RL"'], images=torch.full((1, 3, 48, 224), 255, dtype=torch.uint8))
    ).tolist() == [0.0]


def test_targets_from_a_metadata_key() -> None:
    scorer = OCRReward(text_key="text")
    req = RewardRequest(
        ["a", "b"], ["draw it", "draw it"], images=torch.stack([render("sun"), render("RL")]),
        metadata=[{"text": "sun"}, {"text": "LR"}],
    )  # fmt: skip
    assert scorer(req).tolist() == pytest.approx([1.0, 0.0])  # RL vs LR: 2 substitutions of 2


def test_a_sample_without_a_target_is_named() -> None:
    req = RewardRequest(
        ["s0", "s7"], ['"sun"', "a sign with no quotes"], images=torch.stack([render("sun")] * 2)
    )
    with pytest.raises(ValueError, match=r"sample s7 has no target text in double quotes in its prompt"):
        OCRReward()(req)
    req = RewardRequest(["m0"], ["x"], images=render("sun")[None], metadata=[{"other": 1}])
    with pytest.raises(ValueError, match=r"sample m0 has no target text in metadata key 'text'"):
        OCRReward(text_key="text")(req)
    with pytest.raises(ValueError, match="needs images"):
        OCRReward()(RewardRequest(["t"], ['"x"'], texts=["x"]))


@pytest.mark.parametrize(
    "kwargs, match", [({"mode": "boxes"}, "mode must be one of"), ({"min_confidence": 1.0}, "min_confidence")]
)
def test_bad_settings_are_refused(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        OCRReward(**kwargs)


def test_it_is_a_reward_component(scorer) -> None:
    backend = LocalRewardBackend(components={"ocr": scorer}, weights={"ocr": 1.0})
    resp = backend.score(request(["HELO", "sun"], ["HELLO", "sun"]))
    assert resp.components["ocr"].tolist() == pytest.approx([0.8, 1.0])


def test_the_reward_server_scores_ocr_as_in_process(scorer, monkeypatch) -> None:
    """The same component behind `python -m unirl.reward.server`'s app (real HTTP on loopback)."""
    from unirl.reward import RemoteRewardBackend
    from unirl.reward.server import RewardServer, ServerConfig

    monkeypatch.setenv("UNIRL_TEST_OCR_TOKEN", "t0ken")
    backend = LocalRewardBackend(components={"ocr": OCRReward()}, weights={"ocr": 1.0})
    req = request(["HELO", "sun", "RL"], ["HELLO", "sun", "LR"])
    with RewardServer(backend, "t0ken", ServerConfig(port=0)) as server:
        remote = RemoteRewardBackend(server.url, token_env="UNIRL_TEST_OCR_TOKEN").score(req)
    local = LocalRewardBackend(components={"ocr": scorer}, weights={"ocr": 1.0}).score(req)
    assert torch.equal(remote.components["ocr"], local.components["ocr"])
    assert remote.components["ocr"].tolist() == pytest.approx([0.8, 1.0, 0.0])
