"""The rules of one track, run on every track of every kind of recipe.

A track is a model with its stage and sampling and, when trained, its algorithm, advantage and
train stack. The validator (`unirl.config.validate.validate_recipe`) asks the recipe's kind for
its tracks as `TrackCheck`s and runs `check_track` on each: every rule that concerns one track
alone, on keys written relative to the track (`sampling.guidance_scale`, `advantage.estimator`,
`train.stack...`), each problem then named by its recipe key (`TrackCheck.recipe_key`). A
single-track recipe is one track at the root; a composed recipe's `tracks.<name>` each own their
model and train stack; a unified recipe's segments share the root's `model` and `train` (one
backbone). A rule that needs what a track lacks (the run's geometry for a track of a chain, a
critic section) skips, and the recipe kind's graph rules check those keys.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig

from unirl.config.algorithm import (
    check_advantage,
    check_algorithm,
    check_chained_algorithm,
    check_ema_use,
    check_keep_graph,
    check_reward_backprop,
    check_sde,
)
from unirl.config.critic import check_critic, check_mini_batches
from unirl.config.distill import check_distillation
from unirl.config.distributed import check_module_tree
from unirl.config.engines import group_scorers
from unirl.config.geometry import check_eval_size, check_geometry, check_guidance, check_training_guidance
from unirl.config.modality import check_text
from unirl.config.references import check_model_path
from unirl.config.run import RunBase
from unirl.config.supervised import check_supervised
from unirl.config.tree import target_class

RUN_KEYS = frozenset(f.name for f in dataclasses.fields(RunBase))


def chain_of(cfg: DictConfig) -> list:
    """The chain a recipe with tracks names (`rollout.tracks`, root first); [] without one."""
    return list(cfg.rollout.get("tracks") or []) if isinstance(cfg.get("rollout"), DictConfig) else []


def chain_sections(
    cfg: DictConfig, top: type, track: type, shared: dict[str, type], own: dict[str, type]
) -> dict[str, type]:
    """The plain sections of a recipe with tracks: its `top` level, checkpoint, logging, a chain's
    evaluation (`EvalConfig`), the `shared` sections (a backbone's `train`), every
    `tracks.<name>` node as `track`, and each of a track's `own` sections it sets."""
    from unirl.config.run import CheckpointConfig, EvalConfig, LoggingConfig

    sections = {"": top, "checkpoint": CheckpointConfig, "logging": LoggingConfig, "eval": EvalConfig}
    sections |= shared
    tracks = cfg.get("tracks")
    if isinstance(tracks, DictConfig):
        for name, node in tracks.items():
            sections[f"tracks.{name}"] = track
            for key, schema in own.items():
                if isinstance(node, DictConfig) and node.get(key) is not None:
                    sections[f"tracks.{name}.{key}"] = schema
    return sections


def check_trained_parts(
    name: str, node: DictConfig, needs: tuple[str, ...], optional: tuple[str, ...], problems: list[str]
) -> bool:
    """A track of a recipe with tracks (`tracks.<name>`, its `node`) is trained (the default) and sets
    every part of `needs` (its algorithm, advantage, and its own train stack where it has one), or
    is frozen (`trained: false`) and sets none of `needs` nor `optional` (a critic): a frozen track
    holds no optimizer. Returns whether it is trained."""
    key = f"tracks.{name}"
    trained = bool(node.get("trained", True))
    if trained:
        for part in needs:
            if node.get(part) is None:
                what = "exactly one algorithm of its modality" if part == "algorithm" else f"a {part} node"
                problems.append(
                    f"{key}.{part}: track {name!r} is trained ({key}.trained: true) and needs {what}"
                )
        return True
    extra = [p for p in needs + optional if node.get(p) is not None]
    if extra:
        problems.append(
            f"{key}: track {name!r} is frozen (trained: false) but sets {extra}: a frozen track holds no "
            "optimizer; remove them or set trained: true"
        )
    return False


def track_view(passed: dict[str, Any], prefix: str, renames: dict[str, str] | None = None) -> dict[str, Any]:
    """What phase 1 passed under `prefix` (e.g. `tracks.ar`), keyed relative to it, plus each
    `renames` source key (and its subkeys) under its track-relative name (`rewards.ar` -> `reward`)."""
    view = {k[len(prefix) + 1 :]: v for k, v in passed.items() if k.startswith(prefix + ".")}
    for source, name in (renames or {}).items():
        for k, v in passed.items():
            if k == source or k.startswith(source + "."):
                view[name + k[len(source) :]] = v
    return view


@dataclass
class TrackCheck:
    """One track as the validator walks it.

    Attributes:
        name: the track's name (None: a single-track recipe's one track, at the root).
        node: the track's config, keyed relative to it (`model`, `sampling`, `algorithm`, ...;
            a unified segment's node holds the shared `model` and `train` too).
        view: phase 1's built objects, keyed the same way (`track_view`; a track of a recipe with
            tracks derives it from `renames`: `TrackCheck.chained`).
        modality: "diffusion", "text" or None (sampling not built, or image tokens).
        trained: the track trains (its algorithm, advantage and stack are checked).
        run: the run's top level when the track's batch is the run's (a single track); None for a
            track of a chain, whose batch the graph rules check.
        eval_sampling, ev: the built evaluation, when it evaluates this track's samples.
        renames: track-relative first key -> recipe key, for keys the track reads from elsewhere
            (`reward` -> `rewards.<name>`, a shared `model` -> `model`); every other key is
            written under `tracks.<name>.`.
        group: (samples of one group, the key that sets it): a track's own
            `sampling.samples_per_prompt` (`own_group`), or for a unified image its prompt's plans;
            None when that sampling failed phase 1 (the group rules then skip).
    """

    name: str | None
    node: DictConfig
    view: dict[str, Any]
    modality: str | None
    trained: bool = True
    run: Any = None
    eval_sampling: Any = None
    ev: Any = None
    renames: dict[str, str] = field(default_factory=dict)
    group: tuple[int, str] | None = None

    @classmethod
    def chained(
        cls,
        name: str,
        node: DictConfig,
        passed: dict[str, Any],
        modality: str | None,
        trained: bool,
        renames: dict[str, str],
        group: tuple[int, str] | None,
    ) -> TrackCheck:
        """`tracks.<name>` of a recipe with tracks: its view is what phase 1 passed under it, each
        key of `renames` read from its recipe key, and the run's top level (run-wide: steps,
        devices); its batch is the chain's (the kind's graph rules check it)."""
        view = track_view(passed, f"tracks.{name}", {recipe: own for own, recipe in renames.items()})
        view[""] = passed.get("")
        return cls(name, node, view, modality, trained, renames=renames, group=group)

    def recipe_key(self, problem: str) -> str:
        """`problem`, written with track-relative keys, named by the recipe's keys."""
        if self.name is None:
            return problem
        word = re.match(r"[A-Za-z_]*", problem).group(0)
        if word in RUN_KEYS:  # a run-wide key (`num_devices=2: ...`) is the recipe's own
            return problem
        if word in self.renames:
            return self.renames[word] + problem[len(word) :]
        return f"tracks.{self.name}.{problem}"


def own_group(sampling: Any) -> tuple[int, str] | None:
    """A track whose group is its own samples of one prompt: `TrackCheck.group` from its built
    sampling (None when it failed phase 1)."""
    if sampling is None:
        return None
    return sampling.samples_per_prompt, "sampling.samples_per_prompt"


def check_track(track: TrackCheck, problems: list[str]) -> None:
    """Every one-track rule on `track`: the model's path, image size and guidance, the text
    settings, the SDE; for a trained track its LoRA and FSDP vs the module tree it trains, the
    algorithm against sampling, updates, EMA, kept graphs, reward backprop, distillation, the
    advantage and the critic. Appends each problem under its recipe key."""
    found: list[str] = []
    _one_track_rules(track, found)
    problems.extend(track.recipe_key(p) for p in found)


def _one_track_rules(track: TrackCheck, problems: list[str]) -> None:
    cfg, passed, modality, run = track.node, track.view, track.modality, track.run
    eval_sampling = track.eval_sampling
    model, sampling, stack, train = (passed.get(k) for k in ("model", "sampling", "train.stack", "train"))
    algorithm = target_class(cfg, "algorithm") if cfg.get("algorithm") is not None else None
    built = passed.get("algorithm")
    check_model_path(model, problems)
    fsdp = passed.get("train.fsdp")
    sp = train.parallel.sp if train is not None else 1
    check_geometry(run, sampling, stack, model, problems, sp=sp)
    check_guidance(model, sampling, eval_sampling, problems)
    check_eval_size(model, sampling, eval_sampling, problems)
    if modality == "text":
        check_text(cfg, sampling, model, problems, eval_sampling)
    if modality == "diffusion":
        check_sde(cfg, sampling, problems)
    if not track.trained:
        return
    check_module_tree(model, passed.get("train.lora"), fsdp, problems, sp=sp)
    check_algorithm(algorithm, sampling, stack, train, track.ev, problems)
    check_mini_batches(cfg, stack, algorithm, problems)
    chained = track.name is not None  # a track of a chain (`run` is also None when phase 1 failed)
    check_supervised(cfg, algorithm, sampling, chained, problems)
    if modality == "diffusion":
        check_training_guidance(model, built, problems)
    check_ema_use(built, train, problems)
    if chained:
        check_chained_algorithm(built, problems)
    check_keep_graph(cfg, passed, modality, problems)
    check_reward_backprop(cfg, algorithm, built, sampling, problems)
    check_distillation(cfg, passed, algorithm, sampling, problems)
    group = track.group
    check_advantage(built, passed.get("advantage"), group, modality, problems)
    check_critic(cfg, passed, algorithm, modality, problems)
    grouped = group_scorers(passed.get("reward"))
    if grouped and group is not None and group[0] < 2:
        problems.append(
            f"reward.backend.components.{grouped[0]} scores each sample against its group's, but "
            f"{group[1]}={group[0]}; set it to >= 2"
        )
