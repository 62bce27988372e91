"""The LLM main job through its entry point (real Ray, real worker), its export loaded back, and
`llm/qwen3_grpo` on a real local Qwen3 directory (in this process)."""

from __future__ import annotations

import json
import math

import pytest

from tests.conftest import run_module
from tests.recipes import rows as read_rows
from tests.recipes import run
from unirl.models.causal_lm import CausalLMStage, TinyLMConfig
from unirl.models.qwen import QwenBundle, load_checkpoint
from unirl.types import PromptExample, RolloutReq, TextSamplingParams

pytestmark = [pytest.mark.e2e, pytest.mark.ray]

DIGITS = set("0123456789")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """The README's second main job as it ships (30 steps, under a minute on 2 idle cores)."""
    out = tmp_path_factory.mktemp("tiny_lm")
    res = run_module(
        "unirl.train_vlm",
        "--config-name=llm/tiny_lm_grpo",
        "logging.progress=false",
        f"output_dir={out}",
        timeout=1200,
    )
    assert res.returncode == 0, res.stderr[-4000:]
    return out


def digit_fraction(texts: list[str]) -> float:
    return sum(sum(c in DIGITS for c in t) / max(len(t), 1) for t in texts) / len(texts)


def test_reward_rises_beyond_noise(run_dir):
    """The README's LLM table: mean `reward/mean` over steps 26-30 exceeds steps 1-5 by more than
    max(0.3, 20 * se), se = (mean `reward/std` over steps 1-5) / sqrt(5 * 64). Measured 0.043 ->
    0.85 (a random-reward control drifts 0.04 -> 0.055); 0.3 is "answers mostly in digits"."""
    rows = read_rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 31))
    assert all(r["ratio/first_update_mean"] == 1.0 for r in rows)  # pi_old replayed: exactly on-policy
    first = [r["reward/mean"] for r in rows[:5]]
    last = [r["reward/mean"] for r in rows[-5:]]
    se = sum(r["reward/std"] for r in rows[:5]) / 5 / math.sqrt(5 * 64)
    assert sum(last) / 5 - sum(first) / 5 > max(0.3, 20 * se), (first, last, se)


def test_text_samples_and_gallery(run_dir):
    samples = json.loads((run_dir / "samples" / "step_0030.json").read_text())
    assert len(samples) == 64 and {"prompt", "response", "reward", "response_tokens"} <= set(samples[0])
    assert digit_fraction([s["response"] for s in samples]) > 0.3
    page = (run_dir / "gallery.html").read_text()
    assert 'class="sample text"' in page and 'id="step-30"' in page


def test_exported_model_answers_in_digits(run_dir):
    """`checkpoints/final` loads back with `load_checkpoint` (base + full weights) and samples the
    learned preference; the untrained base in `base_model/` does not."""
    req = RolloutReq.from_prompts(
        [PromptExample("Tell me about the moon.", "m"), PromptExample("Write a line on rain.", "r")],
        TextSamplingParams(samples_per_prompt=8, max_new_tokens=16, stop_tokens=["<|im_end|>"], seed=7),
        None,
        rollout_id=0,
    )
    trained = CausalLMStage(load_checkpoint(str(run_dir / "checkpoints" / "final"))).generate(req)[1]
    base = CausalLMStage(QwenBundle.from_pretrained(str(run_dir / "base_model"))).generate(req)[1]
    assert digit_fraction(trained) > 0.3 > 0.1 > digit_fraction(base)


def test_qwen3_recipe_on_a_local_directory(tmp_path, monkeypatch):
    """`llm/qwen3_grpo` (bf16 autocast, KL loss to the reference, boxed-answer reward) on a Qwen3
    directory written by save_pretrained, shrunk to 2 steps in this process: runs, exactly on-policy."""
    model = tmp_path / "qwen3"
    QwenBundle.tiny(TinyLMConfig(max_position_embeddings=1024)).save_pretrained(str(model))
    monkeypatch.setenv("PRETRAINED_MODEL", str(model))
    out = tmp_path / "run"
    rows = run(
        "llm/qwen3_grpo",
        out,
        "num_steps=2",
        "prompts_per_rollout=2",
        "sampling.samples_per_prompt=4",
        "sampling.max_new_tokens=16",
        "train.stack.micro_batch_size=4",
        "launcher=in_process",
        "transport=inband",
        "checkpoint.every_n_steps=0",
    )
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["ratio/first_update_mean"] == 1.0 and rows[0]["kl"] == pytest.approx(0.0, abs=1e-6)
    assert all(math.isfinite(r["reward/mean"]) for r in rows) and "reward/answer/mean" in rows[0]
    assert (out / "checkpoints" / "final" / "model.safetensors").exists()
