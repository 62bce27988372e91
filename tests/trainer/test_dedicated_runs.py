"""Dedicated rollout engines in real runs (Ray, tiny models): parity with trainside, overlap,
bounded staleness, exact resume, a killed engine.

Runs shrunken tiny recipes in-process through `Trainer` on one shared local Ray instance (the
killed-engine and staleness tests run the colocated and separate recipes' entry points in a
subprocess). Equal rows below are equal floats: the
engines sample with the trainer's weights (a bit-exact sync) through the same stage code and the
same forward batches as the trainside engine.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.conftest import KERNEL_ROUNDING, REPO, run_module, untimed
from tests.recipes import SD3, run, same_weights
from tests.recipes import rows as read_rows
from unirl.distributed.group import DevicePool, Worker, WorkerError, placement, remote

pytestmark = pytest.mark.ray

COLOCATE = "diffusion/tiny_sd3_dedicated_colocate"
SEPARATE = "diffusion/tiny_sd3_dedicated_separate"
TRAINSIDE = "diffusion/tiny_sd3_flowgrpo"
# what differs by construction between engines and trainside: the weight sync's own figures, the
# engine's rows, how many transport calls carried the rollout (one per chunk), and the gap between the
# sampler's recorded log-probs and the replay (`mismatch/`: float rounding of forwards batched
# differently, at most KERNEL_ROUNDING, checked below)
ENGINE_ONLY = ("sync/", "rollout/staleness", "off_policy/", "dataplane/", "mismatch/")


@pytest.fixture(scope="module", autouse=True)
def local_ray(ray_cluster):
    """The session's shared Ray instance (tests/ray_loopback.py)."""
    return ray_cluster


def training(row: dict) -> dict:
    """A row's training and reward figures (what must not depend on where rollouts ran)."""
    return {k: v for k, v in untimed(row).items() if not k.startswith(ENGINE_ONLY)}


@pytest.fixture(scope="module")
def trainside(tmp_path_factory):
    """The sequential trainside loop of the tiny recipe on 2 workers (FSDP2), at the engines'
    forward batch size (2: each rank samples its 4 samples in two forwards)."""
    out = tmp_path_factory.mktemp("trainside")
    return out, run(TRAINSIDE, out, "num_steps=2", "num_devices=2", "rollout.forward_batch_size=2")


def test_colocated_engine_trains_like_trainside(trainside, tmp_path):
    """Two colocated engines (one per training device, sleeping while the trainer trains; the
    FSDP2-sharded LoRA gathered and synced through the object store, verified after every step)
    give the trainside run's rows bit for bit and the same final weights."""
    ref_dir, ref = trainside
    rows = run(
        COLOCATE,
        tmp_path,
        "num_steps=2",
        "num_devices=2",
        "rollout.num_engines=2",
        "rollout.forward_batch_size=2",
        "weight_sync.verify=true",
    )
    assert [training(r) for r in rows] == [training(r) for r in ref]
    assert same_weights(ref_dir, tmp_path)
    assert [r["rollout/staleness"] for r in rows] == [0, 0]
    assert all(abs(r["ratio/first_update_mean"] - 1.0) <= KERNEL_ROUNDING for r in rows)  # engine = trainer
    assert all(r["sync/bytes"] > 0 and r["time/sync_s"] > 0 for r in rows)
    placed = json.loads((tmp_path / "placement.json").read_text())
    assert placed["num_devices"] == 2 and [e["engine"] for e in placed["engines"]] == [0, 1]
    # workers and engines of the shared instance (started as init_ray starts one) at niceness 0
    assert [p["niceness"] for p in placed["workers"] + placed["engines"]] == [0, 0, 0, 0]


def test_overlapped_loop_without_staleness_equals_the_sequential_one(trainside, tmp_path):
    """Separate placement (2 training devices + 2 engine devices), max_staleness 0, each forward
    batch scored while the engines generate the next (2 chunks per rollout, broadcast sync): the
    rows and final weights equal the sequential trainside loop's; only the transport's call
    counts differ (each engine puts 2 chunks where each trainside rank put 1)."""
    ref_dir, ref = trainside
    rows = run(
        SEPARATE,
        tmp_path,
        "num_steps=2",
        "num_devices=2",
        "rollout.num_engines=2",
        "rollout.forward_batch_size=2",
        "rollout.max_staleness=0",
    )
    assert [training(r) for r in rows] == [training(r) for r in ref]
    assert same_weights(ref_dir, tmp_path)
    assert [r["rollout/staleness"] for r in rows] == [0, 0]
    assert rows[0]["dataplane/put_calls"] == 2 * ref[0]["dataplane/put_calls"]
    placed = json.loads((tmp_path / "placement.json").read_text())
    assert placed["num_devices"] == 4  # two training devices + the engines' own two


def test_staleness_one_samples_behind_and_resumes_exactly(tmp_path):
    """max_staleness 1: step n+1's rollout runs while step n trains, on weights one version behind.

    The behaviour policy, checked independently: a run whose first update changes no weight
    (lr 1e-30) samples its step-2 rollout on-policy with the initial weights; the stale run,
    which did train at step 1, samples its step-2 rollout with the initial weights too, so their
    step-2 rewards are equal, while the stale run's importance ratios (trained weights over the
    engine's recorded log-probs) are off 1 where the frozen run's are exactly 1.

    Resume: the step-2 checkpoint is taken while step 3's rollout runs; it holds the engine's
    weights (version 1) and the data position before that rollout's prompts, so a run resumed
    from it writes the uninterrupted run's rows and ends with the same weights.

    The uninterrupted run is the separate recipe through its entry point (`python -m
    unirl.train_diffusion`, on the shared Ray instance): one engine, a weight sync before each
    later rollout, a final export; the frozen and resumed runs train in this process."""
    full_dir = tmp_path / "full"
    res = run_module(
        "unirl.train_diffusion",
        f"--config-name={SEPARATE}",
        *SD3,
        "num_steps=4",
        "checkpoint.every_n_steps=2",
        f"output_dir={full_dir}",
    )
    assert res.returncode == 0, res.stderr[-4000:]
    full = read_rows(full_dir)
    assert [r["rollout/staleness"] for r in full] == [0, 1, 1, 1]
    assert all(r["sync/bytes"] > 0 for r in full[:-1])  # a sync before each later rollout
    assert [e["engine"] for e in json.loads((full_dir / "placement.json").read_text())["engines"]] == [0]
    assert (full_dir / "checkpoints" / "final" / "unirl_checkpoint.json").exists()
    frozen = run(
        SEPARATE, tmp_path / "frozen", "num_steps=2", "rollout.max_staleness=0", "train.optim.lr=1e-30"
    )
    assert {**training(full[0]), "train/lr": 0} == {**training(frozen[0]), "train/lr": 0}
    assert full[1]["reward/mean"] == frozen[1]["reward/mean"]
    assert full[1]["reward/std"] == frozen[1]["reward/std"]
    assert abs(frozen[1]["ratio/first_update_mean"] - 1.0) <= KERNEL_ROUNDING
    assert frozen[1]["approx_kl"] <= KERNEL_ROUNDING**2
    for r in full[1:]:
        assert r["off_policy/ratio_mean"] == r["ratio/first_update_mean"] != 1.0
        assert r["approx_kl"] > 0 and max(abs(r["ratio/max"] - 1), abs(r["ratio/min"] - 1)) > 1e-5

    ckpt = tmp_path / "full" / "checkpoints" / "step_000002"
    state = json.loads((ckpt / "driver_state.json").read_text())
    assert state["engine_weights_version"] == 1 and (ckpt / "engine_weights.safetensors").exists()
    resumed = run(SEPARATE, tmp_path / "resumed", "num_steps=4", f"resume_from={ckpt}")
    assert [r["step"] for r in resumed] == [3, 4]
    assert [training(r) for r in resumed] == [training(r) for r in full[2:]]
    assert same_weights(tmp_path / "full", tmp_path / "resumed")


def test_staleness_two_samples_two_steps_on_one_version_and_resumes_with_both_in_flight(tmp_path):
    """max_staleness 2: after step n's rewards the engine takes weights n and samples steps n+1 and
    n+2 while they train, then syncs again: staleness 0, 1, 2, 1, 2 over five steps.

    The behaviour policy, checked independently: a run that changes no weight (lr 1e-30,
    max_staleness 0) samples steps 2 and 3 with the initial weights, and so does the stale run (its
    engine still holds version 0 there, one and two updates behind), so their rewards are equal.

    Resume: the step-3 checkpoint is taken with steps 4 and 5 in flight, both sampling version 2;
    it holds those weights, the last step in flight and the data position before step 4's
    prompts, so the run resumed from it writes the uninterrupted run's rows and weights."""
    stale = ["rollout.max_staleness=2", "checkpoint.every_n_steps=3"]
    full = run(SEPARATE, tmp_path / "full", "num_steps=5", *stale)
    assert [r["rollout/staleness"] for r in full] == [0, 1, 2, 1, 2]
    synced = [r["step"] for r in full if r.get("sync/bytes", 0) > 0]
    assert synced == [1, 3]  # a sync only when the engine has nothing left in flight
    for r in full[1:]:
        assert r["off_policy/ratio_mean"] == r["ratio/first_update_mean"] != 1.0
    frozen = run(SEPARATE, tmp_path / "frozen", "num_steps=3", "rollout.max_staleness=0", "train.optim.lr=1e-30")
    for step in (1, 2):
        assert full[step]["reward/mean"] == frozen[step]["reward/mean"]
        assert full[step]["reward/std"] == frozen[step]["reward/std"]
    assert len({r["reward/mean"] for r in frozen}) == 3  # each step's own prompts and draws

    ckpt = tmp_path / "full" / "checkpoints" / "step_000003"
    state = json.loads((ckpt / "driver_state.json").read_text())
    assert (state["engine_weights_version"], state["ahead_until"]) == (2, 4)
    resumed = run(SEPARATE, tmp_path / "resumed", "num_steps=5", *stale, f"resume_from={ckpt}")
    assert [r["step"] for r in resumed] == [4, 5]
    assert [training(r) for r in resumed] == [training(r) for r in full[3:]]
    assert same_weights(tmp_path / "full", tmp_path / "resumed")


def test_text_engine_with_dropped_weights_trains_like_trainside(tmp_path):
    """The LM recipe (full fine-tune, every weight synced and verified, the engine dropping its
    weights while the trainer trains and rebuilding them on wake-up; 4 chunks per rollout, each
    scored while the next generates) gives the trainside rows and weights."""
    ref = run("llm/tiny_lm_grpo", tmp_path / "ref", "num_steps=2", "rollout.forward_batch_size=4")
    rows = run("llm/tiny_lm_dedicated", tmp_path / "eng", "num_steps=2", "rollout.forward_batch_size=4")
    assert [training(r) for r in rows] == [training(r) for r in ref]
    assert all(r["mismatch/abs_diff_max"] <= KERNEL_ROUNDING for r in rows + ref)
    assert same_weights(tmp_path / "ref", tmp_path / "eng")


class Recorder(Worker):
    """Appends to a list per call (slowly), so queued calls show their order."""

    def __init__(self, rank_info, *args) -> None:
        super().__init__(rank_info)
        self.seen: list[int] = []

    def append(self, value: float) -> list[int]:
        time.sleep(0.2)
        self.seen.append(len(self.seen) + 1)
        return list(self.seen)

    def pid(self) -> int:
        return os.getpid()


def test_worker_group_submit_runs_calls_in_order_and_names_a_dead_rank(tmp_path):
    """`WorkerGroup.submit` returns at once; calls queued on an actor run in order; a rank that
    died raises `WorkerError` naming it from `result()`."""
    pool = DevicePool(2)
    group = remote(Recorder, placement(pool))
    try:
        first = group.submit("append", 1.0)
        second = group.submit("append", 2.0)
        assert second.result() == [[1, 2], [1, 2]] and first.done()
        pid = group.pid()[1]
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(WorkerError, match="rank 1"):
            group.submit("append", 0.0).result()
    finally:
        group.shutdown()
        pool.shutdown()


def test_a_killed_engine_stops_the_run_naming_it(tmp_path, local_ray):
    """The colocated recipe through its entry point writes on-policy rows (a weight sync before
    each rollout after the first) from its one engine; SIGKILL that engine and the entry point
    exits 1 within seconds, naming the rollout engine and the step; nothing hangs."""
    out = tmp_path / "dies"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "unirl.train_diffusion",
            f"--config-name={COLOCATE}",
            *SD3,
            "num_steps=200",
            f"output_dir={out}",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "RAY_ADDRESS": local_ray},  # the shared instance
    )
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 240
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        assert proc.poll() is None and time.time() < deadline, "run did not reach its second step"
        time.sleep(0.2)
    placed = json.loads((out / "placement.json").read_text())
    assert [e["engine"] for e in placed["engines"]] == [0]
    engine = placed["engines"][0]
    assert "EngineWorker" in " ".join(psutil.Process(engine["pid"]).cmdline())
    os.kill(engine["pid"], signal.SIGKILL)
    killed = time.time()
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 1, stderr[-3000:]
    assert "rollout engine 0 failed" in stderr and "run stopped at step" in stderr, stderr[-3000:]
    assert time.time() - killed < 60
    first = [json.loads(line) for line in metrics.read_text().splitlines()[:2]]
    assert [r["rollout/staleness"] for r in first] == [0, 0] and first[0]["sync/bytes"] > 0
