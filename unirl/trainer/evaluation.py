"""Deterministic evaluation of a diffusion model on held-out prompts. A causal LM's held-out
evaluation is `text_eval.py`; each modality (`modality.py`) builds its own eval requests, and
`unirl.evaluate` scores a checkpoint with either.

Sampling is an ODE (eta = 0) from fixed per-sample seeds, so the same weights
always give the same images and the same numbers; a scorer's `evaluate(images,
prompts) -> dict[str, float]` turns them into accuracies.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

import torch

from unirl.models.flow.stage import FlowMatchingStage
from unirl.models.stage import DiffusionStage
from unirl.rollout.trainside import TrainsideEngine
from unirl.sde.schedules import sigmas_for
from unirl.types.rollout_req import PromptExample, RolloutReq
from unirl.types.sampling import DiffusionSamplingParams


class Scorer(Protocol):
    """Anything with `evaluate(images uint8 [B, 3, H, W], prompts) -> dict[str, float]`."""

    def evaluate(self, images: torch.Tensor, prompts: list[str]) -> dict[str, float]: ...


@dataclass
class EvalSampling:
    """How evaluation samples: `num_steps` Euler steps (eta 0), CFG `guidance_scale`,
    `samples_per_prompt` images per prompt from seeds derived from `seed`."""

    num_steps: int = 20
    guidance_scale: float = 1.0
    samples_per_prompt: int = 1
    seed: int = 1234
    forward_batch_size: int | None = 64

    def __post_init__(self) -> None:
        for key in ("num_steps", "samples_per_prompt", "forward_batch_size"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ValueError(f"eval.sampling.{key} must be >= 1, got {value}")
        if self.guidance_scale < 1.0:
            raise ValueError(
                f"eval.sampling.guidance_scale must be >= 1.0 (1.0 disables CFG), got {self.guidance_scale}"
            )


def eval_request(
    examples: list[PromptExample], base: DiffusionSamplingParams, cfg: EvalSampling, image_seq_len: int
) -> RolloutReq:
    """The deterministic evaluation request: every example x `samples_per_prompt`,
    Euler sampling (eta 0) with the evaluation steps, guidance and seeds."""
    sp = eval_params(base, cfg)
    return RolloutReq.from_prompts(examples, sp, sigmas_for(sp, image_seq_len), rollout_id=0)


def eval_params(base: DiffusionSamplingParams, cfg: EvalSampling) -> DiffusionSamplingParams:
    """`base` made deterministic for evaluation: Euler ODE (eta 0) with `cfg`'s steps, guidance,
    samples per prompt and seed."""
    return replace(
        base,
        num_steps=cfg.num_steps,
        guidance_scale=cfg.guidance_scale,
        samples_per_prompt=cfg.samples_per_prompt,
        eta=0.0,
        seed=cfg.seed,
        same_initial_noise=False,
        sde_scheduler="all",  # eta 0: no SDE step; the training window need not fit num_steps
        ode_solver="euler",  # one sampler for every recipe's evaluation
        noise_all_steps=False,
    )


def sample_eval_images(
    stage: DiffusionStage, examples: list[PromptExample], base: DiffusionSamplingParams, cfg: EvalSampling
) -> tuple[torch.Tensor, list[str]]:
    """([N, 3, H, W] uint8 images, prompts) for every example x samples_per_prompt, deterministic."""
    info = stage.model_info()
    cell = info["vae_scale_factor"] * info["patch_size"]
    req = eval_request(examples, base, cfg, (base.height // cell) * (base.width // cell))
    track = TrainsideEngine(stage, cfg.forward_batch_size).generate(req).track("diffusion")
    return track.media, track.prompts


class BundleEvaluator:
    """`evaluator(bundle) -> dict`: sample the eval prompts deterministically, then score.

    Args:
        examples: held-out prompts, or a dataset holding them in `.examples`
            (e.g. `ShapesDataset("eval")`).
        sampling: base sampling params (resolution, shift, token budget).
        scorer: scores images against prompts (e.g. `unirl.shapes.GenEvalMini`).
        eval_sampling: steps, guidance and seeds of evaluation.
    """

    def __init__(
        self,
        examples: list[PromptExample] | object,
        sampling: DiffusionSamplingParams,
        scorer: Scorer,
        eval_sampling: EvalSampling | None = None,
    ) -> None:
        self.examples: list[PromptExample] = list(getattr(examples, "examples", examples))
        self.sampling = sampling
        self.scorer = scorer
        self.eval_sampling = eval_sampling or EvalSampling()

    @torch.no_grad()
    def __call__(self, bundle) -> dict[str, float]:
        """Scores a flow-matching bundle (a `FlowFamily`) through the shared `FlowMatchingStage`."""
        stage = FlowMatchingStage(bundle)
        images, prompts = sample_eval_images(stage, self.examples, self.sampling, self.eval_sampling)
        return self.scorer.evaluate(images, prompts)
