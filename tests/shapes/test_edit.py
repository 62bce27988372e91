"""The shapes editing world: instructions, sources and targets, the split, and the edit scorer
against hand-made results."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from unirl.types.reward import RewardRequest
from worlds.shapes.edit import (
    EDIT_KINDS,
    Edit,
    ShapesEditDataset,
    ShapesEditScore,
    all_edits,
    draw_row,
    edit_rows,
    held_out_edits,
    moved_box,
    parse_instruction,
    score_edit,
)
from worlds.shapes.world import BACKGROUND, PALETTE, ShapeSpec, draw

RED_CIRCLE = ShapeSpec("red", "circle")
BLUE_SQUARE = ShapeSpec("blue", "square")


def test_instructions_parse_back_and_the_split_holds_out_six_of_each_kind():
    edits = all_edits()
    assert len(edits) == len(set(edits)) == 108
    for e in edits:
        assert parse_instruction(e.instruction) == e
    held = held_out_edits(0)
    assert [sum(e.kind == k for e in held) for k in EDIT_KINDS] == [6, 6, 6]
    train = {r.prompt for r in edit_rows("train", 0)}
    evals = {r.prompt for r in edit_rows("eval", 0)}
    assert not train & evals
    assert evals == {e.instruction for e in held}
    assert len(edit_rows("train", 0)) == 90 * 7 and len(edit_rows("eval", 0, placements=2)) == 18 * 7 * 2
    with pytest.raises(ValueError, match="size >= 24 px, got 16"):
        edit_rows("train", 0, size=16)
    with pytest.raises(ValueError, match="split must be 'train' or 'eval'"):
        edit_rows("test", 0)


@pytest.mark.parametrize(
    "text",
    [
        "make the red circle red",
        "make the red blob blue",
        "move the red circle to the middle",
        "paint it",
        "",
    ],
)
def test_an_instruction_outside_the_grammar_is_named(text):
    with pytest.raises(ValueError, match="instruction"):
        parse_instruction(text)


def test_source_and_target_differ_only_where_the_instruction_says():
    rng = np.random.default_rng(3)
    row = draw_row(Edit("colour", RED_CIRCLE, "green"), BLUE_SQUARE, rng)
    src, tgt = row.source, row.target
    changed = np.any(src != tgt, axis=-1)
    x, y, s = row.boxes[0]
    assert (
        changed.sum() > 0 and not changed[:, :x].any() and not changed[:y].any()
    )  # only inside the circle's box
    assert (tgt[changed] == PALETTE["green"]).all() and (src[changed] == PALETTE["red"]).all()
    move = draw_row(Edit("move", RED_CIRCLE, "left"), BLUE_SQUARE, np.random.default_rng(4))
    (x0, y0, s0), (x1, y1, s1) = move.boxes[0], move.target_boxes[0]
    assert (x1, y1, s1) == moved_box(move.boxes[0], "left", 32) == (2, y0, s0) and x0 - x1 >= 8
    assert move.target_boxes[1] == move.boxes[1]


def _row(edit: Edit, other=BLUE_SQUARE, seed=0):
    return draw_row(edit, other, np.random.default_rng(seed))


@pytest.mark.parametrize("kind,value", [("colour", "yellow"), ("shape", "triangle"), ("move", "bottom")])
def test_the_target_scores_one_the_source_half_and_a_blank_image_zero(kind, value):
    row = _row(Edit(kind, RED_CIRCLE, value))
    edit = row.edit
    perfect = score_edit(row.source, row.target, edit)
    assert perfect["strict"] == perfect["dense"] == perfect["change"] == 1.0
    assert perfect["graded"] > 0.95
    unchanged = score_edit(row.source, row.source, edit)
    # nothing changed: change 0, everything kept (move: the circle's place is the changed attribute)
    assert unchanged["strict"] == 0.0 and unchanged["change"] == 0.0 and unchanged["kept"] == 1.0
    assert unchanged["dense"] == pytest.approx(0.5)
    blank = np.full_like(row.source, BACKGROUND)
    assert score_edit(row.source, blank, edit)["dense"] == 0.0


def test_partial_edits_score_by_hand():
    row = _row(Edit("colour", RED_CIRCLE, "green"))
    # recoloured, but the blue square is gone: change 1; kept = mean(circle shape 1, circle place 1,
    # square colour 0, shape 0, place 0) = 0.4; count: 1 of 2 wanted -> 0.5
    alone = draw([ShapeSpec("green", "circle")], row.boxes[:1], 32)
    s = score_edit(row.source, alone, row.edit)
    assert (s["change"], s["kept"], s["count"], s["strict"]) == (1.0, pytest.approx(0.4), 0.5, 0.0)
    assert s["dense"] == pytest.approx(0.5 + 0.25 * 0.4 + 0.25 * 0.5)
    # the wrong new colour: change 0, all kept
    wrong = draw([ShapeSpec("yellow", "circle"), BLUE_SQUARE], row.boxes, 32)
    s = score_edit(row.source, wrong, row.edit)
    assert (s["change"], s["kept"], s["count"]) == (0.0, 1.0, 1.0)
    # a move half way: reach 0.5 along the asked side
    mv = _row(Edit("move", RED_CIRCLE, "right"), other=None, seed=1)
    (x0, y, side), (x1, _, _) = mv.boxes[0], mv.target_boxes[0]
    if (x1 - x0) % 2:
        pytest.skip("an odd move has no whole half-way box")
    half = draw([RED_CIRCLE], [((x0 + x1) // 2, y, side)], 32)
    s = score_edit(mv.source, half, mv.edit)
    assert s["change"] == pytest.approx(0.5) and s["strict"] == 1.0  # half way is where strict starts


def test_a_source_without_the_named_object_is_refused():
    row = _row(Edit("colour", RED_CIRCLE, "green"))
    with pytest.raises(ValueError, match="names exactly one"):
        score_edit(row.source, row.target, Edit("colour", ShapeSpec("yellow", "circle"), "green"))


def test_the_scorer_reads_the_rows_source_and_names_bad_samples():
    ds = ShapesEditDataset("eval", 0, shuffle=False)
    rows = ds.examples[:6]
    targets = torch.from_numpy(np.stack([r.metadata["target"] for r in rows])).permute(0, 3, 1, 2)
    req = RewardRequest(
        sample_ids=[f"s{i}" for i in range(6)],
        prompts=[r.prompt for r in rows],
        images=targets,
        metadata=[r.metadata for r in rows],
    )
    assert ShapesEditScore("strict")(req).tolist() == [1.0] * 6
    assert (ShapesEditScore("graded")(req) > 0.95).all()
    metrics = ShapesEditScore("strict").evaluate(targets, req.prompts, req.metadata)
    assert metrics["accuracy_strict"] == 1.0 and metrics["dense"] == 1.0
    bad = RewardRequest(sample_ids=req.sample_ids, prompts=req.prompts, images=targets, metadata=[{}] * 6)
    with pytest.raises(ValueError, match="sample 's0'.*metadata 'images'"):
        ShapesEditScore()(bad)
    odd = RewardRequest(
        sample_ids=req.sample_ids, prompts=["paint it"] * 6, images=targets, metadata=req.metadata
    )
    with pytest.raises(ValueError, match="sample 's0'.*outside the editing grammar"):
        ShapesEditScore()(odd)
    with pytest.raises(ValueError, match="mode"):
        ShapesEditScore("exact")


def test_a_pool_is_a_fixed_seeded_subset_of_the_split_and_bad_sizes_are_refused():
    whole = [r.prompt_id for r in ShapesEditDataset("train", 0, shuffle=False).examples]
    pool = [r.prompt_id for r in ShapesEditDataset("train", 0, shuffle=False, rows=32).examples]
    assert len(pool) == len(set(pool)) == 32 and set(pool) <= set(whole)
    assert pool == sorted(pool, key=whole.index)  # split order kept
    assert pool == [r.prompt_id for r in ShapesEditDataset("train", 0, shuffle=False, rows=32).examples]
    assert pool != [r.prompt_id for r in ShapesEditDataset("train", 1, shuffle=False, rows=32).examples][:32]
    ds = ShapesEditDataset("train", 0, rows=8)  # the epochs visit the pool alone
    assert {r.prompt_id for r in ds.next_batch(8)} == {r.prompt_id for r in ds.examples}
    for bad in (0, len(whole) + 1):
        with pytest.raises(ValueError, match=rf"data_source.rows={bad} must be in \[1, {len(whole)}\]"):
            ShapesEditDataset("train", 0, rows=bad)
