"""The remote-reward recipes through their entry points against a real reward server started here
(serving the reward block of the local recipe), and a run whose reward server stops answering."""

from __future__ import annotations

import json
import os
import socket
import threading
import urllib.request

import pytest

from tests.conftest import EXAMPLES, run_module
from tests.recipes import IN_PROCESS, LM, SD3, recipe, rows
from unirl.reward.server import RewardServer, ServerConfig, load_backend
from unirl.trainer.trainer import Trainer, TrainingError

pytestmark = pytest.mark.e2e

TOKEN = "e2e-reward-token"
IN_PROCESS_NO_CHECKPOINTS = [*IN_PROCESS, "checkpoint.every_n_steps=0"]
LM_SMALL = [
    *LM,
    "num_steps=2",
    "train.stack.micro_batch_size=8",
    "logging.save_images_every=1",
    *IN_PROCESS_NO_CHECKPOINTS,
]
SD3_SMALL = [*SD3, "num_steps=2", "train.stack.micro_batch_size=4", *IN_PROCESS_NO_CHECKPOINTS]


def serve(name: str) -> RewardServer:
    """A reward server for the reward block of `examples/<name>.yaml`, with a token."""
    return RewardServer(load_backend(os.path.join(EXAMPLES, name + ".yaml")), TOKEN, ServerConfig(port=0))


def counters(url: str) -> dict:
    with urllib.request.urlopen(url + "/health", timeout=30) as answer:
        return json.loads(answer.read())


def run_remote(entry: str, name: str, server: RewardServer, out, overrides: list[str]):
    res = run_module(
        entry,
        f"--config-name={name}",
        *overrides,
        "reward.backend.token_env=UNIRL_REWARD_TOKEN",
        f"output_dir={out}",
        timeout=600,
        env={"UNIRL_REWARD_URL": server.url, "UNIRL_REWARD_TOKEN": TOKEN, "OMP_NUM_THREADS": "1"},
    )
    assert res.returncode == 0, res.stderr[-4000:]
    assert TOKEN not in res.stdout + res.stderr
    return rows(out)


def test_lm_recipe_scores_through_the_server(tmp_path):
    """llm/tiny_lm_grpo_remote_reward, 2 steps: every sample went through the server, and each
    logged reward is the digit fraction of its saved response, recomputed here."""
    with serve("llm/tiny_lm_grpo") as server:
        rows = run_remote("unirl.train_vlm", "llm/tiny_lm_grpo_remote_reward", server, tmp_path, LM_SMALL)
        seen = counters(server.url)
    assert [r["step"] for r in rows] == [1, 2] and seen["samples"] == 2 * 16 and seen["errors"] == 0
    for row in rows:
        samples = json.loads((tmp_path / "samples" / f"step_{row['step']:04d}.json").read_text())
        expected = [sum(c in "0123456789" for c in s["response"]) / len(s["response"]) for s in samples]
        assert [s["reward"] for s in samples] == pytest.approx(expected, rel=1e-6)
        assert row["reward/digits/mean"] == pytest.approx(sum(expected) / len(expected), rel=1e-5)


def test_diffusion_recipe_scores_through_the_server(tmp_path):
    """diffusion/tiny_sd3_flowgrpo_remote_reward, 2 steps: PNG images to the server, per-component
    reward metrics logged as with the local backend."""
    with serve("diffusion/tiny_sd3_flowgrpo") as server:
        rows = run_remote(
            "unirl.train_diffusion", "diffusion/tiny_sd3_flowgrpo_remote_reward", server, tmp_path, SD3_SMALL
        )
        seen = counters(server.url)
    assert [r["step"] for r in rows] == [1, 2] and seen["samples"] == 2 * 8 and seen["errors"] == 0
    for row in rows:
        assert 0.0 < row["reward/redness/mean"] < 1.0 and row["reward/mean"] == row["reward/redness/mean"]


def test_a_reward_server_that_stops_answering_stops_the_run_with_a_clear_error(tmp_path):
    """A server that accepts connections and never answers: the step stops within the timeout and
    retries, naming the step, the phase and the URL; nothing of the step is trained."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    held, stop = [], threading.Event()

    def accept():
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except TimeoutError:
                pass

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    cfg = recipe(
        "llm/tiny_lm_grpo_remote_reward",
        tmp_path,
        *LM_SMALL,
        f"reward.backend.url={url}",
        "reward.backend.timeout_s=0.5",
        "reward.backend.max_retries=1",
        "reward.backend.backoff_s=0.1",
        expect="text",
    )
    try:
        with pytest.raises(TrainingError) as info:
            Trainer(cfg).run()
    finally:
        stop.set()
        thread.join()
        for conn in held:
            conn.close()
        listener.close()
    msg = str(info.value)
    assert "run stopped at step 1 during 'reward' (nothing of this step was trained)" in msg
    assert f"{url}/v1/info gave no answer after 2 attempt(s)" in msg and "timeout_s=0.5" in msg
    assert not (tmp_path / "metrics.jsonl").exists() or not (tmp_path / "metrics.jsonl").read_text().strip()
