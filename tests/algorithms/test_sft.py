"""Supervised fine-tuning as a track's loss (issue 41, item 5): the demonstration track and
`LMSFT` give the completion cross-entropy of the encoded pairs (loss and gradient, against
`completion_loss` written out here), through the train stack's micro-batches; `FlowSFT` gives the
flow-matching loss written out here; bad rows are named."""

from __future__ import annotations

import pytest
import torch

from unirl.algorithms.sft import LMSFT
from unirl.models.causal_lm import CausalLMStage, TinyLMConfig
from unirl.models.causal_lm.loading import IGNORE_INDEX, encode_pairs
from unirl.models.qwen import QwenConfig
from unirl.rollout.demonstrations import DemonstrationEngine
from unirl.train.backend import OptimConfig, TrainBackend
from unirl.train.stack import TrainStack, TrainStackConfig
from unirl.types import PromptExample, RolloutReq, TextSamplingParams

PAIRS = [("12+3=", "15"), ("7*8=", "56"), ("100-1=", "99"), ("4+4=", "8")]


def completion_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The reference: fp32 mean cross-entropy of `labels[:, 1:]` under `logits[:, :-1]` over the
    labelled positions (IGNORE_INDEX: prompt and padding)."""
    pred = logits[:, :-1].float()
    return torch.nn.functional.cross_entropy(
        pred.reshape(-1, pred.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=IGNORE_INDEX
    )


def flow_matching_loss(pred: torch.Tensor, x0: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """The reference: mean squared error of the predicted velocity against eps - x0."""
    return ((pred.float() - (eps - x0).float()) ** 2).mean()


def _request(pairs=PAIRS, keys=None, max_new_tokens=8) -> RolloutReq:
    keys = keys or ["answer"] * len(pairs)
    examples = [
        PromptExample(p, f"p{i}", {k: c}) for i, ((p, c), k) in enumerate(zip(pairs, keys, strict=True))
    ]
    sampling = TextSamplingParams(
        samples_per_prompt=1, max_new_tokens=max_new_tokens, max_prompt_length=16, chat_template=False
    )
    return RolloutReq.from_prompts(examples, sampling, None, rollout_id=0)


def _stage() -> CausalLMStage:
    torch.manual_seed(0)
    return CausalLMStage(QwenConfig(tiny=TinyLMConfig(hidden_size=32, num_layers=2)).build())


def _grads(module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in module.parameters() if p.grad is not None])


def test_the_demonstration_track_is_the_sft_row():
    stage = _stage()
    track = DemonstrationEngine(stage).generate(_request()).track("text")
    assert list(track.texts) == [c for _, c in PAIRS]
    input_ids, mask, labels = encode_pairs(stage.tokenizer, PAIRS, 64)
    for i, (p, r) in enumerate(zip(track.segment.prompt_ids, track.segment.response_ids, strict=True)):
        n = int(mask[i].sum())
        assert torch.equal(torch.cat([p, r]), input_ids[i, :n])  # prompt + completion + EOS
        assert torch.equal(r, labels[i, p.numel() : n])  # exactly the labelled positions
        assert r[-1] == stage.tokenizer.eos_token_id
    assert all(float(lp.abs().sum()) == 0 for lp in track.segment.log_probs)  # nothing was sampled
    assert track.segment.temperature == 1.0


@pytest.mark.parametrize("micro_batch_size", [4, 1])
def test_lmsft_through_the_train_stack_is_the_completion_cross_entropy(micro_batch_size):
    stage = _stage()
    reference = completion_loss(*_sft_forward(stage))
    reference.backward()
    want = _grads(stage.module).clone()
    stage.module.zero_grad(set_to_none=True)

    backend = TrainBackend(stage.module, None, OptimConfig(), total_steps=1)
    stack = TrainStack(stage, backend, LMSFT(), TrainStackConfig(micro_batch_size=micro_batch_size))
    track = DemonstrationEngine(stage).generate(_request()).track("text")
    micro, ctx = stack.prepare(track, 0.0)
    rows = stack.backward(micro, ctx)
    got = _grads(stage.module)
    assert float((got - want).norm() / want.norm()) < 1e-5
    # the stack's mean of the rows is the batch's loss, whatever the split
    assert sum(r["loss"] for r in rows) / len(rows) == pytest.approx(float(reference), rel=1e-5)


def _sft_forward(stage):
    inputs, labels = stage.bundle.pair_batch(PAIRS, "sft", 64)
    return stage.module(**inputs).logits, labels


def test_bad_rows_are_named():
    stage = _stage()
    with pytest.raises(
        ValueError, match=r"sample 'r0/g1:p1::sample:0'.*metadata\['answer'\].*rollout.target_key"
    ):
        DemonstrationEngine(stage).generate(_request(PAIRS[:2], keys=["answer", "other"]))
    long = [("1+1=", "2" * 20)]
    with pytest.raises(ValueError, match=r"demonstration '2+' is 21 tokens with EOS.*max_new_tokens=8"):
        DemonstrationEngine(stage).generate(_request(pairs=long))


def test_a_stage_that_cannot_teacher_force_is_refused():
    class Images:
        module = torch.nn.Linear(1, 1)

    with pytest.raises(
        TypeError, match="DemonstrationEngine teacher-forces demonstrations; Images has no `teacher_forced`"
    ):
        DemonstrationEngine(Images())


# ---- flow-matching SFT ----------------------------------------------------------------------


def _flow_request(n: int = 4, size: int = 16) -> RolloutReq:
    import numpy as np

    from unirl.sde.schedules import sigmas_for
    from unirl.types import DiffusionSamplingParams

    rng = np.random.default_rng(0)
    prompts = ["a red square", "two blue circles", "a green triangle", "a yellow circle"][:n]
    examples = [
        PromptExample(p, f"p{i}", {"image": rng.integers(0, 256, (size, size, 3), dtype=np.uint8)})
        for i, p in enumerate(prompts)
    ]
    sampling = DiffusionSamplingParams(
        num_steps=2,
        samples_per_prompt=1,
        height=size,
        width=size,
        guidance_scale=1.0,
        eta=0.0,
        max_sequence_length=8,
    )
    return RolloutReq.from_prompts(examples, sampling, sigmas_for(sampling, (size // 4) ** 2), rollout_id=3)


def _flow_stage():
    from tests.conftest import tiny_model_config
    from unirl.models.sd3 import SD3Stage

    torch.manual_seed(0)
    return SD3Stage(tiny_model_config().build())


def _hand_flow_loss(
    stage, track, cond_dropout: float, seed: int = 0, guidance: float | None = None
) -> torch.Tensor:
    """The flow-matching loss written out: per sample, its own generator seeded by (seed, id) draws
    t ~ logit-normal, eps and the dropout coin; x_t = (1 - t) x0 + t eps; the network's velocity
    (at the network's `guidance` input, for a family that takes one) against eps - x0 (the empty
    prompt's conditions, encoded here, for a dropped sample)."""
    import zlib

    req = _flow_request(len(track))
    empty = stage.encode_prompts([""], 1.0, req.sampling.max_sequence_length)
    losses = []
    for i, sid in enumerate(track.sample_ids):
        gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{sid}".encode()))
        t = torch.sigmoid(torch.randn(1, generator=gen))
        x0 = (torch.from_numpy(req.metadata[i]["image"]).float().movedim(-1, 0) / 127.5 - 1)[None]
        eps = torch.randn(x0.shape[1:], generator=gen)[None]
        drop = bool(torch.rand(1, generator=gen) < cond_dropout)
        cond = {k: (empty[k] if drop else v[i : i + 1]) for k, v in track.conditions.items() if k in empty}
        extra = {} if guidance is None else {"guidance": torch.full((1,), guidance)}
        pred = stage.bundle.predict(stage.module, (1 - t) * x0 + t * eps, t, cond, **extra)
        losses.append(flow_matching_loss(pred, x0, eps))
    return torch.stack(losses).mean()


@pytest.mark.parametrize("cond_dropout", [0.0, 0.999])
@pytest.mark.parametrize("micro_batch_size", [4, 1])
def test_flowsft_through_the_train_stack_is_the_flow_matching_loss(cond_dropout, micro_batch_size):
    from unirl.algorithms.sft import FlowSFT, FlowSFTConfig

    stage = _flow_stage()
    track = DemonstrationEngine(stage, target_key="image").generate(_flow_request()).track("diffusion")
    reference = _hand_flow_loss(stage, track, cond_dropout)
    reference.backward()
    want = _grads(stage.module).clone()
    stage.module.zero_grad(set_to_none=True)

    algorithm = FlowSFT(FlowSFTConfig(cond_dropout=cond_dropout))
    backend = TrainBackend(stage.module, None, OptimConfig(), total_steps=1)
    stack = TrainStack(stage, backend, algorithm, TrainStackConfig(micro_batch_size=micro_batch_size))
    micro, ctx = stack.prepare(track, 0.0)
    rows = stack.backward(micro, ctx)
    assert float((_grads(stage.module) - want).norm() / want.norm()) < 1e-5
    assert sum(r["loss"] for r in rows) / len(rows) == pytest.approx(float(reference), rel=1e-5)
    assert sum(r["sft/dropped_frac"] for r in rows) / len(rows) == (1.0 if cond_dropout else 0.0)


def test_the_diffusion_demonstration_track_holds_the_images():
    stage = _flow_stage()
    req = _flow_request()
    track = DemonstrationEngine(stage, target_key="image").generate(req).track("diffusion")
    for i, meta in enumerate(req.metadata):
        assert torch.equal(
            track.media[i].permute(1, 2, 0), torch.from_numpy(meta["image"])
        )  # exact round trip
    assert track.segment.sde_indices == [] and track.segment.log_probs.shape == (4, 0)
    assert {"empty_" + k for k in stage.encode_prompts(["x"], 1.0, 8)} <= set(track.conditions)


def test_bad_diffusion_demonstrations_are_named():
    stage = _flow_stage()
    req = _flow_request(size=16)
    req.metadata[1]["image"] = req.metadata[1]["image"][:8]
    with pytest.raises(
        ValueError, match=r"sample 'r3/g1:p1::sample:0': the demonstration is 16 x 8 pixels.*16 x 16"
    ):
        DemonstrationEngine(stage, target_key="image").generate(req)
    from tests.conftest import tiny_model_config
    from unirl.models.sd3 import SD3Stage

    latent = SD3Stage(tiny_model_config(pixel_space=False, resolution=64).build())
    with pytest.raises(ValueError, match=r"VAE's latent space.*model.tiny.pixel_space: true"):
        DemonstrationEngine(latent, target_key="image").generate(_flow_request())


def test_lmsft_on_a_vlm_is_the_completion_cross_entropy_of_its_image_rows():
    """A vision-language track: the prompt's images go through the stage's encoding as in a
    rollout, and the loss is `completion_loss` of `pair_batch`'s image rows."""
    import numpy as np

    from unirl.models.causal_lm import TinyVLMConfig
    from unirl.models.qwen_vl import QwenVLConfig

    torch.manual_seed(0)
    stage = CausalLMStage(QwenVLConfig(tiny=TinyVLMConfig()).build())
    rng = np.random.default_rng(0)
    rows = [
        ("<image>what colour?", "red", [rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)]),
        ("<image>how many?", "two", [rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)]),
    ]
    inputs, labels = stage.bundle.pair_batch(rows, "sft", 128)
    completion_loss(stage.module(**inputs).logits, labels).backward()
    want = _grads(stage.module).clone()
    stage.module.zero_grad(set_to_none=True)

    examples = [PromptExample(p, f"p{i}", {"answer": c, "images": im}) for i, (p, c, im) in enumerate(rows)]
    sampling = TextSamplingParams(
        samples_per_prompt=1, max_new_tokens=8, max_prompt_length=128, chat_template=False
    )
    track = (
        DemonstrationEngine(stage)
        .generate(RolloutReq.from_prompts(examples, sampling, None, 0))
        .track("text")
    )
    backend = TrainBackend(stage.module, None, OptimConfig(), total_steps=1)
    stack = TrainStack(stage, backend, LMSFT(), TrainStackConfig(micro_batch_size=1))
    stack.backward(*stack.prepare(track, 0.0))
    assert float((_grads(stage.module) - want).norm() / want.norm()) < 1e-5


def test_a_video_familys_demonstration_is_a_clip():
    """A pixel-space Wan's demonstration is a uint8 [F, H, W, 3] clip, its x0 the [3, F, H, W]
    pixels in [-1, 1] (exact round trip); a clip of other frames or dtype is named."""
    import numpy as np

    from unirl.data import SampledDemonstrations
    from unirl.models.wan import WanModelConfig, WanStage
    from unirl.sde.schedules import sigmas_for
    from unirl.types import DiffusionSamplingParams
    from worlds.shapes import MovingSquares

    torch.manual_seed(0)
    model = WanModelConfig(
        num_frames=5, tiny={"resolution": 16, "pixel_space": True, "words": ["a", "red", "square"]}
    )
    stage = WanStage(model.build())
    rows = SampledDemonstrations(MovingSquares(5, 16, 2), rows=3, seed=0, key="video").examples
    sampling = DiffusionSamplingParams(
        num_steps=2, samples_per_prompt=1, height=16, width=16, max_sequence_length=8
    )
    req = RolloutReq.from_prompts(rows, sampling, sigmas_for(sampling, 5 * 8 * 8), rollout_id=0)
    track = DemonstrationEngine(stage, target_key="video").generate(req).track("diffusion")
    for i, row in enumerate(rows):
        x0 = track.segment.latents[i, -1]
        assert x0.shape == (3, 5, 16, 16)
        assert torch.equal(
            ((x0 + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 3, 0),
            torch.from_numpy(row.metadata["video"]),
        )
    req.metadata[1]["video"] = req.metadata[1]["video"][:3]
    with pytest.raises(
        ValueError, match=r"the demonstration is 3 frames of 16 x 16 pixels but the track samples 5 frames"
    ):
        DemonstrationEngine(stage, target_key="video").generate(req)
    req.metadata[1]["video"] = np.zeros((5, 16, 16, 3), dtype=np.float32)
    with pytest.raises(
        ValueError, match=r"a demonstration clip is a uint8 \[F, H, W, 3\] array, got float32"
    ):
        DemonstrationEngine(stage, target_key="video").generate(req)


def _flux_stage(guidance_embeds: bool):
    from unirl.models.flux import FluxModelConfig, FluxStage, TinyFluxConfig

    torch.manual_seed(0)
    tiny = TinyFluxConfig(resolution=16, guidance_embeds=guidance_embeds, clip_max_length=8)
    return FluxStage(FluxModelConfig(tiny=tiny).build())


def test_an_embedded_guidance_family_trains_at_its_guidance_scale():
    """FLUX.1-dev's network takes the guidance scale: FlowSFT's loss is the flow-matching error of
    the velocity at `guidance_scale` (a network input, written out here), not at 1.0."""
    from unirl.algorithms.sft import FlowSFT, FlowSFTConfig

    stage = _flux_stage(guidance_embeds=True)
    track = DemonstrationEngine(stage, target_key="image").generate(_flow_request()).track("diffusion")
    losses = {}
    for scale in (1.0, 3.5):
        with torch.no_grad():
            hand = _hand_flow_loss(stage, track, cond_dropout=0.0, guidance=scale)
        stage.module.zero_grad(set_to_none=True)
        algorithm = FlowSFT(FlowSFTConfig(cond_dropout=0.0, guidance_scale=scale))
        losses[scale] = algorithm.compute_loss_and_backward(stage, track, {"loss_scale": 1.0})["loss"]
        assert losses[scale] == pytest.approx(float(hand), rel=1e-5)
    assert losses[1.0] != pytest.approx(losses[3.5], rel=1e-3)  # the scale reaches the network


def test_a_family_that_trains_unguided_refuses_a_guidance_scale():
    from unirl.algorithms.sft import FlowSFT, FlowSFTConfig

    stage = _flow_stage()  # SD3: classifier-free guidance by two branches at sampling
    track = DemonstrationEngine(stage, target_key="image").generate(_flow_request()).track("diffusion")
    with pytest.raises(
        ValueError, match=r"algorithm.config.guidance_scale=2.0: SD3Bundle guides by two branches"
    ):
        FlowSFT(FlowSFTConfig(guidance_scale=2.0)).compute_loss_and_backward(
            stage, track, {"loss_scale": 1.0}
        )
