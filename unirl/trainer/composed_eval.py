"""Held-out evaluation of a composed run: user prompts -> greedy rewrites -> ODE images, scored
against the user's intent.

Deterministic: the root stage decodes greedily (temperature 0) and the image stage samples
Euler ODE steps from fixed seeds (`unirl.trainer.evaluation.eval_params`), so the same weights
give the same numbers. Keys (the driver prefixes `eval/`):

- the image scorer's `evaluate(images, intents)` keys (e.g. `accuracy_strict`,
  `accuracy/<category>`), where the intent of each image is its user prompt's
  `metadata[intent_key]` (the canonical prompt of the scene the user asked for);
- `accuracy_strict/<key>=<value>` per `group_by` metadata key (e.g. slice=heldout);
- `rewrite/accuracy` (and per group) when a `rewrite_scorer` (a text reward scorer, 1 = right)
  judges the greedy rewrites themselves;
- with references (the step-0 row): `floor/...` (the user prompt fed straight to the image
  model) and `ceiling/...` (the canonical prompt fed to it), the same keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from omegaconf import OmegaConf

from unirl.trainer.evaluation import eval_params
from unirl.trainer.text_eval import TextEvalSampling
from unirl.trainer.worker import build
from unirl.types.reward import RewardRequest
from unirl.types.rollout_req import PromptExample, RolloutReq


@dataclass
class ComposedEvalConfig:
    """`eval` of a composed recipe (run by `unirl.trainer.composed_eval.ComposedEval`).

    Attributes:
        examples: held-out user prompts (a `_target_` node: a list of `PromptExample`s or a
            dataset holding them in `.examples`); each carries `metadata[intent_key]`.
        scorer: the image scorer (`evaluate(images, prompts) -> dict`), e.g. `GenEvalMini`.
        text_sampling: how the root stage decodes (`TextEvalSampling`; greedy is used).
        sampling: how the image stage samples (`EvalSampling`).
        every_n_steps: evaluate every this many steps (0: never) and at the end.
        intent_key: metadata key of the scene the user asked for (scored against).
        rewrite_scorer: optional text scorer of the rewrites (`scorer(RewardRequest) -> [B]`).
        group_by: metadata keys to break the strict accuracy down by.
        references: also measure the floor and the ceiling at step 0.
    """

    examples: Any
    scorer: Any
    text_sampling: Any
    sampling: Any
    every_n_steps: int = 0
    intent_key: str = "canonical"
    rewrite_scorer: Any = None
    group_by: list[str] = field(default_factory=list)
    references: bool = True

    def __post_init__(self) -> None:
        if self.every_n_steps < 0:
            raise ValueError(f"eval.every_n_steps must be >= 0, got {self.every_n_steps}")
        for key in ("examples", "scorer", "text_sampling", "sampling", "rewrite_scorer"):
            value = getattr(self, key)
            if (value is not None or key != "rewrite_scorer") and not (
                isinstance(value, dict) and "_target_" in value
            ):
                raise ValueError(f"eval.{key} must be a _target_ node naming its class, got {value!r}")


FEEDS = {"rewrite": "", "user": "floor/", "canonical": "ceiling/"}


class ComposedEval:
    """Runs `ComposedEvalConfig` through `sample(req, samplings, feed) -> (texts, images)`."""

    def __init__(
        self,
        examples: list[PromptExample],
        scorer: Any,
        text_sampling: TextEvalSampling,
        image_sampling: dict,
        intent_key: str,
        rewrite_scorer: Any,
        group_by: list[str],
        references: bool,
    ) -> None:
        self.examples = examples
        self.scorer = scorer
        self.text_sampling = text_sampling
        self.image_sampling = image_sampling
        self.intent_key = intent_key
        self.rewrite_scorer = rewrite_scorer
        self.group_by = list(group_by)
        self.references = references
        missing = [ex.prompt_id for ex in examples if intent_key not in ex.metadata]
        if missing:
            raise ValueError(
                f"eval.examples: {len(missing)} example(s) lack metadata[{intent_key!r}] (eval.intent_key), "
                f"e.g. {missing[:3]}"
            )

    @classmethod
    def from_config(cls, node: Any, leaf: str, leaf_sampling: Any = None) -> ComposedEval:
        """Build from the recipe's `eval` node for a chain whose images come from track `leaf`:
        its evaluation sampling is `eval.sampling` over `leaf_sampling` (a diffusion leaf's
        sampling params: seeded Euler ODE steps, `eval_params`), or `eval.sampling` itself (None:
        a shared backbone's `ImageTokenSamplingParams`)."""
        cfg = ComposedEvalConfig(**OmegaConf.to_container(node, resolve=True))
        examples = build(cfg.examples)
        sampling = build(cfg.sampling)
        return cls(
            list(getattr(examples, "examples", examples)),
            build(cfg.scorer),
            build(cfg.text_sampling),
            {leaf: sampling if leaf_sampling is None else eval_params(leaf_sampling, sampling)},
            cfg.intent_key,
            build(cfg.rewrite_scorer),
            cfg.group_by,
            cfg.references,
        )

    def _groups(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for key in self.group_by:
            for i, ex in enumerate(self.examples):
                out.setdefault(f"{key}={ex.metadata.get(key)}", []).append(i)
        return out

    def run(self, sample, references: bool = False) -> dict[str, float]:
        """The metrics (see the module docstring); `references` adds the floor and the ceiling."""
        req = RolloutReq.from_prompts(self.examples, self.text_sampling.params(0.0, 1), None, rollout_id=0)
        intents = [m[self.intent_key] for m in req.metadata]
        groups = self._groups()
        out: dict[str, float] = {}
        feeds = ["rewrite"] + (["user", "canonical"] if references and self.references else [])
        for feed in feeds:
            prefix = FEEDS[feed]
            texts, images = sample(req, self.image_sampling, feed)
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
