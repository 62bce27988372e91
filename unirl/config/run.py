"""Schemas of the recipe keys that configure no component: the run itself.

An RL recipe's top level (diffusion or text) is `RunConfig`; its plain sections (no
`_target_`) are `CheckpointConfig`, `LoggingConfig`, `EvalConfig` and
`TrainConfig`. Component sections (`sampling`, `model`, ...) are `_target_`
nodes checked against their own classes, so here they are only required to be
present. `unirl.config.validate` checks a recipe against these with the same
mechanism as every component config (`unirl.config.schema.check_node`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from unirl.models.source import DTYPES, DType
from unirl.sync.config import WeightSyncConfig
from unirl.train.fsdp import ParallelConfig
from unirl.types.constraints import NonNegativeInt, check_fields

LAUNCHERS = ("ray", "in_process")


def _components(section: str, node: Any, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> None:
    """Component slots hold `_target_` nodes (optional ones may be null)."""
    for key in required + optional:
        value = getattr(node, key)
        if (value is not None or key in required) and not (isinstance(value, dict) and "_target_" in value):
            raise ValueError(f"{section}{key} must be a _target_ node naming its class, got {value!r}")


def _at_least(section: str, key: str, value: int | None, low: int) -> None:
    if value is not None and value < low:
        raise ValueError(f"{section}{key} must be >= {low}, got {value}")


def check_run_top_level(run: Any, components: tuple[str, ...], optional: tuple[str, ...] = ()) -> None:
    """The top-level rules of every RL recipe (single-track and composed): the counts are >= 1,
    the `components` are `_target_` nodes (the `optional` ones may be null), the launcher is
    known, and `in_process` runs one worker on the inband transport."""
    for key in ("num_devices", "num_steps", "prompts_per_rollout", "threads_per_worker"):
        _at_least("", key, getattr(run, key), 1)
    _components("", run, components, optional)
    if run.launcher not in LAUNCHERS:
        raise ValueError(f"launcher must be one of {LAUNCHERS}, got {run.launcher!r}")
    if run.max_seconds is not None and not run.max_seconds > 0:
        raise ValueError(f"max_seconds must be > 0 or null, got {run.max_seconds}")
    transport = (run.transport or {}).get("name") if isinstance(run.transport, dict) else None
    if run.launcher == "in_process" and (run.num_devices != 1 or transport != "inband"):
        raise ValueError(
            f"launcher=in_process runs one worker in this process without Ray: it needs num_devices=1 "
            f"and transport=inband, got num_devices={run.num_devices}, transport={transport}"
        )


@dataclass(kw_only=True)
class RunBase:
    """The top-level keys every kind of RL recipe shares (single-track `RunConfig`, composed
    `ComposedRunConfig`, unified `UnifiedRunConfig`); a kind adds its own and names its
    `_target_` slots in `COMPONENTS`.

    Attributes:
        num_devices: data-parallel workers (GPUs, or CPU slots on a CPU machine).
        num_steps: rollout -> train steps of the run.
        seed: base seed of the run.
        output_dir: where metrics, samples and checkpoints go.
        prompts_per_rollout: prompts drawn per step (each sampled
            `sampling.samples_per_prompt` times; a composed root track's).
        data_source, transport: the prompts (`_target_` node) and the data plane.
        threads_per_worker: torch threads per worker (null: CPU cores / num_devices).
        resume_from: a checkpoint directory, `latest`, or null.
        max_seconds: the wall clock of one invocation (null: none): after the step that passes it
            the run writes a checkpoint and stops (exit 0, no final export); `resume_from=latest`
            continues it exactly.
        launcher: "ray" (workers are Ray actors) or "in_process" (one worker in
            the driver process, no Ray).
        checkpoint, logging, eval: plain sections (see their schemas).
        tracking: trackers beside metrics.jsonl, by name (`unirl/tracking/README.md`;
            checked by `unirl.config.references.check_tracking`).
        hydra: Hydra's own settings.
    """

    num_devices: int
    num_steps: int
    seed: int
    output_dir: str
    prompts_per_rollout: int
    data_source: Any
    transport: Any
    threads_per_worker: int | None = None
    resume_from: str | None = None
    max_seconds: float | None = None
    launcher: str = "ray"
    checkpoint: Any = None
    logging: Any = None
    eval: Any = None
    tracking: Any = None
    hydra: Any = None

    COMPONENTS: ClassVar[tuple[str, ...]] = ("data_source",)
    OPTIONAL: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        check_run_top_level(self, self.COMPONENTS, self.OPTIONAL)


@dataclass(kw_only=True)
class RunConfig(RunBase):
    """The top level of a single-track RL recipe (diffusion or text): `RunBase`'s keys and

    Attributes:
        sampling, model, stage, rollout, reward, advantage, algorithm: component sections,
            each a `_target_` node; `reward` and `advantage` are null exactly for a supervised
            track (`unirl.config.supervised.check_supervised`).
        train: the train backend's section (`TrainConfig`).
        weight_sync: how the trainer's weights reach a dedicated rollout engine
            (`unirl.sync.WeightSyncConfig`); only with a dedicated engine.
        critic: PPO's value model and its training (`unirl.train.critic.CriticConfig`),
            or null (checked by `unirl.config.critic.check_critic`).
        export_dir: where the trained model is written after the last step as a whole model
            directory in its library's layout (`model.pretrained_path` loads it: what a supervised
            track that makes a base, such as `diffusion/shapes_sft`, ends with), its weights in
            `export_dtype`: the weights of `checkpoints/final` (a LoRA fused in; not the EMA's of
            `final_ema`); null: only `checkpoints/final`.
        export_dtype: "float16" (default), "bfloat16" or "float32".
    """

    sampling: Any
    model: Any
    stage: Any
    rollout: Any
    reward: Any
    advantage: Any
    algorithm: Any
    train: Any
    weight_sync: Any = None
    critic: Any = None
    export_dir: str | None = None
    export_dtype: DType = "float16"

    COMPONENTS: ClassVar[tuple[str, ...]] = (
        "sampling",
        "model",
        "stage",
        "rollout",
        "algorithm",
        "data_source",
    )
    OPTIONAL: ClassVar[tuple[str, ...]] = ("reward", "advantage")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.export_dtype not in DTYPES:
            raise ValueError(f"export_dtype must be one of {list(DTYPES)}, got {self.export_dtype!r}")
        if self.export_dir is not None and not str(self.export_dir).strip():
            raise ValueError(
                "export_dir is empty; give the directory to write the model to, or null for none"
            )
        random_model = not (self.model or {}).get("pretrained_path")
        if self.export_dir and random_model and not (self.checkpoint or {}).get("save_base_model", True):
            raise ValueError(
                f"export_dir={self.export_dir!r} writes the trained model onto its base, but "
                "checkpoint.save_base_model=false leaves a random model's base unwritten; drop one of them"
            )


@dataclass
class CheckpointConfig:
    """`checkpoint`: `every_n_steps` between resumable checkpoints (0: only the final weights).

    `save_base_model`: a model with random weights (no `pretrained_path`) is written to
    `output_dir/base_model/` before training, so its exports load onto it. false skips that: a
    real-size random model's base is tens of GB (a Qwen-Image-sized one 82 GB); its exports then
    load only onto the same seeded model built on the same kind of device."""

    every_n_steps: NonNegativeInt = 0
    save_base_model: bool = True

    def __post_init__(self) -> None:
        check_fields(self, "checkpoint.")


@dataclass
class LoggingConfig:
    """`logging`: sample grids every `save_images_every` steps and at the last step (0: none); a progress bar."""

    save_images_every: NonNegativeInt = 10
    progress: bool = True

    def __post_init__(self) -> None:
        check_fields(self, "logging.")


@dataclass
class EvalConfig:
    """`eval` of every kind of run (run by `unirl.trainer.evaluation.Evaluator`): held-out
    evaluation every `every_n_steps` steps (0: none) and at the end, from the EMA weights when
    `use_ema`. `examples`, `scorer` and `sampling` are `_target_` nodes.

    Attributes:
        examples: held-out prompts (a list of `PromptExample`s, or a dataset holding them in
            `.examples`).
        scorer: a single track's: an image scorer (`evaluate(images, prompts) -> dict`) or a text
            reward scorer (1 = right); a chain's: the image scorer of its leaf's images.
        sampling: how the leaf samples (`EvalSampling`: diffusion; `TextEvalSampling`: text;
            a shared backbone's image: `ImageTokenSamplingParams`).
        every_n_steps, use_ema: when, and from which weights (every trained track's EMA).
        text_sampling: a chain's: how its root decodes (`TextEvalSampling`; greedy is used);
            null for a single track.
        intent_key: a chain's: the metadata key of the scene the user asked for (scored against).
        rewrite_scorer: a chain's: an optional text scorer of the root's greedy rewrites.
        group_by: a chain's: metadata keys to break the strict accuracy down by.
        references: a chain's: also measure the floor and the ceiling at step 0.
    """

    examples: Any
    scorer: Any
    sampling: Any
    every_n_steps: NonNegativeInt = 0
    use_ema: bool = False
    text_sampling: Any = None
    intent_key: str = "canonical"
    rewrite_scorer: Any = None
    group_by: list[str] = field(default_factory=list)
    references: bool = True

    CHAIN_KEYS: ClassVar[tuple[str, ...]] = (
        "text_sampling",
        "intent_key",
        "rewrite_scorer",
        "group_by",
        "references",
    )

    def __post_init__(self) -> None:
        self.group_by = list(self.group_by)
        check_fields(self, "eval.")
        _components("eval.", self, ("examples", "scorer", "sampling"), ("text_sampling", "rewrite_scorer"))


def check_eval_keys(cfg: Any, chain: bool, problems: list[str]) -> None:
    """A chain's `eval` names how its root decodes (`eval.text_sampling`) and, with `use_ema`,
    every trained track keeps an EMA (the shared `train.ema` of a backbone, else each
    `tracks.<name>.train.ema`); a single track's sets none of the chain's keys
    (`EvalConfig.CHAIN_KEYS`; its own EMA rule is a track rule)."""
    ev = cfg.get("eval")
    if ev is None or not hasattr(ev, "keys"):
        return
    if chain and ev.get("text_sampling") is None:
        problems.append(
            "eval.text_sampling: missing; a chain's evaluation decodes its root greedily with it "
            "(_target_: unirl.trainer.text_eval.TextEvalSampling)"
        )
    if chain and ev.get("use_ema") is True:
        tracks = cfg.get("tracks") if hasattr(cfg.get("tracks"), "items") else {}
        trains = (
            {"train": cfg.get("train")}
            if cfg.get("train") is not None
            else {
                f"tracks.{name}.train": node.get("train")
                for name, node in tracks.items()
                if hasattr(node, "get") and node.get("trained", True) is not False
            }
        )
        problems.extend(
            f"eval.use_ema=true evaluates every trained track's EMA weights, but {key}.ema is null; set "
            "it to {_target_: unirl.train.ema.EMAConfig, decay: 0.999} or eval.use_ema: false"
            for key, train in trains.items()
            if hasattr(train, "get") and train.get("ema") is None
        )
    if not chain:
        problems.extend(
            f"eval.{key}: a chain's key (the root's rewrites feed the leaf); a single track's eval takes "
            "examples, scorer, sampling, every_n_steps and use_ema"
            for key in EvalConfig.CHAIN_KEYS
            if key in ev
        )


@dataclass
class TrainConfig:
    """`train`: the train backend's components (`_target_` nodes; `lora`, `fsdp`, `ema`
    may be null), the device mesh (`parallel`: plain keys, a `ParallelConfig`) and whether Adam
    moments move to host memory while sampling."""

    optim: Any
    stack: Any
    lora: Any = None
    fsdp: Any = None
    ema: Any = None
    parallel: Any = None
    offload_optimizer_during_rollout: bool = False

    def __post_init__(self) -> None:
        _components("train.", self, ("optim", "stack"), ("lora", "fsdp", "ema"))
        self.parallel = ParallelConfig.of(self.parallel)


RL_SECTIONS: dict[str, type] = {
    "": RunConfig,
    "checkpoint": CheckpointConfig,
    "logging": LoggingConfig,
    "eval": EvalConfig,
    "train": TrainConfig,
    "weight_sync": WeightSyncConfig,
}
