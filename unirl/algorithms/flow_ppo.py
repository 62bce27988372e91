"""Flow-PPO: Flow-GRPO's clipped loss on per-step GAE advantages from a learned critic.

A diffusion rollout is an MDP over its K SDE steps (the state before step k is (x_{i_k},
sigma_{i_k}, prompt)); the reward r arrives after the last one. A critic
(`unirl.models.flow.value`, trained by `unirl.train.critic.Critic`) records V_k at rollout, and
`advantage.estimator: gae` gives, per sample (`unirl.types.advantages.gae`, the text PPO's):

    delta_k = R_k + gamma V_{k+1} - V_k,  R_k = r [k = K-1],  V_K = 0
    A_k = delta_k + gamma lam A_{k+1},    returns_k = A_k + V_k

whitened over the batch's B*K steps. The loss is `FlowGRPO`'s per step,
max(-A_k r_k, -A_k clip(r_k, 1 - eps, 1 + eps)), with A_k in place of the sample's group
advantage, so siblings are not needed (samples_per_prompt 1 works) and each step gets credit
for how much it moved the value. The critic's loss is `ppo.ValueLoss` on the returns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from unirl.algorithms.flow_grpo import FlowGRPO, FlowGRPOConfig
from unirl.algorithms.ppo import require_gae
from unirl.types.advantages import AdvantageConfig


@dataclass
class FlowPPOConfig(FlowGRPOConfig):
    """Flow-GRPO's settings with PPO's pi_old: recomputed under the training weights before the
    first update (`old_logp_source: replay`), so that update's ratio is exactly 1, and PPO's
    advantages unclipped (`adv_clip_max: null`: the GAE advantages are whitened, and PPO's clipped
    loss, ours for text as verl's, does not clip them; set it to clip as Flow-GRPO does)."""

    old_logp_source: str = "replay"
    adv_clip_max: float | None = None


class FlowPPO(FlowGRPO):
    """Flow-GRPO on per-step GAE advantages [B, K] (`uses_values`: the recipe needs a `critic`
    with `unirl.models.flow.value.FlowValueConfig`, and `advantage.estimator: gae`)."""

    uses_values: ClassVar[bool] = True

    Config: ClassVar[type] = FlowPPOConfig

    @staticmethod
    def check_advantage(advantage: AdvantageConfig) -> None:
        require_gae(advantage, "FlowPPO trains on the critic's per-step GAE advantages")
        if advantage.kl_coef != 0:
            raise ValueError(
                f"advantage.kl_coef={advantage.kl_coef}: a diffusion track has no per-step KL to fold into "
                "the reward; set it to 0 (algorithm.config.beta adds the KL to the loss)"
            )
