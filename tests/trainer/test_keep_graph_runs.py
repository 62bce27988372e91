"""`rollout.keep_graph` through the worker and the driver loop: a run trains as the replay run
does, kept graphs never outlive their step (success, failed train, failed reward, a new
partition), and a recipe that cannot keep graphs is refused before Ray. In-process, no Ray."""

from __future__ import annotations

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from tests.conftest import EXAMPLES, untimed
from tests.recipes import IN_PROCESS, composed
from unirl.config.validate import ConfigError, validate_recipe
from unirl.dataplane import make_transport
from unirl.distributed.group import RankInfo
from unirl.sde.schedules import sigmas_for
from unirl.trainer.trainer import Trainer, TrainingError
from unirl.trainer.worker import RLWorker, build
from unirl.types import RolloutReq

KEEP = ["++rollout.keep_graph=true"]


def recipe(out, *overrides: str):
    """The shrunk tiny recipe in this process (tests/recipes.py), not validated."""
    return composed("diffusion/tiny_sd3_flowgrpo", out, *IN_PROCESS, "threads_per_worker=1", *overrides)


def test_a_kept_graph_run_trains_as_the_replay_run(tmp_path):
    replay_cfg, keep_cfg = (
        recipe(tmp_path / "replay", "num_steps=3"),
        recipe(tmp_path / "keep", "num_steps=3", *KEEP),
    )
    validate_recipe(keep_cfg, expect="diffusion")
    replay = [untimed(r) for r in Trainer(replay_cfg).run()]
    keep = [untimed(r) for r in Trainer(keep_cfg).run()]
    for r, k in zip(replay, keep, strict=True):
        assert k.pop("keep_graph/kept_fraction") == 1.0
        assert sorted(k) == sorted(r)
        assert k["ratio/first_update_mean"] == k["ratio/min"] == k["ratio/max"] == 1.0
        # the same samples (the kept steps' CFG halves run as two forwards: float rounding apart),
        # the same loss and the same update
        for key in ("reward/mean", "reward/std", "loss", "policy_loss", "train/grad_norm"):
            assert k[key] == pytest.approx(r[key], rel=1e-3, abs=1e-6), (k["step"], key)


@pytest.fixture
def worker(tmp_path):
    cfg = recipe(tmp_path, "num_steps=2", *KEEP)
    plain = OmegaConf.to_container(cfg, resolve=True)
    plain.pop("hydra", None)
    transport = make_transport(cfg.transport)
    w = RLWorker(
        RankInfo(rank=0, world_size=1, dp_rank=0, dp_size=1), plain, 2, None, transport.start(), "cpu"
    )
    sampling = build(cfg.sampling)
    sigmas = sigmas_for(sampling, w.bundle.image_seq_len(sampling.height, sampling.width))
    examples = build(cfg.data_source).next_batch(int(cfg.prompts_per_rollout))
    w.request = lambda rollout_id: RolloutReq.from_prompts(examples, sampling, sigmas, rollout_id)
    yield w
    w.teardown()


def advantages(meta) -> torch.Tensor:
    return torch.linspace(-1.0, 1.0, len(meta.sample_ids))


def test_kept_graphs_live_from_rollout_to_train_of_one_partition(worker):
    pairs = 8 * 2  # samples x SDE steps
    meta = worker.rollout(worker.request(0), "step_0")
    assert len(worker.kept) == pairs and worker.kept.partition == "step_0"
    # a rollout into another partition drops the stale graphs first
    meta = worker.rollout(worker.request(1), "step_1")
    assert len(worker.kept) == pairs and worker.kept.partition == "step_1"
    assert worker.kept.covers(meta.sample_ids, [0]) or worker.kept.covers(meta.sample_ids, [1])
    worker.release_kept("step_0")  # another partition's release leaves them
    assert len(worker.kept) == pairs
    worker.release_kept("step_1")
    assert len(worker.kept) == 0
    # a train that raises drops them too
    meta = worker.rollout(worker.request(2), "step_2")
    with pytest.raises((IndexError, ValueError)):  # 3 advantages for 8 samples
        worker.train(meta, torch.zeros(len(meta.sample_ids)), torch.zeros(3), 0.0)
    assert len(worker.kept) == 0
    # a train that succeeds consumes them
    meta = worker.rollout(worker.request(3), "step_3")
    metrics = worker.train(meta, torch.zeros(len(meta.sample_ids)), advantages(meta), 0.0)
    assert metrics["keep_graph/kept_fraction"] == 1.0 and metrics["ratio/first_update_mean"] == 1.0
    assert len(worker.kept) == 0


class NaNOnOne:
    """A scorer that fails one sample (NaN)."""

    def __call__(self, req):
        scores = torch.zeros(len(req.sample_ids))
        scores[1] = float("nan")
        return scores


def test_a_step_that_fails_before_train_releases_its_graphs(tmp_path, monkeypatch):
    released, held = [], []
    original = RLWorker.release_kept

    def spy(self, partition):
        original(self, partition)
        released.append(partition)
        held.append(len(self.kept))

    monkeypatch.setattr(RLWorker, "release_kept", spy)
    broken = [
        "~reward.backend.components.redness",
        "~reward.backend.weights.redness",
        f"+reward.backend.components.broken={{_target_: {__name__}.NaNOnOne}}",
        "+reward.backend.weights.broken=1.0",
    ]
    with pytest.raises(TrainingError, match="during 'reward'"):
        Trainer(recipe(tmp_path, "num_steps=1", *KEEP, *broken)).run()
    assert released == ["step_0"] and held == [0]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["train.stack.num_updates_per_batch=2"], "train.stack.num_updates_per_batch=2"),
        (["++train.lora.dropout=0.1"], "train.lora.dropout=0.1"),
        (["train.lora=null", "algorithm.config.beta=0.1"], "train.lora: null"),
        (["rollout.keep_graph=false", "++rollout.keep_graph_max_pairs=4"], "has no effect"),
    ],
)
def test_validation_refuses_what_cannot_keep_graphs(tmp_path, overrides, message):
    cfg = recipe(tmp_path, "num_steps=1", *KEEP, *overrides)
    with pytest.raises(ConfigError, match=message):
        validate_recipe(cfg, expect="diffusion")


def test_validation_accepts_keep_graph_on_several_ranks(tmp_path):
    validate_recipe(recipe(tmp_path, *KEEP, "num_devices=2", "launcher=ray", "transport=ray"))


def test_validation_refuses_keep_graph_on_text_and_nft(tmp_path):
    with initialize_config_dir(config_dir=EXAMPLES, version_base=None):
        text = compose("llm/tiny_lm_grpo", overrides=KEEP)
        nft = compose("diffusion/shapes_nft", overrides=KEEP)
    with pytest.raises(ConfigError, match="diffusion rollouts, but this is a text recipe"):
        validate_recipe(text)
    with pytest.raises(ConfigError, match="DiffusionNFT cannot train from graphs kept"):
        validate_recipe(nft)
