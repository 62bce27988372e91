"""The rules of a supervised track. The pairing: a loss that learns from demonstrations
(`learns_from_demonstrations`: `unirl.algorithms.sft.LMSFT`, `FlowSFT`) and the engine that replays them
(`samples_policy = False`, `unirl.rollout.demonstrations.DemonstrationEngine`) come together, with
no reward, advantage or critic and one sample a row; every other trained track has a reward and an
advantage. An offline preference track is the one RL loss an engine that replays may feed: a loss
that compares the samples of a group (`compares_within_groups`: `DiffusionDPO`) on a row's group of
demonstrations (`rollout.target_key` a list, one key per sample: `[chosen, rejected]`), ranked by a
reward. And the demonstrations against the rows and the model (`check_demonstrations`)."""

from __future__ import annotations

from typing import Any

import numpy as np
from omegaconf import DictConfig, ListConfig

from unirl.config.references import check_metadata_key, examples_of
from unirl.config.tree import target_class
from unirl.types.sampling import DiffusionSamplingParams

DEMONSTRATIONS = "unirl.rollout.demonstrations.DemonstrationEngine"


def check_supervised(
    cfg: DictConfig, algorithm: type | None, sampling: Any, composed: bool, problems: list[str]
) -> None:
    """`cfg`: the track's node (a single-track recipe's root, whose `rollout`, `reward`, `advantage`
    and `critic` it reads, or a composed recipe's `tracks.<name>`, whose `engine`); `composed`: the
    track is one of several."""
    engine_key = "engine" if composed else "rollout"
    engine = target_class(cfg, engine_key) if cfg.get(engine_key) is not None else None
    replays = engine is not None and getattr(engine, "samples_policy", True) is False
    supervised = bool(getattr(algorithm, "learns_from_demonstrations", False))
    name = getattr(algorithm, "__name__", "the algorithm")
    keys = cfg[engine_key].get("target_key") if replays else None
    group = isinstance(keys, list | ListConfig)  # a group of demonstrations a row (another type: phase 1's)
    if group and not keys:
        problems.append(
            f"{engine_key}.target_key is an empty list; name the metadata key of a row's demonstration, "
            "or one key per sample of its group ([chosen, rejected])"
        )
        return
    if replays and not supervised and algorithm is not None:
        if not (group and getattr(algorithm, "compares_within_groups", False)):
            problems.append(
                f"{engine_key}: {engine.__name__} gives the data's demonstrations, not samples of the policy, and "
                f"{name} is an RL loss that needs samples: use unirl.rollout.trainside.TrainsideEngine, or a "
                "supervised algorithm (unirl.algorithms.sft.LMSFT or FlowSFT), or for a preference loss that "
                "compares a group's samples (DiffusionDPO) name a row's demonstrations as a list "
                f"{engine_key}.target_key: [chosen, rejected]"
            )
        elif sampling is not None and sampling.samples_per_prompt != len(keys):
            problems.append(
                f"sampling.samples_per_prompt={sampling.samples_per_prompt}: a row's group is its "
                f"{len(keys)} demonstrations ({engine_key}.target_key={list(keys)}); set it to {len(keys)}"
            )
    if not supervised:
        for key in ("reward", "advantage"):
            if algorithm is not None and key in cfg and cfg.get(key) is None:
                problems.append(
                    f"{key} is null, but {name} trains on rewards through advantages: give {key} a _target_ "
                    "node (only a supervised algorithm, which learns from demonstrations, runs without)"
                )
        return
    if composed:
        problems.append(
            f"algorithm: {name} is a supervised loss; a composed run's tracks learn from their rewards, so run "
            "it as a single-track recipe (examples/llm/arith_sft.yaml)"
        )
        return
    if not replays:
        problems.append(
            f"rollout: {name} learns from the data's demonstrations; set rollout._target_={DEMONSTRATIONS} "
            f"(got {cfg.rollout.get('_target_')})"
        )
    for key in ("reward", "advantage", "critic"):
        if cfg.get(key) is not None:
            problems.append(f"{key}: {name} learns from demonstrations, not rewards; set {key}: null")
    if group:
        problems.append(
            f"rollout.target_key={list(keys)}: {name} learns from one demonstration a row; name one key"
        )
    elif sampling is not None and getattr(sampling, "samples_per_prompt", 1) != 1:
        problems.append(
            f"sampling.samples_per_prompt={sampling.samples_per_prompt}: a row has one demonstration, so "
            f"{name} takes one sample a row; set it to 1"
        )


def check_demonstrations(cfg: DictConfig, passed: dict[str, Any], problems: list[str]) -> None:
    """A single-track recipe whose rollout replays demonstrations, against its training rows and
    model before the run: every row carries `rollout.target_key`; an image demonstration is an
    [H, W, 3] array of the sampling size, a video family's clip an [F, H, W, 3] one of its
    `num_frames` (a file is read when the track samples); a tiny
    diffusion model samples in pixel space (a demonstration enters as x0; no VAE encoder)."""
    engine = target_class(cfg, "rollout") if cfg.get("rollout") is not None else None
    if engine is None or getattr(engine, "samples_policy", True) is not False:
        return
    key = cfg.rollout.get("target_key", "answer")
    keys = list(key) if isinstance(key, list | ListConfig) else [key]
    examples = examples_of(passed.get("data_source"))
    for k in keys:
        check_metadata_key("rollout.target_key", k, examples, "data_source", problems)
    sampling = passed.get("sampling")
    if not isinstance(sampling, DiffusionSamplingParams):
        return
    tiny = getattr(passed.get("model"), "tiny", None)
    if tiny is not None and getattr(tiny, "pixel_space", True) is False:
        problems.append(
            "model.tiny.pixel_space=false: a demonstration image enters a supervised track as a pixel-space "
            "model's x0 (the bundles expose no VAE encoder); set model.tiny.pixel_space: true"
        )
    frames = getattr(passed.get("model"), "num_frames", None)  # a video family's clip length
    want = (
        (sampling.height, sampling.width, 3)
        if frames is None
        else (frames, sampling.height, sampling.width, 3)
    )
    what = "image" if frames is None else "clip"
    for ex, k in ((ex, k) for ex in examples or [] for k in keys):
        image = ex.metadata.get(k)
        if isinstance(image, np.ndarray) and image.shape != want:
            problems.append(
                f"data_source: row {ex.prompt_id!r} has a {list(image.shape)} {what} under metadata[{k!r}], but the "
                f"track samples {'' if frames is None else f'model.num_frames={frames} frames of '}sampling.height x "
                f"width = {sampling.height} x {sampling.width}; give {list(want)} {what}s or change the sampling size"
            )
            break
