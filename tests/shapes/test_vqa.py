"""The shapes VQA world: every answer recomputed from the rendered image by the weight-free
detector (an independent reading of the pixels), the split's held-out combinations, the
SFT source, and the verifier on right, wrong and adversarial answers."""

from __future__ import annotations

import numpy as np
import pytest

from unirl.types.reward import RewardRequest
from worlds.shapes import detect
from worlds.shapes.scorer import relation_holds
from worlds.shapes.vqa import (
    ANSWERS,
    QTYPES,
    ShapesVQADataset,
    ShapesVQADataSource,
    ShapesVQASFTSource,
    VQAAnswer,
    VQAFormat,
)
from worlds.shapes.world import is_eval_scene, parse_prompt


def answer_from_pixels(image: np.ndarray, question: str) -> str:
    """The answer to `question` read off the image by `detect` alone."""
    found = detect(image)
    words = question.rstrip("?").split()
    if question.startswith("how many"):
        return str(sum(d.shape == words[2][:-1] for d in found))
    if question.startswith("what colour is the"):
        return next(d.color for d in found if d.shape == words[-1])
    if question.startswith("what shape is the"):
        return next(d.shape for d in found if d.color == words[-2])
    if question.startswith("is there a"):
        return "yes" if any(d.color == words[3] and d.shape == words[4] for d in found) else "no"
    # "is the <c> <s> <relation> the <c> <s>?"
    a, b = words[2:4], words[-2:]
    relation = " ".join(words[4:-3])
    da = next(d for d in found if [d.color, d.shape] == a)
    db = next(d for d in found if [d.color, d.shape] == b)
    return "yes" if relation_holds(da, db, relation) else "no"


@pytest.mark.parametrize("split", ["train", "eval"])
def test_every_answer_is_what_the_image_shows(split) -> None:
    rows = ShapesVQADataset(split, size=300).examples
    assert {r.metadata["qtype"] for r in rows} == set(QTYPES)
    for r in rows:
        assert r.prompt.startswith("<image>") and r.prompt.count("<image>") == 1
        assert r.metadata["answer"] in ANSWERS
        (image,) = r.metadata["images"]
        assert image.shape == (32, 32, 3) and image.dtype == np.uint8
        assert answer_from_pixels(image, r.prompt.removeprefix("<image>")) == r.metadata["answer"], (
            r.prompt_id
        )


def test_the_split_holds_out_combinations_and_placements() -> None:
    evals = ShapesVQADataset("eval").examples
    train = ShapesVQADataset("train").examples
    trained = ShapesVQADataset("eval_trained").examples
    assert all(r.metadata["holdout"] == "combination" for r in evals)
    assert all(r.metadata["holdout"] == "placement" for r in trained)
    # the same questions of the same training scenes, rendered in other placements
    assert [(r.prompt, r.metadata["answer"]) for r in trained] == [
        (r.prompt, r.metadata["answer"]) for r in train
    ]
    differ = sum(
        not np.array_equal(a.metadata["images"][0], b.metadata["images"][0]) for a, b in zip(train, trained, strict=True)
    )
    assert differ > 0.95 * len(train)
    assert not {r.prompt_id for r in evals} & {r.prompt_id for r in train}
    both = ShapesVQADataset("eval_all", size=50).examples
    assert [r.metadata["holdout"] for r in both] == ["combination"] * 50 + ["placement"] * 50
    with pytest.raises(ValueError, match=r"split must be one of .*got 'test'"):
        ShapesVQADataset("test")


def test_sft_source_draws_training_scenes_only() -> None:
    rng = np.random.default_rng(0)
    rows = ShapesVQASFTSource().sample_batch(200, rng)
    eval_prompts = {r.prompt for r in ShapesVQADataset("eval").examples if r.metadata["category"] != "single"}
    for prompt, answer, (image,) in rows:
        assert answer in ANSWERS and answer_from_pixels(image, prompt.removeprefix("<image>")) == answer
    # a held-out pair's question about both objects never appears
    pair_questions = {p for p in eval_prompts if " the " in p and p.startswith("<image>is the")}
    assert not pair_questions & {p for p, _, _ in rows}
    src = ShapesVQADataSource(split="train")
    state = src.state_dict()
    first = [e.prompt_id for e in src.next_batch(5)]
    src.load_state_dict(state)
    assert [e.prompt_id for e in src.next_batch(5)] == first


def test_eval_scenes_are_the_worlds_held_out_scenes() -> None:
    for r in ShapesVQADataset("eval", size=100).examples:
        cat = r.metadata["category"]
        parts = r.prompt_id.split("/")[3].split("_")
        objs = [" ".join(parts[i : i + 2]) for i in range(0, len(parts), 2)]
        if cat == "counting":
            objs = [f"{['', 'a', 'two', 'three'][int(r.prompt_id.split('/')[4])]} {objs[0]}s"]
            prompt = objs[0]
        elif cat == "position":
            prompt = f"a {objs[0]} {r.prompt_id.split('/')[5]} a {objs[1]}"
        else:
            prompt = " and ".join(f"a {o}" for o in objs)
        assert is_eval_scene(parse_prompt(prompt.replace("_", " "))), r.prompt_id


def req(texts, answers) -> RewardRequest:
    return RewardRequest(
        sample_ids=[f"s{i}" for i in range(len(texts))],
        prompts=["q"] * len(texts),
        texts=texts,
        metadata=[{"answer": a} for a in answers],
    )


def test_verifier_on_right_wrong_and_adversarial_answers() -> None:
    cases = [
        ("2", "2", 1.0, 1.0),
        (" red\n", "red", 1.0, 1.0),
        ("Red", "red", 0.0, 0.0),  # case matters: the vocabulary is lower case
        ("two", "2", 0.0, 0.0),
        ("2 3", "2", 0.0, 0.0),
        ("yes no", "yes", 0.0, 0.0),
        ("red.", "red", 0.0, 0.0),
        ("", "no", 0.0, 0.0),
        ("no", "yes", 0.0, 1.0),
        ("circle\u00a0", "circle", 0.0, 0.0),  # unicode whitespace is not stripped
        ("yes" * 1000, "yes", 0.0, 0.0),
    ]
    texts, answers, right, formed = zip(*cases, strict=True)
    assert VQAAnswer()(req(list(texts), list(answers))).tolist() == list(right)
    assert VQAFormat()(req(list(texts), list(answers))).tolist() == list(formed)
    with pytest.raises(ValueError, match=r"sample 's0' has no reference answer.*'answer'"):
        VQAAnswer()(RewardRequest(sample_ids=["s0"], prompts=["q"], texts=["2"], metadata=[{}]))
    with pytest.raises(ValueError, match=r"sample 's0'.*'purple' is not an answer word"):
        VQAAnswer()(req(["2"], ["purple"]))
