"""A composed (multi-track) recipe's shape, for the one validator (`unirl.config.validate`).

A composed recipe has `tracks.<name>` nodes (each a model, stage and sampling, and when
`trained` an algorithm, advantage and train stack), a `rollout` whose `tracks` list is the
chain (root first), and `rewards.<name>` scoring tracks (the leaf's is required; a parent's
own reward is optional and adds to the aggregate of its children's). `sections` types its
nodes; `tracks` checks that the chain and the nodes agree and each track's own model, stack and
engine, and returns the tracks the validator runs every one-track rule on (keys under
`tracks.<name>.`, a track's reward under `rewards.<name>`); `graph` checks the batch down the
chain and the metadata keys of the rewards and the evaluation.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, ClassVar

from omegaconf import DictConfig, OmegaConf

from unirl.config.critic import mini_batch_problem
from unirl.config.engines import check_rollout
from unirl.config.modality import modality_of
from unirl.config.references import check_metadata_key, check_scorer_keys, examples_of
from unirl.config.run import RunBase, TrainConfig, _components
from unirl.config.track import (
    TrackCheck,
    chain_of,
    chain_sections,
    check_trained_parts,
    own_group,
    track_view,
)
from unirl.config.tree import target_class
from unirl.rollout.dedicated import is_dedicated
from unirl.sync.config import WeightSyncConfig
from unirl.types.constraints import check_fields
from unirl.types.lineage import Aggregate
from unirl.types.sampling import TextSamplingParams


@dataclass(kw_only=True)
class ComposedRunConfig(RunBase):
    """The top level of a composed recipe: `RunBase`'s keys and

    Attributes:
        prompts_per_rollout: user prompts drawn per step (each rewritten
            `tracks.<root>.sampling.samples_per_prompt` times, each rewrite rendered
            `tracks.<leaf>.sampling.samples_per_prompt` times).
        tracks: track name -> `TrackConfig` node.
        rewards: track name -> a `RewardService` node scoring that track.
        rollout: a `unirl.rollout.composed.ComposedEngine` node naming the chain.
    """

    rollout: Any
    tracks: dict[str, Any]
    rewards: dict[str, Any]

    COMPONENTS: ClassVar[tuple[str, ...]] = ("rollout", "data_source")


@dataclass
class TrackConfig:
    """`tracks.<name>`: one model of the chain.

    Attributes:
        model, stage, sampling: `_target_` nodes, as in a single-track recipe.
        trained: train this track (it then needs `algorithm`, `advantage` and `train`), or
            keep it frozen (no optimizer; its weights never change).
        algorithm, advantage: `_target_` nodes (trained tracks only).
        train: the track's own train stack (`TrainConfig`: optimizer, schedule, LoRA, FSDP2).
        aggregate: a parent track's reward from its children's: mean | max | min.
        engine: where the track samples, as a single-track `rollout`: null (the train workers,
            with the module they train), a trainside engine node
            (`unirl.rollout.trainside.TrainsideEngine`: its `forward_batch_size`, `keep_graph`),
            or a dedicated engine node (`unirl.rollout.dedicated.DedicatedEngine`, or
            `unirl.rollout.vllm.VLLMEngine` for a text track).
        weight_sync: how the track's trained weights reach its engine (`WeightSyncConfig`);
            only with `engine`.
        critic: PPO's value model of this track (`unirl.train.critic.CriticConfig`, as a
            single-track recipe's `critic`), colocated with it on its workers; trained tracks only.
    """

    model: Any
    stage: Any
    sampling: Any
    trained: bool = True
    algorithm: Any = None
    advantage: Any = None
    train: Any = None
    aggregate: Aggregate = "mean"
    engine: Any = None
    weight_sync: Any = None
    critic: Any = None

    def __post_init__(self) -> None:
        _components("tracks.<name>.", self, ("model", "stage", "sampling"), ("algorithm", "advantage", "critic"))
        check_fields(self)


def sections(cfg: DictConfig) -> dict[str, type]:
    """The plain sections of a composed recipe: the top level, checkpoint, logging, eval, and each
    track's node, train stack and weight sync."""
    return chain_sections(
        cfg, ComposedRunConfig, TrackConfig, {}, {"train": TrainConfig, "weight_sync": WeightSyncConfig}
    )


def _prefixed(prefix: str, found: list[str]) -> list[str]:
    return [f"{prefix}{p}" for p in found]


def tracks(cfg: DictConfig, passed: dict[str, Any], problems: list[str]) -> list[TrackCheck]:
    """The chain's tracks, root first, after the rules that make them a chain (every track named
    once, the leaf scored, only text feeds a child, a trained track's parts, a frozen track's
    absence of them) and each track's own model, LoRA, FSDP, engine and conditions."""
    run = passed.get("")
    tracks = cfg.get("tracks")
    chain = chain_of(cfg)
    if not isinstance(tracks, DictConfig) or not chain:
        return []
    names = list(tracks.keys())
    if sorted(names) != sorted(chain):
        problems.append(
            f"rollout.tracks {chain} and the tracks.<name> nodes {names} disagree: name every track once in the "
            "chain (root first) and give each a tracks.<name> node"
        )
        return []
    walked: list[TrackCheck] = []
    rewards = cfg.get("rewards") or {}
    for name in rewards:
        if name not in names:
            problems.append(f"rewards.{name}: scores track {name!r}, which does not exist; tracks: {names}")
    leaf = chain[-1]
    if leaf not in rewards:
        problems.append(
            f"rewards.{leaf}: the leaf track {leaf!r} needs a reward (the rewards of its parents derive from it)"
        )
    samplings: dict[str, Any] = {}
    for depth, name in enumerate(chain):
        key = f"tracks.{name}"
        node = tracks[name]
        sampling, model = passed.get(f"{key}.sampling"), passed.get(f"{key}.model")
        samplings[name] = sampling
        modality = modality_of(sampling)
        if depth < len(chain) - 1 and sampling is not None and not isinstance(sampling, TextSamplingParams):
            problems.append(
                f"{key}.sampling: track {name!r} feeds track {chain[depth + 1]!r}, so it must be a text track "
                "(its texts are the next stage's prompts)"
            )
        if depth == len(chain) - 1 and node.get("aggregate", "mean") != "mean":
            problems.append(f"{key}.aggregate: the leaf track has no children to aggregate; remove it")
        if model is not None and modality is not None and getattr(model, "modality", modality) != modality:
            problems.append(f"{key}.model: a {model.modality} model under {modality} sampling; pair them")
        trained = check_trained_parts(name, node, ("algorithm", "advantage", "train"), ("critic",), problems)
        algorithm = target_class(node, "algorithm") if node.get("algorithm") is not None else None
        if (
            algorithm is not None
            and modality is not None
            and getattr(algorithm, "modality", modality) != modality
        ):
            problems.append(
                f"{key}.algorithm: {node.algorithm._target_} is a {algorithm.modality} algorithm but track {name!r} "
                f"is a {modality} track; use a {modality} algorithm"
            )
        train = passed.get(f"{key}.train")
        # every one-track rule runs on this track (the validator's walk); its batch is the chain's (`graph`)
        walked.append(
            TrackCheck.chained(
                name, node, passed, modality, trained, {"reward": f"rewards.{name}"}, own_group(sampling)
            )
        )
        if run is not None and trained and train is not None and run.num_devices > 1 and train.fsdp is None:
            problems.append(
                f"{key}.train.fsdp: num_devices={run.num_devices} needs FSDP2 settings for a trained track"
            )
        if train is not None and train.parallel.sp > 1:
            problems.append(
                f"{key}.train.parallel.sp={train.parallel.sp}: sequence parallelism runs in single-track recipes "
                "only (their driver gives each group of sp ranks one sample shard); set it to 1"
            )
        _check_engine(node, passed, key, name, run, [samplings[n] for n in chain[:depth]], problems)
        # an edit model's rows: every child keeps its user prompt's metadata, the source among it
        conditions = getattr(model, "condition_problems", None)
        examples = examples_of(passed.get("data_source"))
        if conditions is not None and examples:
            problems.extend(_prefixed(f"{key}.model: ", conditions(examples, "data_source")))
    return walked


def graph(cfg: DictConfig, passed: dict[str, Any], problems: list[str]) -> None:
    """The batch down the chain and the metadata keys the rewards and the evaluation read."""
    chain = chain_of(cfg)
    if isinstance(cfg.get("tracks"), DictConfig) and chain and sorted(cfg.tracks.keys()) == sorted(chain):
        samplings = {name: passed.get(f"tracks.{name}.sampling") for name in chain}
        _check_batches(passed.get(""), chain, samplings, passed, problems)
    _check_prompt_keys(passed, problems)


def _check_engine(
    node: DictConfig, passed: dict[str, Any], key: str, name: str, run: Any, parents: list, problems: list[str]
) -> None:
    """A track's `engine` and `weight_sync`: the single-track engine rules on the track's view
    (its engine as `rollout`, the batch it samples: the user prompts times its parents' fan-out),
    named `tracks.<name>.engine...`; then what a composed track's engine cannot do."""
    engine = node.get("engine")
    if engine is None:
        if node.get("weight_sync") is not None:
            problems.append(
                f"{key}.weight_sync: track {name!r} samples trainside (no {key}.engine), so nothing is synced; "
                f"remove it or set {key}.engine"
            )
        return
    if not isinstance(engine, DictConfig) or "_target_" not in engine:
        problems.append(
            f"{key}.engine: expected an engine node with a _target_ (unirl.rollout.trainside.TrainsideEngine, "
            f"unirl.rollout.dedicated.DedicatedEngine, unirl.rollout.vllm.VLLMEngine), got {engine!r}"
        )
        return
    dedicated = is_dedicated(engine)
    if not bool(node.get("trained", True)) and (dedicated or engine.get("keep_graph", False)):
        why = "its engine would never receive weights" if dedicated else "its kept graphs would never be trained"
        problems.append(
            f"{key}.engine: track {name!r} is frozen, so {why}; sample it trainside without kept graphs "
            f"(remove {key}.engine)"
        )
        return
    if f"{key}.engine" not in passed:
        return  # phase 1 reported it
    plain = OmegaConf.to_container(node, resolve=True)  # interpolations resolve against the recipe
    view_cfg = OmegaConf.create({k: v for k, v in plain.items() if k != "engine"} | {"rollout": plain["engine"]})
    view = track_view(passed, key, {f"rewards.{name}": "reward", f"{key}.engine": "rollout"})
    if run is not None and all(p is not None for p in parents):
        prompts = run.prompts_per_rollout
        for parent in parents:
            prompts *= parent.samples_per_prompt
        view[""] = SimpleNamespace(launcher=run.launcher, num_devices=run.num_devices, prompts_per_rollout=prompts)
    found: list[str] = []
    check_rollout(view_cfg, view, found, key=f"{key}.engine")
    track_keys = ("sampling", "model", "train", "advantage", "algorithm", "weight_sync", "reward")
    problems.extend(f"{key}.{p}" if p.startswith(track_keys) else p for p in found)
    if dedicated and int(engine.get("max_staleness", 0)) > 0:
        problems.append(
            f"{key}.engine.max_staleness={engine.max_staleness}: a composed run samples every track from the "
            "step's weights (the chain is walked within the step); set it to 0"
        )
    if dedicated and bool(engine.get("overlap_reward", False)):
        problems.append(
            f"{key}.engine.overlap_reward=true: a composed run scores the leaf first after the whole chain is "
            "sampled, so a track's engine returns its rollout whole; remove it"
        )


def _check_batches(
    run: Any, chain: list[str], samplings: dict[str, Any], passed: dict[str, Any], problems: list[str]
) -> None:
    """The root request (prompts x N) splits evenly over the workers; every trained track's
    micro-batch divides its per-rank batch (a child track's is its parents' x its own fan-out), and
    its mini-batches divide its micro-batches."""
    if run is None or any(s is None for s in samplings.values()):
        return
    world = run.num_devices
    total = run.prompts_per_rollout
    for depth, name in enumerate(chain):
        total *= samplings[name].samples_per_prompt
        if depth == 0 and total % world:
            problems.append(
                f"batch geometry: prompts_per_rollout ({run.prompts_per_rollout}) x tracks.{name}.sampling."
                f"samples_per_prompt ({samplings[name].samples_per_prompt}) = {total} root samples do not split "
                f"evenly over num_devices={world}"
            )
            return
        stack = passed.get(f"tracks.{name}.train.stack")
        if stack is not None and (total // world) % stack.micro_batch_size:
            problems.append(
                f"tracks.{name}.train.stack.micro_batch_size={stack.micro_batch_size} does not divide the per-rank "
                f"batch of track {name!r}: {total // world} samples ({total} over num_devices={world})"
            )
        elif problem := mini_batch_problem(stack, total // world, f"tracks.{name}.train.stack"):
            problems.append(problem)


def _check_prompt_keys(passed: dict[str, Any], problems: list[str]) -> None:
    """Metadata keys: every track's reward components vs the user prompts (`data_source`; a child
    track's samples carry their root prompt's metadata); the eval scorers, `eval.intent_key` and
    `eval.group_by` vs the eval prompts (`eval.examples`)."""
    train = examples_of(passed.get("data_source"))
    for path in passed:
        if path.startswith("rewards.") and path.count(".") == 1:
            check_scorer_keys(passed, path, train, "data_source", problems)
    held_out = examples_of(passed.get("eval.examples"))
    for scorer in ("eval.scorer", "eval.rewrite_scorer"):
        check_scorer_keys(passed, scorer, held_out, "eval.examples", problems)
    ev = passed.get("eval")
    if ev is not None:
        check_metadata_key("eval.intent_key", ev.intent_key, held_out, "eval.examples", problems)
        for name in ev.group_by:
            check_metadata_key("eval.group_by", name, held_out, "eval.examples", problems)


def missing(cfg: DictConfig) -> str | None:
    """A recipe run as composed without `tracks`: what a composed recipe names."""
    if "tracks" in cfg:
        return None
    return (
        "tracks: missing; a composed recipe names its tracks (tracks.<name>: model, stage, sampling, ...). "
        "A single-model recipe runs with unirl.train_diffusion or unirl.train_vlm"
    )
