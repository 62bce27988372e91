"""Checkpoint directories of a run: naming, the driver's state, completeness, and `resume_from`.

`<output_dir>/checkpoints/step_000012/` holds the workers' train state (see
`unirl.train.checkpoint`), `weights/` (exported, diffusers-loadable),
`driver_state.json` (step, data-source position, the recipe's model and
geometry) and, written last, `COMPLETE`. Only complete checkpoints resume.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any

from omegaconf import DictConfig, OmegaConf

COMPLETE = "COMPLETE"


def saves_base_model(cfg: DictConfig) -> bool:
    """`checkpoint.save_base_model` (default true): write a random model's base before training."""
    return bool((cfg.get("checkpoint") or {}).get("save_base_model", True))


def checkpoint_dir(output_dir: str, step: int) -> str:
    return os.path.join(output_dir, "checkpoints", f"step_{step:06d}")


def mark_complete(path: str) -> None:
    with open(os.path.join(path, COMPLETE), "w") as f:
        f.write("ok\n")


def _identity(cfg: DictConfig) -> dict[str, Any]:
    """What a checkpoint must agree on with the recipe that resumes it (a composed recipe: per
    track, its model, whether it is trained and its LoRA; a unified recipe: its one model and
    LoRA, and which segments are trained)."""
    if "tracks" in cfg and "model" not in cfg:
        tracks = {}
        for name, node in cfg.tracks.items():
            lora = node.get("train", {}).get("lora") if node.get("train") else None
            tracks[name] = {
                "model": OmegaConf.to_container(node.model, resolve=True),
                "trained": bool(node.get("trained", True)),
                "lora": OmegaConf.to_container(lora, resolve=True) if lora else None,
            }
        return {"tracks": tracks, "num_devices": int(cfg.num_devices)}
    identity = {
        "model": OmegaConf.to_container(cfg.model, resolve=True),
        "num_devices": int(cfg.num_devices),
        "lora": OmegaConf.to_container(cfg.train.get("lora"), resolve=True)
        if cfg.train.get("lora")
        else None,
    }
    if "tracks" in cfg:
        identity["trained"] = {name: bool(node.get("trained", True)) for name, node in cfg.tracks.items()}
    return identity


def write_driver_state(
    path: str,
    step: int,
    data_source_state: dict[str, Any],
    cfg: DictConfig,
    save_s: float | None = None,
    extra: dict[str, Any] | None = None,
) -> None:
    """`driver_state.json`: step, data-source position, the recipe identity, `save_s`, the
    seconds the workers took to write their state, and `extra` keys (a run with a rollout in
    flight records the weight version its engines sample)."""
    state = {"step": step, "data_source": data_source_state, "identity": _identity(cfg), "save_s": save_s}
    state.update(extra or {})
    with open(os.path.join(path, "driver_state.json"), "w") as f:
        json.dump(state, f, indent=2)


def read_driver_state(path: str) -> dict[str, Any]:
    with open(os.path.join(path, "driver_state.json")) as f:
        return json.load(f)


def latest_checkpoint(output_dir: str) -> str | None:
    """The complete checkpoint with the highest step under `output_dir`, or None."""
    done = [
        p
        for p in glob.glob(os.path.join(output_dir, "checkpoints", "step_*"))
        if os.path.exists(os.path.join(p, COMPLETE))
    ]
    return max(done, key=lambda p: int(os.path.basename(p).split("_")[1])) if done else None


def resolve_resume_path(cfg: DictConfig) -> str | None:
    """The checkpoint directory `resume_from` names, checked against the recipe.

    `resume_from: null` -> None; `latest` -> the newest complete checkpoint in
    `output_dir`; otherwise a checkpoint directory. Raises ValueError naming
    `resume_from` when the path is missing or incomplete, or when the
    checkpoint's model, LoRA or num_devices differ from the recipe's.
    """
    spec = cfg.get("resume_from")
    if spec is None:
        return None
    if spec == "latest":
        path = latest_checkpoint(str(cfg.output_dir))
        if path is None:
            raise ValueError(
                f"resume_from=latest: no complete checkpoint under {os.path.join(str(cfg.output_dir), 'checkpoints')}; "
                "run with checkpoint.every_n_steps > 0 first, or set resume_from=null"
            )
    else:
        path = str(spec)
        if not os.path.isdir(path):
            raise ValueError(f"resume_from={path!r} does not exist; give a checkpoint directory or 'latest'")
        if not os.path.exists(os.path.join(path, COMPLETE)):
            raise ValueError(f"resume_from={path!r} is not a complete checkpoint (no {COMPLETE} marker)")
    saved = read_driver_state(path)["identity"]
    current = _identity(cfg)
    diff = [k for k in current if saved.get(k) != current[k]]
    if diff:
        details = "; ".join(f"{k}: checkpoint {saved.get(k)!r} vs recipe {current[k]!r}" for k in diff)
        raise ValueError(f"resume_from={path!r} does not match the recipe ({details})")
    return path


def resume_problem(state: dict[str, Any], settings: Any, path: str) -> str | None:
    """Why a checkpoint's rollouts in flight cannot resume under the recipe's rollout settings (a
    checkpoint with partial rollouts in flight needs `partial_tokens`, one with whole rollouts in
    flight needs it off), or None."""
    if state.get("engine_weights_version") is None:
        return None
    partial = "partial_versions" in state
    if partial == bool(settings.partial_tokens):
        return None
    return (
        f"resume_from={path}: the checkpoint was taken with {'partial' if partial else 'whole'} rollouts in "
        f"flight but the recipe has rollout.partial_tokens={settings.partial_tokens}; resume with the "
        "partial_tokens of the run that wrote it (or from a checkpoint without rollouts in flight)"
    )
