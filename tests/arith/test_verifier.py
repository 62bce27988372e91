"""The arithmetic scorers on correct, wrong, malformed and adversarial responses."""

from __future__ import annotations

import time

import pytest
import torch

from unirl.types.reward import RewardRequest
from worlds.arith import ArithAnswer, ArithDataset, ArithFormat


def _req(texts: list[str], answers: list[object] | None = None, key: str = "answer") -> RewardRequest:
    ids = [f"s{i}" for i in range(len(texts))]
    metadata = [] if answers is None else [{key: a} for a in answers]
    return RewardRequest(sample_ids=ids, prompts=["1+1="] * len(texts), texts=texts, metadata=metadata)


def _scores(texts: list[str], answer: object) -> list[float]:
    out = ArithAnswer()(_req(texts, [answer] * len(texts)))
    assert out.dtype == torch.float32 and out.shape == (len(texts),)
    return out.tolist()


def test_answer_correct_and_whitespace() -> None:
    assert _scores(["168", " 168", "168\n", "\t168 \r\n"], "168") == [1.0] * 4
    assert _scores(["-333", " -333\n"], "-333") == [1.0, 1.0]
    assert _scores(["0"], "0") == [1.0]
    assert _scores(["168"], 168) == [1.0]  # an int reference is canonicalised


@pytest.mark.parametrize(
    "text",
    [
        "167",  # wrong
        "-168",
        "",  # empty
        "   ",
        "168 170",  # several numbers
        "168168",
        "answer: 168",  # extra text
        "168.",
        "168.0",
        "1 68",
        "1,68",
        "+168",  # leading plus
        "0168",  # leading zero
        "00168",
        "１６８",  # fullwidth digits
        "١٦٨",  # Arabic-Indic digits
        "16８",
        "168\u00a0",  # unicode whitespace is not stripped
        "\u3000168",
        "168<|endoftext|>",
        "1.68e2",
        "0x a8",
    ],
)
def test_answer_wrong_and_adversarial(text: str) -> None:
    assert _scores([text], "168") == [0.0]


def test_answer_zero_and_negative_edge_cases() -> None:
    assert _scores(["-0", "0", "00", "+0"], "0") == [0.0, 1.0, 0.0, 0.0]
    assert _scores(["-5", "- 5", "--5", "5"], "-5") == [1.0, 0.0, 0.0, 0.0]


def test_answer_huge_numbers_compared_as_strings() -> None:
    big = "9" * 1_000_000
    t0 = time.perf_counter()
    got = _scores([big, big[:-1] + "8", "1" + big, big + "\n"], big)
    assert got == [1.0, 0.0, 0.0, 1.0]
    assert _scores(["1" * 1_000_000], "168") == [0.0]
    assert time.perf_counter() - t0 < 2.0  # linear scans, no int parsing


def test_answer_missing_key_names_sample_and_key() -> None:
    req = RewardRequest(
        sample_ids=["a", "b"],
        prompts=["1+1="] * 2,
        texts=["2", "2"],
        metadata=[{"answer": "2"}, {"op": "add"}],
    )
    with pytest.raises(ValueError, match=r"'b'.*'answer'"):
        ArithAnswer()(req)
    with pytest.raises(ValueError, match=r"'s0'.*'result'"):
        ArithAnswer(answer_key="result")(_req(["2"], ["2"]))
    with pytest.raises(ValueError, match=r"'s0'.*'answer'"):
        ArithAnswer()(_req(["2"]))  # no metadata at all


@pytest.mark.parametrize("ref", ["0168", "+168", "-0", "1.0", "１６８", "", 1.5, None, True])
def test_answer_non_canonical_reference_raises(ref: object) -> None:
    with pytest.raises(ValueError, match="canonical"):
        ArithAnswer()(_req(["168"], [ref]))


def test_answer_bad_config() -> None:
    with pytest.raises(ValueError, match="answer_key"):
        ArithAnswer(answer_key="")


def test_answer_on_dataset_examples() -> None:
    examples = ArithDataset("eval").examples[:20]
    req = RewardRequest(
        sample_ids=[e.prompt_id for e in examples],
        prompts=[e.prompt for e in examples],
        texts=[e.metadata["answer"] for e in examples],
        metadata=[e.metadata for e in examples],
    )
    assert ArithAnswer()(req).tolist() == [1.0] * 20


def test_format() -> None:
    texts = ["168", " -333\n", "0168", "-0", "", "+1", "1 2", "１６８", "12a", "-", "1.5", "1\u00a0"]
    want = [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    out = ArithFormat()(_req(texts))
    assert out.dtype == torch.float32 and out.tolist() == want


def test_scorers_need_text() -> None:
    req = RewardRequest(
        sample_ids=["a"],
        prompts=["p"],
        images=torch.zeros(1, 3, 4, 4, dtype=torch.uint8),
        metadata=[{"answer": "1"}],
    )
    for scorer, name in ((ArithAnswer(), "ArithAnswer"), (ArithFormat(), "ArithFormat")):
        with pytest.raises(ValueError, match=name):
            scorer(req)
