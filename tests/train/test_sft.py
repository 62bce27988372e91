"""Supervised flow matching: loss math, noise levels, exact resume, export, evaluation determinism."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

from tests.conftest import tiny_model_config
from unirl.models.flow.loading import tiny_clip_t5_tokenizers
from unirl.models.sd3 import SD3Bundle
from unirl.sde.schedules import sample_sigmas
from unirl.train.sft import FlowMatchingSFT, FlowMatchingSFTConfig, flow_matching_loss
from unirl.trainer.evaluation import BundleEvaluator, EvalSampling
from unirl.types import DiffusionSamplingParams
from worlds.shapes import GenEvalMini, ShapesDataset

WORDS = ["a", "red", "circle", "circles", "three", "triangles", "left", "of", "and", "above"]


def test_flow_matching_loss_against_hand_computation():
    x0 = torch.tensor([[1.0, -1.0]])
    eps = torch.tensor([[0.5, 0.5]])
    pred = torch.tensor([[0.0, 1.0]])
    # target v = eps - x0 = [-0.5, 1.5]; errors [0.5, -0.5]; mean square 0.25
    assert float(flow_matching_loss(pred, x0, eps)) == pytest.approx(0.25)


@pytest.mark.parametrize("mode", ["logit_normal", "uniform"])
def test_sigmas_lie_in_open_unit_interval_and_shift(mode):
    gen = torch.Generator().manual_seed(0)
    s = sample_sigmas(4000, FlowMatchingSFTConfig(sigma_sampling=mode), gen)
    assert s.min() > 0 and s.max() < 1 and abs(float(s.mean()) - 0.5) < 0.03
    shifted = sample_sigmas(
        4000, FlowMatchingSFTConfig(sigma_sampling=mode, shift=3.0), torch.Generator().manual_seed(0)
    )
    t = s  # same draws: sigma = 3t / (1 + 2t)
    torch.testing.assert_close(shifted, 3 * t / (1 + 2 * t))


def test_whole_word_tokenizers():
    clip, t5 = tiny_clip_t5_tokenizers(12, 77, WORDS)
    text = "a red circle left of three triangles"
    assert clip.convert_ids_to_tokens(clip(text)["input_ids"])[1:-1] == [w + "</w>" for w in text.split()]
    assert t5.convert_ids_to_tokens(t5(text)["input_ids"])[:-1] == ["\u2581" + w for w in text.split()]
    # unknown words still tokenize, by characters
    assert len(clip("purple")["input_ids"]) > 3


def make_sft(tmp_path, steps: int) -> FlowMatchingSFT:
    bundle = tiny_model_config(resolution=32, words=WORDS).build()
    cfg = FlowMatchingSFTConfig(
        num_steps=steps, batch_size=4, lr=1e-3, warmup_steps=1, checkpoint_every=2, log_every=1, eval_every=0
    )
    return FlowMatchingSFT(bundle, ShapesDataset("train"), cfg, str(tmp_path))


def weights(sft: FlowMatchingSFT) -> list[torch.Tensor]:
    return [p.detach().clone() for p in sft.params]


def test_resumed_run_matches_uninterrupted_run(tmp_path):
    full = make_sft(tmp_path / "full", 4)
    full.run()
    part = make_sft(tmp_path / "part", 4)
    part.run(max_seconds=0.0)  # stops after its first step, state saved
    assert part.step == 1
    with open(tmp_path / "part" / "sft_log.jsonl", "a") as f:  # logged, then stopped before a checkpoint
        f.write(json.dumps({"step": 2, "loss": 9.0, "lr": 0.0, "step_s": 0.0}) + "\n")
    resumed = make_sft(tmp_path / "part", 4)
    resumed.run()
    assert resumed.step == 4
    assert all(torch.equal(a, b) for a, b in zip(weights(full), weights(resumed), strict=True))
    rows = [json.loads(line) for line in open(tmp_path / "full" / "sft_log.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    resumed_rows = [json.loads(line) for line in open(tmp_path / "part" / "sft_log.jsonl")]
    assert [r["step"] for r in resumed_rows] == [1, 2, 3, 4]  # the stale step-2 row was dropped
    assert [r["loss"] for r in resumed_rows] == [r["loss"] for r in rows]


def test_image_size_mismatch_is_named(tmp_path):
    bundle = tiny_model_config(words=WORDS).build()
    sft = FlowMatchingSFT(bundle, ShapesDataset("train"), FlowMatchingSFTConfig(batch_size=2), str(tmp_path))
    with pytest.raises(ValueError, match="model.tiny.resolution"):
        sft.train_step()


def test_loss_decreases_on_the_shapes_world(tmp_path):
    sft = make_sft(tmp_path, 16)
    rows = sft.run()
    first, last = np.mean([r["loss"] for r in rows[:5]]), np.mean([r["loss"] for r in rows[-5:]])
    assert last < first


def test_export_loads_back_bit_equal_in_fp16(tmp_path):
    sft = make_sft(tmp_path, 1)
    sft.run()
    sft.export(str(tmp_path / "export"))
    loaded = SD3Bundle.from_pretrained(str(tmp_path / "export"))
    for p, q in zip(sft.bundle.transformer.parameters(), loaded.transformer.parameters(), strict=True):
        assert torch.equal(p.detach().half().float(), q.detach())
    assert next(sft.bundle.transformer.parameters()).dtype == torch.float32


def test_evaluation_is_deterministic(tmp_path):
    bundle = tiny_model_config(words=WORDS).build()
    sampling = DiffusionSamplingParams(
        height=16, width=16, max_sequence_length=8, eta=0.0, guidance_scale=1.0
    )
    evaluator = BundleEvaluator(
        ShapesDataset("eval"),
        sampling,
        GenEvalMini(mode="strict"),
        EvalSampling(num_steps=2, samples_per_prompt=1),
    )
    a, b = evaluator(bundle), evaluator(bundle)
    assert a == b and "accuracy_strict" in a and 0.0 <= a["dense"] <= 1.0


def flux_sft(tmp_path, guidance_scale: float) -> FlowMatchingSFT:
    """A tiny pixel-space FLUX.1 (guidance-distilled: the scale is a network input) under SFT."""
    from unirl.models.flux import FluxModelConfig, TinyFluxConfig

    bundle = FluxModelConfig(tiny=TinyFluxConfig(resolution=32, words=WORDS, clip_max_length=12)).build()
    cfg = FlowMatchingSFTConfig(
        num_steps=2, batch_size=2, eval_every=0, guidance_scale=guidance_scale, train_text_encoders=False
    )  # frozen encoders: no T5 dropout, so the test can recompute the loss
    return FlowMatchingSFT(bundle, ShapesDataset("train"), cfg, str(tmp_path))


def test_an_embedded_guidance_family_trains_at_its_guidance_scale(tmp_path):
    """FLUX.1-dev's network takes the guidance scale: the SFT loss is the flow-matching error of
    `predict(..., guidance=scale per row)` on the batch's own draws (recomputed here), and
    another scale gives another loss."""
    from unirl.train.sft import images_to_model

    sft = flux_sft(tmp_path, 3.5)
    rng, gen = copy.deepcopy(sft.rng), sft.gen.get_state()
    loss, _ = sft.batch_loss()
    images, prompts = sft.data.sample_batch(2, rng)  # the same draws, in the trainer's order
    g = torch.Generator()
    g.set_state(gen)
    drop = torch.rand(2, generator=g) < sft.cfg.cond_dropout
    prompts = ["" if d else p for p, d in zip(prompts, drop.tolist(), strict=True)]
    x0 = images_to_model(images)
    eps = torch.randn(x0.shape, generator=g)
    sigma = sample_sigmas(2, sft.cfg, g)
    x_t = (1 - sigma.view(-1, 1, 1, 1)) * x0 + sigma.view(-1, 1, 1, 1) * eps
    cond = sft.bundle.encode_text(prompts, False, sft.cfg.max_sequence_length)
    pred = sft.bundle.predict(sft.bundle.denoiser, x_t, sigma, cond, guidance=torch.full((2,), 3.5))
    assert float(loss) == pytest.approx(float(((pred - (eps - x0)) ** 2).mean()), rel=1e-5)
    other = flux_sft(tmp_path / "one", 1.0)
    assert abs(float(other.batch_loss()[0]) - float(loss)) > 1e-6


def test_a_family_that_trains_unguided_refuses_a_guidance_scale(tmp_path):
    bundle = tiny_model_config(resolution=32, words=WORDS).build()
    cfg = FlowMatchingSFTConfig(num_steps=2, batch_size=2, eval_every=0, guidance_scale=3.5)
    with pytest.raises(
        ValueError, match=r"sft.guidance_scale=3.5: SD3Bundle guides by 'cfg'.*Set sft.guidance_scale: 1.0"
    ):
        FlowMatchingSFT(bundle, ShapesDataset("train"), cfg, str(tmp_path))


def test_validation_names_a_scale_a_flux_model_without_guidance_embedding_cannot_take():
    from unirl.config.geometry import check_training_guidance
    from unirl.models.flux import FluxModelConfig, TinyFluxConfig

    problems: list[str] = []
    schnell = FluxModelConfig(tiny=TinyFluxConfig(guidance_embeds=False))
    check_training_guidance(schnell, FlowMatchingSFTConfig(guidance_scale=3.5), problems)
    assert len(problems) == 1 and problems[0].startswith(
        "sft.guidance_scale=3.5: this FLUX model has no guidance"
    )
    problems.clear()
    check_training_guidance(schnell, FlowMatchingSFTConfig(guidance_scale=1.0), problems)
    assert problems == []
