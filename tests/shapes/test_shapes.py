"""The shapes world (specs, prompts, renderer, split) and its GenEval-in-miniature scorer."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from unirl.types.reward import RewardRequest
from worlds.shapes import (
    BACKGROUND,
    CATEGORIES,
    PALETTE,
    SHAPES,
    Detection,
    GenEvalMini,
    SceneSpec,
    ShapesDataset,
    ShapeSpec,
    all_scenes,
    detect,
    evaluate,
    held_out_counts,
    held_out_pairs,
    is_eval_scene,
    parse_prompt,
    relation_holds,
    relation_margin,
    render,
    scene_to_prompt,
    score_scene,
    shape_credit,
    shape_fit,
    split_scenes,
    summarize,
)

SCENES = all_scenes()


def _balanced_renders(n: int, seed: int) -> tuple[np.ndarray, list[str], list[SceneSpec]]:
    """n renders cycling through the categories, a random scene of each."""
    rng = np.random.default_rng(seed)
    by_cat = {c: [s for s in SCENES if s.category == c] for c in CATEGORIES}
    specs = [by_cat[CATEGORIES[i % 4]][int(rng.integers(len(by_cat[CATEGORIES[i % 4]])))] for i in range(n)]
    images = np.stack([render(s, rng) for s in specs])
    return images, [scene_to_prompt(s) for s in specs], specs


@pytest.fixture(scope="module")
def clean() -> tuple[np.ndarray, list[str], list[SceneSpec]]:
    return _balanced_renders(200, seed=1)


# ---------------------------------------------------------------- world


def test_prompt_round_trip_every_scene() -> None:
    assert len(SCENES) == 216
    prompts = [scene_to_prompt(s) for s in SCENES]
    assert len(set(prompts)) == len(prompts)
    for spec, prompt in zip(SCENES, prompts, strict=True):
        assert parse_prompt(prompt) == spec
    assert {s.category for s in SCENES} == set(CATEGORIES)
    assert (
        scene_to_prompt(SceneSpec("counting", [ShapeSpec("red", "square")], count=3)) == "three red squares"
    )
    assert scene_to_prompt(parse_prompt("  One  RED circle ")) == "one red circle"
    rel = SceneSpec("position", [ShapeSpec("red", "circle"), ShapeSpec("blue", "square")], relation="left of")
    assert scene_to_prompt(rel) == "a red circle left of a blue square"


@pytest.mark.parametrize(
    "prompt",
    [
        "a purple circle",
        "two red circle",
        "a red circle and a red circle",
        "a red circle near a blue square",
        "",
    ],
)
def test_parse_errors_name_the_prompt(prompt: str) -> None:
    with pytest.raises(ValueError, match=re.escape(repr(prompt))):
        parse_prompt(prompt)


@pytest.mark.parametrize("seed", [0, 3])
def test_split_holds_out_combinations(seed: int) -> None:
    train, evals = split_scenes(seed)
    assert (len(train), len(evals)) == (165, 51) and len(train) + len(evals) == len(SCENES)
    train_p = {scene_to_prompt(s) for s in train}
    eval_p = {scene_to_prompt(s) for s in evals}
    assert not train_p & eval_p and train_p | eval_p == {scene_to_prompt(s) for s in SCENES}
    pairs = [frozenset(p) for p in held_out_pairs(seed)]
    counts = held_out_counts(seed)
    assert len(set(pairs)) == 9 and len({o for o, _ in counts}) == 6
    # the rule, recomputed: an eval scene is exactly a held-out pair's two_objects/position scene
    # (either order) or a held-out (object, count); no training scene composes a held-out pair
    for s in evals + train:
        held = (
            (s.objects[0], s.count) in counts
            if s.category == "counting"
            else s.category != "single" and frozenset(s.objects) in pairs
        )
        assert held == (s in evals), scene_to_prompt(s)
    # every object is still trained alone, counted, and composed in >= 3 pairs
    objs = {o for s in SCENES for o in s.objects}
    for o in objs:
        assert any(s.category == "single" and s.objects == [o] for s in train)
        assert any(s.category == "counting" and s.objects == [o] for s in train)
        assert (
            len({frozenset(s.objects) for s in train if s.category == "two_objects" and o in s.objects}) >= 3
        )
    assert {s.category for s in evals} == {"two_objects", "counting", "position"}
    assert split_scenes(seed) == (train, evals)
    assert all(is_eval_scene(s, seed) for s in evals) and not any(is_eval_scene(s, seed) for s in train)
    assert split_scenes(0) != split_scenes(3)


def test_render_deterministic_and_in_palette() -> None:
    for spec in SCENES[::7]:
        a = render(spec, np.random.default_rng(5))
        assert a.dtype == np.uint8 and a.shape == (32, 32, 3)
        np.testing.assert_array_equal(a, render(spec, np.random.default_rng(5)))
        colors = {tuple(int(v) for v in c) for c in a.reshape(-1, 3)}
        assert colors <= {BACKGROUND, *PALETTE.values()}
        assert {PALETTE[o.color] for o in spec.objects} <= colors
    spec = SCENES[-1]
    assert not np.array_equal(render(spec, np.random.default_rng(5)), render(spec, np.random.default_rng(6)))
    assert render(spec, np.random.default_rng(0), size=64).shape == (64, 64, 3)


def test_dataset_examples_and_batches() -> None:
    train, evals = ShapesDataset("train"), ShapesDataset("eval")
    assert len(train) == len(split_scenes()[0]) and len(evals) == len(split_scenes()[1])
    ids = [e.prompt_id for e in train.examples + evals.examples]
    assert len(set(ids)) == len(ids)
    ex = train[0]
    assert ex.prompt_id == "shapes/single/a_red_circle" and ex.metadata == {"category": "single"}
    images, prompts = train.sample_batch(8, np.random.default_rng(0))
    assert images.dtype == np.uint8 and images.shape == (8, 32, 32, 3) and len(prompts) == 8
    assert set(prompts) <= {e.prompt for e in train.examples}
    again, prompts2 = train.sample_batch(8, np.random.default_rng(0))
    np.testing.assert_array_equal(images, again)
    assert prompts == prompts2
    with pytest.raises(ValueError, match="split"):
        ShapesDataset("test")


# ---------------------------------------------------------------- scorer


def test_detect_matches_hand_computation() -> None:
    img = np.full((32, 32, 3), BACKGROUND, dtype=np.uint8)
    img[3:13, 2:12] = PALETTE["red"]  # 10x10 square, centre (7, 8)
    img[13, 12] = PALETTE["red"]  # stray pixel touching its corner
    img[25:28, 25:28] = PALETTE["blue"]  # 9 px blob: below the 12 px minimum
    (d,) = detect(img)
    assert (d.color, d.shape, d.area, d.bbox) == ("red", "square", 101, (2, 3, 13, 14))
    assert d.cx == pytest.approx((100 * 7.0 + 12.5) / 101) and d.cy == pytest.approx((100 * 8.0 + 13.5) / 101)
    assert detect(np.full((32, 32, 3), BACKGROUND, dtype=np.uint8)) == []


def test_relation_and_dense_formula_by_hand() -> None:
    def det(color: str, shape: str, cx: float, cy: float) -> Detection:
        return Detection(color, shape, cx, cy, 100, (0, 0, 1, 1))

    assert relation_holds(det("red", "circle", 5, 10), det("blue", "square", 20, 14), "left of")
    assert not relation_holds(det("red", "circle", 5, 10), det("blue", "square", 20, 14), "above")
    assert relation_holds(det("red", "circle", 10, 2), det("blue", "square", 12, 20), "above")

    spec = parse_prompt("three red circles")
    r = score_scene(
        spec, [det("red", "circle", 5, 5), det("red", "circle", 15, 5), det("blue", "circle", 25, 5)]
    )
    # matches 1, 1, 0.5 -> 5/6; count term 1 - |3 - 3| / 3 = 1
    assert r["dense"] == pytest.approx((5 / 6 + 1.0) / 2)
    assert (r["strict"], r["count"], r["color"], r["shape"]) == (0.0, False, False, True)

    spec = parse_prompt("a red circle right of a blue square")
    dets = [det("red", "circle", 5, 10), det("blue", "square", 20, 10), det("green", "triangle", 5, 25)]
    r = score_scene(spec, dets)
    # matches 1, 1; count 1 - |3 - 2| / 2 = 0.5; relation 0
    assert r["dense"] == pytest.approx((1.0 + 0.5 + 0.0) / 3)
    assert (r["strict"], r["position"], r["n_extra"]) == (0.0, False, 1)
    r = score_scene(spec, [det("red", "circle", 25, 10), det("blue", "square", 5, 10)])
    assert (r["strict"], r["dense"], r["position"]) == (1.0, 1.0, True)


def test_graded_credit_by_hand() -> None:
    # shape_fit: IoU with each template in the mask's own box, computed here independently
    mask = np.zeros((10, 10), dtype=bool)
    mask[2:, :] = True  # a 8x10 block in a 10x10 box: square IoU 0.8
    circle = np.add.outer((np.arange(10) + 0.5 - 5) ** 2, (np.arange(10) + 0.5 - 5) ** 2) <= 25
    tri = np.abs(np.arange(10)[None, :] + 0.5 - 5) <= 5 * (np.arange(10)[:, None] + 0.5) / 10 + 0.5
    ref = [(mask & t).sum() / (mask | t).sum() for t in (circle, np.ones((10, 10), bool), tri)]
    assert shape_fit(mask) == pytest.approx(ref)
    assert shape_fit(np.ones((12, 12), dtype=bool))[SHAPES.index("square")] == 1.0

    def det(shape: str, fit: tuple[float, ...], cx: float = 5.0, cy: float = 5.0) -> Detection:
        return Detection("red", shape, cx, cy, 100, (0, 0, 1, 1), fit)

    fit = dict(zip(SHAPES, (0.70, 0.80, 0.55), strict=True))  # square by 0.10 over circle
    d = det("square", tuple(fit.values()))
    assert shape_credit("square", d) == pytest.approx(0.5 + 0.5 * (0.5 + 0.10 / 0.4))
    assert shape_credit("circle", d) == pytest.approx(0.5 * (0.5 - 0.10 / 0.4))
    assert shape_credit("triangle", d) == 0.0  # margin -0.25: below the ramp
    assert shape_credit("square", det("square", ())) == 1.0  # no fit: the label alone

    spec = parse_prompt("a red square left of a blue circle")
    a = det("square", tuple(fit.values()), cx=5.0, cy=10.0)
    b = Detection("blue", "circle", 9.0, 11.0, 100, (0, 0, 1, 1), (0.95, 0.75, 0.6))
    r = score_scene(spec, [a, b])
    # matches: 0.5 + 0.5 * credit; count 1; relation holds with margin 4 - 1 = 3 px of 6
    match = (0.5 + 0.5 * shape_credit("square", a) + 0.5 + 0.5 * shape_credit("circle", b)) / 2
    assert r["graded"] == pytest.approx((match + 1.0 + 0.5 + 0.5 * 3 / 6) / 3)
    assert (r["strict"], r["dense"]) == (1.0, 1.0)
    assert relation_margin(a, b, "left of") == pytest.approx(3.0)


def test_scorer_on_ground_truth(clean: tuple[np.ndarray, list[str], list[SceneSpec]]) -> None:
    images, prompts, _ = clean
    m = evaluate(images, prompts)
    assert m["accuracy_strict"] >= 0.97 and m["dense"] >= 0.99 and m["graded"] >= 0.99
    for cat in CATEGORIES:
        assert m[f"accuracy/{cat}"] >= 0.95
    assert {"color", "shape", "count", "position"} <= set(m)
    chw = evaluate(torch.from_numpy(images).permute(0, 3, 1, 2).contiguous(), prompts)
    assert chw == m


def test_summary_is_genevals_mean_over_categories() -> None:
    results = [
        {"strict": v, "dense": d, "graded": d / 2}
        for v, d in [(1.0, 1.0), (0.0, 0.5), (0.0, 0.5), (0.0, 0.25), (1.0, 1.0)]
    ]
    cats = ["single", "position", "position", "position", "counting"]
    m = summarize(results, cats)
    # per category: single 1, position 0, counting 1 -> overall 2 / 3; per sample 2 / 5
    assert m["accuracy/single"] == 1.0 and m["accuracy/position"] == 0.0 and m["accuracy/counting"] == 1.0
    assert m["accuracy_strict"] == pytest.approx(2 / 3)
    assert m["accuracy_strict_samples"] == pytest.approx(2 / 5)
    assert m["dense"] == pytest.approx(3.25 / 5) and m["graded"] == pytest.approx(3.25 / 10)
    with pytest.raises(ValueError, match="2 results but 1 categories"):
        summarize(results[:2], cats[:1])


def test_scorer_tolerates_noise(clean: tuple[np.ndarray, list[str], list[SceneSpec]]) -> None:
    images, prompts, _ = clean
    rng = np.random.default_rng(2)
    noisy = np.clip(images + rng.normal(0.0, 15.0, images.shape), 0, 255).round().astype(np.uint8)
    m = evaluate(noisy, prompts)
    assert m["accuracy_strict"] >= 0.9 and m["dense"] >= 0.95


def _check(spec: SceneSpec, image: np.ndarray) -> dict:
    return score_scene(spec, detect(image))


def test_scorer_drops_on_corruptions() -> None:
    rng = np.random.default_rng(3)
    other_color = {"red": "blue", "green": "yellow", "blue": "red", "yellow": "green"}
    other_shape = {"circle": "triangle", "square": "circle", "triangle": "square"}
    for spec in [s for s in SCENES if s.category == "single"]:
        obj = spec.objects[0]
        img = render(spec, rng)
        recolored = img.copy()
        recolored[(img == PALETTE[obj.color]).all(-1)] = PALETTE[other_color[obj.color]]
        r = _check(spec, recolored)
        assert (r["strict"], r["color"], r["shape"]) == (0.0, False, True) and r["dense"] <= 0.75
        reshaped = render(SceneSpec("single", [ShapeSpec(obj.color, other_shape[obj.shape])]), rng)
        r = _check(spec, reshaped)
        assert (r["strict"], r["color"], r["shape"]) == (0.0, True, False) and r["dense"] <= 0.75
        blank = np.full_like(img, BACKGROUND)
        r = _check(spec, blank)
        assert r["strict"] == 0.0 and r["dense"] == 0.0

    for spec in [s for s in SCENES if s.category == "counting"][::2]:
        assert spec.count is not None
        fewer = render(SceneSpec("counting", spec.objects, count=spec.count - 1), rng)
        r = _check(spec, fewer)
        assert r["strict"] == 0.0 and not r["count"] and r["dense"] < 0.8

    for spec in [s for s in SCENES if s.relation in ("left of", "right of")][::6]:
        img = render(spec, rng)
        assert _check(spec, img)["strict"] == 1.0
        r = _check(spec, img[:, ::-1])
        assert r["strict"] == 0.0 and not r["position"] and r["dense"] == pytest.approx(2 / 3)

    for spec in [s for s in SCENES if s.category == "two_objects"][::6]:
        a, b = spec.objects
        swapped = SceneSpec("two_objects", [ShapeSpec(a.color, b.shape), ShapeSpec(b.color, a.shape)])
        r = _check(spec, render(swapped, rng))  # colours bound to the wrong shapes
        assert r["strict"] == 0.0 and r["dense"] < 1.0


def test_geneval_mini_reward_component() -> None:
    images, prompts, _ = _balanced_renders(8, seed=4)
    images[0] = BACKGROUND  # one blank sample
    req = RewardRequest(
        sample_ids=[f"s{i}" for i in range(8)],
        prompts=prompts,
        images=torch.from_numpy(images).permute(0, 3, 1, 2).contiguous(),
        metadata=[{} for _ in range(8)],
    )
    for mode in ("dense", "graded", "strict"):
        out = GenEvalMini(mode)(req)
        assert out.dtype == torch.float32 and out.shape == (8,)
        assert bool(((out >= 0) & (out <= 1)).all())
        assert out[0].item() == 0.0
        assert bool((out[1:] >= 0.98).all()) if mode == "graded" else bool((out[1:] == 1.0).all())
    with pytest.raises(ValueError, match="mode"):
        GenEvalMini("soft")
    bad = RewardRequest(sample_ids=["x0"], prompts=["a cat"], images=req.images[:1])
    with pytest.raises(ValueError, match=r"'x0'.*'a cat'"):
        GenEvalMini()(bad)
