"""The moving-squares world: clips as specified, the temporal reward's three values on them, the
prompts as a data source, bad settings refused; and flow-matching pretraining on its clips as a
supervised track (`diffusion/squares_wan_sft`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.recipes import IN_PROCESS, run
from unirl.data import ListDataSource
from unirl.models.wan import WanModelConfig
from unirl.reward.local.video import ColorMotion
from unirl.types import RewardRequest
from worlds.shapes.motion import SQUARE_SIDES, WORDS, MovingSquares, render_clip
from worlds.shapes.world import BACKGROUND, PALETTE

RED = np.array(PALETTE["red"], dtype=np.uint8)


def red_boxes(clip: np.ndarray) -> list[tuple[int, int, int, int]]:
    """Per frame (x_min, x_max, y_min, y_max) of the red pixels; every other pixel is background."""
    boxes = []
    for frame in clip:
        red = (frame == RED).all(-1)
        assert ((frame == np.array(BACKGROUND, dtype=np.uint8)).all(-1) | red).all()
        ys, xs = np.nonzero(red)
        boxes.append((int(xs.min()), int(xs.max()), int(ys.min()), int(ys.max())))
    return boxes


def motion(videos: np.ndarray) -> torch.Tensor:
    """ColorMotion(red, right) of uint8 [n, F, H, W, 3] clips."""
    frames = torch.from_numpy(videos).permute(0, 1, 4, 2, 3)  # [n, F, 3, H, W]
    req = RewardRequest(
        sample_ids=[str(i) for i in range(len(videos))], prompts=["p"] * len(videos), images=frames
    )
    return ColorMotion([1.0, 0.0, 0.0], "right")(req)


def test_clips_hold_one_whole_square_moving_speed_px_a_frame_in_the_prompts_size():
    world = MovingSquares(num_frames=5, size=16, speed=2)
    videos, prompts = world.sample_batch(300, np.random.default_rng(0))
    assert videos.shape == (300, 5, 16, 16, 3) and videos.dtype == np.uint8
    steps = []
    for clip, prompt in zip(videos, prompts, strict=True):
        side = SQUARE_SIDES[prompt.split()[1]]
        boxes = red_boxes(clip)
        assert all(x1 - x0 + 1 == side and y1 - y0 + 1 == side for x0, x1, y0, y1 in boxes)
        assert len({b[2] for b in boxes}) == 1  # the height never changes
        moves = {b[0] - a[0] for a, b in zip(boxes, boxes[1:], strict=False)}
        assert len(moves) == 1 and moves <= {-2, 0, 2}
        steps.append(moves.pop())
    counts = np.bincount(np.array(steps) // 2 + 1, minlength=3)
    assert counts.min() > 70  # each direction about a third of 300
    assert set(prompts) == {f"a {w} red square" for w in SQUARE_SIDES}


def test_a_direction_subset_draws_only_those_directions():
    """`directions=[right]` (supervised fine-tuning on the clips the motion reward asks for): every
    clip's square moves +speed a frame, re-read from its pixels, and ColorMotion scores each +0.5."""
    videos, prompts = MovingSquares(directions=["right"]).sample_batch(40, np.random.default_rng(1))
    for clip in videos:
        boxes = red_boxes(clip)
        assert {b[0] - a[0] for a, b in zip(boxes, boxes[1:], strict=False)} == {2}
    assert len(prompts) == 40
    torch.testing.assert_close(motion(videos), torch.full((40,), 0.5))


def test_the_motion_reward_scores_the_three_directions_plus_minus_travel_over_width():
    clips = np.stack(
        [render_clip(4, d, x, 5, 5, 16, 2) for d, x in (("right", 1), ("still", 6), ("left", 11))]
    )
    # the centroid moves 2 px x 4 frames = 8 px of 16
    torch.testing.assert_close(motion(clips), torch.tensor([0.5, 0.0, -0.5]))
    world = MovingSquares()
    videos, _ = world.sample_batch(60, np.random.default_rng(1))
    assert set(np.round(motion(videos).numpy(), 6).tolist()) == {-0.5, 0.0, 0.5}


def test_prompts_make_a_data_source_and_the_vocabulary_covers_them():
    source = ListDataSource(MovingSquares(), seed=0, source="moving-squares")
    batch = source.next_batch(4)
    assert sorted(e.prompt for e in batch) == sorted(f"a {w} red square" for w in SQUARE_SIDES)
    assert {w for e in batch for w in e.prompt.split()} == set(WORDS)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_frames": 1}, "num_frames must be >= 2"),
        ({"speed": 0}, "speed must be >= 1"),
        ({"num_frames": 9, "speed": 2, "size": 16}, "does not fit"),
        ({"directions": []}, "directions must be a non-empty list"),
        ({"directions": ["up"]}, r"directions must be a non-empty list of \['left', 'still', 'right'\]"),
    ],
)
def test_bad_settings_are_refused_naming_them(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MovingSquares(**kwargs)


def test_a_clip_leaving_the_frame_is_refused():
    with pytest.raises(ValueError, match="leaves the frame at t=3"):
        render_clip(4, "right", 8, 0, 5, 16, 2)


SMALL = [  # diffusion/squares_wan_sft at a test's size
    "num_steps=12",
    "prompts_per_rollout=4",
    "train.stack.micro_batch_size=4",
    "train.optim.lr=3e-3",
    "train.optim.warmup_steps=1",
    "data_source.rows=64",
    "eval.every_n_steps=0",
    "checkpoint.every_n_steps=0",
    "threads_per_worker=1",
]


def test_video_pretraining_on_the_clips_lowers_the_flow_matching_loss(tmp_path):
    """`diffusion/squares_wan_sft` (the clips as a supervised track's demonstrations, FlowSFT on a
    tiny pixel-space Wan): 12 steps lower the loss."""
    rows = [
        r for r in run("diffusion/squares_wan_sft", tmp_path, *IN_PROCESS, *SMALL, "model.tiny.num_layers=1")
    ]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 12 and all(np.isfinite(losses))
    assert np.mean(losses[-3:]) < 0.8 * np.mean(losses[:3])


def test_pretraining_continues_from_the_committed_wan_directory(tmp_path):
    """A Wan directory does not record the frame size it was trained at (Wan's rotary embedding
    takes any): the track trains the committed base on 16 px clips, and its weights move."""
    base = "checkpoints/squares_wan"
    run(
        "diffusion/squares_wan_sft",
        tmp_path,
        *IN_PROCESS,
        *SMALL,
        "num_steps=1",
        f"model.pretrained_path={base}",
        "~model.tiny",
    )
    model = WanModelConfig(pretrained_path=base, num_frames=5, tiny=None)
    before = model.build().denoiser
    after = model.load_checkpoint(str(tmp_path / "checkpoints" / "final")).denoiser
    deltas = [
        float((p - q).abs().max()) for p, q in zip(before.parameters(), after.parameters(), strict=True)
    ]
    assert 0 < max(deltas) < 0.05
