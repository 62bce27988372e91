"""The rules of one track, run on every track of every kind of recipe.

A track is a model with its stage and sampling and, when trained, its algorithm, advantage and
train stack. `check_track` runs every rule that concerns one track alone, on keys written
relative to the track (`sampling.guidance_scale`, `advantage.estimator`, `train.stack...`): a
single-track recipe is one track at the root (`validate_rl_config`); a composed recipe runs it on
each `tracks.<name>` through `track_view` and prefixes what it finds with `tracks.<name>.`
(`validate_composed_config`). A rule that needs what a track view lacks (the run's geometry, a
critic section) skips, and the recipe kind's own validator checks those keys.
"""

from __future__ import annotations

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
from unirl.config.critic import check_critic
from unirl.config.distill import check_distillation
from unirl.config.engines import group_scorers
from unirl.config.geometry import check_eval_size, check_geometry, check_guidance
from unirl.config.modality import check_text
from unirl.config.references import check_model_path
from unirl.config.supervised import check_supervised
from unirl.config.tree import target_class


def track_view(passed: dict[str, Any], prefix: str, renames: dict[str, str] | None = None) -> dict[str, Any]:
    """What phase 1 passed under `prefix` (e.g. `tracks.ar`), keyed relative to it, plus each
    `renames` source key (and its subkeys) under its track-relative name (`rewards.ar` -> `reward`)."""
    view = {k[len(prefix) + 1 :]: v for k, v in passed.items() if k.startswith(prefix + ".")}
    for source, name in (renames or {}).items():
        for k, v in passed.items():
            if k == source or k.startswith(source + "."):
                view[name + k[len(source) :]] = v
    return view


def check_track(
    cfg: DictConfig,
    passed: dict[str, Any],
    modality: str | None,
    problems: list[str],
    *,
    trained: bool = True,
    run: Any = None,
    eval_sampling: Any = None,
    ev: Any = None,
) -> None:
    """Every one-track rule on `cfg` (the track's node) and `passed` (phase 1's results, keyed
    relative to the track): the model's path, image size and guidance, the text settings, the SDE;
    for a trained track the algorithm against sampling, updates, EMA, kept graphs, reward
    backprop, distillation, the advantage and the critic. `run`: the run's top level, when the
    track's batch is the run's (a single-track recipe); `eval_sampling` / `ev`: its evaluation."""
    model, sampling, stack, train = (passed.get(k) for k in ("model", "sampling", "train.stack", "train"))
    algorithm = target_class(cfg, "algorithm") if cfg.get("algorithm") is not None else None
    built = passed.get("algorithm")
    check_model_path(model, problems)
    fsdp = passed.get("train.fsdp")
    check_geometry(
        run, sampling, stack, model, problems, sp=getattr(fsdp, "sp", 1) if fsdp is not None else 1
    )
    check_guidance(model, sampling, eval_sampling, problems)
    check_eval_size(model, sampling, eval_sampling, problems)
    if modality == "text":
        check_text(cfg, sampling, model, problems, eval_sampling)
    if modality == "diffusion":
        check_sde(cfg, sampling, problems)
    if not trained:
        return
    check_algorithm(algorithm, sampling, stack, train, ev, problems)
    check_supervised(cfg, algorithm, sampling, run is None, problems)
    check_ema_use(built, train, problems)
    if run is None:  # a track of a chain
        check_chained_algorithm(built, problems)
    check_keep_graph(cfg, passed, modality, problems)
    check_reward_backprop(cfg, algorithm, built, sampling, problems)
    check_distillation(cfg, passed, algorithm, sampling, problems)
    check_advantage(built, passed.get("advantage"), sampling, modality, problems)
    check_critic(cfg, passed, algorithm, modality, problems)
    grouped = group_scorers(passed.get("reward"))
    if grouped and sampling is not None and sampling.samples_per_prompt < 2:
        problems.append(
            f"reward.backend.components.{grouped[0]} scores each sample against its group's, but "
            f"sampling.samples_per_prompt={sampling.samples_per_prompt}; set it to >= 2"
        )
