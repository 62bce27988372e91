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
from unirl.types.constraints import AtLeastOne, check_fields
from unirl.types.reward import RewardRequest
from unirl.types.rollout_req import PromptExample, RolloutReq
from unirl.types.sampling import DiffusionSamplingParams, Guidance


class Scorer(Protocol):
    """Anything with `evaluate(images uint8 [B, 3, H, W], prompts) -> dict[str, float]`."""

    def evaluate(self, images: torch.Tensor, prompts: list[str]) -> dict[str, float]: ...


@dataclass
class EvalSampling:
    """How evaluation samples: `num_steps` Euler steps (eta 0), CFG `guidance_scale`,
    `samples_per_prompt` images per prompt from seeds derived from `seed`, at `height` x `width`
    pixels (null: the rollouts' `sampling.height` / `sampling.width`).

    Decoupled resolution: rollouts and training at `sampling`'s size, evaluation at another (RL
    gains at a lower resolution carry over to the full one, and a transformer's cost grows with
    the square of its token count). The validator checks both sizes against the model family's
    geometry (`FlowModelConfig.size_problems`). The sigma schedule is pinned for the evaluation
    size (its token count sets a dynamic shift)."""

    num_steps: AtLeastOne = 20
    guidance_scale: Guidance = 1.0
    samples_per_prompt: AtLeastOne = 1
    seed: int = 1234
    forward_batch_size: AtLeastOne | None = 64
    height: AtLeastOne | None = None
    width: AtLeastOne | None = None

    def __post_init__(self) -> None:
        check_fields(self, "eval.sampling.")


def eval_request(
    examples: list[PromptExample], base: DiffusionSamplingParams, cfg: EvalSampling, cell: int
) -> RolloutReq:
    """The deterministic evaluation request: every example x `samples_per_prompt`,
    Euler sampling (eta 0) with the evaluation steps, guidance, seeds and size; `cell` is the
    model's pixels per denoiser token along a side (vae_scale_factor x patch_size)."""
    sp = eval_params(base, cfg)
    image_seq_len = (sp.height // cell) * (sp.width // cell)
    return RolloutReq.from_prompts(examples, sp, sigmas_for(sp, image_seq_len), rollout_id=0)


def eval_params(base: DiffusionSamplingParams, cfg: EvalSampling) -> DiffusionSamplingParams:
    """`base` made deterministic for evaluation: Euler ODE (eta 0) with `cfg`'s steps, guidance,
    samples per prompt, seed and size (the rollouts' where `cfg.height` / `cfg.width` are null)."""
    return replace(
        base,
        height=cfg.height or base.height,
        width=cfg.width or base.width,
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
    req = eval_request(examples, base, cfg, info["vae_scale_factor"] * info["patch_size"])
    track = TrainsideEngine(stage, cfg.forward_batch_size).generate(req).track("diffusion")
    return track.media, track.prompts


class BundleEvaluator:
    """`evaluator(bundle) -> dict`: sample the eval prompts deterministically, then score.

    Args:
        examples: held-out prompts, or a dataset holding them in `.examples`
            (e.g. `ShapesDataset("eval")`).
        sampling: base sampling params (resolution, shift, token budget).
        scorer: scores images against prompts (e.g. `worlds.shapes.GenEvalMini`).
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


class RewardScorer:
    """An evaluation scorer from reward components: `evaluate(images, prompts)` ->
    `{name: mean score}` over every image and, with `examples`, `{name/<source>: mean}` over the
    images of each data source's prompts (`metadata[source_key]` of the example with that prompt).

    Args:
        components: name -> a reward scorer (`scorer(RewardRequest) -> [B]`, e.g.
            `unirl.reward.local.color.ColorTarget`).
        examples: the evaluation prompts (a list, or a data source holding them in `.examples`)
            whose metadata names their sources; None: no per-source means.
        source_key: the metadata key naming a prompt's data source.
    """

    def __init__(self, components: dict, examples: object = None, source_key: str = "source") -> None:
        if not components:
            raise ValueError("eval.scorer.components must name at least one reward scorer")
        self.components = dict(components)
        rows = list(getattr(examples, "examples", examples) or [])
        self.sources = {e.prompt: str(e.metadata.get(source_key)) for e in rows if source_key in e.metadata}

    def evaluate(self, images: torch.Tensor, prompts: list[str]) -> dict[str, float]:
        req = RewardRequest(
            sample_ids=[str(i) for i in range(len(prompts))], prompts=list(prompts), images=images
        )
        out: dict[str, float] = {}
        for name, scorer in self.components.items():
            scores = scorer(req).float()
            out[name] = float(scores.mean())
            for source in sorted(set(self.sources.values())):
                idx = [i for i, p in enumerate(prompts) if self.sources.get(p) == source]
                if idx:
                    out[f"{name}/{source}"] = float(scores[idx].mean())
        return out
