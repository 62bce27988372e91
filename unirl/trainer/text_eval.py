"""Held-out evaluation of a causal LM: greedy exact match, and pass@1 / pass@k at a sampling
temperature, overall and broken down by metadata keys (an operation, an operand length).

Two deterministic requests over the held-out examples: one greedy sample per prompt
(temperature 0), and `pass_k` samples per prompt at `temperature` from seeds derived
from `seed`, so the same weights always give the same numbers. A sample is correct when
the scorer (any text reward scorer, `scorer(RewardRequest) -> [B]`, 1 meaning right)
gives it more than 0.5. Keys (the driver prefixes `eval/`):

- `accuracy/greedy`, `accuracy/greedy/<key>=<value>` per `group_by` key;
- `accuracy/pass@1` (mean fraction correct of the k samples) and `accuracy/pass@<j>` for
  j = 2, 4, ... up to `pass_k` (the unbiased estimator 1 - C(n-c, j) / C(n, j) from the
  n = pass_k samples), with `accuracy/pass@1/<key>=<value>` and `accuracy/pass@<k>/<key>=<value>`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Annotated, Any

import torch
from annotated_types import Ge, doc

from unirl.types.constraints import AtLeastOne, check_fields
from unirl.types.reward import RewardRequest
from unirl.types.rollout_req import PromptExample, RolloutReq
from unirl.types.sampling import Temperature, TextSamplingParams, TopK, TopP


@dataclass
class TextEvalSampling:
    """How text evaluation samples.

    Attributes:
        max_new_tokens, stop_tokens, max_prompt_length, chat_template: as the
            training sampling (`TextSamplingParams`); set them to the recipe's.
        temperature, top_p, top_k: the pass@k sampling (the training temperature).
        pass_k: samples per prompt for pass@1 / pass@k (0: greedy only).
        seed: base seed of the sampled request.
        group_by: metadata keys to break accuracies down by (e.g. [op, digits]).
        forward_batch_size: samples per generation forward on each worker.
    """

    max_new_tokens: AtLeastOne = 16
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = 0
    pass_k: Annotated[int, Ge(0), doc("0: greedy only")] = 16
    stop_tokens: list[str] = field(default_factory=list)
    max_prompt_length: AtLeastOne = 64
    chat_template: bool = False
    seed: int = 1234
    group_by: list[str] = field(default_factory=list)
    forward_batch_size: AtLeastOne | None = 256

    def __post_init__(self) -> None:
        self.stop_tokens, self.group_by = list(self.stop_tokens), list(self.group_by)
        check_fields(self, "eval.sampling.")

    def params(self, temperature: float, samples_per_prompt: int) -> TextSamplingParams:
        """The sampling of `samples_per_prompt` samples per prompt at `temperature`; every other
        key the training sampling has is this config's own of that name."""
        shared = {f.name: getattr(self, f.name) for f in fields(TextSamplingParams) if hasattr(self, f.name)}
        return TextSamplingParams(
            **{**shared, "temperature": temperature, "samples_per_prompt": samples_per_prompt}
        )


def eval_requests(examples: list[PromptExample], cfg: TextEvalSampling) -> dict[str, RolloutReq]:
    """{"greedy": one temperature-0 sample per example, "sampled": `pass_k` per example (when > 0)}."""
    reqs = {"greedy": RolloutReq.from_prompts(examples, cfg.params(0.0, 1), None, rollout_id=0)}
    if cfg.pass_k > 0:
        reqs["sampled"] = RolloutReq.from_prompts(examples, cfg.params(cfg.temperature, cfg.pass_k), None, 1)
    return reqs


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def _correct(scorer: Any, req: RolloutReq, texts: list[str]) -> list[bool]:
    scores = scorer(
        RewardRequest(
            sample_ids=list(req.sample_ids), prompts=list(req.prompts), texts=texts, metadata=req.metadata
        )
    )
    scores = torch.as_tensor(scores, dtype=torch.float64)
    if scores.shape != (len(texts),) or not bool(torch.isfinite(scores).all()):
        raise ValueError(
            f"the eval scorer must return {len(texts)} finite scores, got {scores.tolist()[:8]}..."
        )
    return [bool(s > 0.5) for s in scores]


def _groups(examples: list[PromptExample], keys: list[str]) -> dict[str, list[int]]:
    """ "<key>=<value>" -> example indices, for every group_by key."""
    out: dict[str, list[int]] = {}
    for key in keys:
        for i, ex in enumerate(examples):
            if key not in ex.metadata:
                raise ValueError(
                    f"eval.sampling.group_by: example {ex.prompt_id!r} has no metadata key {key!r}"
                )
            out.setdefault(f"{key}={ex.metadata[key]}", []).append(i)
    return dict(sorted(out.items()))


def text_accuracies(
    reqs: dict[str, RolloutReq],
    texts: dict[str, list[str]],
    examples: list[PromptExample],
    scorer: Any,
    cfg: TextEvalSampling,
) -> dict[str, float]:
    """The accuracies of the module docstring from the responses `texts[name]` to `reqs[name]`."""
    groups = _groups(examples, cfg.group_by)
    greedy = _correct(scorer, reqs["greedy"], texts["greedy"])
    out = {"accuracy/greedy": sum(greedy) / len(greedy)}
    for name, idx in groups.items():
        out[f"accuracy/greedy/{name}"] = sum(greedy[i] for i in idx) / len(idx)
    if "sampled" in reqs:
        n = cfg.pass_k
        flat = _correct(scorer, reqs["sampled"], texts["sampled"])
        counts = [sum(flat[i * n : (i + 1) * n]) for i in range(len(examples))]
        ks = sorted({1, n, *(2**j for j in range(1, n.bit_length()) if 2**j <= n)})
        for k in ks:
            out[f"accuracy/pass@{k}"] = sum(pass_at_k(n, c, k) for c in counts) / len(counts)
        for name, idx in groups.items():
            for k in sorted({1, n}):
                out[f"accuracy/pass@{k}/{name}"] = sum(pass_at_k(n, counts[i], k) for i in idx) / len(idx)
    return out


class LMEvaluator:
    """`evaluator(bundle) -> dict`: the accuracies of a causal-LM bundle on held-out examples
    (supervised training and `python -m unirl.evaluate` use it): the run's
    `unirl.trainer.evaluation.Evaluator` over a sampler in this process, so a checkpoint scores as
    the run that trained it evaluated.

    Args:
        examples: held-out prompts (metadata holding what the scorer checks), or a dataset
            holding them in `.examples`.
        scorer: a text reward scorer, 1 meaning correct.
        eval_sampling: the requests' settings.
    """

    def __init__(self, examples: Any, scorer: Any, eval_sampling: TextEvalSampling | None = None) -> None:
        self.examples: list[PromptExample] = list(getattr(examples, "examples", examples))
        self.scorer = scorer
        self.eval_sampling = eval_sampling or TextEvalSampling()

    @torch.no_grad()
    def __call__(self, bundle: Any) -> dict[str, float]:
        from unirl.models.causal_lm import CausalLMStage
        from unirl.rollout.trainside import TrainsideEngine
        from unirl.trainer.evaluation import Evaluator

        engine = TrainsideEngine(CausalLMStage(bundle), self.eval_sampling.forward_batch_size)
        evaluator = Evaluator(self.examples, self.scorer, self.eval_sampling)
        return evaluator.run(lambda req: engine.generate(req).track(engine.track_name).texts)
