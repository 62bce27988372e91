"""The unified smoke recipe (BiCoT-GRPO on a tiny random Janus) through
`python -m unirl.train_unified_model`: both segments train in one step, the gallery's samples
show each image with its plan, the export loads back with moved weights, bad input exits 2
before any work; in this process, a run stopped at a checkpoint and resumed writes the rows and
weights of the run that never stopped; on 2 ranks with FSDP2 (Ray) the run trains as the one-rank
run does and resumes exactly; with a dedicated engine (its own backbone, synced before every
rollout) it trains as the train workers' own sampling does."""

from __future__ import annotations

import html
import json

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import run_module, untimed
from tests.recipes import exported_weights, run, same_weights, stopped_and_resumed
from tests.recipes import rows as read_rows
from unirl.models.janus import JanusModelConfig

pytestmark = [pytest.mark.e2e]

SMOKE = "unified/tiny_bicot_smoke"


def test_entry_point_trains_both_segments_and_shows_plans(tmp_path):
    out = tmp_path / "smoke"
    done = run_module(
        "unirl.train_unified_model",
        f"--config-name={SMOKE}",
        f"output_dir={out}",
        "logging.progress=false",
        "logging.save_images_every=1",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = read_rows(out)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:  # one image reward credited to both segments, each with its own loss
        assert r["plan/reward/mean"] == pytest.approx(r["image/reward/mean"])
        assert r["plan/ratio/first_update_mean"] == pytest.approx(1.0) and "image/loss" in r
        assert 0.0 <= r["plan/truncated_fraction"] <= 1.0
    captions = json.loads((out / "samples/step_0002.json").read_text())
    plans = json.loads((out / "samples/lineage_step_0002.json").read_text())
    assert len(plans) == 2 and all(len(p["rewrites"]) == 4 for p in plans)
    # the gallery shows each image captioned "user prompt -> plan", the plan being the one sampled
    sampled = {r["rewrite"] for p in plans for r in p["rewrites"]}
    assert len(captions) == 8 and all(c["prompt"].split(" -> ", 1)[1] in sampled for c in captions)
    page = (out / "gallery.html").read_text()
    assert (out / "samples/step_0002.png").exists() and html.escape(
        captions[0]["prompt"].split(" -> ")[0]
    ) in page
    base = load_file(out / "base_model/model.safetensors")
    final = JanusModelConfig(pretrained_path=str(out / "base_model")).load_checkpoint(
        str(out / "checkpoints/final")
    )
    moved = {k for k, v in final.model.state_dict().items() if k in base and not torch.equal(v, base[k])}
    assert any("generation_head" in k for k in moved) and any("lm_head" in k for k in moved)
    bad = run_module(
        "unirl.train_unified_model",
        f"--config-name={SMOKE}",
        "tracks.plan.trained=false",
        "tracks.image.trained=false",
        "~tracks.plan.algorithm",
        "~tracks.plan.advantage",
        "~tracks.image.algorithm",
        "~tracks.image.advantage",
    )
    assert bad.returncode == 2 and "tracks.plan.trained and tracks.image.trained are both false" in bad.stderr


def test_resume_is_exact(tmp_path):
    full, resumed = stopped_and_resumed(SMOKE, tmp_path, "logging.progress=false", stop=2, steps=4)
    assert (tmp_path / "part/checkpoints/step_000002").is_dir()
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert [untimed(r) for r in resumed[2:]] == [untimed(r) for r in full[2:]]
    assert same_weights(tmp_path / "full", tmp_path / "part")


FSDP = "train.fsdp={_target_: unirl.train.fsdp.FSDPConfig, block_classes: [LlamaDecoderLayer]}"


@pytest.mark.ray
def test_two_ranks_train_as_one_and_resume_exactly(tmp_path, ray_cluster):
    """BiCoT-GRPO on 2 workers with FSDP2 (each submodule a stage calls sharded as its own root):
    the same rewards, ratios and gradient norms as one worker, the same final weights to float
    rounding; stopped at a step-2 checkpoint and resumed, the rows and weights of the run that never
    stopped. The one-worker run writes no `base_model/` (`checkpoint.save_base_model=false`)."""
    two = ["num_devices=2", "launcher=ray", "transport=ray", "threads_per_worker=1", FSDP]
    full, resumed = stopped_and_resumed(SMOKE, tmp_path, *two, stop=2, steps=3)
    assert [r["step"] for r in resumed] == [1, 2, 3]
    assert [untimed(r) for r in resumed[2:]] == [untimed(r) for r in full[2:]]
    assert same_weights(tmp_path / "full", tmp_path / "part")
    one = run(SMOKE, tmp_path / "one", "num_steps=3", "threads_per_worker=1", "++checkpoint.save_base_model=false")
    assert not (tmp_path / "one" / "base_model").exists() and (tmp_path / "full" / "base_model").is_dir()
    for a, b in zip(one, full, strict=True):
        for seg in ("plan", "image"):
            assert a[f"{seg}/reward/mean"] == b[f"{seg}/reward/mean"]
            assert a[f"{seg}/ratio/first_update_mean"] == pytest.approx(1.0, abs=1e-6)
            assert b[f"{seg}/ratio/first_update_mean"] == pytest.approx(1.0, abs=1e-6)
        assert a["train/grad_norm"] == pytest.approx(b["train/grad_norm"], rel=1e-5)
    wa, wb = exported_weights(tmp_path / "one"), exported_weights(tmp_path / "full")
    assert wa.keys() == wb.keys() and all(torch.allclose(wa[k], wb[k], atol=1e-6, rtol=0) for k in wa)


DEDICATED = "unified/tiny_bicot_dedicated"


@pytest.mark.ray
def test_a_dedicated_engine_samples_what_the_trainer_would_and_resumes_exactly(tmp_path, ray_cluster):
    """The engine actor's rollouts (weights dropped while the trainer trains, rebuilt and synced
    back: sleep level 2; its shard in forward batches of 2) give the samples and rewards of the
    run whose train worker samples itself, its losses, gradients and final weights to float
    rounding; stopped at a step-2 checkpoint and resumed, the run that never stopped bit for bit."""
    # forward batches of 2: the engine samples its shard in 4 batches, and is called once for it
    dedicated = ["rollout.sleep_level=2", "rollout.forward_batch_size=2"]
    full, resumed = stopped_and_resumed(DEDICATED, tmp_path, *dedicated, stop=2, steps=3)
    assert [untimed(r) for r in resumed[2:]] == [untimed(r) for r in full[2:]]
    assert same_weights(tmp_path / "full", tmp_path / "part")
    assert all(r["sync/bytes"] > 0 and r["sync/buckets"] >= 1 for r in full)
    # the trainside run samples in forward batches of 8: the same samples and rewards, the
    # recorded log-probs (so the losses and gradients) equal to float rounding
    trainside = run(SMOKE, tmp_path / "trainside", "num_steps=3", "threads_per_worker=1")
    for a, b in zip(trainside, full, strict=True):
        assert {k: v for k, v in a.items() if "reward/" in k} == {k: v for k, v in b.items() if "reward/" in k}
        for k in (k for k in a if k.endswith("loss")):
            assert a[k] == pytest.approx(b[k], abs=1e-6), k
        assert a["train/grad_norm"] == pytest.approx(b["train/grad_norm"], rel=1e-5)
    wa, wb = exported_weights(tmp_path / "trainside"), exported_weights(tmp_path / "full")
    assert wa.keys() == wb.keys() and all(torch.allclose(wa[k], wb[k], atol=1e-6, rtol=0) for k in wa)
