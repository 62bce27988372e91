"""Rules of a distillation recipe: a loss that trains on teachers' predictions, not on a reward
(an algorithm class with `uses_reward = False`, DiffusionOPD).

Its reward components only monitor (every weight 0: a weighted one would be a training reward
the loss never reads); it distils LoRA teachers into a LoRA student on one rank, and each
teacher's LoRA layout (adapted modules, rank, alpha) is the student's (`train.lora` on the
model's module tree, read on the meta device); an ODE rollout keeps its trajectory (the visited
states); every prompt of the data source names a data source that has a teacher.
"""

from __future__ import annotations

import os
from typing import Any

from omegaconf import DictConfig

from unirl.config.distributed import meta_module
from unirl.types.sampling import DiffusionSamplingParams


def reward_weights(built: Any) -> dict[str, float] | None:
    """Component name -> weight of the recipe's built reward service; None when it did not build
    (phase 1 reported why), a remote backend (not asked) or one that cannot say."""
    backend = getattr(built, "backend", None)
    if getattr(backend, "url", None) is not None:  # a reward server: asking it is not validation's job
        return None
    try:
        return {k: float(v) for k, v in backend.weights.items()}
    except Exception:  # noqa: BLE001 - no backend, or a remote one that cannot answer now
        return None


def check_distillation(
    cfg: DictConfig, passed: dict[str, Any], algorithm: type | None, sampling: Any, problems: list[str]
) -> None:
    """A teacher-distillation algorithm's recipe: no training reward, LoRA on one rank, teachers
    with the student's LoRA layout, the trajectory kept for ODE rollouts, a teacher per source."""
    if algorithm is None or getattr(algorithm, "uses_reward", True):
        return
    if getattr(algorithm, "learns_from_demonstrations", False):  # supervised: unirl.config.supervised
        return
    name = algorithm.__name__
    weights = reward_weights(passed.get("reward"))
    weighted = sorted(k for k, w in (weights or {}).items() if w != 0)
    if weighted:
        problems.append(
            f"reward.backend.weights: {name} trains on its teachers' predictions, not on a reward, but "
            f"{weighted} weigh {[weights[k] for k in weighted]}; set every weight to 0.0 (the components then "
            "only monitor the rollouts) and score the student with eval.scorer"
        )
    run = passed.get("")
    if run is not None and run.num_devices != 1:
        problems.append(
            f"num_devices={run.num_devices}: {name} swaps each teacher's LoRA into the student's unsharded "
            "parameters, so it runs on one rank; set num_devices: 1"
        )
    if isinstance(sampling, DiffusionSamplingParams) and sampling.eta == 0:
        stage = cfg.get("stage")
        if not (stage is not None and stage.get("store_trajectory")):
            problems.append(
                f"stage.store_trajectory: {name} trains on the states an ODE rollout visited (sampling.eta 0), "
                "so the stage must keep them; set stage.store_trajectory: true"
            )
    built = passed.get("algorithm")
    config = getattr(built, "config", None)
    if config is None:
        return
    lora, model = passed.get("train.lora"), passed.get("model")
    if "train" in passed and cfg.train.get("lora") is None:
        problems.append(
            f"train.lora is null: {name} distils LoRA teachers into a LoRA student; set train.lora"
        )
        lora = None
    if lora is not None and lora.dropout > 0:
        problems.append(
            f"train.lora.dropout={lora.dropout}: {name} runs its teachers through the student's LoRA layers, "
            "so dropout would noise the teachers' targets; set train.lora.dropout: 0"
        )
    check_teachers(config, lora, model, problems)
    source = passed.get("data_source")
    examples = getattr(source, "examples", None)
    if examples:
        key = config.source_key
        missing = sorted({str(e.metadata.get(key)) for e in examples} - set(config.teachers))
        if missing:
            problems.append(
                f"data_source: prompts name data sources {missing} (metadata `{key}`, algorithm.config.source_key) "
                f"that have no teacher in algorithm.config.teachers ({sorted(config.teachers)}); add a teacher "
                "for each, or tag the prompts"
            )


def check_teachers(config: Any, lora: Any, model: Any, problems: list[str]) -> None:
    """Each teacher directory holds a LoRA export whose layout is the student's."""
    from unirl.algorithms.diffusion_opd import layout_problems, read_teacher, student_layout

    student = None
    if lora is not None and model is not None and hasattr(model, "trainable_on_meta"):
        try:
            student = student_layout(meta_module(model), list(lora.target_modules), lora.rank, lora.alpha)
        except Exception:  # noqa: BLE001 - an unreadable model is check_model_path's report
            student = None
    for source, path in config.teachers.items():
        key = f"algorithm.config.teachers.{source}"
        if not os.path.isdir(path):
            problems.append(
                f"{key}={path}: not a directory; give a teacher's LoRA export (a run's checkpoints/final)"
            )
            continue
        try:
            _, layout = read_teacher(path)
        except (OSError, ValueError) as exc:
            problems.append(f"{key}={path}: {exc}")
            continue
        if student is not None:
            problems.extend(layout_problems(source, path, layout, student))
