"""Multi-worker training on real Ray: exact resume, 1-vs-2-worker parity, worker failure.

Runs a shrunken tiny recipe in-process through `Trainer` on one shared
local Ray instance (the worker failure test runs the entry point in a subprocess).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import ClassVar

import psutil
import pytest
import torch

from tests.conftest import REPO, untimed
from tests.dataplane.backends import BACKENDS, transport_cfg
from tests.recipes import (
    IN_PROCESS,
    SD3,
    exported_weights,
    per_transport,
    recipe,
    same_weights,
    stopped_and_resumed,
)
from tests.recipes import run as run_recipe
from unirl.algorithms.flow_grpo import FlowGRPO
from unirl.config.validate import ConfigError
from unirl.dataplane import make_transport
from unirl.evaluate import main as evaluate_main
from unirl.trainer.trainer import Trainer

pytestmark = pytest.mark.ray

TINY = "diffusion/tiny_sd3_flowgrpo"
SHAPES = "diffusion/shapes_flowgrpo_smoke"


def run(out, *overrides: str) -> list[dict]:
    return run_recipe(TINY, out, *overrides)


@pytest.fixture(scope="module", autouse=True)
def local_ray(ray_cluster):
    """The session's shared Ray instance (tests/ray_loopback.py)."""
    return ray_cluster


# a full fine-tune with Flow-GRPO's KL term keeps a copy of the initial weights as its reference
FULL_FINETUNE_KL = ["train.lora=null", "algorithm.config.beta=0.04", "train.optim.lr=3e-4"]
RESUME_CASES = {
    "lora-1-worker": IN_PROCESS,
    "lora-2-workers": ["num_devices=2"],
    "full-finetune-kl-2-workers": ["num_devices=2", *FULL_FINETUNE_KL],
}


@pytest.mark.parametrize("case", list(RESUME_CASES))
def test_resume_continues_identically(tmp_path, case, request):
    """Stopped at a step-2 checkpoint and resumed, a run writes the rows of the run that never
    stopped (apart from measurements of the machine) and ends with bit-equal weights. With a
    full fine-tune and a KL term, equal `kl` rows say the reference came back as the initial
    weights. 1 worker (in this process) trains the plain module, 2 workers FSDP2-sharded weights,
    optimizer and reference; the backend's own round trip is tests/train/test_checkpoint.py.
    The LoRA 2-worker run stopped at step 2 is the `two_workers` fixture's `ray` run (the same
    recipe, checkpointed at its last step), copied and resumed here."""
    overrides = RESUME_CASES[case]
    if case == "lora-2-workers":
        full = run(tmp_path / "full", "num_steps=4", *overrides)
        shutil.copytree(request.getfixturevalue("two_workers")["ray"][0], tmp_path / "part")
        resumed = run(tmp_path / "part", "num_steps=4", "resume_from=latest", *overrides)
    else:
        full, resumed = stopped_and_resumed(TINY, tmp_path, *overrides)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert [untimed(r) for r in resumed[2:]] == [untimed(r) for r in full[2:]]
    assert same_weights(tmp_path / "full", tmp_path / "part")
    if "train.lora=null" in overrides:
        weights = exported_weights(tmp_path / "part")
        assert len(weights) > 50 and not any("lora" in k for k in weights)  # every weight of the transformer
        assert resumed[0]["kl"] == 0.0 and all(r["kl"] > 0.0 for r in resumed[1:])


EMA = "train.ema={_target_: unirl.train.ema.EMAConfig, decay: 0.5}"


# the mean-pixel scorer on images of 2 Euler steps without guidance (a quarter of the recipe's
# 4 guided steps): they still move with any change of the weights
MEAN_PIXEL = [
    "eval.scorer._target_=tests.recipes.MeanPixel",
    "~eval.scorer.mode",
    "eval.sampling.num_steps=2",
    "eval.sampling.guidance_scale=1.0",
]
# the shapes smoke recipe (held-out prompts) with an EMA and the mean-pixel scorer, evaluated every step, on 2 workers
SHAPES_EMA = [EMA, *MEAN_PIXEL, "num_devices=2", "eval.every_n_steps=1"]


def test_ema_evaluation_export_and_resume(tmp_path, capsys):
    """With `train.ema`, `eval.use_ema` evaluates the EMA weights, `checkpoints/final_ema/` exports
    them, and a run stopped at a step-1 checkpoint and resumed keeps them exactly.

    Two runs of one recipe that differ only in `eval.use_ema`: the EMA does not touch training,
    so their training rows are equal, as are their step-0 evaluations (the EMA starts as a copy
    of the weights); later evaluations and the two exports differ. The EMA run is the resumed
    one: its rows after the checkpoint equal the uninterrupted run's and both its exports are
    bit-equal to the uninterrupted run's (FSDP2-sharded EMA shadows through the checkpoint).
    The evaluate command on `final_ema` scores what the run's last EMA evaluation scored."""
    live = run_recipe(SHAPES, tmp_path / "live", *SHAPES_EMA, "num_steps=2", "eval.use_ema=false")
    part = tmp_path / "ema"
    run_recipe(SHAPES, part, *SHAPES_EMA, "num_steps=1", "checkpoint.every_n_steps=1", "eval.use_ema=true")
    ema = run_recipe(SHAPES, part, *SHAPES_EMA, "num_steps=2", "resume_from=latest", "eval.use_ema=true")
    assert [r["step"] for r in ema] == [r["step"] for r in live] == [0, 1, 2]

    def training(row: dict) -> dict:
        return {k: v for k, v in untimed(row).items() if not k.startswith("eval/")}

    assert [training(r) for r in ema] == [training(r) for r in live]
    pixel = "eval/mean_pixel"
    assert all(pixel in r for r in ema + live)
    assert ema[0][pixel] == live[0][pixel]
    assert ema[1][pixel] != live[1][pixel] and ema[2][pixel] != live[2][pixel]

    for name in ("final", "final_ema"):
        assert same_weights(tmp_path / "live", part, name), name
    weights, averaged = exported_weights(part), exported_weights(part, "final_ema")
    assert weights.keys() == averaged.keys()
    assert not all(torch.equal(weights[k], averaged[k]) for k in weights)

    # the evaluate command (`python -m unirl.evaluate`; its own process in tests/e2e/test_shapes_smoke.py)
    argv = ["--recipe", SHAPES, "--checkpoint", str(part / "checkpoints" / "final_ema"), *MEAN_PIXEL]
    capsys.readouterr()
    assert evaluate_main(argv) == 0
    scored = json.loads(capsys.readouterr().out)[pixel]
    # the exported LoRA file on the base matches the run's weights to float rounding, which may
    # flip a pixel's rounding: far less than what separates the EMA from the live weights
    tol = abs(ema[2][pixel] - live[2][pixel]) / 10
    assert scored == pytest.approx(ema[2][pixel], abs=tol)


class FlowGRPOFromEMA(FlowGRPO):
    """Flow-GRPO whose rollouts come from the EMA weights (no shipped algorithm asks for that)."""

    requires_ema_rollout: ClassVar[bool] = True


def test_ema_rollouts_sample_from_the_ema_weights(tmp_path):
    """An algorithm with `requires_ema_rollout` samples from the EMA: the log-probs recorded at
    sampling are the EMA policy's, so the first update's ratios (live / sampling policy) are
    off 1 once the EMA and the weights part (step 2 on). Control: the same recipe and EMA with
    plain Flow-GRPO, whose ratios stay at 1 up to replay rounding; both runs are identical at
    step 1, where the EMA still equals the weights."""

    def ratio_spread(row: dict) -> float:
        return max(abs(row["ratio/max"] - 1.0), abs(row["ratio/min"] - 1.0))

    plain = run(tmp_path / "plain", "num_steps=2", *IN_PROCESS, EMA)
    ema = run(
        tmp_path / "ema", "num_steps=2", *IN_PROCESS, EMA, f"algorithm._target_={__name__}.FlowGRPOFromEMA"
    )
    assert untimed(ema[0]) == untimed(plain[0])
    p, e = plain[1], ema[1]
    assert ratio_spread(p) < 1e-5 and ratio_spread(e) > 100 * max(ratio_spread(p), 1e-7), (p, e)
    assert e["approx_kl"] > 100 * max(p["approx_kl"], 1e-12)


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory) -> dict[str, tuple]:
    """2 steps on 2 workers through each transport, checkpointed at step 2 (the `ray` run is
    the LoRA 2-worker resume test's stopped run): {transport: (output dir, rows)}."""
    return per_transport(
        TINY,
        tmp_path_factory.mktemp("two_workers"),
        BACKENDS,
        "num_steps=2",
        "num_devices=2",
        "checkpoint.every_n_steps=2",
    )


def test_one_and_two_workers_agree(tmp_path, two_workers):
    one = run(tmp_path / "one", "num_steps=2", *IN_PROCESS)
    two_dir, two = two_workers["ray"]  # the recipe's transport
    for r1, r2 in zip(one, two, strict=True):
        assert r1["reward/mean"] == pytest.approx(r2["reward/mean"], abs=1e-6)
        assert r1["loss"] == pytest.approx(r2["loss"], abs=1e-6)
        assert r1["train/grad_norm"] == pytest.approx(r2["train/grad_norm"], rel=1e-4)
    # The two runs reduce gradients in different orders (fp32 sums differ in the last bits); Adam's
    # first step is g / (|g| + eps), so an element whose gradient is near eps can move its weight by a
    # visible fraction of a step. Equal within 1% of one lr step (lr 3e-3 -> 3e-5).
    a, b = exported_weights(tmp_path / "one"), exported_weights(two_dir)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=3e-5)


def test_every_transport_trains_identically(two_workers):
    """Same metrics (bytes moved included) and bit-equal final weights whichever transport moves the data."""
    ref_dir, ref = two_workers["inband"]
    ref = [untimed(r) for r in ref]
    assert ref[0]["dataplane/put_bytes"] > 0 and ref[0]["dataplane/get_calls"] == 3  # driver + 2 ranks
    for name, (out, rows) in two_workers.items():
        assert [untimed(r) for r in rows] == ref, name
        assert same_weights(out, ref_dir), name


def test_failed_step_leaks_nothing_and_spares_a_running_controller(tmp_path):
    """A step that fails after the rollout still clears its partition, and a TransferQueue
    controller the run found running (another user's) survives the run's shutdown."""
    outer = make_transport(transport_cfg("tq_simple"))
    outer.start()
    try:
        trainer = Trainer(recipe(TINY, tmp_path, "num_steps=2", "transport=tq_simple"))

        def reward_down(track):
            assert len(outer.get(outer.put("probe", ["p"], {"x": torch.ones(1)}))["x"]) == 1
            outer.clear("probe")
            assert outer.stored_partitions() == ["step_0"]  # the rollout is in the store...
            raise RuntimeError("reward server down")

        trainer.graph.tracks[None].reward.score_and_attach = reward_down
        with pytest.raises(RuntimeError, match="reward server down"):
            trainer.run()
        assert outer.stored_partitions() == []  # ...and gone after the failed step
        meta = outer.put("after", ["a"], {"x": torch.arange(3).view(1, 3)})  # the controller still serves
        assert outer.get(meta)["x"].tolist() == [[0, 1, 2]]
        outer.clear("after")
    finally:
        outer.close()


def test_resume_validation_errors(tmp_path):
    with pytest.raises(ConfigError, match="resume_from=latest: no complete checkpoint"):
        recipe(TINY, tmp_path / "empty", "resume_from=latest")
    with pytest.raises(ConfigError, match="does not exist"):
        recipe(TINY, tmp_path, f"resume_from={tmp_path / 'nope'}")
    out = tmp_path / "ck"
    run(out, "num_steps=1", "checkpoint.every_n_steps=1", *IN_PROCESS)
    with pytest.raises(ConfigError, match="does not match the recipe"):
        recipe(TINY, out, "resume_from=latest", "model.tiny.num_layers=1")
    with pytest.raises(ConfigError, match="num_devices"):
        recipe(TINY, out, "resume_from=latest", "num_devices=2")


def alive(pids: set[int]) -> set[int]:
    """The processes of `pids` still running (not exited, not zombies)."""
    left = set()
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                left.add(pid)
        except psutil.NoSuchProcess:
            pass
    return left


def test_worker_death_stops_the_run_cleanly(tmp_path):
    out = tmp_path / "dies"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "unirl.train_diffusion",
            f"--config-name={TINY}",
            *SD3,
            "num_steps=200",
            "checkpoint.every_n_steps=1",
            f"output_dir={out}",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    deadline = time.time() + 240
    while not (out / "checkpoints" / "step_000002" / "COMPLETE").exists():
        assert proc.poll() is None and time.time() < deadline, "run did not reach its second checkpoint"
        time.sleep(0.5)
    # kill exactly this run's rank-0 worker (recorded by the trainer), never another run's
    placed = json.loads((out / "placement.json").read_text())
    victim = next(w for w in placed["workers"] if w["rank"] == 0)
    assert all(w["niceness"] == 0 for w in placed["workers"])  # the run's own instance: init_ray's setting
    assert "RLWorker" in " ".join(psutil.Process(victim["pid"]).cmdline())
    # the run's own Ray (GCS, raylet, workers) are the driver's descendants while it runs; another
    # test process's Ray instance on the machine is not
    run_pids = {c.pid for c in psutil.Process(proc.pid).children(recursive=True)}
    os.kill(victim["pid"], signal.SIGKILL)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 1, stderr[-3000:]
    assert "RLWorker" in stderr and "rank 0" in stderr and "run stopped at step" in stderr
    assert "Last complete checkpoint" in stderr and "step_00000" in stderr
    # the last checkpoint's exported weights load back
    from unirl.models.sd3 import load_checkpoint
    from unirl.trainer.checkpoints import latest_checkpoint

    last = latest_checkpoint(str(out))
    assert last is not None
    load_checkpoint(os.path.join(last, "weights"))
    # no Ray process of that run is left behind
    deadline = time.time() + 30
    while (left := alive(run_pids)) and time.time() < deadline:
        time.sleep(0.5)
    assert not left, f"processes left behind: {left}"
