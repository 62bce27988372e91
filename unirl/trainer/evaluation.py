"""Deterministic evaluation on held-out prompts: `Evaluator`, the one evaluation of every kind of
run (a single track, a chain of tracks, a shared backbone's), and the image side's parts.

Sampling is deterministic: images are an ODE (eta = 0) from fixed per-sample seeds, a chain's
root decodes greedily, a text track's pass@k draws from fixed seeds; the same weights always
give the same numbers. A scorer's `evaluate(images, prompts) -> dict[str, float]` turns images
into accuracies; a text track's accuracies are `unirl.trainer.text_eval.text_accuracies`.
`unirl.evaluate` scores a checkpoint's bundle with the same requests (`BundleEvaluator`,
`text_eval.LMEvaluator`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch
from omegaconf import OmegaConf

from unirl.models.flow.stage import FlowMatchingStage
from unirl.models.stage import DiffusionStage
from unirl.rollout.trainside import TrainsideEngine
from unirl.sde.schedules import schedule_tokens, sigmas_for
from unirl.trainer.text_eval import TextEvalSampling, eval_requests, text_accuracies
from unirl.types.constraints import AtLeastOne, check_fields
from unirl.types.reward import RewardRequest
from unirl.types.rollout_req import PromptExample, RolloutReq
from unirl.types.sampling import DiffusionSamplingParams, Guidance


class Scorer(Protocol):
    """Anything with `evaluate(images uint8 [B, 3, H, W], prompts) -> dict[str, float]`; a scorer
    with `reads_metadata = True` is called `evaluate(images, prompts, metadata)` with each image's
    prompt row's metadata (an edit scorer reads the row's source image there)."""

    def evaluate(self, images: torch.Tensor, prompts: list[str]) -> dict[str, float]: ...


def score_images(scorer: Scorer, images: torch.Tensor, req: RolloutReq) -> dict[str, float]:
    """`scorer.evaluate` of the images sampled for `req`, one per sample in order, given the
    request's metadata when the scorer reads it (`reads_metadata`)."""
    if getattr(scorer, "reads_metadata", False):
        return scorer.evaluate(images, list(req.prompts), list(req.metadata))
    return scorer.evaluate(images, req.prompts)


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
    examples: list[PromptExample], base: DiffusionSamplingParams, cfg: EvalSampling, model_info: dict
) -> RolloutReq:
    """The deterministic evaluation request: every example x `samples_per_prompt`,
    Euler sampling (eta 0) with the evaluation steps, guidance, seeds and size; `model_info` is the
    model's (its schedule's token count: `unirl.sde.schedules.schedule_tokens`)."""
    sp = eval_params(base, cfg)
    return RolloutReq.from_prompts(
        examples, sp, sigmas_for(sp, schedule_tokens(sp, model_info)), rollout_id=0
    )


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
) -> tuple[torch.Tensor, RolloutReq]:
    """([N, 3, H, W] uint8 images, the request that sampled them, one sample each) for every
    example x samples_per_prompt, deterministic."""
    info = stage.model_info()
    req = eval_request(examples, base, cfg, info)
    track = TrainsideEngine(stage, cfg.forward_batch_size).generate(req).track("diffusion")
    return track.media, req


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
        """Scores a flow-matching bundle (a `FlowFamily`) through the shared `FlowMatchingStage`,
        with the request a run's image evaluation sends (`eval_request`)."""
        images, req = sample_eval_images(
            FlowMatchingStage(bundle), self.examples, self.sampling, self.eval_sampling
        )
        return score_images(self.scorer, images, req)


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


FEEDS = {"rewrite": "", "user": "floor/", "canonical": "ceiling/"}


@dataclass
class Evaluator:
    """The held-out evaluation of a run (its `eval`, `unirl.config.run.EvalConfig`): the examples
    sampled deterministically through the run's tracks on the workers, the leaf's output scored.

    `run(sample, leaf, references)` asks the driver's `sample` for the workers' outputs:
    - a single track (`chain` None): `sample(req)` -> its [n, 3, H, W] uint8 images or n texts.
      An image track's keys are its scorer's `evaluate(images, prompts)` of the ODE images of
      every example x `sampling.samples_per_prompt` (at `sampling`'s size, if set; `leaf` is the
      track's `ImageModality`: its rollouts' sampling and the model's pixels per token); a text
      track's are greedy exact match and pass@k (`text_eval.text_accuracies`).
    - a chain (`chain` = (leaf track, its evaluation sampling)): user prompts -> the root's greedy
      texts -> the leaf's images, `sample(req, samplings, feed)` -> (root texts, leaf images).
      Keys: the scorer's `evaluate(images, intents)` (the intent of an image is its user prompt's
      `metadata[intent_key]`: the scene the user asked for), `accuracy_strict/<key>=<value>` per
      `group_by` key, `rewrite/accuracy` (and per group) when a `rewrite_scorer` (a text reward
      scorer, 1 = right) judges the root's texts, and with `references` (the step-0 row) the same
      keys under `floor/` (the user prompt fed straight to the leaf) and `ceiling/` (the intent
      fed to it).
    """

    examples: list[PromptExample]
    scorer: Any
    sampling: Any
    use_ema: bool = False
    chain: tuple[str, Any] | None = None
    text_sampling: TextEvalSampling | None = None
    intent_key: str = "canonical"
    rewrite_scorer: Any = None
    group_by: list[str] = field(default_factory=list)
    references: bool = True

    def __post_init__(self) -> None:
        self.group_by = list(self.group_by)
        missing = [ex.prompt_id for ex in self.examples if self.intent_key not in ex.metadata]
        if self.chain is not None and missing:
            raise ValueError(
                f"eval.examples: {len(missing)} example(s) lack metadata[{self.intent_key!r}] (eval.intent_key), "
                f"e.g. {missing[:3]}"
            )

    @classmethod
    def from_config(cls, node: Any, leaf: str | None = None, leaf_sampling: Any = None) -> Evaluator:
        """Build from a recipe's `eval` node. A chain names its `leaf` track: its evaluation
        sampling is `eval.sampling` over `leaf_sampling` (a diffusion leaf's sampling params: seeded
        Euler ODE steps, `eval_params`), or `eval.sampling` itself (None: a shared backbone's
        `ImageTokenSamplingParams`). A single track (`leaf` None) samples with `eval.sampling`."""
        from unirl.trainer.worker import build

        ev = OmegaConf.to_container(node, resolve=True)  # validated: `unirl.config.run.EvalConfig`
        examples, sampling = build(ev["examples"]), build(ev["sampling"])
        chain = None
        if leaf is not None:
            chain = (leaf, sampling if leaf_sampling is None else eval_params(leaf_sampling, sampling))
        return cls(
            list(getattr(examples, "examples", examples)),
            build(ev["scorer"]),
            sampling,
            bool(ev.get("use_ema", False)),
            chain,
            build(ev.get("text_sampling")),
            ev.get("intent_key", "canonical"),
            build(ev.get("rewrite_scorer")),
            ev.get("group_by", []),
            bool(ev.get("references", True)),
        )

    def run(self, sample, leaf: Any = None, references: bool = False) -> dict[str, float]:
        """The metrics of the class docstring (the driver prefixes `eval/`)."""
        if self.chain is not None:
            return self._chain(sample, references)
        if isinstance(self.sampling, TextEvalSampling):
            reqs = eval_requests(self.examples, self.sampling)
            texts = {name: sample(req) for name, req in reqs.items()}
            return text_accuracies(reqs, texts, self.examples, self.scorer, self.sampling)
        req = eval_request(self.examples, leaf.sampling, self.sampling, leaf.model_info)
        return score_images(self.scorer, sample(req), req)

    def _groups(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for key in self.group_by:
            for i, ex in enumerate(self.examples):
                out.setdefault(f"{key}={ex.metadata.get(key)}", []).append(i)
        return out

    def _chain(self, sample, references: bool) -> dict[str, float]:
        req = RolloutReq.from_prompts(self.examples, self.text_sampling.params(0.0, 1), None, rollout_id=0)
        intents = [m[self.intent_key] for m in req.metadata]
        groups = self._groups()
        leaf, leaf_sampling = self.chain
        out: dict[str, float] = {}
        feeds = ["rewrite"] + (["user", "canonical"] if references and self.references else [])
        for feed in feeds:
            prefix = FEEDS[feed]
            texts, images = sample(req, {leaf: leaf_sampling}, feed)
            per = images.shape[0] // len(req)
            wanted = [x for x in intents for _ in range(per)]
            out.update({prefix + k: v for k, v in self.scorer.evaluate(images, wanted).items()})
            for name, idx in groups.items():
                rows = [i * per + j for i in idx for j in range(per)]
                part = self.scorer.evaluate(images[torch.tensor(rows)], [wanted[r] for r in rows])
                out[f"{prefix}accuracy_strict/{name}"] = part["accuracy_strict"]
            if feed == "rewrite" and self.rewrite_scorer is not None:
                right = (
                    self.rewrite_scorer(
                        RewardRequest(
                            sample_ids=list(req.sample_ids),
                            prompts=list(req.prompts),
                            texts=texts,
                            metadata=req.metadata,
                        )
                    )
                    > 0.5
                )
                out["rewrite/accuracy"] = right.float().mean().item()
                for name, idx in groups.items():
                    out[f"rewrite/accuracy/{name}"] = right[torch.tensor(idx)].float().mean().item()
        return out
