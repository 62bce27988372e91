"""Composed runs (a prompt enhancer feeding a diffusion model) through `Trainer` and
`python -m unirl.train_pe`: a frozen track stays bit-identical, both tracks export, and a run
with both tracks trained on 2 Ray workers resumes exactly (3 + 3 steps == 6)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import run_module, untimed
from tests.recipes import IN_PROCESS, QUIET, recipe, run, same_weights, stopped_and_resumed
from tests.recipes import rows as read_rows

PE = "pe/tiny_pe_smoke"
FROZEN = [
    "tracks.diffusion.trained=false",
    "~tracks.diffusion.algorithm",
    "~tracks.diffusion.advantage",
    "~tracks.diffusion.train",
]


def transformer(path) -> dict[str, torch.Tensor]:
    return load_file(path / "transformer" / "diffusion_pytorch_model.safetensors")


def test_frozen_track_is_bit_identical_and_both_tracks_export(tmp_path) -> None:
    """The diffusion track is frozen: after 3 steps its exported weights equal the base bit for bit
    and its rows hold no training metrics; the trained prompt enhancer's weights moved."""
    out = tmp_path / "frozen"
    rows = run(PE, out, "num_steps=3", *IN_PROCESS, *FROZEN)
    assert all("ar/loss" in r and not any(k.startswith("diffusion/train") for k in r) for r in rows)
    assert all(
        r["ar/reward/mean"] == pytest.approx(r["diffusion/reward/mean"]) for r in rows
    )  # mean of a mean
    base, final = (
        transformer(out / "base_model" / "diffusion"),
        transformer(out / "checkpoints/final/diffusion"),
    )
    assert base.keys() == final.keys() and all(torch.equal(base[k], final[k]) for k in base)
    ar_base = load_file(out / "base_model/ar/model.safetensors")
    ar_final = load_file(out / "checkpoints/final/ar/model.safetensors")
    assert any(not torch.equal(ar_base[k], ar_final[k]) for k in ar_base)


@pytest.mark.ray
def test_entry_point_smoke(tmp_path, ray_cluster) -> None:
    """`python -m unirl.train_pe` runs the smoke recipe (both tracks trained, Ray, 2 steps) and
    writes the lineage samples; a bad recipe exits 2 naming the key, before Ray."""
    out = tmp_path / "smoke"
    done = run_module(
        "unirl.train_pe",
        "--config-name=pe/tiny_pe_smoke",
        f"output_dir={out}",
        *QUIET[:1],
        "logging.save_images_every=1",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = read_rows(out)
    assert [r["step"] for r in rows] == [1, 2] and all("diffusion/loss" in r and "ar/loss" in r for r in rows)
    tree = json.load(open(out / "samples/lineage_step_0002.json"))
    assert len(tree) == 2 and all(
        len(t["rewrites"]) == 2 and len(t["rewrites"][0]["image_rewards"]) == 2 for t in tree
    )
    assert (out / "checkpoints/final/ar/model.safetensors").exists()
    assert (out / "checkpoints/final/diffusion/pytorch_lora_weights.safetensors").exists()
    bad = run_module("unirl.train_pe", "--config-name=pe/tiny_pe_smoke", "tracks.ar.aggregate=median")
    assert bad.returncode == 2 and "tracks.ar" in bad.stderr and "median" in bad.stderr


@pytest.mark.ray
def test_two_workers_both_tracks_resume_exactly(tmp_path, ray_cluster) -> None:
    """Both tracks trained (GRPO on the prompt enhancer, Flow-GRPO with LoRA on the diffusion
    model) on 2 workers with FSDP2: stopped at a step-3 checkpoint and resumed, the run writes the
    rows of the run that never stopped and ends with bit-equal weights of both tracks (3 + 3 == 6,
    as issue 23 asks)."""
    two = ["num_devices=2", "threads_per_worker=1"]
    full, resumed = stopped_and_resumed(PE, tmp_path, *two, stop=3, steps=6)
    checkpoint = tmp_path / "part" / "checkpoints" / "step_000003"
    assert (checkpoint / "ar").is_dir() and (checkpoint / "diffusion").is_dir()
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6]
    assert [untimed(r) for r in resumed[3:]] == [untimed(r) for r in full[3:]]
    assert same_weights(tmp_path / "full", tmp_path / "part")  # both tracks: ar/ and diffusion/


DGPO_TRACK = [
    "tracks.diffusion.algorithm._target_=unirl.algorithms.dgpo.DGPO",
    "tracks.diffusion.algorithm.config._target_=unirl.algorithms.dgpo.DGPOConfig",
    "~tracks.diffusion.algorithm.config.old_logp_source",
    "+tracks.diffusion.algorithm.config.reference=ema",
    "+tracks.diffusion.algorithm.config.draws_per_sample=1",
    "+tracks.diffusion.algorithm.config.seed=0",
]


def test_dgpo_with_its_ema_reference_trains_a_composed_track(tmp_path) -> None:
    """DGPO's EMA reference is a snapshot of the policy kept by the track's backend (issue 41):
    the diffusion track of a composed run trains with it for 2 steps, its loss and group weight
    finite, the enhancer beside it unchanged in kind."""
    rows = run(PE, tmp_path, "num_steps=2", *IN_PROCESS, *DGPO_TRACK)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert torch.isfinite(torch.tensor(r["diffusion/loss"])) and 0 < r["diffusion/dgpo/group_weight"] < 1
        assert "ar/loss" in r


REWARDS = ("reward/mean", "ar/reward/mean", "ar/reward/std", "diffusion/reward/mean", "diffusion/reward/std")


@pytest.mark.ray
def test_enhancer_on_a_dedicated_engine_gives_the_trainside_rewards_and_resumes(tmp_path, ray_cluster) -> None:
    """Issue 41's proof that a track names its engine: `pe/tiny_pe_dedicated` samples the rewrites
    on a dedicated colocated engine (the `ar` weights synced, checksummed, before every rollout;
    the engine sleeps while the trainer trains) and renders them trainside. Every step's rewards
    equal the all-trainside run's exactly, and a run resumed from its step-3 checkpoint continues
    as the uninterrupted one (3 + 3 == 6: rows and both tracks' final weights)."""
    one = ["threads_per_worker=1", *QUIET]
    trainside = run(PE, tmp_path / "trainside", "num_steps=6", *IN_PROCESS, *one)
    full = run("pe/tiny_pe_dedicated", tmp_path / "full", "num_steps=6", "checkpoint.every_n_steps=3", *one)
    ckpt = tmp_path / "full" / "checkpoints" / "step_000003"
    resumed = run("pe/tiny_pe_dedicated", tmp_path / "resumed", "num_steps=6", f"resume_from={ckpt}", *one)
    assert [[r[k] for k in REWARDS] for r in full] == [[r[k] for k in REWARDS] for r in trainside]
    assert len({r["reward/mean"] for r in full}) == 6  # the policies moved: six different steps
    for r in full:
        assert r["ar/sync/bytes"] > 0 and r["ar/time/sync_s"] > 0  # synced before every rollout
    assert [r["step"] for r in resumed] == [4, 5, 6]
    assert [untimed(r) for r in resumed] == [untimed(r) for r in full[3:]]
    assert same_weights(tmp_path / "full", tmp_path / "resumed")
    placement = json.load(open(tmp_path / "full" / "placement.json"))
    assert [e["track"] for e in placement["engines"]] == ["ar"]


KEEP_TRACK = [
    "+tracks.diffusion.engine._target_=unirl.rollout.trainside.TrainsideEngine",
    "+tracks.diffusion.engine.keep_graph=true",
]


def test_a_composed_track_trains_from_its_kept_graphs_as_the_replay_run(tmp_path) -> None:
    """The diffusion track names a trainside engine that keeps its sampling graphs
    (`tracks.diffusion.engine.keep_graph`): its loss backpropagates through the graphs of the
    rollout instead of a replay, and the run trains as the replay run does (the same samples,
    losses and updates to float rounding), every kept pair used and none left after a step."""
    one = ["num_steps=3", "threads_per_worker=1", *IN_PROCESS, *QUIET]
    replay = [untimed(r) for r in run(PE, tmp_path / "replay", *one)]
    keep = [untimed(r) for r in run(PE, tmp_path / "keep", *one, *KEEP_TRACK)]
    for r, k in zip(replay, keep, strict=True):
        assert k.pop("diffusion/keep_graph/kept_fraction") == 1.0
        assert sorted(k) == sorted(r)
        assert k["diffusion/ratio/first_update_mean"] == 1.0
        for key in ("reward/mean", "ar/reward/mean", "diffusion/loss", "diffusion/train/grad_norm", "ar/loss"):
            assert k[key] == pytest.approx(r[key], rel=1e-3, abs=1e-6), (k["step"], key)


def test_a_composed_step_that_fails_before_train_releases_its_kept_graphs(tmp_path, monkeypatch) -> None:
    """A step whose leaf reward fails (a NaN naming the sample) stops the run before training;
    the graphs the diffusion track kept for it are released on the worker, none left behind."""
    from tests.trainer.test_keep_graph_runs import NaNOnOne  # noqa: F401 (the recipe names it)
    from unirl.trainer.trainer import Trainer, TrainingError
    from unirl.trainer.worker import RLWorker

    released, before, held = [], [], []
    original = RLWorker.release_kept

    def spy(self, partition):
        before.append(len(self.samplers["diffusion"].kept))
        original(self, partition)
        released.append(partition)
        held.append(len(self.samplers["diffusion"].kept))

    monkeypatch.setattr(RLWorker, "release_kept", spy)
    broken = [
        "~rewards.diffusion.backend.components.redness",
        "~rewards.diffusion.backend.weights.redness",
        "+rewards.diffusion.backend.components.broken={_target_: tests.trainer.test_keep_graph_runs.NaNOnOne}",
        "+rewards.diffusion.backend.weights.broken=1.0",
    ]
    cfg = recipe(PE, tmp_path, "num_steps=1", *IN_PROCESS, *QUIET, *KEEP_TRACK, *broken)
    with pytest.raises(TrainingError, match=r"during 'reward \(diffusion\)'"):
        Trainer(cfg).run()
    assert released == ["step_0"] and before[0] > 0 and held == [0]


def test_an_edit_model_renders_the_rewrites_over_each_rows_source(tmp_path) -> None:
    """`pe/tiny_pe_kontext`: the enhancer rewrites each edit instruction and FLUX.1-Kontext renders
    the rewrites as edits of the row's source (its `condition_key: source`, which the text track
    does not read); the leaf's reward sees the source (`SourcePreservation`). A row without a
    source is refused before the run, naming the track and the row."""
    rows = run("pe/tiny_pe_kontext", tmp_path / "run", "num_steps=2", *IN_PROCESS, *QUIET)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert 0 < r["diffusion/reward/preservation/mean"] < 1 and "ar/loss" in r and "diffusion/loss" in r
        assert r["ar/reward/mean"] == pytest.approx(r["diffusion/reward/mean"])
    bare = tmp_path / "bare.jsonl"
    bare.write_text(json.dumps({"prompt": "make it red", "prompt_id": "bare"}) + "\n")
    from unirl.config.validate import ConfigError

    with pytest.raises(ConfigError) as info:
        recipe("pe/tiny_pe_kontext", tmp_path / "bad", f"data_source.data_path={bare}")
    assert any(
        p.startswith("tracks.diffusion.model: data_source: prompt 'bare' carries no condition image")
        and "'source'" in p
        for p in info.value.problems
    )


def test_each_track_trains_with_its_own_critic(tmp_path) -> None:
    """pe/tiny_pe_ppo: PPO on the prompt enhancer and Flow-PPO on the diffusion track, each valued
    by its own critic (`tracks.<name>.critic`) on the track's workers. The driver fetches each
    track's values for its GAE (per token, per SDE step); the enhancer's critic warms up alone for
    its `warmup_steps` (no policy update) while the diffusion track trains from step 1; the first
    update of every step is on-policy (ratio exactly 1); each critic's state is in its track's
    checkpoint directory."""
    rows = run("pe/tiny_pe_ppo", tmp_path, *IN_PROCESS, "checkpoint.every_n_steps=2", "tracks.ar.critic.warmup_steps=1")
    assert [r["ar/critic/warmup"] for r in rows] == [1.0, 0.0]
    assert [r["diffusion/critic/warmup"] for r in rows] == [0.0, 0.0]
    assert "ar/loss" not in rows[0] and "ar/loss" in rows[1]
    assert all("diffusion/loss" in r for r in rows)
    for name in ("ar", "diffusion"):
        assert all(r[f"{name}/critic/vf_loss"] > 0 for r in rows)
        assert all(r[f"{name}/ratio/first_update_mean"] == 1.0 for r in rows if f"{name}/loss" in r)
        assert (tmp_path / "checkpoints" / "step_000002" / name / "critic" / "train").is_dir()


def test_a_chains_evaluation_samples_every_trained_tracks_ema(tmp_path) -> None:
    """`eval.use_ema` on a chain: every trained track samples its EMA weights (the one `Evaluator`
    and the worker's `sample_eval`). Two runs that differ only in `eval.use_ema` train alike (the
    EMA does not touch training), evaluate alike at step 0 (the EMAs start as copies of the
    weights), and differ after a step (decay 0.5: the EMA lags the weights), the mean pixel of
    the leaf's images moving with any change of either track."""
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text(
        "".join(
            json.dumps({"prompt": p, "prompt_id": f"h{i}", "metadata": {"canonical": p}}) + "\n"
            for i, p in enumerate(["a red box.", "the sea at night."])
        )
    )
    ema = "{_target_: unirl.train.ema.EMAConfig, decay: 0.5}"
    evaluation = (
        "+eval={every_n_steps: 1, references: false,"
        f" examples: {{_target_: unirl.data.PromptDataSource, data_path: '{held_out}'}},"
        " scorer: {_target_: tests.recipes.MeanPixel},"
        " text_sampling: {_target_: unirl.trainer.text_eval.TextEvalSampling, max_new_tokens: 8,"
        " max_prompt_length: 32},"
        " sampling: {_target_: unirl.trainer.evaluation.EvalSampling, num_steps: 2}}"
    )
    common = ["num_steps=2", *IN_PROCESS, evaluation, f"+tracks.ar.train.ema={ema}", f"+tracks.diffusion.train.ema={ema}"]
    live = run(PE, tmp_path / "live", *common, "+eval.use_ema=false")
    averaged = run(PE, tmp_path / "ema", *common, "+eval.use_ema=true")
    def trained(rows):  # the training rows, less the evaluation and the machine's measurements
        return [{k: v for k, v in untimed(r).items() if not k.startswith("eval/")} for r in rows]

    assert trained(live) == trained(averaged)
    assert live[0]["eval/mean_pixel"] == averaged[0]["eval/mean_pixel"]
    assert live[2]["eval/mean_pixel"] != averaged[2]["eval/mean_pixel"]
