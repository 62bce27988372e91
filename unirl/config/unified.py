"""A unified-model recipe's shape, for the one validator (`unirl.config.validate`).

A unified recipe has one `model` (a family whose config has `modality: "unified"`), one
`train` node (the backbone's optimizer, LoRA, stack), a `rollout` (`UnifiedEngine`) whose
`tracks` are [plan, image], and `tracks.<name>` nodes (each a stage and sampling, a `weight`,
`trained`, and when trained an algorithm and advantage); `rewards.<image>` scores the images
(the plan's reward is its image's, plus `rewards.<plan>` when set). Its two tracks share one
backbone: the validator runs every one-track rule on each with the shared `model` and `train`
named at the root (`tracks`); `graph` checks the engine, the backbone's batch, LoRA and FSDP,
the rewards' metadata keys and the evaluation. Every problem names its key.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from omegaconf import DictConfig, OmegaConf

from unirl.config.engines import check_rollout
from unirl.config.references import check_metadata_key, check_scorer_keys, examples_of
from unirl.config.run import RunBase, TrainConfig, _components
from unirl.config.track import (
    TrackCheck,
    chain_of,
    chain_sections,
    check_trained_parts,
    own_group,
)
from unirl.config.tree import target_class
from unirl.sync.config import WeightSyncConfig
from unirl.types.constraints import NonNegative, check_fields
from unirl.types.sampling import ImageTokenSamplingParams, TextSamplingParams


@dataclass(kw_only=True)
class UnifiedRunConfig(RunBase):
    """The top level of a unified recipe: `RunBase`'s keys and

    Attributes:
        prompts_per_rollout: user prompts drawn per step (each planned and drawn
            `tracks.<plan>.sampling.samples_per_prompt` times: the BiCoT group).
        model: the unified model (`_target_` a family config with `modality: "unified"`).
        train: the backbone's train stack (`TrainConfig`).
        tracks: track name -> `SegmentConfig` node.
        rewards: track name -> a `RewardService` node (the image track's is required).
        rollout: a `unirl.rollout.unified.UnifiedEngine` node naming [plan, image] (the train
            workers sample), or a `DedicatedUnifiedEngine` (engine actors sample, fed by `weight_sync`).
        weight_sync: how the trainer's weights reach the dedicated engines (`WeightSyncConfig`).
    """

    model: Any
    train: Any
    rollout: Any
    tracks: dict[str, Any]
    rewards: dict[str, Any]
    weight_sync: Any = None

    COMPONENTS: ClassVar[tuple[str, ...]] = ("model", "rollout", "data_source")


@dataclass
class SegmentConfig:
    """`tracks.<name>`: one segment of the unified model's output.

    Attributes:
        stage, sampling: `_target_` nodes (the plan: a text stage and `TextSamplingParams`; the
            image: an image-token stage and `ImageTokenSamplingParams`).
        trained: train this segment (its loss term is in the joint step) or freeze it (no
            term, no gradient from it; it is still sampled).
        weight: w_s of the segment's loss in sum_s w_s L_s (> 0 when trained).
        algorithm, advantage: `_target_` nodes (trained segments only).
    """

    stage: Any
    sampling: Any
    trained: bool = True
    weight: NonNegative = 1.0
    algorithm: Any = None
    advantage: Any = None

    def __post_init__(self) -> None:
        _components("tracks.<name>.", self, ("stage", "sampling"), ("algorithm", "advantage"))
        check_fields(self)


def sections(cfg: DictConfig) -> dict[str, type]:
    """The plain sections of a unified recipe: the top level, checkpoint, logging, the backbone's
    train stack, eval, weight sync and each segment's node."""
    return chain_sections(
        cfg, UnifiedRunConfig, SegmentConfig, {"train": TrainConfig, "weight_sync": WeightSyncConfig}, {}
    )


def _check_rollout(cfg: DictConfig, passed: dict[str, Any], problems: list[str]) -> None:
    """`rollout` is a `UnifiedEngine` or a `DedicatedUnifiedEngine`; the engines' placement and
    weight sync (`check_rollout`), and the root request splits evenly over the engines."""
    from unirl.rollout.unified import DedicatedUnifiedEngine, UnifiedEngine

    engine = target_class(cfg, "rollout") if isinstance(cfg.get("rollout"), DictConfig) else None
    if engine is None:
        return
    if not (isinstance(engine, type) and issubclass(engine, UnifiedEngine | DedicatedUnifiedEngine)):
        problems.append(
            f"rollout: {cfg.rollout._target_} is not a unified engine; use unirl.rollout.unified.UnifiedEngine "
            "(the train workers sample) or unirl.rollout.unified.DedicatedUnifiedEngine (engine actors)"
        )
        return
    check_rollout(cfg, passed, problems)
    run, tracks = passed.get(""), list(cfg.rollout.get("tracks") or ["plan"])
    sampling = passed.get(f"tracks.{tracks[0]}.sampling")
    if issubclass(engine, DedicatedUnifiedEngine) and run is not None and isinstance(sampling, TextSamplingParams):
        engines = int(cfg.rollout.get("num_engines", 1))
        if (run.prompts_per_rollout * sampling.samples_per_prompt) % engines:
            problems.append(
                f"batch geometry: prompts_per_rollout ({run.prompts_per_rollout}) x tracks.{tracks[0]}.sampling."
                f"samples_per_prompt ({sampling.samples_per_prompt}) samples do not split evenly over "
                f"rollout.num_engines={engines}"
            )


def _segments(cfg: DictConfig) -> list[str] | None:
    """[plan, image] when the chain and the tracks.<name> nodes agree on them."""
    tracks, chain = cfg.get("tracks"), chain_of(cfg)
    if not isinstance(tracks, DictConfig) or len(chain) != 2 or not all(isinstance(t, str) for t in chain):
        return None
    return chain if sorted(tracks.keys()) == sorted(chain) else None


def tracks(cfg: DictConfig, passed: dict[str, Any], problems: list[str]) -> list[TrackCheck]:
    """The plan and image segments, after the rules that make them one model's two tracks (the
    model is unified, the chain names both, the image is scored, something trains with a weight
    > 0, each segment's sampling and stage are of its kind, a trained one has an algorithm);
    each segment's node holds the shared `model` and `train`, named at the root."""
    model = passed.get("model")
    if model is not None and getattr(model, "modality", None) != "unified":
        problems.append(
            f"model: {cfg.model._target_} is not a unified model (modality {getattr(model, 'modality', None)!r}); "
            "use one that writes text and draws images, e.g. unirl.models.janus.JanusModelConfig"
        )
        passed.pop("model")
    tracks, chain = cfg.get("tracks"), chain_of(cfg)
    if not isinstance(tracks, DictConfig) or len(chain) != 2 or not all(isinstance(t, str) for t in chain):
        problems.append(f"rollout.tracks: name the plan track then the image track, got {chain}")
        return []
    if _segments(cfg) is None:
        problems.append(
            f"rollout.tracks {chain} and the tracks.<name> nodes {list(tracks.keys())} disagree: give each of "
            "the plan and image tracks one tracks.<name> node"
        )
        return []
    plan, image = chain
    plan_sampling = passed.get(f"tracks.{plan}.sampling")
    plan_group = (  # an image's group is its prompt's plans, one image each
        (plan_sampling.samples_per_prompt, f"tracks.{plan}.sampling.samples_per_prompt")
        if isinstance(plan_sampling, TextSamplingParams)
        else None
    )
    walked: list[TrackCheck] = []
    shared = {k: OmegaConf.to_container(cfg[k], resolve=True) for k in ("model", "train") if cfg.get(k) is not None}
    rewards = cfg.get("rewards") or {}
    if image not in rewards:
        problems.append(f"rewards.{image}: the image track needs a reward (the plan's reward is its image's)")
    for name in rewards:
        if name not in chain:
            problems.append(f"rewards.{name}: scores track {name!r}, which does not exist; tracks: {chain}")
    trained = {n: bool(tracks[n].get("trained", True)) for n in chain}
    weights = {n: tracks[n].get("weight", 1.0) for n in chain}
    if not any(trained.values()):
        problems.append(
            f"tracks.{plan}.trained and tracks.{image}.trained are both false: nothing would train; train at "
            "least one segment (plan-only: freeze the image, image-only: freeze the plan)"
        )
    elif all(isinstance(w, int | float) and w == 0 for n, w in weights.items() if trained[n]):
        keys = " and ".join(f"tracks.{n}.weight" for n in chain if trained[n])
        problems.append(
            f"{keys}: the segment weights of the trained segments are all 0, so the joint loss is 0 and nothing "
            "trains; give a trained segment a weight > 0 (freeze a segment with tracks.<name>.trained: false)"
        )
    else:
        for n in chain:
            if trained[n] and isinstance(weights[n], int | float) and weights[n] == 0:
                problems.append(
                    f"tracks.{n}.weight is 0 but tracks.{n}.trained is true; set a weight > 0, or freeze the "
                    f"segment with tracks.{n}.trained: false"
                )
    kinds = {
        plan: (TextSamplingParams, "TextSamplingParams"),
        image: (ImageTokenSamplingParams, "ImageTokenSamplingParams"),
    }
    for n in chain:
        key, node = f"tracks.{n}", tracks[n]
        sampling = passed.get(f"{key}.sampling")
        kind, kind_name = kinds[n]
        if sampling is not None and not isinstance(sampling, kind):
            problems.append(
                f"{key}.sampling: the {'plan' if n == plan else 'image'} track samples with {kind_name}"
            )
        stage = target_class(node, "stage") if node.get("stage") is not None else None
        needs = "stop_token_ids" if n == plan else "image_context"
        if stage is not None and not hasattr(stage, needs):
            what = (
                "a text stage (unirl.models.causal_lm.CausalLMStage)" if n == plan else "an image-token stage"
            )
            problems.append(
                f"{key}.stage: {node.stage._target_} is not {what}; the {'plan' if n == plan else 'image'} "
                f"track needs one (see unirl/rollout/unified.py)"
            )
        if check_trained_parts(n, node, ("algorithm", "advantage"), (), problems):
            algorithm = target_class(node, "algorithm") if node.get("algorithm") is not None else None
            if algorithm is not None and getattr(algorithm, "modality", "text") != "text":
                problems.append(
                    f"{key}.algorithm: {node.algorithm._target_} is a {algorithm.modality} algorithm; both segments "
                    "are token sequences, use a text algorithm (e.g. unirl.algorithms.grpo.GRPO)"
                )
        # the segment's own keys under tracks.<name>; the backbone it shares (model, train) at the root
        walked.append(
            TrackCheck.chained(
                n,
                OmegaConf.create(OmegaConf.to_container(node, resolve=True) | shared),
                passed,
                "text" if isinstance(sampling, TextSamplingParams) else None,
                trained[n],
                {"model": "model", "train": "train", "reward": f"rewards.{n}"},
                own_group(sampling) if n == plan else plan_group,
            )
        )
    image_sampling = passed.get(f"tracks.{image}.sampling")
    if isinstance(image_sampling, ImageTokenSamplingParams) and image_sampling.samples_per_prompt != 1:
        problems.append(
            f"tracks.{image}.sampling.samples_per_prompt={image_sampling.samples_per_prompt}: a unified run draws one "
            f"image per plan (the group is the prompt's plans: set tracks.{plan}.sampling.samples_per_prompt); set it to 1"
        )
    return walked


def _check_geometry(cfg: DictConfig, passed: dict[str, Any], plan: str, problems: list[str]) -> None:
    """The backbone's batch: FSDP2 on more than one device, one mini-batch (the joint step), the
    root request (prompts x plans) split evenly over the devices and into micro-batches. (Its LoRA
    targets and FSDP blocks vs the model are the one-track module-tree rule.)"""
    run, stack, sampling = passed.get(""), passed.get("train.stack"), passed.get(f"tracks.{plan}.sampling")
    if run is None:
        return
    world = run.num_devices
    fsdp = passed.get("train.fsdp")
    if world > 1 and passed.get("train") is not None and fsdp is None:
        problems.append(
            f"train.fsdp: num_devices={world} needs FSDP2 settings for the backbone "
            "(e.g. {_target_: unirl.train.fsdp.FSDPConfig, block_classes: [LlamaDecoderLayer]})"
        )
    if stack is not None and stack.num_mini_batches != 1:
        problems.append(
            f"train.stack.num_mini_batches={stack.num_mini_batches}: one joint step holds both segments' whole batch; "
            "set it to 1"
        )
    if isinstance(sampling, TextSamplingParams):
        total = run.prompts_per_rollout * sampling.samples_per_prompt
        if total % world:
            problems.append(
                f"batch geometry: prompts_per_rollout ({run.prompts_per_rollout}) x tracks.{plan}.sampling."
                f"samples_per_prompt ({sampling.samples_per_prompt}) = {total} samples do not split evenly over "
                f"num_devices={world}"
            )
        elif stack is not None and (total // world) % stack.micro_batch_size:
            problems.append(
                f"train.stack.micro_batch_size={stack.micro_batch_size} does not divide each rank's batch of "
                f"{total // world} samples (prompts_per_rollout x tracks.{plan}.sampling.samples_per_prompt / "
                "num_devices)"
            )


def _check_eval(passed: dict[str, Any], problems: list[str]) -> None:
    """`eval`: the image sampling is `ImageTokenSamplingParams`, the greedy plans fit the model and
    stop on one-token stop tokens, and the scorers, `intent_key` and `group_by` find their keys in
    `eval.examples` (`eval.rewrite_scorer`, a text scorer, judges the greedy plans)."""
    from unirl.trainer.text_eval import TextEvalSampling

    ev = passed.get("eval")
    if ev is None:
        return
    sampling, text = passed.get("eval.sampling"), passed.get("eval.text_sampling")
    if sampling is not None and not isinstance(sampling, ImageTokenSamplingParams):
        problems.append("eval.sampling: a unified evaluation draws images with ImageTokenSamplingParams")
    if text is not None and not isinstance(text, TextEvalSampling):
        problems.append("eval.text_sampling: the plans decode with unirl.trainer.text_eval.TextEvalSampling")
    elif text is not None and passed.get("model") is not None:
        problems.extend(
            f"eval.text_sampling.{p.removeprefix('sampling.')}"
            for p in passed["model"].text_problems(text.params(0.0, 1))
        )
    held_out = examples_of(passed.get("eval.examples"))
    for scorer in ("eval.scorer", "eval.rewrite_scorer"):
        check_scorer_keys(passed, scorer, held_out, "eval.examples", problems)
    check_metadata_key("eval.intent_key", ev.intent_key, held_out, "eval.examples", problems)
    for name in ev.group_by:
        check_metadata_key("eval.group_by", name, held_out, "eval.examples", problems)


def graph(cfg: DictConfig, passed: dict[str, Any], problems: list[str]) -> None:
    """The engine, the backbone's batch, LoRA and FSDP, the rewards' metadata keys (what the
    engine adds to every image's metadata included) and the evaluation."""
    _check_rollout(cfg, passed, problems)
    segments = _segments(cfg)
    if segments is not None:
        _check_geometry(cfg, passed, segments[0], problems)
    train_examples = examples_of(passed.get("data_source"))
    if train_examples is not None:  # what the engine adds to every image's metadata
        key = (
            cfg.rollout.get("prompt_key", "user_prompt")
            if isinstance(cfg.get("rollout"), DictConfig)
            else None
        )
        train_examples = [
            dataclasses.replace(
                e, metadata={**e.metadata, key: e.prompt, "plan": "", "plan_truncated": False}
            )
            for e in train_examples
        ]
    for path in passed:
        if path.startswith("rewards.") and path.count(".") == 1:
            check_scorer_keys(passed, path, train_examples, "data_source", problems)
    _check_eval(passed, problems)


def missing(cfg: DictConfig) -> str | None:
    """A recipe run as unified without its model or tracks: what a unified recipe names."""
    if "tracks" in cfg and "model" in cfg:
        return None
    return (
        "model / tracks: a unified recipe names one model and its plan and image tracks "
        "(tracks.<name>: stage, sampling, weight, ...); see examples/unified/"
    )
