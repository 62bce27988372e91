"""The prompt-enhancer world: its form layers, datasets, SFT source, rewrite reward, and
GenEvalMini judging images against the user's intent."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from unirl.data import ListDataSource
from unirl.types.reward import RewardRequest
from worlds.shapes import (
    COLOR_FORMS,
    COUNT_FORMS,
    PREFIX_FORMS,
    RELATION_FORMS,
    SHAPE_FORMS,
    TEMPLATES,
    GenEvalMini,
    RewriteMatchesScene,
    ShapesPEDataset,
    ShapesPEDemonstrations,
    ShapesPESFTSource,
    is_eval_scene,
    parse_prompt,
    render,
    split_scenes,
)
from worlds.shapes.paraphrase import END, KNOWN_WORDS, SLICES, Tiers, plural

WORD_CLASSES: dict[str, dict] = {
    "color": COLOR_FORMS,
    "shape": SHAPE_FORMS,
    "count": COUNT_FORMS,
    "relation": RELATION_FORMS,
}


def _forms(tiers: tuple[str, ...], with_prefixes: bool = True) -> set[str]:
    """Every word form (shapes with their plurals) of the given tiers, and the prefixes."""
    out: set[str] = set()
    for table in WORD_CLASSES.values():
        for entry in table.values():
            for tier in tiers:
                out |= set(getattr(entry, tier))
    for entry in SHAPE_FORMS.values():
        for tier in tiers:
            out |= {plural(w) for w in getattr(entry, tier)}
    if with_prefixes:
        for tier in tiers:
            out |= {p for p in getattr(PREFIX_FORMS, tier) if p}
    return out


def _contains(text: str, form: str) -> bool:
    return re.search(rf"(?<!\w){re.escape(form)}(?!\w)", text) is not None


def _alt(forms: set[str], nonce: str = "") -> str:
    """Any of `forms`, or (SFT's word dropout) a nonce word matching `nonce`."""
    alts = [re.escape(f) for f in sorted(forms, key=len, reverse=True)] + ([nonce] if nonce else [])
    return "(?:" + "|".join(alts) + ")"


def _template_regex(fmt: str) -> re.Pattern[str]:
    """Full-match regex of a template with any form of any tier, or a nonce word, in its slots
    (and any prefix)."""
    every = ("sft", "rl", "unseen")
    word = rf"(?!{_alt(set(KNOWN_WORDS))}(?!\w))[a-z]{{4,7}}"  # a nonce word: no known one
    colors = _alt({w for e in COLOR_FORMS.values() for t in every for w in getattr(e, t)}, word)
    shapes = _alt({w for e in SHAPE_FORMS.values() for t in every for w in getattr(e, t)}, word)
    plurals = _alt(
        {plural(w) for e in SHAPE_FORMS.values() for t in every for w in getattr(e, t)}, word + "e?s"
    )
    relations = _alt({w for e in RELATION_FORMS.values() for t in every for w in getattr(e, t)}, word)
    slots = {
        "{a}": f"an? {colors} {shapes}",
        "{b}": f"an? {colors} {shapes}",
        "{c}": colors,
        "{s}": shapes,
        "{p}": plurals,
        "{n}": _alt({w for e in COUNT_FORMS.values() for t in every for w in getattr(e, t)}, word),
        "{r}": relations,
        "{ri}": relations,
    }
    words = [slots.get(w, "an?" if w == "a" else re.escape(w)) for w in fmt.split()]
    prefix = (
        ""
        if fmt.startswith("there")
        else f"(?:{_alt({p for t in every for p in getattr(PREFIX_FORMS, t) if p})} )?"
    )
    return re.compile(prefix + " ".join(words) + re.escape(END))


TEMPLATE_REGEX = {tid: _template_regex(fmt) for tid, (_, fmt) in TEMPLATES.items()}


def _templates_matching(text: str) -> set[str]:
    return {tid for tid, rx in TEMPLATE_REGEX.items() if rx.fullmatch(text)}


@pytest.fixture(scope="module")
def sft_pairs() -> list[tuple[str, str]]:
    return ShapesPESFTSource(seed=0).sample_batch(1500, np.random.default_rng(0))


@pytest.fixture(scope="module")
def rl_examples() -> list:
    return ShapesPEDataset("train", seed=0, per_scene=8).examples


@pytest.fixture(scope="module")
def eval_examples() -> list:
    return ShapesPEDataset("eval", seed=0, per_scene=4).examples


# ---------------------------------------------------------------- the layers


def test_tiers_are_disjoint_whole_words() -> None:
    """No form of a later tier is a form (or a whole-word part of a form) of an earlier one, so
    "this text holds no rl form" means what it says."""
    for table in WORD_CLASSES.values():
        for entry in table.values():
            assert isinstance(entry, Tiers) and entry.sft and entry.rl and entry.unseen
    order = ("sft", "rl", "unseen")
    tiers = {t: _forms((t,)) for t in order}
    for i, earlier in enumerate(order):
        for later in order[i + 1 :]:
            clash = {(x, y) for x in tiers[later] for y in tiers[earlier] if _contains(y, x)}
            assert not clash, (later, earlier, clash)


def test_template_regexes_recognise_every_prompt(sft_pairs, rl_examples, eval_examples) -> None:
    """Each prompt matches its template's regex and no other, except that position/swapped
    ("{b} {ri} {a}") reads like position/plain and differs in the order of the objects."""
    same = {"position/swapped", "position/plain"}
    for ex in rl_examples + eval_examples:
        found = _templates_matching(ex.prompt)
        assert found == {ex.metadata["template"]} or (found == same and ex.metadata["template"] in same), ex
    for text, _ in sft_pairs[:500]:
        found = _templates_matching(text)
        assert len(found) == 1 or found == same, text


def test_sft_nonce_words() -> None:
    """SFT's word dropout: about nonce_rate of the word slots hold a word of no form or template."""
    pairs = ShapesPESFTSource(nonce_rate=0.15).sample_batch(400, np.random.default_rng(1))
    unknown = [w for text, _ in pairs for w in text.removesuffix(END).split() if w not in KNOWN_WORDS]
    assert 0.05 < len(unknown) / sum(len(t.split()) for t, _ in pairs) < 0.15
    assert all(w.isalpha() and 4 <= len(w) <= 9 for w in unknown)
    clean = ShapesPESFTSource(nonce_rate=0.0).sample_batch(400, np.random.default_rng(1))
    assert all(w in KNOWN_WORDS for text, _ in clean for w in text.removesuffix(END).split())


def test_sft_prompts_hold_sft_forms_only(sft_pairs) -> None:
    later = _forms(("rl", "unseen"))
    for text, canonical in sft_pairs:
        assert not [f for f in later if _contains(text, f)], text
        found = _templates_matching(text) - {"position/swapped"}
        assert {TEMPLATES[t][0] for t in found} == {"sft"}, text
        spec = parse_prompt(canonical)
        assert not is_eval_scene(spec)
        if found == {"position/plain"}:  # not position/swapped: the objects in canonical order
            body = text
            for prefix in PREFIX_FORMS.sft:
                body = body.removeprefix(prefix + " ") if prefix else body
            color, shape = body.split()[1:3]  # the first object: "a <color> <shape>"
            obj = spec.objects[0]
            assert color in COLOR_FORMS[obj.color].sft or color not in KNOWN_WORDS, text
            assert shape in SHAPE_FORMS[obj.shape].sft or shape not in KNOWN_WORDS, text
    # and they cover every SFT form
    assert all(any(_contains(t, f) for t, _ in sft_pairs) for f in _forms(("sft",)))


def test_rl_prompts_use_every_rl_form_and_nothing_unseen(rl_examples) -> None:
    texts = [ex.prompt for ex in rl_examples]
    assert all(any(_contains(t, f) for t in texts) for f in _forms(("sft", "rl")) - {"one"})
    assert {ex.metadata["template"] for ex in rl_examples} == {
        t for t, (tier, _) in TEMPLATES.items() if tier != "unseen"
    }
    unseen = _forms(("unseen",))
    for ex in rl_examples:
        assert not [f for f in unseen if _contains(ex.prompt, f)], ex.prompt
        assert TEMPLATES[ex.metadata["template"]][0] != "unseen"
        assert not is_eval_scene(parse_prompt(ex.metadata["canonical"]))
    assert {ex.metadata["forms"] for ex in rl_examples} == {"sft", "rl"}


def test_eval_slices(eval_examples) -> None:
    by_slice = {s: [ex for ex in eval_examples if ex.metadata["slice"] == s] for s in SLICES["eval"]}
    unseen = _forms(("unseen",))
    for ex in by_slice["heldout"]:
        assert is_eval_scene(parse_prompt(ex.metadata["canonical"]))
        assert ex.metadata["forms"] in ("sft", "rl")
    assert len(by_slice["heldout"]) == 4 * len(split_scenes(0)[1])
    for ex in by_slice["unseen_templates"]:
        assert TEMPLATES[ex.metadata["template"]][0] == "unseen"
        assert not [f for f in unseen if _contains(ex.prompt, f)], ex.prompt
    for ex in by_slice["unseen_words"]:
        assert [f for f in unseen if _contains(ex.prompt, f)], ex.prompt
        assert TEMPLATES[ex.metadata["template"]][0] != "unseen"
    for name in ("unseen_templates", "unseen_words"):  # held-out scenes, plus the single scenes
        for ex in by_slice[name]:
            spec = parse_prompt(ex.metadata["canonical"])
            assert is_eval_scene(spec) or spec.category == "single"
        assert {ex.metadata["forms"] for ex in by_slice[name]} == {"unseen"}


def test_unseen_forms_are_in_no_training_prompt(sft_pairs, rl_examples, eval_examples) -> None:
    training = [t for t, _ in sft_pairs] + [ex.prompt for ex in rl_examples]
    for form in _forms(("unseen",)):
        assert not any(_contains(t, form) for t in training), form
    for tid, (tier, _) in TEMPLATES.items():
        if tier == "unseen":
            assert not any(TEMPLATE_REGEX[tid].fullmatch(t) for t in training), tid
            assert any(ex.metadata["template"] == tid for ex in eval_examples), tid


# ---------------------------------------------------------------- datasets


def test_examples_contract(rl_examples, eval_examples) -> None:
    for ex in rl_examples + eval_examples:
        assert set(ex.metadata) == {"category", "canonical", "slice", "template", "forms"}
        spec = parse_prompt(ex.metadata["canonical"])
        assert spec.category == ex.metadata["category"]
        assert ex.prompt == ex.prompt.strip().lower() and "  " not in ex.prompt
    ids = [ex.prompt_id for ex in rl_examples + eval_examples]
    assert len(set(ids)) == len(ids)
    source = ListDataSource(ShapesPEDataset("eval", slice="heldout").examples, seed=0)
    assert len(source.next_batch(8)) == 8


def test_determinism() -> None:
    a = ShapesPEDataset("eval", slice="unseen_words", seed=3, per_scene=2).examples
    b = ShapesPEDataset("eval", slice="unseen_words", seed=3, per_scene=2).examples
    assert a == b
    assert a != ShapesPEDataset("eval", slice="unseen_words", seed=4, per_scene=2).examples
    src = ShapesPESFTSource()
    assert src.sample_batch(64, np.random.default_rng(5)) == src.sample_batch(64, np.random.default_rng(5))


def test_dataset_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="slices"):
        ShapesPEDataset("train", slice="heldout")
    with pytest.raises(ValueError, match="split"):
        ShapesPEDataset("test")
    with pytest.raises(ValueError, match="per_scene"):
        ShapesPEDataset("train", per_scene=0)


# ---------------------------------------------------------------- rewrite reward


def _text_req(texts: list[str], canonicals: list[str | None]) -> RewardRequest:
    meta = [{} if c is None else {"canonical": c} for c in canonicals]
    return RewardRequest(
        sample_ids=[f"s{i}" for i in range(len(texts))],
        prompts=["p"] * len(texts),
        texts=texts,
        metadata=meta,
    )


def test_rewrite_reward_hand_cases() -> None:
    pos = "a red circle left of a blue square"
    cases = [
        ("a red circle left of a blue square", pos, 1.0),
        ("  A red circle  left of a blue square\n", pos, 1.0),
        ("a blue square right of a red circle", pos, 1.0),  # the swapped form
        ("a blue square left of a red circle", pos, 0.0),
        ("a red circle right of a blue square", pos, 0.0),
        ("a red circle above a blue square", pos, 0.0),
        ("a red circle and a blue square", pos, 0.0),
        ("a blue square and a red circle", "a red circle and a blue square", 1.0),
        ("a green square and a red circle", "a red circle and a blue square", 0.0),
        ("two red circles", "two red circles", 1.0),
        ("three red circles", "two red circles", 0.0),
        ("one red circle", "a red circle", 0.0),
        ("a red circle", "a red circle", 1.0),
        ("a crimson ball", "a red circle", 0.0),
        ("", "a red circle", 0.0),
        ("a red circle and a red circle", "a red circle", 0.0),
        ("a red circle left of", pos, 0.0),
        ("\x00\xff garbage ###", pos, 0.0),
    ]
    scores = RewriteMatchesScene()(_text_req([t for t, _, _ in cases], [c for _, c, _ in cases]))
    assert scores.dtype == torch.float32
    assert scores.tolist() == [want for _, _, want in cases]


def test_rewrite_reward_bad_metadata_names_the_sample() -> None:
    with pytest.raises(ValueError, match="'s1'.*canonical"):
        RewriteMatchesScene()(_text_req(["a red circle", "a red circle"], ["a red circle", None]))
    with pytest.raises(ValueError, match="'s0'"):
        RewriteMatchesScene()(_text_req(["a red circle"], ["a crimson ball"]))


def test_every_canonical_scores_its_own_paraphrases(eval_examples) -> None:
    exs = eval_examples[:64]
    req = RewardRequest(
        sample_ids=[ex.prompt_id for ex in exs],
        prompts=[ex.prompt for ex in exs],
        texts=[ex.metadata["canonical"] for ex in exs],
        metadata=[ex.metadata for ex in exs],
    )
    assert RewriteMatchesScene()(req).tolist() == [1.0] * len(exs)


# ---------------------------------------------------------------- GenEvalMini against the intent


def test_geneval_intent_key_judges_against_metadata() -> None:
    rng = np.random.default_rng(0)
    intents = ["a red circle left of a blue square", "two green triangles"]
    images = np.stack([render(parse_prompt(p), rng) for p in intents]).transpose(0, 3, 1, 2)
    rewrites = ["a red circle right of a blue square", "a crimson ball"]  # wrong and ungrammatical
    req = RewardRequest(
        sample_ids=["a", "b"],
        prompts=rewrites,
        images=torch.from_numpy(np.ascontiguousarray(images)),
        metadata=[{"canonical": p} for p in intents],
    )
    assert GenEvalMini(mode="strict", intent_key="canonical")(req).tolist() == [1.0, 1.0]
    with pytest.raises(ValueError, match="'b'"):
        GenEvalMini()(req)  # the default judges the prompts, and "a crimson ball" is no prompt
    req.prompts = intents
    assert GenEvalMini(mode="strict")(req).tolist() == [1.0, 1.0]
    swapped = ["a blue square left of a red circle", "three green triangles"]
    req.metadata = [{"canonical": p} for p in swapped]
    assert GenEvalMini(mode="strict", intent_key="canonical")(req).tolist() == [0.0, 0.0]
    req.metadata = [{"canonical": intents[0]}, {}]
    with pytest.raises(ValueError, match="'b'.*canonical"):
        GenEvalMini(intent_key="canonical")(req)
    summary = GenEvalMini().evaluate(images, rewrites, intents=intents)
    assert summary["accuracy_strict"] == 1.0 and set(summary) >= {"accuracy/position", "accuracy/counting"}


def test_canonical_format_rewards_only_the_grammar() -> None:
    from unirl.types.reward import RewardRequest
    from worlds.shapes import CanonicalFormat

    texts = ["a red circle", " two blue squares ", "a red trianglue abo", "a blue square right of a red circle", ""]
    req = RewardRequest(sample_ids=[str(i) for i in range(5)], prompts=[""] * 5, texts=texts, metadata=[{}] * 5)
    assert CanonicalFormat()(req).tolist() == [1.0, 1.0, 0.0, 1.0, 0.0]


def test_demonstrations_are_the_loops_pairs_as_rows() -> None:
    """`ShapesPEDemonstrations` (the LM SFT track's data, llm/shapes_pe_sft) holds exactly the
    pairs `ShapesPESFTSource` draws from the same seed, each prompt with its rewrite under
    "canonical" (what `DemonstrationEngine(target_key=canonical)` teacher-forces), visited in
    shuffled epochs that a resumed run repeats."""
    rows = ShapesPEDemonstrations(seed=3, size=200)
    pairs = ShapesPESFTSource(seed=3).sample_batch(200, np.random.default_rng(3))
    assert [(e.prompt, e.metadata["canonical"]) for e in rows.examples] == pairs
    assert len({e.prompt_id for e in rows.examples}) == 200
    first = rows.next_batch(64)
    state = rows.state_dict()
    after = [e.prompt_id for e in rows.next_batch(64)]
    again = ShapesPEDemonstrations(seed=3, size=200)
    again.load_state_dict(state)
    assert [e.prompt_id for e in again.next_batch(64)] == after
    assert sorted(e.prompt_id for e in first) != sorted(after)
    with pytest.raises(ValueError, match="ShapesPEDemonstrations size must be >= 1, got 0"):
        ShapesPEDemonstrations(size=0)
