"""The prompt-enhancer (PE) world: user prompts that state a shapes scene in surface forms the
diffusion base never saw, to be rewritten into the canonical prompt (`world.scene_to_prompt`).

Every surface form (a word's synonym, a count or relation phrase, a filler prefix, a sentence
template) belongs to one of three tiers:

    sft     what supervised pretraining of the PE sees (`ShapesPESFTSource`): about half of
            each word class and of each category's templates, the canonical words included
    rl      RL-only forms: the other half; RL prompts (`ShapesPEDataset(split="train")`) mix
            them into SFT forms, so what RL must learn is learnable from the reward alone
    unseen  forms in no training prompt at all (eval slices `unseen_templates`, `unseen_words`)

Evaluation slices are built on the held-out scenes of `world.split_scenes(seed)`:
    heldout            held-out scene combinations in RL forms (the headline slice)
    unseen_templates   unseen templates with seen words (compositional generalisation)
    unseen_words       one unseen word per prompt, otherwise RL forms (no target)
The unseen_* slices also take the 12 single scenes (no single scene is held out, and their
templates and words would otherwise go unmeasured).

Every example carries its scene's canonical prompt in `metadata["canonical"]`: the scene is
`parse_prompt(metadata["canonical"])`. Deterministic (string-seeded `random.Random`), pure python.
"""

from __future__ import annotations

import functools
import random
from typing import NamedTuple

import numpy as np

from unirl.data.data_source import ListDataSource
from unirl.types.rollout_req import PromptExample
from worlds.shapes.world import CATEGORIES, SceneSpec, scene_to_prompt, split_scenes


class Tiers(NamedTuple):
    """The surface forms of one word or category, by tier."""

    sft: tuple[str, ...]
    rl: tuple[str, ...]
    unseen: tuple[str, ...]


TIERS: tuple[str, ...] = ("sft", "rl", "unseen")

COLOR_FORMS: dict[str, Tiers] = {
    "red": Tiers(("red", "crimson"), ("scarlet", "ruby"), ("cherry",)),
    "green": Tiers(("green", "emerald"), ("lime", "jade"), ("olive",)),
    "blue": Tiers(("blue", "navy"), ("azure", "cobalt"), ("sapphire",)),
    "yellow": Tiers(("yellow", "golden"), ("lemon", "amber"), ("mustard",)),
}
SHAPE_FORMS: dict[str, Tiers] = {
    "circle": Tiers(("circle", "ball"), ("disc", "orb"), ("ring",)),
    "square": Tiers(("square", "box"), ("block", "tile"), ("cube",)),
    "triangle": Tiers(("triangle", "pyramid"), ("wedge", "delta"), ("cone",)),
}
COUNT_FORMS: dict[int, Tiers] = {
    2: Tiers(("two", "2"), ("a pair of", "a couple of"), ("a duo of",)),
    3: Tiers(("three", "3"), ("a trio of", "a triple of"), ("a triad of",)),
}
RELATION_FORMS: dict[str, Tiers] = {
    "left of": Tiers(("left of", "to the left of"), ("on the left of", "on the left side of"), ("west of",)),
    "right of": Tiers(
        ("right of", "to the right of"), ("on the right of", "on the right side of"), ("east of",)
    ),
    "above": Tiers(("above", "over"), ("on top of", "atop"), ("higher than",)),
    "below": Tiers(("below", "under"), ("beneath", "underneath"), ("lower than",)),
}
PREFIX_FORMS = Tiers(
    ("", "a picture of", "please draw", "draw"), ("an image of", "show me", "a photo of", "i want"), ()
)
"""Filler put before the sentence ("" for none); templates starting with "there" take none."""

END = "."
"""Every user prompt ends with it: the PE's cue that the prompt is over and its rewrite begins
(the byte-level PE has no other boundary; `prompt.removesuffix(END)` is the bare paraphrase)."""

INVERSE_RELATION: dict[str, str] = {
    "left of": "right of",
    "right of": "left of",
    "above": "below",
    "below": "above",
}

# Slots: {a} / {b} the first / second object ("a {color} {shape}"), {c} {s} a single object's
# colour and shape, {n} a count phrase, {p} a plural shape, {r} the scene's relation phrase
# (A r B), {ri} the inverse relation's phrase. The "... it" templates state the relation from
# B's side; "{b} {ri} {a}" swaps the objects and inverts the relation.
TEMPLATES: dict[str, tuple[str, str]] = {
    "single/plain": ("sft", "a {c} {s}"),
    "single/one": ("sft", "one {c} {s}"),
    "single/in": ("sft", "a {s} in {c}"),
    "single/single": ("rl", "a single {c} {s}"),
    "single/colored": ("rl", "a {c} colored {s}"),
    "single/that_is": ("unseen", "a {s} that is {c}"),
    "two_objects/and": ("sft", "{a} and {b}"),
    "two_objects/with": ("sft", "{a} with {b}"),
    "two_objects/both": ("sft", "both {a} and {b}"),
    "two_objects/plus": ("rl", "{a} plus {b}"),
    "two_objects/along_with": ("rl", "{a} along with {b}"),
    "two_objects/there_is": ("unseen", "there is {a} and {b}"),
    "counting/plain": ("sft", "{n} {c} {p}"),
    "counting/in": ("sft", "{n} {p} in {c}"),
    "counting/exactly": ("rl", "exactly {n} {c} {p}"),
    "counting/colored": ("rl", "{n} {c} colored {p}"),
    "counting/exactly_in": ("unseen", "exactly {n} {p} in {c}"),
    "position/plain": ("sft", "{a} {r} {b}"),
    "position/there_is": ("sft", "there is {a} {r} {b}"),
    "position/that_is": ("sft", "{a} that is {r} {b}"),
    "position/with_it": ("sft", "{b} with {a} {r} it"),
    "position/swapped": ("rl", "{b} {ri} {a}"),
    "position/placed": ("rl", "{a} placed {r} {b}"),
    "position/has_it": ("rl", "{b} has {a} {r} it"),
    "position/there_with_it": ("unseen", "there is {b} with {a} {r} it"),
}
"""Template id ("<category>/<name>") -> (tier, format)."""

SLICES: dict[str, tuple[str, ...]] = {
    "train": ("train",),
    "eval": ("heldout", "unseen_templates", "unseen_words"),
}
"""The slices of each split of `ShapesPEDataset`."""


def templates_of(category: str, tiers: tuple[str, ...]) -> list[str]:
    """Template ids of a category in the given tiers, in `TEMPLATES` order."""
    return [t for t, (tier, _) in TEMPLATES.items() if t.startswith(category + "/") and tier in tiers]


def plural(word: str) -> str:
    """English plural of a shape word ("box" -> "boxes", "ball" -> "balls")."""
    return word + "es" if word.endswith(("x", "s", "sh", "ch")) else word + "s"


def _articles(text: str) -> str:
    """'a' before a vowel-initial word becomes 'an'; spaces collapsed."""
    words = text.split()
    for i in range(len(words) - 1):
        if words[i] == "a" and words[i + 1][0] in "aeiou":
            words[i] = "an"
    return " ".join(words)


def _known_words() -> frozenset[str]:
    words: set[str] = set()
    for table in (COLOR_FORMS, SHAPE_FORMS, COUNT_FORMS, RELATION_FORMS):
        for tiers in table.values():
            words.update(w for forms in tiers for form in forms for w in form.split())
    words.update(w for forms in PREFIX_FORMS for form in forms for w in form.split())
    words.update(w for _, fmt in TEMPLATES.values() for w in fmt.split() if not w.startswith("{"))
    return frozenset(words | {plural(w) for w in words} | {"an", "one", "two", "three"})


KNOWN_WORDS: frozenset[str] = _known_words()
"""Every word of every form and template: a nonce word is none of them."""


def nonce_word(rng: random.Random) -> str:
    """A random lower-case word of 4-7 letters outside `KNOWN_WORDS` (and not ending in "s")."""
    while True:
        word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(4, 7)))
        if word not in KNOWN_WORDS and not word.endswith("s"):
            return word


class _Drawer:
    """Chooses one surface form per slot.

    `rl_share`: the chance that a word, prefix or template slot takes an RL-only form (else an SFT
    form); 0 draws SFT forms only. `unseen_slot`: the word slot that takes an unseen form (None:
    none). `unseen_template`: draw the template from the unseen tier. `nonce_rate`: the chance
    that a word slot takes a `nonce_word` instead.
    """

    def __init__(
        self,
        rng: random.Random,
        rl_share: float,
        unseen_slot: str | None,
        unseen_template: bool,
        nonce_rate: float = 0.0,
    ):
        self.rng, self.rl_share, self.nonce_rate = rng, rl_share, nonce_rate
        self.unseen_slot, self.unseen_template = unseen_slot, unseen_template
        self.used: set[str] = set()  # tiers used: "sft", "rl", "unseen"

    def _tier(self) -> str:
        return "rl" if self.rl_share > 0 and self.rng.random() < self.rl_share else "sft"

    def nonce(self, slot: str) -> str | None:
        """A nonce word for a word slot, drawn with probability `nonce_rate`, else None."""
        if slot != "prefix" and self.nonce_rate > 0 and self.rng.random() < self.nonce_rate:
            return nonce_word(self.rng)
        return None

    def pick(self, forms: Tiers, slot: str) -> tuple[str, int]:
        """(tier, index) of the form of `slot`."""
        tier = "unseen" if slot == self.unseen_slot else self._tier()
        self.used.add(tier)
        return tier, self.rng.randrange(len(getattr(forms, tier)))

    def form(self, forms: Tiers, slot: str) -> str:
        nonce = self.nonce(slot)
        if nonce is not None:
            return nonce
        tier, i = self.pick(forms, slot)
        return getattr(forms, tier)[i]

    def template(self, category: str) -> str:
        tier = "unseen" if self.unseen_template else self._tier()
        self.used.add(tier)
        return self.rng.choice(templates_of(category, (tier,)))


def _word_slots(scene: SceneSpec) -> list[str]:
    if scene.category in ("single", "counting"):
        return ["color", "shape"] + (["count"] if scene.category == "counting" else [])
    return ["color_a", "shape_a", "color_b", "shape_b"] + (
        ["relation"] if scene.category == "position" else []
    )


def _write(scene: SceneSpec, d: _Drawer) -> tuple[str, str]:
    """(paraphrase, template id) of a scene, forms chosen by `d`."""
    template = d.template(scene.category)
    fmt = TEMPLATES[template][1]
    slots: dict[str, str] = {}
    if scene.category in ("single", "counting"):
        obj = scene.objects[0]
        slots["c"] = d.form(COLOR_FORMS[obj.color], "color")
        shape = d.form(SHAPE_FORMS[obj.shape], "shape")
        slots["s"], slots["p"] = shape, plural(shape)
        if scene.count is not None:
            slots["n"] = d.form(COUNT_FORMS[scene.count], "count")
    else:
        for key, obj in zip("ab", scene.objects, strict=True):
            color = d.form(COLOR_FORMS[obj.color], f"color_{key}")
            slots[key] = f"a {color} {d.form(SHAPE_FORMS[obj.shape], f'shape_{key}')}"
        if scene.relation is not None:
            nonce = d.nonce("relation")
            if nonce is not None:
                slots["r"] = slots["ri"] = nonce
            else:  # one draw serves {r} and {ri}: the same tier and index of the two relations' forms
                tier, i = d.pick(RELATION_FORMS[scene.relation], "relation")
                slots["r"] = getattr(RELATION_FORMS[scene.relation], tier)[i]
                slots["ri"] = getattr(RELATION_FORMS[INVERSE_RELATION[scene.relation]], tier)[i]
    text = fmt.format(**slots)
    if not fmt.startswith("there"):
        text = f"{d.form(PREFIX_FORMS, 'prefix')} {text}"
    return _articles(text) + END, template


def paraphrase(
    scene: SceneSpec,
    rng: random.Random,
    rl_share: float = 0.0,
    unseen_slot: str | None = None,
    unseen_template: bool = False,
    nonce_rate: float = 0.0,
) -> tuple[str, dict[str, str]]:
    """One user prompt for `scene`, and its metadata.

    Args:
        scene: what the prompt asks for.
        rng: the draws (advanced).
        rl_share: chance that each word, prefix or template slot takes an RL-only form (else
            SFT); 0 gives SFT forms only.
        unseen_slot: a word slot taking an unseen form ("color", "shape", "count" for
            single/counting, "color_a", "shape_a", "color_b", "shape_b", "relation" for the pairs).
        unseen_template: draw the template from the unseen tier.
        nonce_rate: chance that each word slot takes a `nonce_word` (SFT: a word the PE does not
            know could be any colour, shape, count or relation).

    Returns:
        (prompt ending in `END`, metadata) with metadata {"category", "canonical": scene_to_prompt(scene),
        "template": template id, "forms": the highest tier used, "sft" < "rl" < "unseen"}.
    """
    if unseen_slot is not None and unseen_slot not in _word_slots(scene):
        raise ValueError(
            f"unseen_slot {unseen_slot!r} is not a word slot of {scene.category}: {_word_slots(scene)}"
        )
    d = _Drawer(rng, rl_share, unseen_slot, unseen_template, nonce_rate)
    text, template = _write(scene, d)
    forms = max(d.used, key=TIERS.index)
    return text, {
        "category": scene.category,
        "canonical": scene_to_prompt(scene),
        "template": template,
        "forms": forms,
    }


RL_SHARE = 0.5
"""The default chance that a slot of an RL-form prompt takes an RL-only form."""


def _slice_scenes(slice_: str, seed: int) -> list[SceneSpec]:
    train, evals = split_scenes(seed)
    if slice_ == "train":
        return train
    if slice_ == "heldout":
        return evals
    return [s for s in train if s.category == "single"] + evals


class ShapesPEDataset:
    """User prompts of the PE world, `per_scene` paraphrases of each scene of a slice.

    Args:
        split: "train" (slice "train": the training scenes in RL forms, the RL prompts) or
            "eval" (slices "heldout", "unseen_templates", "unseen_words"; see module docstring).
        slice: one slice of the split (None: all of them, in `SLICES` order).
        seed: the scene split's seed and the paraphrases' seed.
        per_scene: paraphrases per scene (distinct where the forms allow).
        rl_share: see `paraphrase` (RL-form slots of train, heldout and unseen_* prompts).

    Attributes:
        examples: `PromptExample(prompt, prompt_id="shapes_pe/<slice>/<canonical_with_underscores>/<j>",
            metadata={"category", "canonical", "slice", "template", "forms"})`, usable with
            `unirl.data.ListDataSource(ds.examples)` and as an `eval.examples` node.
    """

    def __init__(
        self,
        split: str = "train",
        slice: str | None = None,
        seed: int = 0,
        per_scene: int = 4,
        rl_share: float = RL_SHARE,
    ) -> None:
        if split not in SLICES:
            raise ValueError(f"ShapesPEDataset split must be one of {sorted(SLICES)}, got {split!r}")
        if slice is not None and slice not in SLICES[split]:
            raise ValueError(
                f"ShapesPEDataset split {split!r} has slices {SLICES[split]}, got slice={slice!r}"
            )
        if per_scene < 1:
            raise ValueError(f"ShapesPEDataset per_scene must be >= 1, got {per_scene}")
        self.split, self.seed, self.per_scene = split, seed, per_scene
        self.examples: list[PromptExample] = []
        for name in SLICES[split] if slice is None else (slice,):
            for scene in _slice_scenes(name, seed):
                self.examples += _scene_examples(scene, name, seed, per_scene, rl_share)

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> PromptExample:
        return self.examples[i]


def _scene_examples(
    scene: SceneSpec, slice_: str, seed: int, per_scene: int, rl_share: float
) -> list[PromptExample]:
    canonical = scene_to_prompt(scene)
    rng = random.Random(f"shapes_pe/{slice_}/{seed}/{canonical}")
    slots = _word_slots(scene)
    seen: set[str] = set()
    out = []
    for j in range(per_scene):
        for _ in range(20):  # a few redraws for distinct prompts; small scenes may repeat
            unseen_slot = rng.choice(slots) if slice_ == "unseen_words" else None
            text, meta = paraphrase(scene, rng, rl_share, unseen_slot, slice_ == "unseen_templates")
            if text not in seen:
                break
        seen.add(text)
        pid = f"shapes_pe/{slice_}/{canonical.replace(' ', '_')}/{j}"
        out.append(PromptExample(prompt=text, prompt_id=pid, metadata={**meta, "slice": slice_}))
    return out


NONCE_RATE = 0.15
"""The default chance that a word slot of an SFT prompt is a nonce word."""


class ShapesPESFTSource:
    """(paraphrase, canonical prompt) pairs for supervised pretraining of the PE: training scenes
    (`split_scenes(seed)[0]`) written in SFT forms only.

    A category is drawn uniformly, then a scene of it uniformly (as `ShapesDataset.sample_batch`).
    Each word slot (colour, shape, count, relation) is a random `nonce_word` with probability
    `nonce_rate`, the target unchanged: the PE learns that a word it does not know could be any
    colour (shape, ...) and samples among them, so that on an RL-only synonym its samples hold
    the right rewrite often enough for a reward to find it (word dropout).
    """

    def __init__(self, seed: int = 0, nonce_rate: float = NONCE_RATE) -> None:
        if not 0.0 <= nonce_rate < 1.0:
            raise ValueError(f"ShapesPESFTSource nonce_rate must be in [0, 1), got {nonce_rate}")
        self.seed, self.nonce_rate = seed, nonce_rate
        train = split_scenes(seed)[0]
        self._by_category = {c: [s for s in train if s.category == c] for c in CATEGORIES}

    def sample_batch(self, n: int, rng: np.random.Generator) -> list[tuple[str, str]]:
        """`n` pairs like ("a crimson ball left of a navy box.", "a red circle left of a blue square");
        deterministic given `rng`'s state, which it advances."""
        py_rng = random.Random(int(rng.integers(2**63)))
        pairs = []
        for _ in range(n):
            group = self._by_category[py_rng.choice(CATEGORIES)]
            scene = py_rng.choice(group)
            text, meta = paraphrase(scene, py_rng, nonce_rate=self.nonce_rate)
            pairs.append((text, meta["canonical"]))
        return pairs


@functools.lru_cache(maxsize=4)
def _demonstrations(seed: int, nonce_rate: float, size: int) -> tuple[PromptExample, ...]:
    """The drawn rows of `ShapesPEDemonstrations` (a function of its arguments, drawn once per
    process: the validator builds the data source of every check; `next_batch` copies rows)."""
    pairs = ShapesPESFTSource(seed, nonce_rate).sample_batch(size, np.random.default_rng(seed))
    return tuple(
        PromptExample(prompt, f"pe-sft-{seed}-{i}", {"canonical": canonical})
        for i, (prompt, canonical) in enumerate(pairs)
    )


class ShapesPEDemonstrations(ListDataSource):
    """`ShapesPESFTSource`'s pairs as supervised rows (recipe: `_target_:
    worlds.shapes.ShapesPEDemonstrations`): each user prompt with its canonical rewrite under
    metadata "canonical", the demonstrations an LM SFT track learns from
    (`unirl.algorithms.sft.LMSFT` with `rollout: unirl.rollout.demonstrations.DemonstrationEngine`,
    `target_key: canonical`).

    The `size` pairs are `ShapesPESFTSource(seed, nonce_rate).sample_batch(size, rng)` with `rng =
    np.random.default_rng(seed)`, drawn once (the retired single-process loop drew fresh pairs
    every step; the default `size` is what its 600 steps of 64 drew); epochs, shuffling and resume are
    `ListDataSource`'s.
    """

    def __init__(self, seed: int = 0, nonce_rate: float = NONCE_RATE, size: int = 38_400) -> None:
        if size < 1:
            raise ValueError(f"ShapesPEDemonstrations size must be >= 1, got {size}")
        super().__init__(
            list(_demonstrations(seed, nonce_rate, size)),
            shuffle=True,
            seed=seed,
            source=f"<shapes PE demonstrations seed={seed} size={size}>",
        )
