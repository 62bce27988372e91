"""Validation of a recipe, run before any Ray work: one validator for every kind of run.

A recipe is one of three kinds (`recipe_kind`): a single-track run (one model: no `tracks`; a
supervised one replays its data's demonstrations), a composed run (`tracks.<name>`, each with its
own model: a prompt enhancer feeding a diffusion model) or a unified run (`tracks.<name>` sharing
the recipe's one `model`: Janus's plan and image segments). `validate_recipe` checks a recipe of
any kind the same way, in four phases, reporting every problem it finds:

1. Every node is type- and range-checked on its own (`unirl.config.tree.check_recipe`) against
   the sections of its kind (`RecipeShape.sections`): the top level and the plain sections
   against their schemas (`unirl.config.run`), every `_target_` node against its target, and
   each target that can be built from the recipe alone is built, so its constructor's own
   checks run too.
2. The kind names its tracks (`RecipeShape.tracks`: a single-track recipe is one track at the
   root; `unirl.config.composed`, `unirl.config.unified`), checking what makes them a graph on
   the way (the chain names every track once, a trained track has an algorithm, ...).
3. Every rule of one track runs on every track with the track's keys (`unirl.config.track`).
4. The rules that belong to the graph (`RecipeShape.graph`: how the batch splits over devices
   and micro-batches, metadata keys, the evaluation, the engines), then the run's own: the
   transport, trackers, resume and what this machine must have.

The rules live in one module per concern: the modality (`modality`), batch and image geometry
(`geometry`), the algorithm vs sampling, updates, EMA, SDE, kept graphs and advantages
(`algorithm`), PPO's critic and mini-batches (`critic`), distillation (`distill`), supervised
tracks (`supervised`), devices, FSDP, LoRA and transport (`distributed`), the rollout engine and
weight sync (`engines`), and the paths and names a recipe refers to (`references`). A rule is
skipped only when one of its inputs failed phase 1. Every problem names the recipe keys involved
and says what is expected; all of them are reported together in one `ConfigError`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig

from unirl.config.critic import mini_batch_problem
from unirl.config.distributed import check_distributed, check_this_machine, check_transport
from unirl.config.engines import check_rollout
from unirl.config.modality import check_entry_point, check_eval_sampling, check_modality, modality_of
from unirl.config.references import check_conditions, check_prompt_keys, check_tracking
from unirl.config.run import RL_SECTIONS, check_eval_keys
from unirl.config.supervised import check_demonstrations
from unirl.config.track import TrackCheck, check_track, own_group
from unirl.config.tree import ConfigError, check_recipe, target_class

__all__ = ["ConfigError", "KINDS", "recipe_kind", "validate_recipe"]

KINDS = ("single", "composed", "unified")


def recipe_kind(cfg: DictConfig) -> str:
    """single (no `tracks`), unified (`tracks` and one top-level `model` they share) or composed
    (`tracks`, each with its own model)."""
    if "tracks" not in cfg:
        return "single"
    return "unified" if "model" in cfg else "composed"


@dataclass(frozen=True)
class RecipeShape:
    """What the validator asks of a kind of RL recipe.

    Attributes:
        sections: recipe -> {key path: schema} of its plain sections (phase 1).
        tracks: (recipe, phase 1's results, problems) -> its tracks, after checking that they
            form a graph (phase 2).
        graph: (recipe, phase 1's results, problems) -> None, the rules between tracks (phase 4).
        missing: recipe -> a problem when it lacks what makes it this kind (reported alone).
    """

    sections: Callable[[DictConfig], dict[str, type]]
    tracks: Callable[[DictConfig, dict[str, Any], list[str]], list[TrackCheck]]
    graph: Callable[[DictConfig, dict[str, Any], list[str]], None]
    missing: Callable[[DictConfig], str | None]


def _single_tracks(cfg: DictConfig, passed: dict[str, Any], problems: list[str]) -> list[TrackCheck]:
    """A single-track recipe is one track at the root: its batch is the run's, its evaluation the run's."""
    algorithm = target_class(cfg, "algorithm") if "algorithm" in cfg else None
    modality = check_modality(cfg, passed.get("sampling"), passed.get("model"), algorithm, problems)
    return [
        TrackCheck(
            None,
            cfg,
            passed,
            modality,
            run=passed.get(""),
            eval_sampling=passed.get("eval.sampling"),
            ev=passed.get("eval"),
            group=own_group(passed.get("sampling")),
        )
    ]


def _single_graph(cfg: DictConfig, passed: dict[str, Any], problems: list[str]) -> None:
    check_eval_sampling(cfg, modality_of(passed.get("sampling")), problems)
    run, sampling, stack = passed.get(""), passed.get("sampling"), passed.get("train.stack")
    if run is not None and sampling is not None:
        per_rank = run.prompts_per_rollout * sampling.samples_per_prompt // run.num_devices
        if problem := mini_batch_problem(stack, per_rank):
            problems.append(problem)
    check_distributed(cfg, passed, problems)
    check_rollout(cfg, passed, problems)
    check_prompt_keys(passed, problems)
    check_demonstrations(cfg, passed, problems)
    check_conditions(passed, problems)


def _shapes() -> dict[str, RecipeShape]:
    from unirl.config import composed, unified

    return {
        "single": RecipeShape(lambda cfg: RL_SECTIONS, _single_tracks, _single_graph, lambda cfg: None),
        "composed": RecipeShape(composed.sections, composed.tracks, composed.graph, composed.missing),
        "unified": RecipeShape(unified.sections, unified.tracks, unified.graph, unified.missing),
    }


def validate_recipe(
    cfg: DictConfig, kind: str | None = None, expect: str | None = None, on_this_machine: bool = True
) -> None:
    """Raise `ConfigError` listing every problem of a recipe of any kind.

    Args:
        kind: the kind the entry point runs (None: `recipe_kind(cfg)`); `unirl.train_pe` passes
            "composed", so a recipe without tracks is told what a composed recipe needs.
        expect: the modality a single-track entry point runs ("diffusion" or "text"); a recipe
            of the other modality is a problem naming the right entry point.
        on_this_machine: the run starts here, so what this machine must have is checked too
            (`check_this_machine`); False for a recipe planned for other machines
            (`unirl.plan_memory`).
    """
    from unirl.trainer.checkpoints import resolve_resume_path

    kind = kind or recipe_kind(cfg)
    shapes = _shapes()
    if kind not in shapes:
        raise ValueError(f"recipe kind must be one of {list(KINDS)}, got {kind!r}")
    shape = shapes[kind]
    missing = shape.missing(cfg)
    if missing:
        raise ConfigError([missing])
    problems: list[str] = []
    passed = check_recipe(cfg, shape.sections(cfg), problems)
    check_eval_keys(cfg, kind != "single", problems)
    check_transport(cfg, problems)
    tracks = shape.tracks(cfg, passed, problems)
    if expect is not None and kind == "single":
        check_entry_point(passed.get("sampling"), expect, problems)
    for track in tracks:
        check_track(track, problems)
    shape.graph(cfg, passed, problems)
    if on_this_machine:
        check_this_machine(cfg, passed, problems)
    check_tracking(cfg, problems)
    if "" in passed and ("model" in passed or "model" not in cfg):  # resume compares the model
        try:
            resume = resolve_resume_path(cfg)
            if resume is not None and cfg.get("rollout") is not None:  # rollouts in flight vs this recipe
                from unirl.trainer.checkpoints import read_driver_state, resume_problem
                from unirl.trainer.engines import RolloutSettings

                problem = resume_problem(read_driver_state(resume), RolloutSettings.of(cfg), resume)
                if problem:
                    problems.append(problem)
        except (ValueError, OSError, KeyError) as exc:
            problems.append(str(exc))
    if problems:
        raise ConfigError(list(dict.fromkeys(problems)))  # a shared key's problem is named once
