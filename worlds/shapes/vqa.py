"""The shapes VQA world: rendered scenes, questions with one checkable word as the answer,
the verifier, and the splits.

A row is a rendered shapes scene (`world.render`) and a question about it; the prompt is
`"<image>" + question` (one image placeholder, `QwenVLBundle.prepare` expands it) and the
image travels in `metadata["images"]`. Question types (`QTYPES`), all asked of the scenes
`world.all_scenes` enumerates:

    count     "how many circles?"              -> "0" .. "3" (a shape in the scene, or one absent)
    color     "what colour is the square?"     -> a colour   (a shape drawn exactly once)
    shape     "what shape is the red one?"     -> a shape    (a colour drawn exactly once)
    exist     "is there a blue triangle?"      -> "yes" / "no" (an object drawn, or a near miss:
                                                  its shape in another colour)
    position  "is the red circle left of the blue square?" -> "yes" / "no" (position scenes;
                                                  every relation is asked, one is true)

Splits follow the shapes world's (`world.split_scenes`): held-out *combinations* (object
pairs and (object, count)s never seen in training) make "eval"; "eval_trained" asks the
same questions about training scenes in placements training never drew (its own render
seeds), so a model that learned the objects but not the combinations shows up as the gap
between the two.

The verifier (`VQAAnswer`) gives 1.0 when the response, stripped of surrounding ASCII
whitespace, is exactly the reference word (lower case); `VQAFormat` gives 1.0 when it is
one word of the answer vocabulary (`ANSWERS`).
"""

from __future__ import annotations

import functools
import zlib

import numpy as np
import torch

from unirl.data.data_source import ListDataSource
from unirl.types.reward import RewardRequest
from unirl.types.rollout_req import PromptExample
from worlds.shapes.world import (
    COLORS,
    RELATIONS,
    SHAPES,
    SceneSpec,
    ShapeSpec,
    parse_prompt,
    render,
    split_scenes,
)

QTYPES: tuple[str, ...] = ("count", "color", "shape", "exist", "position")
ANSWERS: frozenset[str] = frozenset({"0", "1", "2", "3", "yes", "no", *COLORS, *SHAPES})
IMAGE_SIZE = 32
SPLITS = ("train", "eval", "eval_trained", "eval_all")
_KEY = "reward.backend.components.<name>"
_ASCII_WHITESPACE = " \t\n\r\x0b\x0c"


def questions(spec: SceneSpec) -> list[tuple[str, str, str]]:
    """(qtype, question, answer) of every question `spec` answers, in a fixed order."""
    drawn = spec.rendered_objects()
    out: list[tuple[str, str, str]] = []
    shapes_in = [s for s in SHAPES if any(o.shape == s for o in drawn)]
    absent = [s for s in SHAPES if s not in shapes_in]
    for s in shapes_in + absent[:1]:
        out.append(("count", f"how many {s}s?", str(sum(o.shape == s for o in drawn))))
    for o in spec.objects:
        if sum(d.shape == o.shape for d in drawn) == 1:
            out.append(("color", f"what colour is the {o.shape}?", o.color))
        if sum(d.color == o.color for d in drawn) == 1:
            out.append(("shape", f"what shape is the {o.color} one?", o.shape))
    for o in spec.objects:
        out.append(("exist", f"is there a {o.phrase}?", "yes"))
        other = next(c for c in COLORS if all(d != ShapeSpec(c, o.shape) for d in drawn))
        out.append(("exist", f"is there a {other} {o.shape}?", "no"))
    if spec.category == "position":
        a, b = spec.objects
        for rel in RELATIONS:
            out.append(
                (
                    "position",
                    f"is the {a.phrase} {rel} the {b.phrase}?",
                    "yes" if rel == spec.relation else "no",
                )
            )
    return out


def prompt_questions(spec: SceneSpec) -> list[tuple[str, str]]:
    """(question, answer) pairs in this world's templates whose answers are all right exactly
    when an image shows `spec` as `GenEvalMini`'s strict verdict wants it: every wanted object
    is there ("is there a red circle?" -> yes), each wanted shape is drawn as often as asked
    ("how many circles?" -> its count among the wanted objects), and a position prompt's
    relation holds ("is the red circle left of the blue square?" -> yes)."""
    wanted = spec.rendered_objects()
    out = [(f"is there a {o.phrase}?", "yes") for o in dict.fromkeys(wanted)]
    for shape in dict.fromkeys(o.shape for o in wanted):
        out.append((f"how many {shape}s?", str(sum(o.shape == shape for o in wanted))))
    if spec.category == "position":
        a, b = spec.objects
        out.append((f"is the {a.phrase} {spec.relation} the {b.phrase}?", "yes"))
    return out


class JudgeQuestions:
    """`VLMJudge` questions (`unirl.reward.judge`) for shapes prompts: `prompt_questions` of
    the prompt's scene. A prompt outside the grammar is a ValueError naming it."""

    def __call__(self, prompt: str, metadata: dict) -> list[tuple[str, str]]:
        return prompt_questions(parse_prompt(prompt))


def _seed(*parts: object) -> int:
    return zlib.crc32("|".join(map(str, parts)).encode())


def _row(
    spec: SceneSpec, qtype: str, question: str, answer: str, row_id: str, render_seed: int, holdout: str
):
    image = render(spec, np.random.default_rng(render_seed), IMAGE_SIZE)
    metadata = {
        "images": [image],
        "answer": answer,
        "qtype": qtype,
        "category": spec.category,
        "holdout": holdout,
    }
    return PromptExample(prompt=f"<image>{question}", prompt_id=row_id, metadata=metadata)


@functools.lru_cache(maxsize=8)
def _split_rows(split: str, seed: int, size: int | None) -> tuple[PromptExample, ...]:
    if split not in SPLITS:
        raise ValueError(f"ShapesVQA split must be one of {list(SPLITS)}, got {split!r}")
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
        raise ValueError(f"ShapesVQA size must be an integer >= 1 (or null: the whole split), got {size!r}")
    if split == "eval_all":
        return _split_rows("eval", seed, size) + _split_rows("eval_trained", seed, size)
    train, evals = split_scenes(seed)
    scenes = evals if split == "eval" else train
    holdout = {"train": "none", "eval": "combination", "eval_trained": "placement"}[split]
    # eval_trained renders with seeds training never uses (a different salt)
    salt = "held" if split == "eval_trained" else "train"
    rows = []
    for spec in scenes:
        for j, (qtype, question, answer) in enumerate(questions(spec)):
            rid = f"vqa/{split}/{spec.category}/{'_'.join(o.phrase for o in spec.objects)}/{spec.count}/{spec.relation}/{j}"
            rows.append((spec, qtype, question, answer, rid.replace(" ", "_"), _seed(salt, seed, rid)))
    if size is not None and size < len(rows):
        picked = np.random.default_rng(_seed("pick", split, seed)).choice(len(rows), size, replace=False)
        rows = [rows[i] for i in sorted(picked)]
    return tuple(_row(*r, holdout) for r in rows)


class ShapesVQADataset:
    """The question rows of one split as prompts (`examples`), each with its rendered image.

    Args:
        split: "train", "eval" (held-out combinations), "eval_trained" (training scenes in
            placements training never drew) or "eval_all" (both; metadata "holdout" says which:
            "combination" or "placement").
        seed: the split seed (`world.split_scenes`) and the render seeds.
        size: rows drawn at random (fixed by seed) from the split (from each, for eval_all);
            None: all of them.
    """

    def __init__(self, split: str = "train", seed: int = 0, size: int | None = None) -> None:
        self.split, self.seed = split, seed
        self.examples: list[PromptExample] = [
            PromptExample(e.prompt, e.prompt_id, dict(e.metadata)) for e in _split_rows(split, seed, size)
        ]

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> PromptExample:
        return self.examples[i]


class ShapesVQADataSource(ListDataSource):
    """A `ShapesVQADataset` as a resumable RL data source (`_target_: worlds.shapes.vqa.ShapesVQADataSource`)."""

    def __init__(self, split: str = "train", seed: int = 0, size: int | None = None, shuffle: bool = True):
        rows = _split_rows(split, seed, size)
        super().__init__(
            list(rows),
            shuffle=shuffle,
            seed=seed,
            source=f"<shapes vqa split={split} seed={seed} size={len(rows)}>",
        )


class ShapesVQASFTSource:
    """(prompt, completion, images) triples for supervised pretraining of a VLM: a training scene
    (category uniform, then scene), one of its questions (question type uniform among those it
    answers), rendered in a fresh random placement from `rng`; never a held-out combination."""

    def __init__(self, seed: int = 0) -> None:
        train, _ = split_scenes(seed)
        self._by_category: dict[str, list[SceneSpec]] = {}
        for s in train:
            self._by_category.setdefault(s.category, []).append(s)

    def sample_batch(self, n: int, rng: np.random.Generator) -> list[tuple[str, str, list[np.ndarray]]]:
        cats = sorted(self._by_category)
        out = []
        for _ in range(n):
            group = self._by_category[cats[int(rng.integers(len(cats)))]]
            spec = group[int(rng.integers(len(group)))]
            qs = questions(spec)
            types = sorted({q[0] for q in qs})
            qtype = types[int(rng.integers(len(types)))]
            of_type = [q for q in qs if q[0] == qtype]
            _, question, answer = of_type[int(rng.integers(len(of_type)))]
            out.append((f"<image>{question}", answer, [render(spec, rng, IMAGE_SIZE)]))
        return out


def strip_answer(text: str) -> str:
    """`text` without surrounding ASCII whitespace."""
    return text.strip(_ASCII_WHITESPACE)


class VQAAnswer:
    """Scorer: 1.0 when the stripped response is exactly the reference word `metadata[answer_key]`.

    A sample without the key, or whose reference is not a word of `ANSWERS`, is a data bug:
    ValueError naming the sample id and the key.
    """

    def __init__(self, answer_key: str = "answer") -> None:
        if not isinstance(answer_key, str) or not answer_key:
            raise ValueError(f"VQAAnswer: {_KEY}.answer_key must be a non-empty string, got {answer_key!r}")
        self.answer_key = answer_key

    def reference(self, sample_id: str, metadata: dict) -> str:
        if self.answer_key not in metadata:
            raise ValueError(
                f"VQAAnswer: sample {sample_id!r} has no reference answer: its metadata lacks key "
                f"{self.answer_key!r} (keys: {sorted(metadata)}); fix the data or set answer_key"
            )
        ref = metadata[self.answer_key]
        if ref not in ANSWERS:
            raise ValueError(
                f"VQAAnswer: sample {sample_id!r}: reference {self.answer_key!r} = {ref!r} is not an answer "
                f"word ({sorted(ANSWERS)})"
            )
        return ref

    def __call__(self, req: RewardRequest) -> torch.Tensor:
        texts = req.require_texts("VQAAnswer")
        metadata = req.metadata or [{} for _ in texts]
        scores = [
            1.0 if strip_answer(t) == self.reference(sid, m) else 0.0
            for sid, t, m in zip(req.sample_ids, texts, metadata, strict=True)
        ]
        return torch.tensor(scores, dtype=torch.float32)


class VQAFormat:
    """Scorer: 1.0 when the stripped response is one word of the answer vocabulary (`ANSWERS`)."""

    def __call__(self, req: RewardRequest) -> torch.Tensor:
        texts = req.require_texts("VQAFormat")
        return torch.tensor([1.0 if strip_answer(t) in ANSWERS else 0.0 for t in texts], dtype=torch.float32)
