"""FLUX.2 reading reference images (`unirl.models.flux2.references`): ODE sampling through the
shared stage with two references per row equals diffusers' `Flux2Pipeline` / `Flux2KleinPipeline`
given the same `image` list, on tiny models; the references change the sample; rows that cannot
batch, or carry no reference, are refused naming the row."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from unirl.models.flux2 import Flux2EditModelConfig, Flux2KleinEditModelConfig, Flux2Stage
from unirl.sde.schedules import sigmas_for
from unirl.types import DiffusionSamplingParams, PromptExample, RolloutReq

PROMPTS = ["a red square", "a blue dot"]
WORDS = ["a", "red", "blue", "square", "dot"]
SIZE = 32
LENGTH = 48


def image(width: int, height: int, seed: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


# two references of different sizes, at least 64 px a side as the pipelines' input check asks (a
# 98x72 one floors to 96x72 with the tiny model's 4 px cell: the pipeline crops it)
REFERENCES = [image(64, 64, 0), image(98, 72, 1)]


def request(bundle, guidance: float, num_steps: int, references: list | None) -> RolloutReq:
    sp = DiffusionSamplingParams(
        num_steps=num_steps, samples_per_prompt=2, height=SIZE, width=SIZE, guidance_scale=guidance, eta=0.0,
        sigma_grid="steps", dynamic_shift=True, mu_rule="empirical", max_sequence_length=LENGTH,
    )  # fmt: skip
    sigmas = sigmas_for(sp, bundle.image_seq_len(SIZE, SIZE))
    meta = {"images": references} if references is not None else {}
    examples = [PromptExample(p, str(i), metadata=dict(meta)) for i, p in enumerate(PROMPTS)]
    return RolloutReq.from_prompts(examples, sp, sigmas, 0)


def stage_and_pipeline(bundle, guidance: float, num_steps: int):
    """(the stage's final latents, x_T, the pipeline's final latents) for the same prompts,
    references, x_T and guidance."""
    stage = Flux2Stage(bundle)
    req = request(bundle, guidance, num_steps, REFERENCES)
    ours = stage.diffuse(req, stage.encode_request(req)).at(num_steps)
    shape = bundle.latent_shape(SIZE, SIZE)
    x_t = torch.stack(
        [torch.randn(shape, generator=torch.Generator().manual_seed(s)) for s in req.init_seeds]
    )
    pipe = type(bundle).PIPELINE(**bundle.pipeline.components)
    pipe.set_progress_bar_config(disable=True)
    final = {}

    def keep_last(pipe, i, t, tensors):
        final["latents"] = tensors["latents"]
        return tensors

    with torch.no_grad():
        pipe(
            prompt=list(PROMPTS), image=list(REFERENCES), num_images_per_prompt=2, height=SIZE, width=SIZE,
            num_inference_steps=num_steps, guidance_scale=guidance, latents=pipe._patchify_latents(x_t),
            max_sequence_length=LENGTH, output_type="latent", callback_on_step_end=keep_last,
        )  # fmt: skip
    h, w = shape[1:]
    theirs = pipe._unpatchify_latents(final["latents"].transpose(1, 2).reshape(len(x_t), -1, h // 2, w // 2))
    return ours, x_t, theirs


@pytest.fixture(scope="module")
def dev():
    return Flux2EditModelConfig(tiny={"resolution": SIZE, "words": WORDS}).build()


@pytest.fixture(scope="module")
def klein():
    return Flux2KleinEditModelConfig(tiny={"resolution": SIZE, "words": WORDS}).build()


@pytest.mark.parametrize("family", ["dev", "klein"])
def test_ode_sampling_with_two_references_matches_the_pipeline(family, dev, klein) -> None:
    bundle = dev if family == "dev" else klein
    ours, x_t, theirs = stage_and_pipeline(bundle, 4.0, 3)
    assert (ours - x_t).abs().max().item() > 0.1
    assert torch.equal(ours, theirs), f"max |stage - pipeline| = {(ours - theirs).abs().max().item()}"


def test_the_references_are_encoded_as_the_pipeline_encodes_them(dev) -> None:
    """Tokens [B, R, 4C] and ids (10 (i + 1), row, col, 0) of `prepare_image_latents`; the 98x72
    reference is cropped to 96x72 (18 rows x 24 columns of packed cells)."""
    cond = dev.encode_conditions(request(dev, 4.0, 2, REFERENCES))
    pipe = dev.pipeline
    pixels = [pipe.image_processor.preprocess(im, height=h, width=w, resize_mode="crop") for im, (h, w) in
              zip(REFERENCES, [(64, 64), (72, 96)], strict=True)]  # fmt: skip
    tokens, ids = pipe.prepare_image_latents(pixels, 4, None, torch.device("cpu"), torch.float32)
    assert cond["reference_tokens"].shape[:2] == (4, 16 * 16 + 18 * 24)
    assert torch.equal(cond["reference_tokens"], tokens.float())
    assert torch.equal(cond["reference_ids"], ids.float())
    assert ids[0, :2].tolist() == [[10, 0, 0, 0], [10, 0, 1, 0]]
    assert ids[0, -1].tolist() == [20, 17, 23, 0]


def test_the_references_change_the_sample(dev) -> None:
    stage = Flux2Stage(dev)
    finals = []
    for refs in (REFERENCES, [image(64, 64, 5)]):
        req = request(dev, 4.0, 2, refs)
        finals.append(stage.diffuse(req, stage.encode_request(req)).at(2))
    assert (finals[0] - finals[1]).abs().max().item() > 1e-3


def test_rows_without_references_or_of_other_layouts_are_refused(dev) -> None:
    stage = Flux2Stage(dev)
    with pytest.raises(
        ValueError,
        match=r"sample 'r0/g0:0::sample:0': FLUX.2 with references reads one or more reference images",
    ):
        stage.encode_request(request(dev, 4.0, 2, None))
    config = Flux2EditModelConfig(tiny={"resolution": SIZE, "words": WORDS})
    rows = [
        PromptExample("a", "a", metadata={"images": [image(32, 32, 0)]}),
        PromptExample("b", "b", metadata={"images": [image(32, 32, 0), image(32, 32, 1)]}),
        PromptExample("c", "c", metadata={}),
        PromptExample("d", "d", metadata={"images": [image(2, 2, 0)]}),
    ]
    problems = config.condition_problems(rows, "data.path=prompts.jsonl")
    assert any("prompt 'c' carries no reference image in metadata 'images'" in p for p in problems)
    assert any("prompt 'd': reference 0 is 2x2 px, under one packed cell of 4 px" in p for p in problems)
    assert any("different token grids [((8, 8),), ((8, 8), (8, 8))]" in p for p in problems)
    assert config.condition_problems(rows[:1], "x") == []
