"""GRPO, DAPO, Dr.GRPO, GSPO and DRPO on a text track: the on-policy invariants, exact micro-batch
accumulation, GSPO's sequence ratio, DRPO's loss and gradient, the KL loss term, DAPO's group filter
and the config errors. The stage is a bigram table (a learnable [V, V] logit table indexed by the
previous token): a small differentiable stand-in for `TextStage.token_log_probs`."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from unirl.algorithms.dapo import DAPO, DAPOConfig
from unirl.algorithms.dr_grpo import DrGRPO, DrGRPOConfig
from unirl.algorithms.drpo import DRPO, DRPOConfig
from unirl.algorithms.grpo import GRPO, GRPOConfig
from unirl.algorithms.gspo import GSPO, GSPOConfig
from unirl.types import AdvantageConfig, RolloutTrack, TokenSegment
from unirl.types.segments import pad_right

VOCAB = 6
LENGTHS = [3, 1, 4, 2]  # 10 response tokens over 4 samples, two groups of two
ADV = [1.5, -1.5, -0.5, 0.5]
C = 5.0  # norm_constant for seq-mean-token-sum-norm


class BigramStage:
    """log p(token | previous token) = log_softmax(table[previous] / temperature); the reference policy is
    a fixed second table swapped in by `reference()`."""

    def __init__(self, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.module = torch.nn.Module()
        self.module.table = torch.nn.Parameter(torch.randn(VOCAB, VOCAB, generator=g))
        self.ref_table = torch.randn(VOCAB, VOCAB, generator=g)

    def token_log_probs(self, seg: TokenSegment) -> torch.Tensor:
        rows = []
        for p, r in zip(seg.prompt_ids, seg.response_ids, strict=True):
            prev = torch.cat([p[-1:], r[:-1]])
            lp = torch.log_softmax(self.module.table[prev] / seg.temperature, dim=-1)
            rows.append(lp.gather(1, r[:, None]).squeeze(1))
        return pad_right(rows)

    @contextlib.contextmanager
    def reference(self):
        saved = self.module.table.data.clone()
        self.module.table.data.copy_(self.ref_table)
        try:
            yield
        finally:
            self.module.table.data.copy_(saved)


def make_track(stage: BigramStage, shift: list[float] | None = None) -> RolloutTrack:
    """4 samples of lengths LENGTHS; rollout log-probs are the stage's own (on-policy) plus `shift[i]`
    times a fixed per-token pattern (off-policy when given)."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (2,), generator=g) for _ in LENGTHS]
    responses = [torch.randint(0, VOCAB, (n,), generator=g) for n in LENGTHS]
    seg = TokenSegment(
        prompt_ids=prompts, response_ids=responses, log_probs=[torch.zeros(n) for n in LENGTHS]
    )
    with torch.no_grad():
        lp = stage.token_log_probs(seg)
    rows = []
    for i, n in enumerate(LENGTHS):
        pattern = torch.tensor([1.0, -0.5, 0.75, -1.0][:n])
        rows.append(lp[i, :n] + (shift[i] * pattern if shift else 0.0))
    seg = TokenSegment(prompt_ids=prompts, response_ids=responses, log_probs=rows)
    return RolloutTrack(
        name="ar",
        sample_ids=[str(i) for i in range(4)],
        group_ids=["a", "a", "b", "b"],
        prompts=["p"] * 4,
        metadata=[{} for _ in range(4)],
        segment=seg,
        rewards=torch.tensor([1.0, 0.0, 0.0, 1.0]),
        advantages=torch.tensor(ADV),
    )


def ctx_for(stage: BigramStage, loss_scale: float = 1.0, totals: bool = True) -> dict:
    ctx = {"loss_scale": loss_scale, "progress": 0.0, "reference": stage.reference}
    if totals:
        ctx.update(num_tokens=float(sum(LENGTHS)), num_samples=float(len(LENGTHS)))
    return ctx


def run(algo, stage: BigramStage, track: RolloutTrack, **ctx_kwargs) -> tuple[dict, torch.Tensor]:
    stage.module.zero_grad()
    track = algo.prepare_segment(stage, track)
    metrics = algo.compute_loss_and_backward(stage, track, ctx_for(stage, **ctx_kwargs))
    return metrics, stage.module.table.grad.clone()


# on-policy, every token's loss is -A_i: the aggregate by hand
TOKEN_MEAN = -sum(a * n for a, n in zip(ADV, LENGTHS, strict=True)) / sum(LENGTHS)  # -(4.5-1.5-2+1)/10
SEQ_MEAN = -sum(ADV) / 4  # 0.0
SUM_NORM = -sum(a * n / C for a, n in zip(ADV, LENGTHS, strict=True)) / 4

ON_POLICY = [
    (GRPO, GRPOConfig, TOKEN_MEAN),
    (DAPO, DAPOConfig, TOKEN_MEAN),
    (DrGRPO, lambda **kw: DrGRPOConfig(norm_constant=C, **kw), SUM_NORM),
    (GSPO, GSPOConfig, SEQ_MEAN),
    (DRPO, DRPOConfig, TOKEN_MEAN),
]


@pytest.mark.parametrize(("cls", "make_cfg", "expected"), ON_POLICY)
@pytest.mark.parametrize("source", ["rollout", "replay"])
def test_first_on_policy_update(cls, make_cfg, expected: float, source: str) -> None:
    stage = BigramStage()
    track = make_track(stage)
    if source == "replay":  # the recorded log-probs are wrong; replay must replace them
        track.segment.log_probs = [lp - 0.3 for lp in track.segment.log_probs]
    algo = cls(make_cfg(old_logp_source=source))
    metrics, grad = run(algo, stage, track)
    assert metrics["ratio/mean"] == 1.0 and metrics["ratio/min"] == 1.0 and metrics["ratio/max"] == 1.0
    assert metrics["loss"] == pytest.approx(expected, abs=1e-7)
    assert metrics["policy_loss"] == metrics["loss"]
    assert metrics["approx_kl"] == 0.0
    assert metrics["response_length/mean"] == sum(LENGTHS) / 4
    # the gradient is the policy gradient -A grad(logp), aggregated the same way
    stage.module.zero_grad()
    logp = stage.token_log_probs(track.segment)
    per_seq = [sum(logp[i, t] for t in range(n)) for i, n in enumerate(LENGTHS)]
    if expected is TOKEN_MEAN:
        pg = -sum(a * s for a, s in zip(ADV, per_seq, strict=True)) / sum(LENGTHS)
    elif expected is SEQ_MEAN:
        pg = -sum(a * s / n for a, s, n in zip(ADV, per_seq, LENGTHS, strict=True)) / 4
    else:
        pg = -sum(a * s / C for a, s in zip(ADV, per_seq, strict=True)) / 4
    pg.backward()
    assert torch.allclose(grad, stage.module.table.grad, atol=1e-6)


def test_per_token_advantages() -> None:
    stage = BigramStage()
    track = make_track(stage)
    adv = torch.zeros(4, 5)  # wider than the longest response (4): the extra column is ignored
    for i, n in enumerate(LENGTHS):
        adv[i, :n] = torch.arange(1, n + 1) * (-1) ** i
    track.advantages = adv
    metrics, _ = run(GRPO(), stage, track)
    # tokens: [1, 2, 3], [-1], [1, 2, 3, 4], [-1, -2] -> -(6 - 1 + 10 - 3) / 10
    assert metrics["loss"] == pytest.approx(-12 / 10)
    with pytest.raises(ValueError, match="GSPO needs one per sample"):
        run(GSPO(), stage, track)


MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
OFF_POLICY = [0.3, -0.2, 0.15, -0.4]  # ratios up to e^0.4: the clip and dual clip both act


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "make",
    [
        lambda mode: GRPO(GRPOConfig(loss_agg_mode=mode, norm_constant=C, kl_coef=0.05, clip_ratio_c=1.2)),
        lambda mode: GSPO(GSPOConfig(loss_agg_mode=mode, norm_constant=C, eps_low=0.05, eps_high=0.05)),
        lambda mode: DRPO(DRPOConfig(loss_agg_mode=mode, norm_constant=C, drpo_epsilon=0.5)),
    ],
    ids=["grpo", "gspo", "drpo"],
)
def test_two_micro_batches_sum_to_the_full_batch(mode: str, make) -> None:
    algo = make(mode)
    stage = BigramStage()
    track = make_track(stage, shift=OFF_POLICY)
    full_metrics, full_grad = run(algo, stage, track)
    # micro-batches of unequal token counts: samples {0, 1} hold 4 tokens, {2, 3} hold 6
    stage.module.zero_grad()
    rows = []
    for idx in ([0, 1], [2, 3]):
        mb = algo.prepare_segment(stage, track.select(idx))
        rows.append(algo.compute_loss_and_backward(stage, mb, ctx_for(stage, loss_scale=0.5)))
    assert torch.allclose(stage.module.table.grad, full_grad, rtol=1e-5, atol=1e-7)
    # the stack averages rows over micro-batches: that reproduces the full batch's loss
    assert (rows[0]["loss"] + rows[1]["loss"]) / 2 == pytest.approx(full_metrics["loss"], rel=1e-5)


def test_without_totals_micro_batches_weigh_their_own_means() -> None:
    """The documented fallback: each micro-batch's token-mean times loss_scale, which differs from the
    batch token-mean when micro-batches hold different numbers of tokens (here 4 vs 6)."""
    stage = BigramStage()
    track = make_track(stage)
    rows = [
        GRPO().compute_loss_and_backward(stage, track.select(idx), ctx_for(stage, 0.5, totals=False))
        for idx in ([0, 1], [2, 3])
    ]
    # token means -(4.5 - 1.5) / 4 and -(-2 + 1) / 6, each weighted 1/2
    assert rows[0]["loss"] == pytest.approx(-3 / 4) and rows[1]["loss"] == pytest.approx(1 / 6)
    assert (rows[0]["loss"] + rows[1]["loss"]) / 2 != pytest.approx(TOKEN_MEAN)


def test_clip_and_dual_clip_counted() -> None:
    stage = BigramStage()
    track = make_track(stage, shift=OFF_POLICY)
    metrics, _ = run(GRPO(GRPOConfig(eps_low=0.05, eps_high=0.05, clip_ratio_c=1.2)), stage, track)
    assert 0 < metrics["clipfrac"] < 1 and 0 < metrics["clipfrac_dual"] < 1
    assert metrics["ratio/min"] < 1 < metrics["ratio/max"]


def test_kl_loss_term() -> None:
    stage = BigramStage()
    track = make_track(stage)
    algo = GRPO(GRPOConfig(kl_coef=0.1, kl_estimator="low_var_kl"))
    assert algo.needs_reference_policy and not GRPO().needs_reference_policy
    metrics, _ = run(algo, stage, track)
    with torch.no_grad():
        logp = stage.token_log_probs(track.segment)
        with stage.reference():
            ref = stage.token_log_probs(track.segment)
    k3 = [
        math.exp(d) - d - 1
        for i, n in enumerate(LENGTHS)
        for t in range(n)
        for d in [(ref[i, t] - logp[i, t]).item()]
    ]
    kl = sum(k3) / len(k3)
    assert metrics["kl"] == pytest.approx(kl, rel=1e-5)
    assert metrics["loss"] == pytest.approx(TOKEN_MEAN + 0.1 * kl, rel=1e-5)
    # the reference context restored the policy
    assert torch.equal(stage.token_log_probs(track.segment).detach(), logp)


def test_gspo_sequence_ratio_and_its_gradient() -> None:
    """r_t equals s_i = exp(mean_t(logp - old)) on every token, and the token-form gradient equals the
    gradient of the sequence-level loss mean_i max(-A_i s_i, -A_i clip(s_i))."""
    stage = BigramStage()
    track = make_track(stage, shift=[1e-4, -2e-4, 0.02, -0.03])  # two inside the clip, two outside
    algo = GSPO()
    metrics, grad = run(algo, stage, track)
    stage.module.zero_grad()
    logp = stage.token_log_probs(track.segment)
    old = track.segment.log_probs
    seq_losses, ratios = [], []
    for i, n in enumerate(LENGTHS):
        s = torch.exp(sum(logp[i, t] - old[i][t] for t in range(n)) / n)
        a = ADV[i]
        seq_losses.append(torch.maximum(-a * s, -a * torch.clamp(s, 1 - 3e-4, 1 + 4e-4)))
        ratios.append(s.item())
    (sum(seq_losses) / 4).backward()
    assert torch.allclose(grad, stage.module.table.grad, atol=1e-7)
    assert grad.abs().sum() > 0
    assert metrics["ratio/min"] == pytest.approx(min(ratios)) and metrics["ratio/max"] == pytest.approx(
        max(ratios)
    )
    assert metrics["clipfrac"] == pytest.approx((4 + 2) / 10)  # samples 2 and 3: 6 of 10 tokens


def test_drpo_loss_and_gradient_by_hand() -> None:
    logp = torch.tensor([[-1.0, -0.5], [-2.0, -0.1]], requires_grad=True)
    old = torch.tensor([[-1.2, -0.5], [-1.5, -0.4]])
    adv = torch.tensor([[2.0, 2.0], [-1.0, -1.0]])
    mask = torch.ones(2, 2)
    eps = 0.5
    algo = DRPO(DRPOConfig(drpo_epsilon=eps))
    loss, _, metrics = algo.policy_loss(logp, old, adv, mask)
    expected, penalties, grads = [], [], []
    for i in range(2):
        for t in range(2):
            r = math.exp(logp[i, t].item() - old[i, t].item())
            a, mu = adv[i, t].item(), math.exp(old[i, t].item())
            penalties.append(abs(a) * mu * (r - 1) ** 2 / (2 * eps))
            expected.append(-a * r + penalties[-1])
            grads.append(r * (-a + abs(a) * mu * (r - 1) / eps))  # dL/dlogp = r dL/dr
    assert loss.flatten().tolist() == pytest.approx(expected, rel=1e-6)
    loss.sum().backward()
    assert logp.grad.flatten().tolist() == pytest.approx(grads, rel=1e-6)
    assert metrics["drpo/penalty"] == pytest.approx(sum(penalties) / 4, rel=1e-6)
    # without mu weighting the penalty is |A| (r - 1)^2 / (2 eps)
    plain, _, _ = DRPO(DRPOConfig(drpo_epsilon=eps, penalty_mu_weighted=False)).policy_loss(
        logp, old, adv, mask
    )
    r00 = math.exp(0.2)
    assert plain[0, 0].item() == pytest.approx(-2 * r00 + 2 * (r00 - 1) ** 2 / (2 * eps), rel=1e-6)


def test_dapo_keep_groups() -> None:
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.7, 0.7, 2.0, 2.0, 0.1 + 0.2, 0.3], dtype=torch.float64)
    groups = ["a", "a", "b", "b", "c", "c", "d", "d", "e", "e"]
    # a, c, d are all-equal; b varies; e differs in float64 (0.30000000000000004 != 0.3)
    assert DAPO.keep_groups(rewards, groups) == [2, 3, 8, 9]
    assert DAPO().keep_groups(torch.tensor([0.5, 0.5, 0.5]), ["x", "y", "x"]) == []
    assert DAPO.keep_groups(torch.tensor([0.0, 1.0, 0.0]), ["x", "y", "x"]) == []
    assert DAPO.keep_groups(torch.tensor([0.0, 1.0, 1.0]), ["x", "y", "x"]) == [0, 2]


def test_defaults() -> None:
    grpo, dapo, gspo, drpo = GRPOConfig(), DAPOConfig(), GSPOConfig(), DRPOConfig()
    assert (grpo.eps_low, grpo.eps_high, grpo.clip_ratio_c, grpo.loss_agg_mode) == (
        0.2,
        0.2,
        3.0,
        "token-mean",
    )
    assert (dapo.eps_low, dapo.eps_high, dapo.loss_agg_mode) == (0.2, 0.28, "token-mean")
    assert dapo.dynamic_sampling and dapo.max_num_gen_batches == 10
    assert (gspo.eps_low, gspo.eps_high, gspo.loss_agg_mode) == (3e-4, 4e-4, "seq-mean-token-mean")
    assert (drpo.drpo_epsilon, drpo.penalty_mu_weighted, drpo.old_logp_source) == (12.5, True, "rollout")
    assert DrGRPOConfig(norm_constant=512).loss_agg_mode == "seq-mean-token-sum-norm"
    assert GRPO.modality == "text" and GRPO.supports_multi_update
    assert grpo.kl_coef == 0.0 and grpo.kl_estimator == "low_var_kl"


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: GRPOConfig(eps_low=0.0), r"algorithm.config.eps_low must be in \(0, 1\)"),
        (lambda: GRPOConfig(eps_low=1.0), r"algorithm.config.eps_low must be in \(0, 1\)"),
        (lambda: GRPOConfig(eps_high=0.0), "algorithm.config.eps_high must be > 0"),
        (lambda: GRPOConfig(clip_ratio_c=1.0), "algorithm.config.clip_ratio_c must be > 1 or null"),
        (lambda: GRPOConfig(loss_agg_mode="mean"), "algorithm.config.loss_agg_mode must be one of"),
        (
            lambda: GRPOConfig(loss_agg_mode="seq-mean-token-sum-norm"),
            r"algorithm.config.norm_constant must be set .*sampling.max_new_tokens",
        ),
        (lambda: GRPOConfig(norm_constant=0), "algorithm.config.norm_constant must be > 0"),
        (lambda: GRPOConfig(kl_coef=-1.0), "algorithm.config.kl_coef must be >= 0"),
        (lambda: GRPOConfig(kl_estimator="full"), "algorithm.config.kl_estimator must be one of"),
        (lambda: GRPOConfig(old_logp_source="engine"), "algorithm.config.old_logp_source must be one of"),
        (lambda: DAPOConfig(max_num_gen_batches=0), "algorithm.config.max_num_gen_batches must be >= 1"),
        (lambda: DrGRPOConfig(), "algorithm.config.norm_constant must be set"),
        (lambda: GSPOConfig(eps_low=-1e-4), r"algorithm.config.eps_low must be in \(0, 1\)"),
        (lambda: DRPOConfig(drpo_epsilon=0.0), "algorithm.config.drpo_epsilon must be > 0"),
    ],
)
def test_config_errors_name_the_key(make, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make()


def test_advantage_checks() -> None:
    with pytest.raises(
        ValueError, match="DrGRPO needs advantages without std normalisation: set advantage.norm_by_std"
    ):
        DrGRPO.check_advantage(AdvantageConfig())
    with pytest.raises(ValueError, match="advantage.estimator='reinforce_pp_baseline' whitens"):
        DrGRPO.check_advantage(AdvantageConfig(estimator="reinforce_pp_baseline"))
    DrGRPO.check_advantage(AdvantageConfig(norm_by_std=False))
    DrGRPO.check_advantage(AdvantageConfig(estimator="rloo"))
    with pytest.raises(ValueError, match="GSPO needs a sequence-level advantage"):
        GSPO.check_advantage(AdvantageConfig(estimator="reinforce_pp"))
    GSPO.check_advantage(AdvantageConfig())


def test_missing_advantages_and_wrong_segment() -> None:
    stage = BigramStage()
    track = make_track(stage)
    track.advantages = None
    with pytest.raises(ValueError, match="track 'ar' has no advantages"):
        GRPO().compute_loss_and_backward(stage, track, ctx_for(stage))


@pytest.mark.parametrize(("cls", "cfg_cls"), [(GRPO, GRPOConfig), (DRPO, DRPOConfig)])
def test_train_stack_passes_exact_batch_totals(cls, cfg_cls) -> None:
    """Through the real TrainStack and TrainBackend: the first update's gradient norm does not depend on
    the micro-batch size (the stack's num_tokens / num_samples make the split exact), and with pi_old
    replayed the first update is on-policy."""
    from unirl.train.backend import OptimConfig, TrainBackend
    from unirl.train.stack import TrainStack, TrainStackConfig

    rows = []
    for micro in (1, 2, 4):
        stage = BigramStage()
        backend = TrainBackend(stage.module, None, OptimConfig(lr=1e-2, weight_decay=0.0), 10)
        stage.module = backend.module
        algo = cls(cfg_cls(old_logp_source="replay"))
        stack = TrainStack(
            stage, backend, algo, TrainStackConfig(micro_batch_size=micro, num_updates_per_batch=2)
        )
        rows.append(stack.train_track(make_track(stage), progress=0.0))
    for row in rows:
        assert row["ratio/first_update_mean"] == 1.0
    norms = [r["train/grad_norm"] for r in rows]
    # the metric averages the two updates; the first is identical, the second starts from equal weights
    assert norms[1] == pytest.approx(norms[0], rel=1e-5) and norms[2] == pytest.approx(norms[0], rel=1e-5)
