"""Wan 2.2 A14B-style two experts (`unirl.models.wan.experts`): ODE sampling through the shared
stage equals diffusers' `WanPipeline` with `transformer_2` and `boundary_ratio` on a tiny model,
rows are routed by their own timestep, each expert's LoRA is trained by the steps on its side of
the boundary only, and the exported LoRA is what the pipeline loads into both experts.

With the Euler scheduler's grid shifted by 3.0 and 4 steps the pipeline's timesteps are 1000, 858,
602 and 9: at `boundary_ratio` 0.875 the high-noise expert takes the first step and the low-noise
one the other three, so a trajectory crosses the boundary.
"""

from __future__ import annotations

import json

import pytest
import torch
from diffusers import WanPipeline

from tests.models.lora import trained_lora_backend
from unirl.models.wan import LORA_TARGETS, WanBundle, WanStage, load_checkpoint
from unirl.models.wan.experts import WanExperts
from unirl.sde.schedules import sigmas_for
from unirl.train.backend import LoRAConfig, OptimConfig, TrainBackend, lora_target_problem
from unirl.types import DiffusionSamplingParams, PromptExample, RolloutReq

from .conftest import tiny_wan_config

PROMPTS = ["a red square", "a blue dot"]
BOUNDARY = 0.875  # Wan 2.2 T2V-A14B's


@pytest.fixture(scope="module")
def experts_bundle():
    return tiny_wan_config(boundary_ratio=BOUNDARY).build()


def test_two_experts_are_one_module_with_both_experts_parameters(experts_bundle) -> None:
    experts = experts_bundle.transformer
    assert isinstance(experts, WanExperts) and experts.boundary_timestep == 875.0
    assert experts.transformer is experts_bundle.pipeline.transformer
    assert experts.transformer_2 is experts_bundle.pipeline.transformer_2
    names = [n for n, _ in experts.named_parameters()]
    assert {n.split(".")[0] for n in names} == {"transformer", "transformer_2"}
    one = sum(p.numel() for p in experts.transformer.parameters())
    assert sum(p.numel() for p in experts.parameters()) == 2 * one
    # the experts differ (the low-noise one is built after the high-noise one) and the first is
    # the Wan 2.1 tiny model of the same seed, unchanged by the second
    single = tiny_wan_config().build().transformer
    assert all(
        torch.equal(a, b) for a, b in zip(single.parameters(), experts.transformer.parameters(), strict=True)
    )
    assert not torch.equal(experts.transformer.proj_out.weight, experts.transformer_2.proj_out.weight)
    meta = tiny_wan_config(boundary_ratio=BOUNDARY).trainable_on_meta()
    assert isinstance(meta, WanExperts) and lora_target_problem(meta, LORA_TARGETS) is None


def test_ode_sampling_across_the_boundary_matches_wan_pipeline(experts_bundle) -> None:
    num_steps, guidance, size = 4, 5.0, 16
    sp = DiffusionSamplingParams(
        num_steps=num_steps, samples_per_prompt=2, height=size, width=size, guidance_scale=guidance,
        eta=0.0, shift=3.0, max_sequence_length=8,
    )  # fmt: skip
    stage = WanStage(experts_bundle)
    sigmas = sigmas_for(sp, experts_bundle.image_seq_len(size, size))
    assert [round(1000 * s) for s in sigmas[:-1].tolist()] == [1000, 858, 602, 9]
    req = RolloutReq.from_prompts([PromptExample(p, str(i)) for i, p in enumerate(PROMPTS)], sp, sigmas, 0)
    ours = stage.diffuse(req, stage.encode_request(req)).at(num_steps)
    shape = experts_bundle.latent_shape(size, size)
    x_t = torch.stack(
        [torch.randn(shape, generator=torch.Generator().manual_seed(s)) for s in req.init_seeds]
    )

    pipe = WanPipeline(**experts_bundle.pipeline.components, boundary_ratio=BOUNDARY)
    pipe.set_progress_bar_config(disable=True)
    final, used = {}, []

    def keep_last(pipe, i, t, tensors):
        final["latents"] = tensors["latents"]
        return tensors

    hooks = [
        m.register_forward_hook(lambda *_, name=name: used.append(name))
        for name, m in (("high", pipe.transformer), ("low", pipe.transformer_2))
    ]
    with torch.no_grad():
        frames = pipe(
            prompt=PROMPTS, num_videos_per_prompt=sp.samples_per_prompt, height=size, width=size,
            num_frames=experts_bundle.num_frames, num_inference_steps=num_steps, guidance_scale=guidance,
            latents=x_t, max_sequence_length=sp.max_sequence_length, output_type="pt", callback_on_step_end=keep_last,
        ).frames  # fmt: skip
    for hook in hooks:
        hook.remove()
    assert used == ["high"] * 2 + ["low"] * 6  # cond and uncond forwards per step
    theirs = final["latents"]
    assert torch.equal(pipe.scheduler.sigmas, sigmas)
    assert torch.equal(ours, theirs), f"max |stage - pipeline| = {(ours - theirs).abs().max().item()}"
    assert torch.equal(stage.decode_float(ours), frames)


def test_a_batch_of_rows_on_both_sides_is_routed_row_by_row(experts_bundle) -> None:
    """Replay batches rows of several steps: each row gets its own expert's velocity."""
    x = torch.randn(4, *experts_bundle.latent_shape(16, 16), generator=torch.Generator().manual_seed(0))
    sigma = torch.tensor([0.95, 0.3, 0.875, 0.5])  # high, low, high (at the boundary), low
    cond = {"prompt_embeds": torch.randn(4, 8, 32, generator=torch.Generator().manual_seed(1))}
    experts = experts_bundle.transformer
    with torch.no_grad():
        mixed = experts_bundle.predict(experts, x, sigma, cond)
        for i, expert in enumerate([experts.transformer, experts.transformer_2] * 2):
            alone = experts_bundle.predict(
                expert, x[i : i + 1], sigma[i : i + 1], {"prompt_embeds": cond["prompt_embeds"][i : i + 1]}
            )
            torch.testing.assert_close(mixed[i : i + 1], alone, rtol=1e-5, atol=1e-6)


def test_each_experts_lora_is_trained_by_its_own_steps_only() -> None:
    bundle = tiny_wan_config(boundary_ratio=BOUNDARY).build()
    backend = TrainBackend(
        bundle.transformer, LoRAConfig(rank=2, alpha=4, target_modules=LORA_TARGETS), OptimConfig(), 1
    )
    x = torch.randn(2, *bundle.latent_shape(16, 16), generator=torch.Generator().manual_seed(0))
    cond = {"prompt_embeds": torch.randn(2, 8, 32)}
    with torch.no_grad():  # make every lora_B nonzero so that every lora_A gets a gradient
        for name, p in backend.module.named_parameters():
            if "lora_B" in name:
                p.fill_(0.01)
    for sigma, trained, untouched in (
        (0.95, "transformer.", "transformer_2."),
        (0.3, "transformer_2.", "transformer."),
    ):
        backend.module.zero_grad()
        bundle.predict(backend.module, x, torch.full((2,), sigma), cond).square().mean().backward()
        grads = {n: p.grad for n, p in backend.module.named_parameters() if p.requires_grad}
        assert all(grads[n] is not None and grads[n].abs().sum() > 0 for n in grads if n.startswith(trained))
        assert all(grads[n] is None for n in grads if n.startswith(untouched))


def test_exported_lora_loads_into_both_experts_of_wan_pipeline(tmp_path) -> None:
    """`write_weights` writes the high-noise expert's LoRA in the checkpoint directory and the
    low-noise one's under `transformer_2/`; `WanPipeline.load_lora_weights` (the second with
    `load_into_transformer_2=True`) and `load_checkpoint` reproduce the trained velocities on
    both sides of the boundary."""
    bundle = tiny_wan_config(boundary_ratio=BOUNDARY).build()
    bundle.save_pretrained(str(tmp_path / "base"))
    backend = trained_lora_backend(bundle.transformer, LORA_TARGETS, WanBundle.write_weights)
    backend.save_weights(str(tmp_path / "ckpt"), base_model=str(tmp_path / "base"))
    assert (tmp_path / "ckpt" / "pytorch_lora_weights.safetensors").is_file()
    assert (tmp_path / "ckpt" / "transformer_2" / "pytorch_lora_weights.safetensors").is_file()

    x = torch.randn(2, *bundle.latent_shape(8, 8), generator=torch.Generator().manual_seed(1))
    cond = {"prompt_embeds": torch.randn(2, 8, 32)}
    sigma = torch.tensor([0.95, 0.3])  # one row per expert
    pipe = WanPipeline.from_pretrained(tmp_path / "base")
    pipe.load_lora_weights(tmp_path / "ckpt")
    pipe.load_lora_weights(tmp_path / "ckpt" / "transformer_2", load_into_transformer_2=True)
    loaded = load_checkpoint(str(tmp_path / "ckpt"), num_frames=5)
    assert isinstance(loaded.transformer, WanExperts)
    with torch.no_grad():
        trained = bundle.predict(backend.module, x, sigma, cond)
        by_pipeline = WanExperts(pipe.transformer, pipe.transformer_2, BOUNDARY * 1000)
        torch.testing.assert_close(bundle.predict(by_pipeline, x, sigma, cond), trained, rtol=0, atol=1e-6)
        torch.testing.assert_close(
            loaded.predict(loaded.transformer, x, sigma, cond), trained, rtol=0, atol=1e-6
        )
        backend.module.disable_adapters()
        base = bundle.predict(backend.module, x, sigma, cond)
        assert all(not torch.allclose(base[i], trained[i], atol=1e-4) for i in range(2))  # both experts moved


def test_a_directory_with_two_experts_needs_its_boundary(tmp_path) -> None:
    from unirl.models.wan import WanModelConfig

    tiny_wan_config(boundary_ratio=BOUNDARY).build().save_pretrained(str(tmp_path))
    assert WanModelConfig(pretrained_path=str(tmp_path), tiny=None, num_frames=5).directory_problems() == []
    index = json.loads((tmp_path / "model_index.json").read_text())
    index["boundary_ratio"] = None
    (tmp_path / "model_index.json").write_text(json.dumps(index))
    (problem,) = WanModelConfig(pretrained_path=str(tmp_path), tiny=None, num_frames=5).directory_problems()
    assert "transformer_2/" in problem and "boundary_ratio=None" in problem and "(0, 1)" in problem
    with pytest.raises(ValueError, match=r"transformer_2.*no boundary_ratio"):
        WanBundle.from_pretrained(str(tmp_path), num_frames=5)


def test_sequence_parallelism_plans_each_expert() -> None:
    """Ulysses applies diffusers' context-parallel plan to each expert (the container has none of
    its own); a degree that does not divide the experts' heads is refused, naming it."""
    from unirl.train.sequence_parallel import cp_plan_problem, planned_parts

    meta = tiny_wan_config(boundary_ratio=BOUNDARY).trainable_on_meta()
    assert planned_parts(meta) == [meta.transformer, meta.transformer_2]
    assert cp_plan_problem(meta, 2) is None
    assert "does not divide the transformer's 2 attention heads" in cp_plan_problem(meta, 4)


def test_guidance_scale_2_guides_the_low_noise_steps_as_wan_pipeline(tmp_path) -> None:
    """`model.guidance_scale_2`: the low-noise expert's steps combine their branches with it, the
    high-noise expert's with `sampling.guidance_scale`; ODE sampling equals `WanPipeline(...,
    guidance_scale=5.0, guidance_scale_2=2.0)` bit for bit, and differs from one scale throughout.
    Without two experts it is refused before Ray."""
    config = tiny_wan_config(boundary_ratio=BOUNDARY)
    config.guidance_scale_2 = 2.0
    bundle = config.build()
    num_steps, size = 4, 16
    sp = DiffusionSamplingParams(
        num_steps=num_steps, samples_per_prompt=2, height=size, width=size, guidance_scale=5.0,
        eta=0.0, shift=3.0, max_sequence_length=8,
    )  # fmt: skip
    stage = WanStage(bundle)
    sigmas = sigmas_for(sp, bundle.image_seq_len(size, size))
    req = RolloutReq.from_prompts([PromptExample(p, str(i)) for i, p in enumerate(PROMPTS)], sp, sigmas, 0)
    ours = stage.diffuse(req, stage.encode_request(req)).at(num_steps)
    x_t = torch.stack(
        [
            torch.randn(bundle.latent_shape(size, size), generator=torch.Generator().manual_seed(s))
            for s in req.init_seeds
        ]
    )
    pipe = WanPipeline(**bundle.pipeline.components, boundary_ratio=BOUNDARY)
    pipe.set_progress_bar_config(disable=True)
    final = {}

    def keep_last(pipe, i, t, tensors):
        final["latents"] = tensors["latents"]
        return tensors

    with torch.no_grad():
        pipe(
            prompt=PROMPTS, num_videos_per_prompt=2, height=size, width=size, num_frames=bundle.num_frames,
            num_inference_steps=num_steps, guidance_scale=5.0, guidance_scale_2=2.0, latents=x_t,
            max_sequence_length=8, output_type="latent", callback_on_step_end=keep_last,
        )  # fmt: skip
    assert torch.equal(ours, final["latents"]), (ours - final["latents"]).abs().max().item()
    bundle.guidance_scale_2 = None
    one_scale = stage.diffuse(req, stage.encode_request(req)).at(num_steps)
    assert (one_scale - ours).abs().max().item() > 1e-4

    from tests.recipes import composed
    from unirl.config.validate import ConfigError, validate_recipe

    cfg = composed("diffusion/tiny_wan_flowgrpo", tmp_path, "+model.guidance_scale_2=3.0")
    with pytest.raises(
        ConfigError,
        match=r"model.guidance_scale_2=3.0: the low-noise expert's scale needs Wan 2.2's two experts",
    ):
        validate_recipe(cfg, expect="diffusion")
