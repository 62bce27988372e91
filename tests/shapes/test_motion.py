"""The moving-squares world: clips as specified, the temporal reward's three values on them, the
prompts as a data source, bad settings refused; and flow-matching pretraining on its videos."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from unirl.data import ListDataSource
from unirl.models.wan import WanModelConfig
from unirl.models.wan.config import TinyWanConfig
from unirl.reward.local.video import ColorMotion
from unirl.train.sft import FlowMatchingSFT, FlowMatchingSFTConfig, images_to_model
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


def tiny_wan(num_frames: int = 5):
    tiny = TinyWanConfig(resolution=16, num_layers=1, words=list(WORDS))
    return WanModelConfig(num_frames=num_frames, tiny=tiny).build()


def test_videos_enter_the_model_frames_after_channels():
    videos, _ = MovingSquares().sample_batch(2, np.random.default_rng(0))
    x = images_to_model(videos)
    assert x.shape == (2, 3, 5, 16, 16)
    torch.testing.assert_close(
        x[1, :, 3], torch.from_numpy(videos[1, 3]).permute(2, 0, 1).float() / 127.5 - 1
    )


def test_video_pretraining_loss_is_the_flow_matching_loss_and_falls(tmp_path):
    """The first step's loss equals the loss computed here from the same draws (the text
    encoder's dropout too: the same global seed before each); 12 steps lower it."""
    cfg = FlowMatchingSFTConfig(
        num_steps=12,
        batch_size=4,
        lr=3e-3,
        warmup_steps=1,
        log_every=1,
        eval_every=0,
        cond_dropout=0.0,
        max_sequence_length=8,
        checkpoint_every=1000,
    )
    sft = FlowMatchingSFT(tiny_wan(), MovingSquares(), cfg, str(tmp_path))
    rng, gen = np.random.default_rng(), torch.Generator()  # copies of the run's generators
    rng.bit_generator.state = sft.rng.bit_generator.state
    gen.set_state(sft.gen.get_state())
    videos, prompts = MovingSquares().sample_batch(4, rng)
    torch.rand(4, generator=gen)  # the cond-dropout draw
    x0 = images_to_model(videos)
    eps = torch.randn(x0.shape, generator=gen)
    sigma = torch.sigmoid(torch.randn(4, generator=gen))
    s = sigma.view(-1, 1, 1, 1, 1)
    torch.manual_seed(7)
    with torch.no_grad():
        cond = sft.bundle.encode_text(prompts, False, 8)
        pred = sft.bundle.predict(sft.bundle.denoiser, (1 - s) * x0 + s * eps, sigma, cond)
        expected = float(((pred - (eps - x0)) ** 2).mean())
    torch.manual_seed(7)
    rows = sft.run()
    assert rows[0]["loss"] == pytest.approx(expected, rel=1e-5)
    assert np.mean([r["loss"] for r in rows[-3:]]) < 0.8 * np.mean([r["loss"] for r in rows[:3]])


def test_video_data_of_the_wrong_frame_count_or_images_are_refused_naming_the_key(tmp_path):
    cfg = FlowMatchingSFTConfig(batch_size=2, max_sequence_length=8)
    sft = FlowMatchingSFT(tiny_wan(num_frames=9), MovingSquares(num_frames=5), cfg, str(tmp_path / "a"))
    with pytest.raises(ValueError, match=r"5-frame videos but model.num_frames=9"):
        sft.train_step()

    class Stills:
        def sample_batch(self, n, rng):
            return np.zeros((n, 16, 16, 3), dtype=np.uint8), ["a red square"] * n

    sft = FlowMatchingSFT(tiny_wan(), Stills(), cfg, str(tmp_path / "b"))
    with pytest.raises(ValueError, match=r"images but model.num_frames=5"):
        sft.train_step()


def test_pretraining_continues_from_a_saved_wan_directory_at_the_datas_frame_size(tmp_path):
    """A Wan directory does not record the frame size it was trained at (Wan's rotary embedding
    takes any): supervised training from it takes 16 px clips, and refuses sides its 2x2 patch
    does not divide, naming the multiple."""
    tiny_wan().save_pretrained(str(tmp_path / "base"))
    loaded = WanModelConfig(pretrained_path=str(tmp_path / "base"), num_frames=5, tiny=None).build()
    cfg = FlowMatchingSFTConfig(batch_size=2, max_sequence_length=8, log_every=1, eval_every=0)
    sft = FlowMatchingSFT(loaded, MovingSquares(), cfg, str(tmp_path / "a"))
    before = [p.detach().clone() for p in sft.bundle.denoiser.parameters()]
    row = sft.train_step()
    assert np.isfinite(row["loss"])
    assert any(not torch.equal(a, b) for a, b in zip(before, sft.bundle.denoiser.parameters(), strict=True))

    class OddClips:
        def sample_batch(self, n, rng):
            return np.zeros((n, 5, 15, 15, 3), dtype=np.uint8), ["a red square"] * n

    sft = FlowMatchingSFT(loaded, OddClips(), cfg, str(tmp_path / "b"))
    with pytest.raises(
        ValueError, match=r"\(15, 15\) frames but the model takes sides that are multiples of 2"
    ):
        sft.train_step()
