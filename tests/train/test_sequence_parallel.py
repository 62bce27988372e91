"""Ulysses sequence parallelism (`train.parallel.sp`) under FSDP2 on 4 gloo ranks, 2 x 2 (two sample
groups of two ranks) and 1 x 4: a tiny FLUX.1's (diffusers' context parallelism), a tiny SD3.5's
(SD3's own plan and processor, `unirl.models.sd3.attention`) and a tiny Qwen3's (token-sharded
replay, `unirl.models.causal_lm.ulysses`) rollout log-probs and update's LoRA gradient equal the
unsharded single-process ones (1e-5) (issue 45, item 2)."""

from __future__ import annotations

import os
import re

import pytest
import torch

from tests.gloo import join_gloo, spawn_ranks

WORLD = 4
SAMPLES = 8
MESHES = (2, 4)  # sp: 2 groups x 2 ranks, 1 group x 4 ranks


FAMILIES = ("flux", "sd3", "lm")


def _setup(family: str, sp: int | None, samples: list[int]):
    """A tiny pixel-space FLUX.1 (4 heads; 64 image and 8 text tokens) or SD3.5 (4 heads, RMS
    q/k norms, a dual-attention first block, a last block that only reads the text; 64 image and
    9 text tokens, which no degree divides) with LoRA, under FSDP2 with Ulysses degree `sp` (None:
    one process, unsharded), its Flow-GRPO train stack, and the track of `samples` (rollout 0,
    the same noise for a sample on any rank) with fixed advantages."""
    from unirl.algorithms.flow_grpo import FlowGRPO, FlowGRPOConfig
    from unirl.models.flow.stage import FlowMatchingStage
    from unirl.rollout.trainside import TrainsideEngine
    from unirl.sde.schedules import sigmas_for
    from unirl.train.backend import LoRAConfig
    from unirl.train.fsdp import FSDPConfig
    from unirl.train.stack import TrainStack, TrainStackConfig
    from unirl.types import DiffusionSamplingParams, PromptExample, RolloutReq

    torch.manual_seed(0)
    if family == "lm":
        return _lm_setup(sp, samples)
    if family == "flux":
        from unirl.models.flux import FluxModelConfig, TinyFluxConfig

        tiny = TinyFluxConfig(
            resolution=16, num_attention_heads=4, attention_head_dim=16, clip_max_length=8, seed=0
        )
        bundle = FluxModelConfig(tiny=tiny).build()
        blocks, guidance, text = ["FluxTransformerBlock", "FluxSingleTransformerBlock"], 3.5, 8
        targets = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "proj_out"]
    else:
        from unirl.models.sd3 import SD3ModelConfig, TinySD3Config

        tiny = TinySD3Config(
            resolution=16, num_attention_heads=4, attention_head_dim=16, clip_max_length=5,
            qk_norm="rms_norm", dual_attention_layers=[0], seed=0,
        )  # fmt: skip
        bundle = SD3ModelConfig(tiny=tiny).build()
        blocks, guidance, text = ["JointTransformerBlock"], 3.0, 4
        targets = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "to_add_out", "proj_out"]
    stage = FlowMatchingStage(bundle, replay_steps_per_forward=2)
    fsdp = FSDPConfig(block_classes=blocks) if sp else None
    lora = LoRAConfig(rank=4, alpha=8, target_modules=targets)
    backend = _backend(stage.module, lora, fsdp, sp)
    stage.module = backend.module
    stack = TrainStack(stage, backend, FlowGRPO(FlowGRPOConfig(clip_range=0.2)), TrainStackConfig(4))
    sp_params = DiffusionSamplingParams(
        num_steps=4, samples_per_prompt=4, height=16, width=16, guidance_scale=guidance, eta=0.7,
        max_sequence_length=text, sde_scheduler="all",
    )  # fmt: skip
    sigmas = sigmas_for(sp_params, bundle.image_seq_len(16, 16))
    prompts = [PromptExample("a red square", "0"), PromptExample("a blue dot", "1")]
    req = RolloutReq.from_prompts(prompts, sp_params, sigmas, 0).select(samples)
    track = TrainsideEngine(stage, forward_batch_size=4).generate(req).track("diffusion")
    track.advantages = torch.linspace(-1.0, 1.0, SAMPLES)[samples]
    return backend, stack, track


def _lm_setup(sp: int | None, samples: list[int]):
    """A tiny Qwen3 (4 query heads, 2 key / value heads: at sp=4 they are repeated) with LoRA,
    its GRPO stack, and the track of `samples` of 4 prompts of different lengths x 2 samples
    (responses of different lengths, rows right-padded): replay shards the rows' tokens."""
    from unirl.algorithms.grpo import GRPO, GRPOConfig
    from unirl.models.causal_lm import CausalLMStage, TinyLMConfig
    from unirl.models.qwen import QwenConfig
    from unirl.rollout.trainside import TrainsideEngine
    from unirl.train.backend import LoRAConfig
    from unirl.train.fsdp import FSDPConfig
    from unirl.train.stack import TrainStack, TrainStackConfig
    from unirl.types import PromptExample, RolloutReq, TextSamplingParams

    stage = CausalLMStage(QwenConfig(tiny=TinyLMConfig(num_layers=2)).build())
    fsdp = FSDPConfig(block_classes=["Qwen3DecoderLayer"]) if sp else None
    lora = LoRAConfig(rank=4, alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    backend = _backend(stage.module, lora, fsdp, sp)
    stage.module = backend.module
    stack = TrainStack(stage, backend, GRPO(GRPOConfig()), TrainStackConfig(2))
    params = TextSamplingParams(samples_per_prompt=2, max_new_tokens=7, temperature=1.0)
    words = ["Hi", "Name a colour.", "What is 2 + 2? Be brief.", "Count: one two three four"]
    prompts = [PromptExample(w, str(i)) for i, w in enumerate(words)]
    req = RolloutReq.from_prompts(prompts, params, None, 0).select(samples)
    track = TrainsideEngine(stage, forward_batch_size=4).generate(req).track("text")
    track.advantages = torch.linspace(-1.0, 1.0, SAMPLES)[samples]
    return backend, stack, track


def _backend(module, lora, fsdp, sp: int | None):
    """The train backend of `module` (AdamW at 1e-2) under FSDP2 `fsdp` with Ulysses degree `sp`
    (None: one unsharded process), a group's ranks given the same samples."""
    from unirl.train.backend import OptimConfig, TrainBackend
    from unirl.train.fsdp import ParallelConfig

    parallel = ParallelConfig(sp=sp or 1)
    return TrainBackend(
        module, lora, OptimConfig(lr=1e-2), 10, fsdp=fsdp, parallel=parallel, groups_share_samples=True
    )


def _rows(log_probs) -> list[torch.Tensor]:
    """A segment's rollout log-probs per sample: rows of a [B, K] tensor (diffusion) or the
    list of [R_i] (text)."""
    return [row.detach().clone() for row in log_probs]


def _grad(backend, stack, track) -> torch.Tensor:
    backend.zero_grad()
    micro, ctx = stack.prepare(track, 0.0)
    stack.backward(micro, ctx)
    return torch.cat(
        [
            p.grad.full_tensor().flatten() if hasattr(p.grad, "full_tensor") else p.grad.flatten()
            for p in backend.params
        ]
    )


def _rank(rank: int, rdzv: str, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    join_gloo(rank, WORLD, rdzv)
    try:
        out = {}
        for family, sp in [(f, sp) for f in FAMILIES for sp in MESHES]:
            groups = WORLD // sp
            per = SAMPLES // groups
            group = rank // sp
            samples = list(range(group * per, group * per + per))
            backend, stack, track = _setup(family, sp, samples)
            out[family, sp] = {
                "samples": samples,
                "log_probs": _rows(track.segment.log_probs),
                "grad": _grad(backend, stack, track).tolist(),
            }
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_ulysses_sequence_parallel_matches_unsharded_training(tmp_path):
    reference = {}
    for family in FAMILIES:
        backend, stack, track = _setup(family, None, list(range(SAMPLES)))
        reference[family] = (_rows(track.segment.log_probs), _grad(backend, stack, track))
        assert float(reference[family][1].norm()) > 0
    spawn_ranks(_rank, (str(tmp_path), str(tmp_path)), WORLD)  # a failed rank raises here
    results = {r: torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)}
    for rank, out in results.items():
        for family in FAMILIES:
            log_probs, ref_grad = reference[family]
            for sp in MESHES:
                got = out[family, sp]
                for sample, row in zip(got["samples"], got["log_probs"], strict=True):
                    torch.testing.assert_close(row, log_probs[sample], rtol=0, atol=1e-5)
                grad = torch.tensor(got["grad"])
                rel = float((grad - ref_grad).norm() / ref_grad.norm())
                assert rel < 1e-5, (rank, family, sp, rel)


FLUX_SMALL = [
    "model.tiny.num_attention_heads=4",
    "num_steps=2",
    "threads_per_worker=1",
]  # + tests.recipes.FLUX


@pytest.mark.ray
def test_a_flux_recipe_trains_with_sp_2_through_ray_as_on_one_worker(ray_cluster, tmp_path):
    """`diffusion/tiny_flux_flowgrpo` with `train.parallel.sp=2` on 2 Ray workers (one sample shard, its
    tokens split over both) samples what one in-process worker samples and trains the same way:
    the same step-1 rewards, the on-policy ratio 1, and step-2 rewards that agree to float rounding
    (the sharded update differs from the unsharded one by 1e-5 of the gradient at most)."""
    from tests.recipes import IN_PROCESS
    from tests.recipes import run as run_recipe

    one = run_recipe("diffusion/tiny_flux_flowgrpo", tmp_path / "one", *FLUX_SMALL, *IN_PROCESS)
    sp = run_recipe(
        "diffusion/tiny_flux_flowgrpo", tmp_path / "sp", *FLUX_SMALL, "num_devices=2", "+train.parallel.sp=2"
    )
    steps = [r for r in sp if "reward/mean" in r]
    ref = [r for r in one if "reward/mean" in r]
    assert len(steps) == len(ref) == 2
    assert steps[0]["reward/mean"] == pytest.approx(ref[0]["reward/mean"], abs=1e-4)
    assert steps[0]["ratio/first_update_mean"] == pytest.approx(1.0, abs=1e-5)
    assert steps[1]["reward/mean"] == pytest.approx(ref[1]["reward/mean"], abs=1e-3)


@pytest.mark.ray
def test_a_text_recipe_trains_with_sp_2_through_ray_as_on_one_worker(ray_cluster, tmp_path):
    """`llm/tiny_lm_grpo` with `train.parallel.sp=2` on 2 Ray workers (one sample shard whose replay
    splits each row's tokens over both) samples what one in-process worker samples and trains the
    same way: the same step-1 rewards, the on-policy ratio 1, the same step-2 rewards."""
    from tests.recipes import IN_PROCESS
    from tests.recipes import run as run_recipe

    small = ["num_steps=2", "threads_per_worker=1"]
    one = run_recipe("llm/tiny_lm_grpo", tmp_path / "one", *small, *IN_PROCESS)
    sp = run_recipe("llm/tiny_lm_grpo", tmp_path / "sp", *small, "num_devices=2", "+train.parallel.sp=2")
    steps = [r for r in sp if "reward/mean" in r]
    ref = [r for r in one if "reward/mean" in r]
    assert len(steps) == len(ref) == 2
    assert steps[0]["reward/mean"] == pytest.approx(ref[0]["reward/mean"], abs=1e-6)
    assert steps[0]["ratio/first_update_mean"] == pytest.approx(1.0, abs=1e-5)
    assert steps[1]["reward/mean"] == pytest.approx(ref[1]["reward/mean"], abs=1e-6)
    assert steps[0]["train/grad_norm"] == pytest.approx(ref[0]["train/grad_norm"], rel=1e-4)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["num_devices=2", "+train.parallel.sp=3"],
            "train.parallel.sp=3 does not divide num_devices=2; valid values: [1, 2]",
        ),
        (
            ["+train.parallel.sp=2"],
            "train.parallel.sp=2 needs 2 or more Ray workers: launcher=in_process runs one",
        ),
        (
            [
                "num_devices=4",
                "+train.parallel.sp=2",
                "sampling.samples_per_prompt=3",
                "prompts_per_rollout=1",
            ],
            "= 3 samples do not split evenly over num_devices / train.parallel.sp=2",
        ),
        (
            ["num_devices=2", "+train.parallel.sp=2", "sampling.max_sequence_length=7"],
            "does not divide sampling.max_sequence_length=7",
        ),
        (
            [
                "num_devices=2",
                "+train.parallel.sp=2",
                "model.tiny.num_attention_heads=3",
                "model.tiny.attention_head_dim=16",
            ],
            "does not divide the transformer's 3 attention heads; valid values (also dividing num_devices): [1, 3]",
        ),
        (
            ["num_devices=4", "prompts_per_rollout=4", "+train.parallel.replicate=3"],
            "train.parallel.replicate=3 does not divide num_devices=4: HSDP's mesh is replicate x shard = "
            "num_devices ranks; valid values: [1, 2, 4]",
        ),
        (
            [
                "num_devices=4",
                "prompts_per_rollout=4",
                "+train.parallel.replicate=2",
                "+train.parallel.shard=4",
            ],
            "train.parallel: replicate x shard = 2 x 4 = 8 ranks, but num_devices=4; set train.parallel.shard=2 "
            "(or null: num_devices / replicate)",
        ),
        (
            ["num_devices=2", "+train.parallel.ulysses=2"],
            "train.parallel: unknown key(s) ['ulysses']; valid keys: replicate, shard, sp",
        ),
        (["num_devices=2", "+train.parallel.sp=0"], "train.parallel.sp must be >= 1, got 0"),
    ],
)
def test_bad_sequence_parallel_settings_are_refused_before_ray(overrides, message, tmp_path):
    from tests.recipes import IN_PROCESS, composed
    from unirl.config.validate import ConfigError, validate_recipe

    launch = (
        list(IN_PROCESS) if "+train.parallel.sp=2" in overrides and len(overrides) == 1 else ["launcher=ray"]
    )
    cfg = composed("diffusion/tiny_flux_flowgrpo", tmp_path, *FLUX_SMALL, *launch, *overrides)
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate_recipe(cfg, expect="diffusion")


def test_a_transformer_without_a_plan_is_refused_and_sd3_has_its_own():
    from diffusers import SD3Transformer2DModel

    from tests.conftest import tiny_model_config
    from unirl.models.sd3.attention import UlyssesJointAttnProcessor
    from unirl.train.sequence_parallel import cp_plan_problem, splits_text_tokens

    sd3 = tiny_model_config().build().denoiser
    assert cp_plan_problem(sd3, 2) is None and not splits_text_tokens(sd3)
    assert {type(p) for p in sd3.attn_processors.values()} == {UlyssesJointAttnProcessor}
    with torch.device("meta"):
        bare = SD3Transformer2DModel(num_layers=1, attention_head_dim=8, num_attention_heads=2)
    problem = cp_plan_problem(bare, 2)
    assert problem.startswith("train.parallel.sp=2: SD3Transformer2DModel has no context-parallel plan")


def test_sd3_processor_without_a_parallel_config_is_diffusers_bit_for_bit():
    """The processor every SD3 bundle now carries samples exactly as diffusers' own: the same
    velocity from the same weights with `JointAttnProcessor2_0` put back."""
    from diffusers.models.attention_processor import JointAttnProcessor2_0

    from unirl.models.sd3 import SD3ModelConfig, TinySD3Config

    tiny = TinySD3Config(resolution=16, qk_norm="rms_norm", dual_attention_layers=[0], clip_max_length=5)
    bundle = SD3ModelConfig(tiny=tiny).build()
    cond = bundle.encode_text(["a red square"], guided=False, max_sequence_length=4)
    x, sigma = torch.randn(1, 3, 16, 16), torch.tensor([0.7])
    with torch.no_grad():
        ours = bundle.predict(bundle.transformer, x, sigma, cond)
        bundle.transformer.set_attn_processor(JointAttnProcessor2_0())
        theirs = bundle.predict(bundle.transformer, x, sigma, cond)
    assert torch.equal(ours, theirs)


def _family_setup(family: str, sp: int | None):
    """A tiny Wan 2.1 (3 frames) or Qwen-Image (2 heads each) with LoRA on q/k/v, under Ulysses
    degree `sp` (None: unsharded): its 4 samples' rollout log-probs and one update's gradient."""
    from unirl.algorithms.flow_grpo import FlowGRPO, FlowGRPOConfig
    from unirl.models.flow.stage import FlowMatchingStage
    from unirl.rollout.trainside import TrainsideEngine
    from unirl.sde.schedules import sigmas_for
    from unirl.train.backend import LoRAConfig
    from unirl.train.fsdp import FSDPConfig
    from unirl.train.stack import TrainStack, TrainStackConfig
    from unirl.types import DiffusionSamplingParams, PromptExample, RolloutReq

    torch.manual_seed(0)
    if family == "wan":
        from unirl.models.wan.config import TinyWanConfig, WanModelConfig

        model, blocks, guidance = (
            WanModelConfig(tiny=TinyWanConfig(), num_frames=3),
            ["WanTransformerBlock"],
            2.0,
        )
    else:
        from unirl.models.qwenimage.config import QwenImageModelConfig, TinyQwenImageConfig

        model, blocks, guidance = (
            QwenImageModelConfig(tiny=TinyQwenImageConfig(resolution=16)),
            ["QwenImageTransformerBlock"],
            1.0,
        )
    bundle = model.build()
    stage = FlowMatchingStage(bundle, replay_steps_per_forward=2)
    # checkpointed blocks: the plan's hooks go on before the checkpoint wrappers (Wan's plan names
    # a block's inputs)
    fsdp = FSDPConfig(block_classes=blocks, activation_checkpointing=True) if sp else None
    lora = LoRAConfig(rank=4, alpha=8, target_modules=["to_q", "to_k", "to_v"])
    backend = _backend(stage.module, lora, fsdp, sp)
    stage.module = backend.module
    stack = TrainStack(stage, backend, FlowGRPO(FlowGRPOConfig(clip_range=0.2)), TrainStackConfig(4))
    params = DiffusionSamplingParams(
        num_steps=4, samples_per_prompt=2, height=16, width=16, guidance_scale=guidance, eta=0.7,
        max_sequence_length=8, sde_scheduler="all",
    )  # fmt: skip
    prompts = [PromptExample("a red square", "0"), PromptExample("a blue dot", "1")]
    req = RolloutReq.from_prompts(prompts, params, sigmas_for(params, bundle.image_seq_len(16, 16)), 0)
    track = TrainsideEngine(stage, forward_batch_size=4).generate(req).track("diffusion")
    track.advantages = torch.linspace(-1.0, 1.0, 4)
    return track.segment.log_probs, _grad(backend, stack, track)


class _Redness:
    """A differentiable reward (`score_differentiable`): minus the mean squared distance of the
    image to a colour the prompt picks."""

    def score_differentiable(self, images, prompts, metadata):
        target = torch.stack([torch.full((3, 1, 1), 0.2 if "red" in p else 0.8) for p in prompts])
        return -((images - target) ** 2).mean(dim=(1, 2, 3))


def _kept_setup(sp: int | None) -> tuple[torch.Tensor, float]:
    """A tiny FLUX.1's Flow-GRPO update from the graphs kept by its rollout under Ulysses degree
    `sp` (None: one process, replaying instead): (gradient, fraction of SDE steps kept)."""
    from unirl.algorithms.flow_grpo import FlowGRPO, FlowGRPOConfig
    from unirl.models.flow.stage import FlowMatchingStage
    from unirl.models.flux import FluxModelConfig, TinyFluxConfig
    from unirl.rollout.trainside import TrainsideEngine
    from unirl.sde.schedules import sigmas_for
    from unirl.train.backend import LoRAConfig
    from unirl.train.fsdp import FSDPConfig
    from unirl.train.stack import TrainStack, TrainStackConfig
    from unirl.types import DiffusionSamplingParams, PromptExample, RolloutReq

    torch.manual_seed(0)
    tiny = TinyFluxConfig(
        resolution=16, num_attention_heads=4, attention_head_dim=16, clip_max_length=8, seed=0
    )
    bundle = FluxModelConfig(tiny=tiny).build()
    stage = FlowMatchingStage(bundle, replay_steps_per_forward=2)
    blocks = ["FluxTransformerBlock", "FluxSingleTransformerBlock"]
    fsdp = FSDPConfig(block_classes=blocks) if sp else None
    lora = LoRAConfig(rank=4, alpha=8, target_modules=["to_q", "to_k", "to_v"])
    backend = _backend(stage.module, lora, fsdp, sp)
    stage.module = backend.module
    stack = TrainStack(stage, backend, FlowGRPO(FlowGRPOConfig(clip_range=0.2)), TrainStackConfig(2))
    params = DiffusionSamplingParams(
        num_steps=4, samples_per_prompt=2, height=16, width=16, guidance_scale=3.5, eta=0.7,
        max_sequence_length=8, sde_scheduler="all",
    )  # fmt: skip
    prompts = [PromptExample("a red square", "0"), PromptExample("a blue dot", "1")]
    req = RolloutReq.from_prompts(prompts, params, sigmas_for(params, bundle.image_seq_len(16, 16)), 0)
    engine = TrainsideEngine(stage, forward_batch_size=4, keep_graph=sp is not None)
    track = engine.generate(req, keep=sp is not None).track("diffusion")
    track.advantages = torch.linspace(-1.0, 1.0, 4)
    if sp is None:
        return _grad(backend, stack, track), 0.0
    seen, step = {}, backend.optimizer_step

    def recording_step():  # the update's gradient, read just before the optimizer step
        seen["grad"] = torch.cat([p.grad.full_tensor().flatten() for p in backend.params])
        return step()

    backend.optimizer_step = recording_step
    metrics = stack.train_track(track, 0.0, kept=engine.kept)
    return seen["grad"], metrics["keep_graph/kept_fraction"]


def _draft_setup(sp: int | None) -> torch.Tensor:
    """A tiny SD3's DRaFT-K update (K = 2, reward backpropagated through the decoded image) under
    Ulysses degree `sp` (None: one process): its LoRA gradient."""
    from tests.conftest import tiny_model_config
    from unirl.algorithms.draft import DRaFT, DRaFTConfig
    from unirl.models.flow.stage import FlowMatchingStage
    from unirl.rollout.trainside import TrainsideEngine
    from unirl.sde.schedules import sigmas_for
    from unirl.train.backend import LoRAConfig
    from unirl.train.fsdp import FSDPConfig
    from unirl.train.stack import TrainStack, TrainStackConfig
    from unirl.types import DiffusionSamplingParams, PromptExample, RolloutReq

    torch.manual_seed(0)
    bundle = tiny_model_config(num_layers=2).build()
    stage = FlowMatchingStage(bundle, store_trajectory=True, detach_uncond=False)
    fsdp = FSDPConfig(block_classes=["JointTransformerBlock"]) if sp else None
    backend = _backend(stage.module, LoRAConfig(rank=4, alpha=8), fsdp, sp)
    stage.module = backend.module
    stack = TrainStack(stage, backend, DRaFT(_Redness(), DRaFTConfig(steps=2)), TrainStackConfig(2))
    params = DiffusionSamplingParams(
        num_steps=4, samples_per_prompt=2, height=16, width=16, guidance_scale=2.0, eta=0.0, shift=1.0,
        max_sequence_length=8,
    )  # fmt: skip
    prompts = [PromptExample("a red square", "0"), PromptExample("a blue dot", "1")]
    req = RolloutReq.from_prompts(prompts, params, sigmas_for(params, bundle.image_seq_len(16, 16)), 0)
    track = TrainsideEngine(stage, forward_batch_size=4).generate(req).track("diffusion")
    track.advantages = torch.zeros(4)
    return _grad(backend, stack, track)


def _family_rank(rank: int, rdzv: str, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    join_gloo(rank, 2, rdzv)
    try:
        out = {family: _family_setup(family, 2) for family in ("wan", "qwenimage")}
        out["kept"] = _kept_setup(2)
        out["draft"] = _draft_setup(2)
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_wan_qwen_image_kept_graphs_and_reward_backprop_under_sp_2_match_unsharded(tmp_path):
    """One group of 2 gloo ranks samples the same log-probs and trains the same gradient as one
    process (1e-5): the other families with diffusers' context-parallel plan (Wan's video tokens
    with its rotary embedding and cross-attention; Qwen-Image's joint stream); FLUX.1's update from
    the rollout's kept graphs (every SDE step kept); SD3's DRaFT-K, whose reward backpropagates
    through the gathered image into every rank's token shard."""
    reference = {family: _family_setup(family, None) for family in ("wan", "qwenimage")}
    kept_reference, _ = _kept_setup(None)
    draft_reference = _draft_setup(None)
    spawn_ranks(_family_rank, (str(tmp_path), str(tmp_path)), 2)

    def rel(got, want):
        assert float(want.norm()) > 0
        return float((got - want).norm() / want.norm())

    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for family, (log_probs, grad) in reference.items():
            torch.testing.assert_close(got[family][0], log_probs, rtol=0, atol=1e-5)
            assert rel(got[family][1], grad) < 1e-5, (rank, family)
        kept_grad, kept_fraction = got["kept"]
        assert kept_fraction == 1.0
        assert rel(kept_grad, kept_reference) < 1e-5, rank
        assert rel(got["draft"], draft_reference) < 1e-5, rank


def test_sd3_under_sp_keeps_its_text_whole_so_any_text_length_validates(tmp_path):
    """SD3's plan splits only the image tokens: a T5 budget no degree divides passes; its heads
    and image tokens are still checked."""
    from tests.recipes import composed
    from unirl.config.validate import ConfigError, validate_recipe

    sd3 = ["num_steps=2", "launcher=ray", "num_devices=2", "+train.parallel.sp=2"]
    validate_recipe(
        composed("diffusion/tiny_sd3_flowgrpo", tmp_path, *sd3, "sampling.max_sequence_length=7"),
        expect="diffusion",
    )
    heads = composed("diffusion/tiny_sd3_flowgrpo", tmp_path, *sd3, "model.tiny.num_attention_heads=3")
    with pytest.raises(ConfigError, match=re.escape("does not divide the transformer's 3 attention heads")):
        validate_recipe(heads, expect="diffusion")


def test_a_text_only_causal_lm_takes_sp_and_a_vision_language_model_is_refused():
    from unirl.models.causal_lm import TinyLMConfig, TinyVLMConfig
    from unirl.models.qwen import QwenConfig
    from unirl.models.qwen_vl import QwenVLConfig
    from unirl.train.sequence_parallel import cp_plan_problem

    lm = QwenConfig(tiny=TinyLMConfig(num_attention_heads=4, num_key_value_heads=2)).trainable_on_meta()
    assert cp_plan_problem(lm, 4) is None  # key / value heads repeated to the query heads
    assert cp_plan_problem(lm, 3) == (
        "train.parallel.sp=3 does not divide the transformer's 4 attention heads; valid values (also dividing "
        "num_devices): [1, 2, 4]"
    )
    vlm = QwenVLConfig(tiny=TinyVLMConfig()).trainable_on_meta()
    assert "is a vision-language model (set train.parallel.sp=1)" in cp_plan_problem(vlm, 2)


def test_causal_lm_sp_with_activation_checkpointing_is_refused(tmp_path):
    """Checkpointed decoder layers would recompute their attention in backward, outside the
    sharded replay's attention function: refused before Ray, naming both keys."""
    from tests.recipes import composed
    from unirl.config.validate import ConfigError, validate_recipe

    lm = ["launcher=ray", "num_devices=2", "+train.parallel.sp=2", "train.fsdp.activation_checkpointing=true"]
    with pytest.raises(
        ConfigError, match=re.escape("with train.fsdp.activation_checkpointing=true on a causal LM")
    ):
        validate_recipe(composed("llm/tiny_lm_grpo", tmp_path, *lm), expect="text")
