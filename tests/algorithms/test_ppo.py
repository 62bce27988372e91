"""PPO for text: GAE against the recurrence written out here (padding, KL in the reward), the
batch whitening, the clipped value loss and its gradient against a direct computation, the
critic's values on the response tokens only (a tiny Qwen3 critic, row by row), and the
mini-batch loop: the first step's ratio exactly 1, one optimizer step per mini-batch, each
mini-batch's loss its own aggregate."""

from __future__ import annotations

import pytest
import torch

from tests.algorithms.test_grpo_family import BigramStage
from unirl.algorithms.advantages import gae, track_advantages, track_value_targets
from unirl.algorithms.ppo import PPO, ValueLoss
from unirl.models.causal_lm import TinyLMConfig
from unirl.models.qwen import QwenBundle, QwenValueConfig
from unirl.train.backend import OptimConfig, TrainBackend
from unirl.train.stack import TrainStack, TrainStackConfig
from unirl.types import AdvantageConfig, RolloutTrack, TokenSegment

LENGTHS = [3, 1, 4, 2]
REWARDS = [1.0, -0.5, 0.3, 0.8]
GAMMA, LAM, KL_COEF = 0.9, 0.8, 0.1


def make_track(values_seed: int = 0) -> RolloutTrack:
    """4 samples of LENGTHS response tokens with rollout values, rollout and reference log-probs."""
    g = torch.Generator().manual_seed(values_seed)
    seg = TokenSegment(
        prompt_ids=[torch.randint(0, 6, (2,), generator=g) for _ in LENGTHS],
        response_ids=[torch.randint(0, 6, (n,), generator=g) for n in LENGTHS],
        log_probs=[-torch.rand(n, generator=g) for n in LENGTHS],
        ref_log_probs=[-torch.rand(n, generator=g) for n in LENGTHS],
        values=[torch.randn(n, generator=g) for n in LENGTHS],
    )
    n = len(LENGTHS)
    return RolloutTrack(
        name="ar",
        sample_ids=[f"s{i}" for i in range(n)],
        group_ids=[f"g{i}" for i in range(n)],
        prompts=["p"] * n,
        metadata=[{}] * n,
        segment=seg,
        rewards=torch.tensor(REWARDS),
    )


def hand_gae(track: RolloutTrack) -> tuple[list[list[float]], list[list[float]]]:
    """Per sample (advantages, returns) by the direct sum A_t = sum_l (gamma lam)^l delta_{t+l},
    delta_t = R_t + gamma V_{t+1} - V_t, V past the end 0, R_t = -kl_coef k1_t (+ r on the last)."""
    seg, advs, rets = track.segment, [], []
    for i, n in enumerate(LENGTHS):
        v = [float(x) for x in seg.values[i]]
        kl = [float(a - b) for a, b in zip(seg.log_probs[i], seg.ref_log_probs[i], strict=True)]
        rew = [-KL_COEF * k + (REWARDS[i] if t == n - 1 else 0.0) for t, k in enumerate(kl)]
        delta = [rew[t] + GAMMA * (v[t + 1] if t + 1 < n else 0.0) - v[t] for t in range(n)]
        a = [sum((GAMMA * LAM) ** k * delta[t + k] for k in range(n - t)) for t in range(n)]
        advs.append(a)
        rets.append([a[t] + v[t] for t in range(n)])
    return advs, rets


def test_gae_matches_the_direct_sum_and_whitens_over_response_tokens():
    track = make_track()
    cfg = AdvantageConfig(estimator="gae", gamma=GAMMA, lam=LAM, kl_coef=KL_COEF, kl_estimator="k1", eps=1e-6)
    advs, rets = hand_gae(track)
    flat = [a for row in advs for a in row]
    mean = sum(flat) / len(flat)
    std = (sum((a - mean) ** 2 for a in flat) / len(flat)) ** 0.5
    got = track_advantages(track, cfg)
    returns = track_value_targets(track, cfg)
    assert got.shape == returns.shape == (4, max(LENGTHS))
    for i, n in enumerate(LENGTHS):
        assert got[i, :n].tolist() == pytest.approx([(a - mean) / (std + 1e-6) for a in advs[i]], abs=1e-5)
        assert returns[i, :n].tolist() == pytest.approx(rets[i], abs=1e-6)
        assert not got[i, n:].any() and not returns[i, n:].any()  # padding stays 0
    # values on padding (here garbage) change nothing: the mask decides
    mask = track.segment.response_mask()
    tr = torch.zeros(4, 4)
    padded = track.segment.padded("values", value=123.0)
    a1, r1 = gae(tr, padded, mask, GAMMA, LAM)
    a2, r2 = gae(tr, track.segment.padded("values"), mask, GAMMA, LAM)
    assert torch.equal(a1, a2) and torch.equal(r1, r2)


def test_gae_settings_are_checked():
    with pytest.raises(ValueError, match=r"advantage.lam must be in \[0, 1\]"):
        AdvantageConfig(estimator="gae", lam=1.5)
    with pytest.raises(ValueError, match=r"advantage.gamma must be in \(0, 1\]"):
        AdvantageConfig(estimator="gae", gamma=-0.1)
    with pytest.raises(ValueError, match="advantage.lam is GAE's lambda"):
        AdvantageConfig(estimator="grpo", lam=0.9)
    with pytest.raises(ValueError, match="set advantage.estimator: gae"):
        PPO().check_advantage(AdvantageConfig(estimator="grpo"))
    track = make_track()
    track.segment.values = None
    with pytest.raises(ValueError, match="needs per-token values"):
        track_advantages(track, AdvantageConfig(estimator="gae"))


class TableCritic:
    """V = a learnable [B, Rmax] table (padding masked out): the value loss's gradient is readable."""

    def __init__(self, init: torch.Tensor) -> None:
        self.module = torch.nn.Module()
        self.module.v = torch.nn.Parameter(init.clone())

    def values(self, track: RolloutTrack) -> torch.Tensor:
        return torch.where(track.segment.response_mask().bool(), self.module.v, 0.0)


def test_clipped_value_loss_and_gradient_match_a_direct_computation():
    track = make_track()
    cfg = AdvantageConfig(estimator="gae", gamma=GAMMA, lam=LAM, kl_coef=KL_COEF, kl_estimator="k1")
    c = 0.3
    old = track.segment.padded("values")
    g = torch.Generator().manual_seed(5)
    stage = TableCritic(old + torch.randn(old.shape, generator=g))  # some tokens beyond +-c, some inside
    loss_fn = ValueLoss(cfg, cliprange_value=c)
    mb = loss_fn.prepare_segment(stage, track)
    n_tok = sum(LENGTHS)
    out = loss_fn.compute_loss_and_backward(
        stage, mb, {"loss_scale": 1.0, "num_tokens": n_tok, "num_samples": 4}
    )
    _, rets = hand_gae(track)
    v, total, clipped_count = stage.module.v.detach(), 0.0, 0
    grad = torch.zeros_like(v)
    for i, n in enumerate(LENGTHS):
        for t in range(n):
            vt, ot, rt = float(v[i, t]), float(old[i, t]), rets[i][t]
            vc = min(max(vt, ot - c), ot + c)
            plain, clip = (vt - rt) ** 2, (vc - rt) ** 2
            total += 0.5 * max(plain, clip)
            if clip > plain:
                clipped_count += 1
                grad[i, t] = (vc - rt) if ot - c < vt < ot + c else 0.0
            else:
                grad[i, t] = vt - rt
    assert out["vf_loss"] == pytest.approx(total / n_tok, rel=1e-5)
    assert out["vf_clipfrac"] == pytest.approx(clipped_count / n_tok)
    assert 0 < clipped_count < n_tok
    assert torch.allclose(stage.module.v.grad, grad / n_tok, atol=1e-6)


def test_critic_values_sit_on_response_tokens_row_by_row():
    """A tiny Qwen3 critic: V_t is the score at position P_i - 1 + t of the row's own unpadded
    forward, 0 past R_i; the backbone starts as the policy's, the head is seeded."""
    cfg = QwenValueConfig(tiny=TinyLMConfig(num_layers=1))
    stage = cfg.build_value_stage()
    policy = QwenBundle.tiny(TinyLMConfig(num_layers=1)).model
    assert all(
        torch.equal(p, stage.module.model.state_dict()[k]) for k, p in policy.model.state_dict().items()
    )
    assert torch.equal(stage.module.score.weight, cfg.build_value_stage().module.score.weight)
    g = torch.Generator().manual_seed(0)
    prompts, responses = [5, 2, 7], [3, 6, 1]
    seg = TokenSegment(
        prompt_ids=[torch.randint(0, 200, (p,), generator=g) for p in prompts],
        response_ids=[torch.randint(0, 200, (r,), generator=g) for r in responses],
        log_probs=[torch.zeros(r) for r in responses],
    )
    with torch.no_grad():
        values = stage.token_values(seg)
        assert values.shape == (3, 6)
        for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
            ids = torch.cat([seg.prompt_ids[i], seg.response_ids[i]])[None]
            scores = stage.module(input_ids=ids).logits[0, :, 0]
            assert torch.allclose(values[i, :r], scores[p - 1 : p - 1 + r], atol=1e-5)
            assert not values[i, r:].any()


def test_mini_batches_first_step_exactly_on_policy_and_each_its_own_aggregate():
    """2 epochs x 2 mini-batches of one micro-batch each: 4 optimizer steps, the first step's ratio
    exactly 1 (pi_old replayed), and each step's gradient that of its mini-batch as a whole batch."""
    torch.manual_seed(0)
    track = make_track()
    track.advantages = torch.tensor(
        [[0.5, -1.0, 2.0, 0.0], [1.0, 0, 0, 0], [-0.3, 0.2, 0.7, -1.2], [0.4, 0.9, 0, 0]]
    )
    stage = BigramStage()
    initial = stage.module.table.detach().clone()
    backend = TrainBackend(stage.module, None, OptimConfig(lr=0.1, weight_decay=0.0), 4)
    stack = TrainStack(
        stage,
        backend,
        PPO(),
        TrainStackConfig(micro_batch_size=2, num_updates_per_batch=2, num_mini_batches=2),
    )
    grads, step = [], backend.optimizer_step

    def record():
        grads.append(stage.module.table.grad.clone())
        return step()

    backend.optimizer_step = record
    out = stack.train_track(track, 0.0)
    assert backend.optimizer_steps == 4 and out["ratio/first_update_mean"] == 1.0 and out["ratio/mean"] != 1.0
    # the first mini-batch (samples 0, 1) alone, as one batch, from the initial weights
    fresh = BigramStage()
    fresh.module.table.data.copy_(initial)
    mini = PPO().prepare_segment(fresh, track.select([0, 1]))
    PPO().compute_loss_and_backward(fresh, mini, {"loss_scale": 1.0})
    assert torch.allclose(grads[0], fresh.module.table.grad, atol=1e-6)
