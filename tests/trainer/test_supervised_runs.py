"""Supervised tracks through the RL machinery (issue 41, item 5): `llm/arith_sft_smoke` (LM SFT)
and `diffusion/shapes_sft_smoke` (flow-matching SFT) train their demonstrations on 2 Ray workers
with FSDP2, learn, evaluate by sampling the policy, and the run resumed from its step-2
checkpoint writes the uninterrupted run's rows and weights; one in-process worker gives the 2
workers' losses (each loss is the whole batch's, whatever the split). `vlm/shapes_vqa_sft` trains
a VLM's answers after its images in process. `diffusion/shapes_diffusiondpo_offline_smoke` trains
DiffusionDPO on a file's preference pairs replayed as groups, on the same machinery."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from tests.conftest import untimed
from tests.recipes import IN_PROCESS, exported_weights, run, same_weights
from tests.recipes import composed as composed_recipe
from tests.recipes import recipe as recipe_of
from unirl.config.validate import ConfigError
from unirl.trainer.worker import build

RECIPES = {  # recipe -> (an evaluation key, the steps that evaluate)
    "llm/arith_sft_smoke": ("eval/accuracy/greedy", [0, 2, 4]),
    "diffusion/shapes_sft_smoke": ("eval/accuracy_strict", [0, 4]),
}


@pytest.mark.ray
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_sft_on_two_fsdp_workers_learns_and_resumes_exactly(ray_cluster, tmp_path, recipe):
    full = run(recipe, tmp_path / "full", "checkpoint.every_n_steps=2")
    # the run as it stood at its step-2 checkpoint, resumed from there
    shutil.copytree(
        tmp_path / "full", tmp_path / "part", ignore=shutil.ignore_patterns("step_000004", "final")
    )
    step_2 = tmp_path / "part" / "checkpoints" / "step_000002"
    resumed = run(recipe, tmp_path / "part", "checkpoint.every_n_steps=2", f"resume_from={step_2}")
    train = [r for r in full if "loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    assert train[-1]["loss"] < train[0]["loss"]  # the demonstrations' loss falls
    assert not any(k.startswith(("reward/", "advantage")) for r in full for k in r)  # no reward phase
    key, steps = RECIPES[recipe]
    assert [r["step"] for r in full if key in r] == steps  # evaluated by sampling the policy
    assert [untimed(r) for r in resumed if r["step"] > 2] == [untimed(r) for r in full if r["step"] > 2]
    assert same_weights(tmp_path / "full", tmp_path / "part")
    with open(tmp_path / "full" / "placement.json") as f:
        assert json.load(f)["num_devices"] == 2
    weights = exported_weights(tmp_path / "full")
    assert weights and not any("lora" in k for k in weights)  # the whole model, in its library's layout
    one = [r for r in run(recipe, tmp_path / "one", *IN_PROCESS, "eval.every_n_steps=0") if "loss" in r]
    for a, b in zip(one, train, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["train/grad_norm"] == pytest.approx(b["train/grad_norm"], rel=1e-5)


def _trainable(bundle) -> dict[str, torch.Tensor]:
    module = bundle.denoiser if hasattr(bundle, "denoiser") else bundle.model
    return {k: v.detach().float() for k, v in module.named_parameters()}


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_export_dir_writes_the_whole_trained_model(tmp_path, recipe):
    """`export_dir`: after the last step the run writes the whole trained model in its library's
    layout, fp16 by default, which `model.pretrained_path` loads: the trained weights are the
    final checkpoint's rounded to fp16, a flow model's frozen modules the base's."""
    out = tmp_path / "export"
    run(recipe, tmp_path / "run", *IN_PROCESS, "num_steps=1", "eval.every_n_steps=0", f"+export_dir={out}")
    model_cfg = build(composed_recipe(recipe, tmp_path / "run").model)
    final = _trainable(model_cfg.load_checkpoint(str(tmp_path / "run" / "checkpoints" / "final")))
    exported = type(model_cfg)(pretrained_path=str(out)).build()
    loaded = _trainable(exported)
    assert final.keys() == loaded.keys()
    assert all(torch.equal(final[k].half().float(), loaded[k]) for k in final)
    assert any(not torch.equal(final[k], loaded[k]) for k in final)  # fp16 on disk
    if hasattr(exported, "frozen_modules"):  # the text encoders and VAE: the run's tiny base
        base = model_cfg.build().frozen_modules()
        for m, n in zip(base, exported.frozen_modules(), strict=True):
            for p, q in zip(m.parameters(), n.parameters(), strict=True):
                assert torch.equal(p.detach().half().float(), q.detach().float())


def test_vlm_sft_trains_its_answers_in_process(tmp_path):
    small = [
        "num_steps=2",
        "prompts_per_rollout=4",
        "train.stack.micro_batch_size=2",
        "train.optim.warmup_steps=0",
    ]
    small += ["eval.every_n_steps=2", "eval.examples.size=4", "eval.sampling.pass_k=2"]
    rows = run("vlm/shapes_vqa_sft", tmp_path, *IN_PROCESS, *small)
    train = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train] == [1, 2] and train[1]["loss"] < train[0]["loss"]
    assert all(r["response_length/mean"] >= 2 for r in train)  # a one-word answer + EOS
    assert [r["step"] for r in rows if "eval/accuracy/greedy" in r] == [0, 2]


@pytest.mark.ray
def test_offline_dpo_trains_the_files_pairs_on_two_fsdp_workers_and_resumes_exactly(ray_cluster, tmp_path):
    """Each row's chosen and rejected images are one group, the chosen one rewarded 1: the first
    update's loss is exactly log 2 (the policy is its reference, so every margin is 0), every pair
    counts, and the run resumed from its step-2 checkpoint, and one in-process worker, give the 2
    workers' rows (pairs stay whole on a rank)."""
    recipe = "diffusion/shapes_diffusiondpo_offline_smoke"
    full = run(recipe, tmp_path / "full", "checkpoint.every_n_steps=2")
    shutil.copytree(
        tmp_path / "full", tmp_path / "part", ignore=shutil.ignore_patterns("step_000004", "final")
    )
    step_2 = tmp_path / "part" / "checkpoints" / "step_000002"
    resumed = run(recipe, tmp_path / "part", "checkpoint.every_n_steps=2", f"resume_from={step_2}")
    assert [r["step"] for r in full] == [1, 2, 3, 4]
    assert full[0]["loss"] == pytest.approx(math.log(2), abs=1e-6) and full[0]["dpo/margin"] == 0.0
    assert all(r["reward/mean"] == 0.5 and r["dpo/tied_groups"] == 0 for r in full)  # one chosen a pair
    assert full[-1]["dpo/err_chosen"] != full[-1]["dpo/err_chosen_ref"]  # the policy moved off its reference
    assert [untimed(r) for r in resumed if r["step"] > 2] == [untimed(r) for r in full if r["step"] > 2]
    assert same_weights(tmp_path / "full", tmp_path / "part")
    one = run(recipe, tmp_path / "one", *IN_PROCESS, "num_steps=2")
    for a, b in zip(
        one, full[:2], strict=True
    ):  # one rank's reductions vs two's: 2.4e-5 apart at step 2 on AVX2
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)
        assert a["train/grad_norm"] == pytest.approx(b["train/grad_norm"], rel=1e-4)


def test_export_dir_fuses_a_lora_into_the_whole_model(tmp_path):
    """A LoRA run's `export_dir` holds the base with the LoRA fused into its weights (not the
    base alone, nor adapter layers a plain load cannot read): its velocity is the final
    checkpoint's (base + LoRA) to fp16 rounding, and far from the base's."""
    from tests.recipes import SD3

    out = tmp_path / "export"
    run(
        "diffusion/tiny_sd3_flowgrpo",
        tmp_path / "run",
        *IN_PROCESS,
        *SD3,
        "num_steps=2",
        "train.optim.lr=3e-2",
        f"+export_dir={out}",
    )
    model_cfg = build(composed_recipe("diffusion/tiny_sd3_flowgrpo", tmp_path / "run", *SD3).model)
    final = model_cfg.load_checkpoint(str(tmp_path / "run" / "checkpoints" / "final"))
    exported = type(model_cfg)(pretrained_path=str(out)).build()
    base = type(model_cfg)(pretrained_path=str(tmp_path / "run" / "base_model")).build()
    assert not any("lora" in name for name, _ in exported.denoiser.named_parameters())
    x, sigma = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0)), torch.tensor([0.3, 0.7])
    cond = final.encode_text(["a red circle", "two blue squares"], False, 8)
    with torch.no_grad():
        v_final, v_export, v_base = (b.predict(b.denoiser, x, sigma, cond) for b in (final, exported, base))
    to_final, to_base = float((v_export - v_final).abs().max()), float((v_export - v_base).abs().max())
    assert to_final < 5e-3 and to_base > 10 * to_final, (to_final, to_base)


def test_max_seconds_stops_with_a_checkpoint_and_resume_continues_exactly(tmp_path):
    """`max_seconds` bounds one invocation: after the step that passes it the run writes a
    checkpoint and stops (no final export); `resume_from=latest` then writes the uninterrupted
    run's rows and weights (one torch thread, so that no thread-count change between the
    invocations reorders a reduction). A bound that is not > 0 is refused before the run."""
    recipe, small = "llm/arith_sft_smoke", [*IN_PROCESS, "eval.every_n_steps=0", "threads_per_worker=1"]
    full = run(recipe, tmp_path / "full", *small)
    part = run(recipe, tmp_path / "part", *small, "+max_seconds=1e-6")
    assert [r["step"] for r in part] == [1]
    assert (tmp_path / "part" / "checkpoints" / "step_000001").is_dir()
    assert not (tmp_path / "part" / "checkpoints" / "final").exists()
    resumed = run(recipe, tmp_path / "part", *small, "resume_from=latest")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert [untimed(r) for r in resumed[1:]] == [untimed(r) for r in full[1:]]
    assert same_weights(tmp_path / "full", tmp_path / "part")
    with pytest.raises(ConfigError, match=r"max_seconds must be > 0 or null, got 0"):
        recipe_of(recipe, tmp_path / "bad", *small, "+max_seconds=0")
