"""Text RL through the one driver loop on real Ray: resume, 1 vs 2 workers, transports, DAPO's
dynamic sampling, KL folded into the reward, and bad input stopping a run before it trains.

Runs a shrunken `llm/tiny_lm_grpo` (a tiny random Qwen3) in-process through `Trainer`.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import untimed
from tests.dataplane.backends import BACKENDS
from tests.recipes import IN_PROCESS, LM, exported_weights, per_transport, same_weights, stopped_and_resumed
from tests.recipes import run as run_recipe
from unirl.evaluate import main as evaluate_main
from unirl.trainer.trainer import Trainer, TrainingError

pytestmark = pytest.mark.ray

TEXT = "llm/tiny_lm_grpo"
LORA_KL = [
    "train.lora={_target_: unirl.train.backend.LoRAConfig, rank: 4, alpha: 8, "
    "target_modules: [q_proj, k_proj, v_proj, o_proj]}",
    "algorithm.config.kl_coef=0.05",
]


def text_run(out, *overrides: str) -> list[dict]:
    return run_recipe(TEXT, out, *overrides)


def dapo_run(out, *overrides: str) -> list[dict]:
    return run_recipe("llm/tiny_lm_dapo", out, *overrides)


@pytest.fixture(scope="module", autouse=True)
def local_ray(ray_cluster):
    """The session's shared Ray instance (tests/ray_loopback.py)."""
    return ray_cluster


RESUME_CASES = {"full-1-worker": IN_PROCESS, "lora-kl-2-workers": ["num_devices=2", *LORA_KL]}


@pytest.mark.parametrize("case", list(RESUME_CASES))
def test_text_resume_continues_identically(tmp_path, case):
    """2 steps, a checkpoint, 2 resumed steps == 4 uninterrupted steps: rows (apart from machine
    measurements) and bit-equal exported weights; the first on-policy ratio is exactly 1."""
    overrides = RESUME_CASES[case]
    full, resumed = stopped_and_resumed(TEXT, tmp_path, *overrides)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert [untimed(r) for r in resumed[2:]] == [untimed(r) for r in full[2:]]
    assert all(r["ratio/first_update_mean"] == 1.0 for r in full)  # pi_old replayed: exactly on-policy
    assert same_weights(tmp_path / "full", tmp_path / "part")
    if "num_devices=2" in overrides:
        names = [k.split(":", 1)[1] for k in exported_weights(tmp_path / "part")]
        assert all(k.startswith("base_model.model.") and "lora_" in k for k in names)
        assert full[0]["kl"] == pytest.approx(0.0, abs=1e-6) and full[-1]["kl"] > 0.0


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory) -> dict[str, tuple]:
    """2 steps on 2 workers through each transport: {transport: (output dir, rows)}."""
    return per_transport(
        TEXT, tmp_path_factory.mktemp("text_two_workers"), BACKENDS, "num_steps=2", "num_devices=2"
    )


def test_text_one_and_two_workers_agree(tmp_path, two_workers):
    """The same 2 steps on 1 worker (in this process) and on 2: identical rollouts (per-sample
    seeds), and the loss aggregated over the global batch whatever the split (token-mean over
    all ranks' tokens)."""
    one = text_run(tmp_path / "one", "num_steps=2", *IN_PROCESS)
    two_dir, two = two_workers["ray"]  # the recipe's transport
    for r1, r2 in zip(one, two, strict=True):
        assert r1["reward/mean"] == pytest.approx(r2["reward/mean"], abs=1e-6)
        assert r1["response_length/mean"] == r2["response_length/mean"]
        assert r1["loss"] == pytest.approx(r2["loss"], abs=1e-6)
        assert r1["train/grad_norm"] == pytest.approx(r2["train/grad_norm"], rel=1e-4)
    a, b = exported_weights(tmp_path / "one"), exported_weights(two_dir)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-4)  # lr 3e-3: within 3% of a step


def test_every_transport_trains_text_identically(two_workers):
    """Jagged token segments through every transport on 2 workers: the same rows (bytes moved
    included) and bit-equal weights."""
    ref_dir, ref = two_workers["inband"]
    ref = [untimed(r) for r in ref]
    for name, (out, rows) in two_workers.items():
        assert [untimed(r) for r in rows] == ref, name
        assert same_weights(out, ref_dir), name


def test_dapo_dynamic_sampling_trains_only_groups_with_signal(tmp_path, monkeypatch):
    """DAPO drops groups whose rewards are all equal and rolls out more prompts until
    `prompts_per_rollout` groups with signal are kept: the train batch keeps its geometry and
    holds no zero-variance group, and a reward with no signal stops the run by name."""
    batches = []
    original = Trainer._rollout_and_score

    def spy(self, *args):
        meta, track, t = original(self, *args)
        batches.append(track)
        return meta, track, t

    monkeypatch.setattr(Trainer, "_rollout_and_score", spy)
    rows = dapo_run(tmp_path / "dapo", "num_steps=3", *IN_PROCESS)
    assert len(batches) == 3 and any(r["dynamic/gen_batches"] > 1 for r in rows)
    for track in batches:
        assert len(track) == 16 and len(set(track.group_ids)) == 4
        groups = track.rewards.view(4, 4)
        assert bool((groups.max(1).values > groups.min(1).values).all())
        assert len(set(track.sample_ids)) == 16

    no_signal = [
        "reward.backend.components.has_digit.pattern='^NEVER$'",
        "reward.backend.weights.overlong=0.0",
    ]
    with pytest.raises(TrainingError, match=r"kept 0 groups .* algorithm.config.max_num_gen_batches=3"):
        dapo_run(
            tmp_path / "flat",
            "num_steps=1",
            *IN_PROCESS,
            "algorithm.config.max_num_gen_batches=3",
            *no_signal,
        )


def test_kl_folded_into_the_reward_records_reference_log_probs(tmp_path):
    """advantage.kl_coef > 0: the rollout records the reference's token log-probs and the
    advantages see r - kl_coef * sum_t kl_t. At step 1 the policy is the reference (KL ~ 0), so
    the gradient matches the plain run's; once the policy moved, the gradients part."""
    plain = text_run(tmp_path / "plain", "num_steps=3", *IN_PROCESS)
    folded = text_run(
        tmp_path / "kl", "num_steps=3", *IN_PROCESS, "advantage.kl_coef=0.5", "advantage.kl_estimator=k1"
    )
    assert folded[0]["reward/mean"] == plain[0]["reward/mean"]  # raw scores; the KL enters the advantages
    assert folded[0]["train/grad_norm"] == pytest.approx(plain[0]["train/grad_norm"], rel=1e-3)
    g_plain, g_folded = plain[2]["train/grad_norm"], folded[2]["train/grad_norm"]
    assert abs(g_folded - g_plain) > 0.02 * g_plain


class NaNOnOne:
    """A scorer that fails one sample (NaN), as a broken verifier would."""

    def __call__(self, req):
        scores = torch.zeros(len(req.sample_ids))
        scores[1] = float("nan")
        return scores


def test_bad_input_stops_the_run_before_training(tmp_path):
    """A prompt over the token budget names its sample; a NaN reward names its sample; neither
    run writes a metrics row or trains."""
    with pytest.raises(
        TrainingError,
        match=r"sample 'r0/g\d+:tiny_lm:\d+::sample:0': the prompt is \d+ tokens, more than sampling.max_prompt_length=8",
    ):
        text_run(tmp_path / "long", "num_steps=1", *IN_PROCESS, "sampling.max_prompt_length=8")
    nan = [
        "~reward.backend.components.digits",
        "~reward.backend.weights.digits",
        f"+reward.backend.components.broken={{_target_: {__name__}.NaNOnOne}}",
        "+reward.backend.weights.broken=1.0",
    ]
    with pytest.raises(
        TrainingError, match=r"step 1 during 'reward' \(nothing of this step was trained\).*::sample:1"
    ):
        text_run(tmp_path / "nan", "num_steps=1", *IN_PROCESS, *nan)
    for out in ("long", "nan"):
        path = tmp_path / out / "metrics.jsonl"
        assert not path.exists() or path.read_text() == ""
        assert not (tmp_path / out / "checkpoints" / "final").exists()


TEXT_EVAL = [
    "+eval={every_n_steps: 2, use_ema: false, "
    "examples: {_target_: unirl.data.PromptDataSource, data_path: datasets/tiny_lm/prompts.jsonl, shuffle: false}, "
    "scorer: {_target_: unirl.reward.local.text.FormatCheck, pattern: '[0-9]', mode: search}, "
    "sampling: {_target_: unirl.trainer.text_eval.TextEvalSampling, max_new_tokens: 8, temperature: 1.0, "
    "pass_k: 4, stop_tokens: ['<|im_end|>'], chat_template: true, group_by: [verb]}}",
]


def test_text_evaluation_in_the_loop_and_from_the_checkpoint(tmp_path, capsys):
    """A text recipe with an eval block logs greedy accuracy and pass@k (overall and per metadata
    group) at step 0, every `every_n_steps` and at the end; the evaluate command on the exported
    checkpoint reproduces the run's last evaluation exactly."""
    rows = text_run(tmp_path, "num_steps=3", *IN_PROCESS, *TEXT_EVAL)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    keys = {"eval/accuracy/greedy", "eval/accuracy/pass@1", "eval/accuracy/pass@2", "eval/accuracy/pass@4"}
    assert [keys <= set(r) for r in rows] == [True, False, True, True]
    assert {"eval/accuracy/greedy/verb=Tell", "eval/accuracy/pass@4/verb=Write"} <= set(rows[0])
    for r in (rows[0], rows[2], rows[3]):
        assert 0 <= r["eval/accuracy/pass@1"] <= r["eval/accuracy/pass@2"] <= r["eval/accuracy/pass@4"] <= 1
    # the evaluate command (`python -m unirl.evaluate`; its own process in tests/e2e/test_shapes_smoke.py)
    argv = ["--recipe", TEXT, "--checkpoint", str(tmp_path / "checkpoints" / "final"), *LM, *TEXT_EVAL]
    capsys.readouterr()
    assert evaluate_main(argv) == 0
    scored = json.loads(capsys.readouterr().out)
    assert {k: scored[k] for k in keys} == {k: rows[3][k] for k in keys}
