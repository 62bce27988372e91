"""`DedicatedEngine` in-process: parity with trainside sampling, sleep / wake_up, its state errors.

The engine is built as an engine worker builds it: its own bundle from the
model config, the same LoRA adapter injected, and the trainer's weights
copied in (what a weight sync delivers; the sync itself is tested in
tests/sync). Parity is then exact: the same stage code runs on the same
weights with the same per-sample seeds.
"""

from __future__ import annotations

import psutil
import pytest
import torch

from tests.conftest import tiny_model_config
from unirl.models.causal_lm import CausalLMStage, TinyLMConfig
from unirl.models.qwen import QwenConfig
from unirl.models.sd3 import SD3Stage
from unirl.rollout.dedicated import DedicatedEngine, EngineStateError
from unirl.rollout.trainside import TrainsideEngine
from unirl.sde.schedules import sigmas_for
from unirl.train.backend import LoRAConfig, inject_lora
from unirl.types.rollout_req import PromptExample, RolloutReq
from unirl.types.sampling import DiffusionSamplingParams, TextSamplingParams

LORA = LoRAConfig(rank=4, target_modules=["to_q", "to_k", "to_v"])


@torch.no_grad()
def trained(module: torch.nn.Module, only_lora: bool) -> torch.nn.Module:
    """Move the weights off their initial values, as training would (LoRA B starts at zero)."""
    gen = torch.Generator().manual_seed(1)
    for name, p in module.named_parameters():
        if "lora_" in name or not only_lora:
            p.add_(0.2 * torch.randn(p.shape, generator=gen))
    return module


@torch.no_grad()
def sync(src: torch.nn.Module, dst: torch.nn.Module, engine: DedicatedEngine, version: int) -> None:
    """What a weight sync leaves behind: the trainer's parameters in the engine's module."""
    weights = dict(src.named_parameters())
    for name, p in dst.named_parameters():
        p.copy_(weights[name])
    engine.weights_version = version


def diffusion_pair(**engine_kwargs):
    cfg = tiny_model_config()
    trainer = SD3Stage(cfg.build())
    inject_lora(trainer.module, LORA)
    trained(trainer.module, only_lora=True)
    own = SD3Stage(cfg.build())
    inject_lora(own.module, LORA)
    engine = DedicatedEngine(own, forward_batch_size=4, rebuild=cfg.build, **engine_kwargs)
    return trainer, engine


def diffusion_req(bundle, rollout_id: int = 3) -> RolloutReq:
    sp = DiffusionSamplingParams(
        num_steps=4,
        samples_per_prompt=4,
        height=16,
        width=16,
        eta=0.7,
        sde_num_steps=2,
        max_sequence_length=8,
        guidance_scale=2.0,
    )
    sigmas = sigmas_for(sp, bundle.image_seq_len(16, 16))
    examples = [PromptExample("a red cat", "0"), PromptExample("blue", "1")]
    return RolloutReq.from_prompts(examples, sp, sigmas, rollout_id=rollout_id)


def text_pair():
    cfg = QwenConfig(tiny=TinyLMConfig())
    trainer = CausalLMStage(cfg.build())
    trained(trainer.module, only_lora=False)  # a full fine-tune: every weight moved
    engine = DedicatedEngine(CausalLMStage(cfg.build()), forward_batch_size=3, rebuild=cfg.build)
    return trainer, engine


def text_req(max_new_tokens: int = 10) -> RolloutReq:
    prompts = ["Hi", "Name a colour, please.", "What is 2 + 2?"]
    sp = TextSamplingParams(samples_per_prompt=2, max_new_tokens=max_new_tokens)
    return RolloutReq.from_prompts([PromptExample(p, f"p{i}") for i, p in enumerate(prompts)], sp, None, 0)


def test_diffusion_samples_and_log_probs_equal_trainside() -> None:
    trainer, engine = diffusion_pair()
    sync(trainer.module, engine.stage.module, engine, 0)
    req = diffusion_req(trainer.bundle)
    a = TrainsideEngine(trainer, 4).generate(req).track("diffusion")
    b = engine.generate(req).track("diffusion")
    assert a.segment.log_probs.shape == (8, len(req.sde_indices)) and req.sde_indices
    assert float((a.segment.log_probs - b.segment.log_probs).abs().max()) == 0.0  # max |delta logp|
    assert torch.equal(a.segment.latents, b.segment.latents) and torch.equal(a.media, b.media)
    assert all(torch.equal(a.conditions[k], b.conditions[k]) for k in a.conditions)
    assert b.sample_ids == req.sample_ids and b.name == "diffusion"
    # the control: with the adapter back at its init (B = 0) the engine samples another policy
    with torch.no_grad():
        for name, p in engine.stage.module.named_parameters():
            if "lora_B" in name:
                p.zero_()
    c = engine.generate(req).track("diffusion")
    assert float((a.segment.latents - c.segment.latents).abs().max()) > 1e-2


def test_text_tokens_and_log_probs_equal_trainside() -> None:
    trainer, engine = text_pair()
    sync(trainer.module, engine.stage.module, engine, 0)
    req = text_req()
    a = TrainsideEngine(trainer, 3).generate(req).track("text")
    b = engine.generate(req).track("text")
    assert a.texts == b.texts
    assert all(torch.equal(x, y) for x, y in zip(a.segment.response_ids, b.segment.response_ids, strict=True))
    delta = max(
        float((x - y).abs().max()) for x, y in zip(a.segment.log_probs, b.segment.log_probs, strict=True)
    )
    assert delta == 0.0  # max |delta logp|


def test_sampling_needs_synced_weights_and_an_awake_engine() -> None:
    trainer, engine = text_pair()
    with pytest.raises(EngineStateError, match="no synced weights"):
        engine.generate(text_req())
    sync(trainer.module, engine.stage.module, engine, 0)
    engine.sleep(1)
    with pytest.raises(EngineStateError, match="asleep"):
        engine.generate(text_req())
    engine.wake_up()
    engine.generate(text_req())
    no_source = DedicatedEngine(CausalLMStage(QwenConfig(tiny=TinyLMConfig()).build()))
    with pytest.raises(ValueError, match="rebuild"):
        no_source.sleep(2)
    with pytest.raises(ValueError, match="sleep level"):
        no_source.sleep(3)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"placement": "nearby"}, "rollout.placement"),
        ({"sleep_level": 4}, "rollout.sleep_level"),
        ({"num_engines": 0}, "rollout.num_engines"),
        ({"max_staleness": -1}, "rollout.max_staleness"),
        ({"forward_batch_size": 0}, "rollout.forward_batch_size"),
    ],
)
def test_settings_are_range_checked(kwargs, match) -> None:
    stage = CausalLMStage(QwenConfig(tiny=TinyLMConfig()).build())
    with pytest.raises(ValueError, match=match):
        DedicatedEngine(stage, **kwargs)


def test_sleep_levels_restore_the_same_samples_diffusion() -> None:
    """Level 1 restores every tensor bit-exactly (frozen text encoders and VAE included: the
    samples are equal); level 2 restores the base from the model source and needs a sync."""
    trainer, engine = diffusion_pair()
    sync(trainer.module, engine.stage.module, engine, 0)
    req = diffusion_req(trainer.bundle)
    ref = engine.generate(req).track("diffusion")
    engine.sleep(1)
    assert all(t.numel() == 0 for t in engine._state().values())
    engine.wake_up()
    again = engine.generate(req).track("diffusion")
    assert torch.equal(ref.segment.log_probs, again.segment.log_probs) and torch.equal(ref.media, again.media)
    engine.sleep(2)
    engine.wake_up()
    assert engine.weights_version is None  # the adapters must come from a sync
    sync(trainer.module, engine.stage.module, engine, 1)
    third = engine.generate(req).track("diffusion")
    assert torch.equal(ref.segment.log_probs, third.segment.log_probs) and torch.equal(ref.media, third.media)


def rss_mb() -> float:
    return psutil.Process().memory_info().rss / 2**20


def test_sleep_releases_memory_and_wake_up_restores_it() -> None:
    """A 67 MB LM: sleeping at either level gives most of its weights' memory back to the OS
    (resident set measured before and after); waking up restores the same tokens and log-probs
    (level 2 rebuilds the tensors from the model source; a full fine-tune's sync would then
    overwrite every weight, and here the weights are the source's)."""
    cfg = QwenConfig(
        tiny=TinyLMConfig(hidden_size=384, num_layers=8, num_attention_heads=6, intermediate_size=1536)
    )
    engine = DedicatedEngine(CausalLMStage(cfg.build()), rebuild=cfg.build)
    engine.weights_version = 0
    weights_mb = sum(t.numel() * t.element_size() for t in engine._state().values()) / 2**20
    assert weights_mb > 60
    req = text_req(max_new_tokens=3)
    ref = engine.generate(req).track("text")
    for level in (1, 2):
        before = rss_mb()
        engine.sleep(level)
        asleep = rss_mb()
        engine.wake_up()
        awake = rss_mb()
        assert before - asleep > 0.8 * weights_mb, (level, before, asleep, weights_mb)
        assert awake - asleep > 0.8 * weights_mb, (level, asleep, awake, weights_mb)
        engine.weights_version = level
        out = engine.generate(req).track("text")
        assert out.texts == ref.texts
        assert all(
            torch.equal(x, y) for x, y in zip(ref.segment.log_probs, out.segment.log_probs, strict=True)
        )
