"""Wan 2.2 image-to-video (`unirl.models.wan.i2v`): ODE sampling through the shared stage equals
diffusers' `WanImageToVideoPipeline` (no image encoder, two experts at boundary 0.9, or one) on a
tiny model given the same first frames, the frame is read, and bad frames are named with their row.

The pipeline resizes each row's frame to the output size, VAE-encodes it followed by black frames
behind the first-frame mask (`prepare_latents`) and concatenates that condition after the noisy
latents along the channels at every step; our stage encodes each row once per request with the
pipeline's own `prepare_latents` and does the same in `predict`. The pipeline takes one image per
call, so it runs per row with `num_videos_per_prompt` (a batch of 2, its CFG halves in two
forwards) while our stage samples both rows in one batch of 4 with the halves batched (8): the same
arithmetic over another batch composition, whose fp32 rounding differs. `BATCH_ATOL` bounds that
(measured 2.9e-6 on latents of magnitude ~2.5 after 4 steps); the first step's velocity of a row,
computed with the pipeline's batch composition, is equal bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import WanImageToVideoPipeline
from PIL import Image

from unirl.models.wan import TinyWanConfig, WanI2VModelConfig, WanStage
from unirl.models.wan.experts import WanExperts
from unirl.sde.schedules import sigmas_for
from unirl.types import DiffusionSamplingParams, PromptExample, RolloutReq

PROMPTS = ["a red square", "a blue dot"]
BATCH_ATOL = 1e-5


def i2v_config(**tiny) -> WanI2VModelConfig:
    base = dict(resolution=16, pixel_space=False, seed=0)
    return WanI2VModelConfig(tiny=TinyWanConfig(**{**base, **tiny}), num_frames=5)


def frame(seed: int, size: int = 24) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8), "RGB")


def request(sp: DiffusionSamplingParams, bundle, frames) -> RolloutReq:
    sigmas = sigmas_for(sp, bundle.image_seq_len(sp.height, sp.width))
    examples = [
        PromptExample(p, str(i), {"images": [f]})
        for i, (p, f) in enumerate(zip(PROMPTS, frames, strict=True))
    ]
    return RolloutReq.from_prompts(examples, sp, sigmas, 0)


@pytest.mark.parametrize("boundary", [0.9, None])
def test_ode_sampling_matches_wan_image_to_video_pipeline(boundary) -> None:
    bundle = i2v_config(boundary_ratio=boundary).build()
    assert isinstance(bundle.transformer, WanExperts) == (boundary is not None)
    num_steps, guidance, size = 4, 5.0, 16
    sp = DiffusionSamplingParams(
        num_steps=num_steps, samples_per_prompt=2, height=size, width=size, guidance_scale=guidance, eta=0.0,
        shift=3.0, max_sequence_length=8,
    )  # fmt: skip
    frames = [frame(0), frame(1)]  # 24 px: resized to the 16 px output, as the pipeline does
    stage = WanStage(bundle)
    req = request(sp, bundle, frames)
    cond = stage.encode_request(req)
    assert set(cond) == {"prompt_embeds", "negative_prompt_embeds", "condition"}
    # the mask (2 channels: the VAE's temporal compression) and the 4 latent channels, 3 latent frames
    assert cond["condition"].shape == (4, 2 + 4, 3, 8, 8)
    assert torch.equal(cond["condition"][:, :2, 0], torch.ones(4, 2, 8, 8))  # the given first frame
    assert not cond["condition"][:, :2, 1:].any()
    ours = stage.diffuse(req, cond).at(num_steps)
    shape = bundle.latent_shape(size, size)
    x_t = torch.stack(
        [torch.randn(shape, generator=torch.Generator().manual_seed(s)) for s in req.init_seeds]
    )

    pipe = WanImageToVideoPipeline(**bundle.pipeline.components, boundary_ratio=boundary)
    pipe.set_progress_bar_config(disable=True)
    theirs, videos = [], []
    for i, prompt in enumerate(PROMPTS):
        final = {}

        def keep_last(pipe, step, t, tensors, final=final):
            final["latents"] = tensors["latents"]
            return tensors

        with torch.no_grad():
            videos.append(
                pipe(
                    image=frames[i], prompt=prompt, num_videos_per_prompt=2, height=size, width=size,
                    num_frames=bundle.num_frames, num_inference_steps=num_steps, guidance_scale=guidance,
                    latents=x_t[2 * i : 2 * i + 2], max_sequence_length=8, output_type="pt",
                    callback_on_step_end=keep_last,
                ).frames
            )  # fmt: skip
        theirs.append(final["latents"])
        assert torch.equal(pipe.scheduler.sigmas, req.sigmas)
    theirs = torch.cat(theirs)
    assert (ours - x_t).abs().max().item() > 0.1
    err = (ours - theirs).abs().max().item()
    assert err <= BATCH_ATOL, f"max |stage - pipeline| = {err}"
    assert (stage.decode_float(ours) - torch.cat(videos)).abs().max().item() <= BATCH_ATOL

    # the first step of row 0 with the pipeline's batch composition (its two samples; the halves
    # in two forwards): the same velocity bit for bit
    row = {k: v[:2] for k, v in cond.items()}
    with torch.no_grad():
        v_cond = bundle.predict(bundle.transformer, x_t[:2], req.sigmas[:1].expand(2), row)
        negative = {**row, "prompt_embeds": row["negative_prompt_embeds"]}
        v_uncond = bundle.predict(bundle.transformer, x_t[:2], req.sigmas[:1].expand(2), negative)
        latent_input = torch.cat([x_t[:2], row["condition"]], dim=1)
        t = pipe.scheduler.timesteps[0].expand(2)
        model = pipe.transformer  # the high-noise expert at t = 1000 (or the one transformer)
        c = model(
            hidden_states=latent_input,
            timestep=t,
            encoder_hidden_states=row["prompt_embeds"],
            return_dict=False,
        )[0]
        u = model(
            hidden_states=latent_input,
            timestep=t,
            encoder_hidden_states=negative["prompt_embeds"],
            return_dict=False,
        )[0]
    assert torch.equal(v_cond, c) and torch.equal(v_uncond, u)


def test_a_last_frame_is_the_pipelines_last_image() -> None:
    """A row with a first and a last frame: the condition marks both given (the mask's first and
    last pixel frames) and the ODE samples equal `WanImageToVideoPipeline(image, last_image)`'s
    within the batch-composition tolerance (module doc); a clip too short for a frame between
    the two is refused naming the row."""
    bundle = i2v_config(boundary_ratio=None).build()
    num_steps, size = 3, 16
    sp = DiffusionSamplingParams(
        num_steps=num_steps, samples_per_prompt=1, height=size, width=size, guidance_scale=4.0, eta=0.0,
        shift=3.0, max_sequence_length=8,
    )  # fmt: skip
    first, last = frame(3), frame(4)
    sigmas = sigmas_for(sp, bundle.image_seq_len(size, size))
    req = RolloutReq.from_prompts([PromptExample(PROMPTS[0], "0", {"images": [first, last]})], sp, sigmas, 0)
    stage = WanStage(bundle)
    cond = stage.encode_request(req)
    # the mask's 2 channels are the pixel frames of a latent frame (the VAE's temporal 2): frames
    # 0 and 4 of 5 are given, i.e. latent frame 0 whole and the second half of latent frame 2
    mask = cond["condition"][:, :2]
    assert mask[:, :, 0].all() and mask[:, 1, -1].all() and not mask[:, 0, -1].any()
    assert not mask[:, :, 1:-1].any()
    ours = stage.diffuse(req, cond).at(num_steps)
    x_t = torch.randn(
        bundle.latent_shape(size, size), generator=torch.Generator().manual_seed(req.init_seeds[0])
    )
    pipe = WanImageToVideoPipeline(**bundle.pipeline.components)
    pipe.set_progress_bar_config(disable=True)
    final = {}

    def keep_last(pipe, step, t, tensors):
        final["latents"] = tensors["latents"]
        return tensors

    with torch.no_grad():
        pipe(
            image=first, last_image=last, prompt=PROMPTS[0], height=size, width=size, num_frames=bundle.num_frames,
            num_inference_steps=num_steps, guidance_scale=4.0, latents=x_t[None], max_sequence_length=8,
            output_type="latent", callback_on_step_end=keep_last,
        )  # fmt: skip
    err = (ours - final["latents"]).abs().max().item()
    assert err <= BATCH_ATOL, f"max |stage - pipeline| = {err}"
    alone = stage.encode_request(
        RolloutReq.from_prompts([PromptExample(PROMPTS[0], "0", {"images": [first]})], sp, sigmas, 0)
    )
    assert not torch.equal(alone["condition"], cond["condition"])  # the last frame is read
    short = WanI2VModelConfig(tiny=TinyWanConfig(resolution=16, pixel_space=False), num_frames=1).build()
    with pytest.raises(ValueError, match=r"sample '[^']*' gives a first and a last frame, but model.num_frames=1"):
        WanStage(short).encode_request(req)


def test_the_first_frame_changes_the_velocity() -> None:
    bundle = i2v_config().build()
    stage = WanStage(bundle)
    sp = DiffusionSamplingParams(
        num_steps=2, samples_per_prompt=1, height=16, width=16, eta=0.0, max_sequence_length=8
    )
    velocities = []
    for seed in (0, 1):
        req = request(sp, bundle, [frame(seed), frame(seed)])
        x = torch.zeros(2, *bundle.latent_shape(16, 16))
        velocities.append(stage.velocity(x, req.sigmas[:1].expand(2), stage.encode_request(req), 1.0))
    assert (velocities[0] - velocities[1]).abs().max().item() > 1e-4


def test_bad_first_frames_are_named(tmp_path) -> None:
    bundle = i2v_config().build()
    stage = WanStage(bundle)
    sp = DiffusionSamplingParams(
        num_steps=2, samples_per_prompt=1, height=16, width=16, max_sequence_length=8
    )

    def req(metadata):
        return RolloutReq.from_prompts(
            [PromptExample("a red square", "row7", metadata)], sp, sigmas_for(sp, 16), 0
        )

    with pytest.raises(ValueError, match=r"row7.*one first frame.*got none"):
        stage.encode_conditions(req({}))
    with pytest.raises(ValueError, match=r"row7.*a first and a last frame.*one or two images\), got 3"):
        stage.encode_conditions(req({"images": [frame(0), frame(1), frame(2)]}))
    with pytest.raises(ValueError, match=r"row7.*no image file"):
        stage.encode_conditions(req({"images": [str(tmp_path / "missing.png")]}))
    good = tmp_path / "ok.png"
    frame(0).save(good)
    rows = [
        PromptExample("a", "fine", {"images": [str(good)]}),
        PromptExample("a", "bare", {}),
        PromptExample("a", "lost", {"images": [str(tmp_path / "gone.png")]}),
    ]
    problems = i2v_config().condition_problems(rows, "data_source")
    assert len(problems) == 2
    assert "prompt 'bare' carries no frame(s)" in problems[0] and "'lost'" in problems[1]
    three = [PromptExample("a", "many", {"images": [str(good)] * 3})]
    assert i2v_config().condition_problems(three, "data_source") == [
        "data_source: prompt 'many' carries 3 frame(s) in metadata 'images'; Wan I2V animates one first frame, "
        "or a first and a last frame"
    ]
    with pytest.raises(ValueError, match=r"pixel_space must be false"):
        i2v_config(pixel_space=True)


def test_the_tiny_i2v_recipe_trains_and_both_experts_loras_load_into_the_pipeline(tmp_path) -> None:
    """`diffusion/tiny_wan22_i2v_flowgrpo` trains 2 steps in this process (on-policy first ratio
    1: the replay read the rollout's first frames); its two LoRA files load into
    `WanImageToVideoPipeline` (the low-noise one with `load_into_transformer_2=True`) and change
    the clip it makes from a row's first frame. Rows without a usable first frame are refused before
    anything runs, naming the row."""
    import json

    from tests.recipes import IN_PROCESS, QUIET, recipe, run
    from unirl.config.validate import ConfigError

    small = [
        *IN_PROCESS, *QUIET, "threads_per_worker=1", "prompts_per_rollout=2", "sampling.samples_per_prompt=2",
        "sampling.num_steps=3", "sampling.max_sequence_length=8", "model.num_frames=5", "model.tiny.num_layers=1",
        "train.stack.micro_batch_size=4",
    ]  # fmt: skip
    rows = run("diffusion/tiny_wan22_i2v_flowgrpo", tmp_path, *small, "num_steps=2")
    assert [r["step"] for r in rows] == [1, 2] and all(r["ratio/first_update_mean"] == 1.0 for r in rows)
    pipe = WanImageToVideoPipeline.from_pretrained(tmp_path / "base_model")
    pipe.set_progress_bar_config(disable=True)
    first = Image.open("datasets/tiny_edit/blue_square.png")

    def clip():
        return pipe(
            image=first, prompt="the blue square turns red and slides right", height=16, width=16, num_frames=5,
            num_inference_steps=3, max_sequence_length=8, output_type="pt", generator=torch.Generator().manual_seed(0),
        ).frames  # fmt: skip

    before = clip()
    final = tmp_path / "checkpoints" / "final"
    pipe.load_lora_weights(final)
    pipe.load_lora_weights(final / "transformer_2", load_into_transformer_2=True)
    assert (clip() - before).abs().max().item() > 0

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "a clip", "prompt_id": "bare"}) + "\n")
    with pytest.raises(ConfigError, match=r"prompt 'bare' carries no frame\(s\)"):
        recipe("diffusion/tiny_wan22_i2v_flowgrpo", tmp_path / "bad", *small, f"data_source.data_path={bad}")
