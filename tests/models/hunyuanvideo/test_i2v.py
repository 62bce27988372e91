"""HunyuanVideo 1.5 image-to-video (`unirl.models.hunyuanvideo.i2v`): ODE sampling from a first
frame through the shared stage equals diffiusers' `HunyuanVideo15ImageToVideoPipeline` on a tiny
model (its condition latents and first-frame mask, its SigLIP image stream, its guider); the first
frame changes the sample; rows without one frame are refused naming the row.

The pipeline picks the video size from the frame among its buckets and sizes the image stream by
prompts, so the comparison is one 16 x 16 frame at 16 x 16 (the tiny model's bucket) and one video
per prompt (diffusers 0.42)."""

from __future__ import annotations

import pytest
import torch
from diffusers.guiders import ClassifierFreeGuidance as Guider
from PIL import Image

from tests.conftest import REPO
from unirl.models.hunyuanvideo import HunyuanVideo15I2VModelConfig, HunyuanVideo15Stage
from unirl.sde.schedules import sigmas_for
from unirl.types import DiffusionSamplingParams, PromptExample, RolloutReq

SIZE, FRAMES, LENGTH = 16, 5, 16
FRAME = f"{REPO}/datasets/tiny_edit/blue_square.png"
PROMPT = "the blue square turns red"


def tiny_config() -> HunyuanVideo15I2VModelConfig:
    words = ["the", "blue", "square", "turns", "red"]
    return HunyuanVideo15I2VModelConfig(tiny={"resolution": SIZE, "words": words}, num_frames=FRAMES)


@pytest.fixture(scope="module")
def bundle():
    return tiny_config().build()


def request(bundle, frame, guidance: float, num_steps: int) -> RolloutReq:
    sp = DiffusionSamplingParams(
        num_steps=num_steps, samples_per_prompt=1, height=SIZE, width=SIZE, guidance_scale=guidance,
        eta=0.0, shift=5.0, sigma_grid="steps", max_sequence_length=LENGTH,
    )  # fmt: skip
    sigmas = sigmas_for(sp, bundle.image_seq_len(SIZE, SIZE))
    meta = {"images": [frame]} if frame is not None else {}
    return RolloutReq.from_prompts([PromptExample(PROMPT, "0", metadata=meta)], sp, sigmas, 0)


@pytest.mark.parametrize(("guidance", "num_steps"), [(6.0, 4), (1.0, 3)])
def test_ode_sampling_from_a_first_frame_matches_the_pipeline(bundle, guidance, num_steps) -> None:
    stage = HunyuanVideo15Stage(bundle)
    req = request(bundle, FRAME, guidance, num_steps)
    ours = stage.diffuse(req, stage.encode_request(req)).at(num_steps)
    x_t = torch.randn(
        bundle.latent_shape(SIZE, SIZE), generator=torch.Generator().manual_seed(req.init_seeds[0])
    )[None]
    pipe = type(bundle).PIPELINE(**{**bundle.pipeline.components, "guider": Guider(guidance_scale=guidance)})
    pipe.tokenizer_max_length = LENGTH
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        theirs = pipe(
            image=Image.open(FRAME).convert("RGB"), prompt=[PROMPT], num_frames=FRAMES,
            num_inference_steps=num_steps, latents=x_t, output_type="latent",
        ).frames  # fmt: skip
    assert torch.equal(pipe.scheduler.sigmas, sigmas_for(req.sampling, bundle.image_seq_len(SIZE, SIZE)))
    assert (ours - x_t).abs().max().item() > 0.1
    assert torch.equal(ours, theirs), f"max |stage - pipeline| = {(ours - theirs).abs().max().item()}"


def test_the_first_frame_conditions_the_sample(bundle) -> None:
    stage = HunyuanVideo15Stage(bundle)
    finals = []
    for frame in (FRAME, f"{REPO}/datasets/tiny_edit/yellow_square.png"):
        req = request(bundle, frame, 6.0, 2)
        cond = stage.encode_request(req)
        assert cond["condition"].shape == (1, 5, 3, SIZE // 2, SIZE // 2)  # C + mask, 3 latent frames
        assert cond["condition"][:, :4, 1:].abs().max() == 0 and cond["condition"][:, 4, 0].min() == 1
        finals.append(stage.diffuse(req, cond).at(2))
    assert (finals[0] - finals[1]).abs().max().item() > 1e-4


def test_rows_without_one_first_frame_are_refused(bundle) -> None:
    stage = HunyuanVideo15Stage(bundle)
    with pytest.raises(ValueError, match=r"starts from one first frame .* got none"):
        stage.encode_request(request(bundle, None, 6.0, 2))
    rows = [
        PromptExample("a", "a", metadata={"images": [FRAME]}),
        PromptExample("b", "b", metadata={"images": [FRAME, FRAME]}),
        PromptExample("c", "c", metadata={}),
    ]
    problems = tiny_config().condition_problems(rows, "data.path=x.jsonl")
    assert len(problems) == 2
    assert "prompt 'b' carries 2 image(s)" in problems[0] and "prompt 'c' carries no image(s)" in problems[1]
