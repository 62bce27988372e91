"""The `StageAlgorithm` contract: one loss bound to one track."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar, Literal

from unirl.models.stage import DiffusionStage, TextStage
from unirl.types.rollout_resp import RolloutTrack

# pi_old of a policy-gradient loss: the log-probs recorded at sampling time, or recomputed ("replay")
# under the training weights before the first update (the ratio is then exactly 1 on it)
OldLogpSource = Literal["rollout", "replay"]


class StageAlgorithm(ABC):
    """A loss over one track's samples.

    Lifecycle per rollout, driven by `TrainStack.train_track` on each rank:
      1. `prepare_segment(stage, micro_batch)` once per micro-batch, before any
         update: freeze pi_old (returns the micro-batch with old log-probs set).
      2. for each of `num_updates_per_batch` updates and each micro-batch:
         `compute_loss_and_backward(stage, micro_batch, ctx)` replays the
         stage under the current weights, computes the loss, calls backward
         (scaled by `ctx["loss_scale"]`) and returns float metrics.

    Class attributes:
        Config: the loss's config dataclass (`algorithm.config`; None for a loss without
            settings); `__init__(config=None)` keeps `config`, or `Config()` (its defaults).
        modality: "diffusion" or "text", the tracks the loss reads (validation
            refuses a recipe whose sampling, model and algorithm disagree).
        supports_multi_update: may run several optimizer updates per rollout.
        requires_ema_rollout: rollouts must come from EMA weights.
        requires_sde_logprobs: needs per-step log-probs (sampling.eta > 0).
        supports_kept_graph: can train from graphs kept at sampling
            (`rollout.keep_graph`): `prepare_segment` then takes `kept` (a
            `unirl.rollout.kept.KeptGraphs`) as a keyword, and
            `compute_loss_and_backward` reads `ctx["kept"]` for the pairs it
            covers and appends those losses (scaled as it would backpropagate
            them) to `ctx["deferred"]` instead of calling backward.
        compares_within_groups: the loss compares the samples of a prompt group with
            each other (preference pairs), so it needs samples_per_prompt >= 2 and
            whole groups in every micro-batch (micro_batch_size a multiple of
            samples_per_prompt); validation checks both before Ray starts.
        uses_values: the loss trains on a critic's values (PPO: GAE advantages), so the
            recipe needs a `critic`; a recipe with a critic needs such a loss.
        uses_reward: the loss trains on the rollout's rewards (through its advantages). A
            loss that does not (distillation from teachers: DiffusionOPD) sets it False, and
            validation then refuses a weighted reward component (weight-0 monitors only).
        learns_from_demonstrations: a supervised loss (`unirl.algorithms.sft`): its batch is the
            data's demonstrations (`rollout: unirl.rollout.demonstrations.DemonstrationEngine`), so
            the recipe has no reward and no advantage (both null); validation holds the pairing.

    State that evolves over training (an adaptive KL coefficient) is updated in
    `end_of_rollout` and saved with the checkpoint through `state_dict` /
    `load_state_dict`.
    """

    Config: ClassVar[type | None] = None
    modality: ClassVar[str | None] = None
    supports_multi_update: ClassVar[bool] = False
    requires_ema_rollout: ClassVar[bool] = False
    requires_sde_logprobs: ClassVar[bool] = False
    supports_kept_graph: ClassVar[bool] = False
    compares_within_groups: ClassVar[bool] = False
    uses_values: ClassVar[bool] = False
    uses_reward: ClassVar[bool] = True
    learns_from_demonstrations: ClassVar[bool] = False

    def __init__(self, config: Any = None) -> None:
        self.config = self.Config() if config is None and self.Config is not None else config

    def dynamic_sampling_limit(self) -> int | None:
        """Dynamic sampling: None (the default) trains on every sampled group; an int n lets the
        driver generate up to n rollouts per step, keeping the samples `keep_groups` returns,
        until the train batch is full (DAPO)."""
        return None

    def keep_groups(self, rewards, group_ids: list[str]) -> list[int]:
        """With dynamic sampling: the indices of the samples to keep from one generation
        (rewards [B], group ids per sample). The default keeps every sample."""
        return list(range(len(group_ids)))

    @property
    def needs_reference_policy(self) -> bool:
        """Whether the loss evaluates the reference policy (the backend then keeps it)."""
        return False

    @property
    def snapshots(self) -> dict[str, dict[str, Any]]:
        """EMA snapshots of the policy the loss evaluates, {name: `unirl.train.ema.EMAConfig`
        keywords}: the backend keeps and updates them and the loss context carries
        `ctx["snapshots"][name]`, a context-manager factory that swaps the snapshot's weights
        in. Default: none."""
        return {}

    def prepare_segment(self, stage: DiffusionStage | TextStage, track: RolloutTrack) -> RolloutTrack:
        return track

    def end_of_rollout(
        self, stage: DiffusionStage | TextStage, metrics: dict[str, float], num_samples: int
    ) -> dict[str, float]:
        """Called by the train stack on every rank at once after a rollout's updates, with
        this rank's metrics of them and the samples trained over all ranks; may run
        collectives; returns metrics to add to the step's row. Default: nothing."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to continue identically (saved per rank)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()`'s output (the default state is empty)."""
        if state:
            raise ValueError(f"{type(self).__name__} keeps no state, got {sorted(state)}")

    @abstractmethod
    def compute_loss_and_backward(
        self, stage: DiffusionStage | TextStage, track: RolloutTrack, ctx: dict[str, Any]
    ) -> dict[str, float]:
        """Loss on one micro-batch; calls backward; returns float metrics."""
