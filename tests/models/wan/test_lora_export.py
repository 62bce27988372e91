"""Wan's LoRA targets are its own module names, and a trained LoRA exported by the train backend
loads back through `WanPipeline.load_lora_weights` (`load_checkpoint`) at the trained scale, on a
base directory laid out as a real one (UniPC scheduler at its flow shift)."""

from __future__ import annotations

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

from tests.models.lora import trained_lora_backend
from unirl.models.wan import LORA_TARGETS, WanBundle, load_checkpoint
from unirl.train.backend import lora_target_problem

from .conftest import tiny_wan_config


def test_lora_targets_name_wan_modules() -> None:
    meta = tiny_wan_config().trainable_on_meta()
    assert lora_target_problem(meta, LORA_TARGETS) is None
    assert lora_target_problem(meta, ["ffn.net.0.proj", "ffn.net.2"]) is None
    assert "add_q_proj" in lora_target_problem(meta, ["add_q_proj"])  # FLUX's name, not Wan's


def test_exported_lora_loads_back_through_wan_pipeline(tmp_path) -> None:
    bundle = tiny_wan_config().build()
    # a real Wan directory ships UniPC at its flow shift: loaded, it is the Euler scheduler at that shift
    bundle.pipeline.scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=5.0
    )
    bundle.save_pretrained(str(tmp_path / "base"))
    backend = trained_lora_backend(bundle.transformer, LORA_TARGETS, WanBundle.write_weights)
    backend.save_weights(str(tmp_path / "ckpt"), base_model=str(tmp_path / "base"))
    loaded = load_checkpoint(str(tmp_path / "ckpt"), num_frames=5)
    assert loaded.num_frames == 5 and loaded.latent_shape(8, 8) == bundle.latent_shape(8, 8)
    assert isinstance(loaded.pipeline.scheduler, FlowMatchEulerDiscreteScheduler)
    assert loaded.pipeline.scheduler.config.shift == 5.0

    x = torch.randn(2, *bundle.latent_shape(8, 8), generator=torch.Generator().manual_seed(1))
    cond = {"prompt_embeds": torch.randn(2, 8, 32)}
    sigma = torch.tensor([0.3, 0.8])
    with torch.no_grad():
        trained = bundle.predict(backend.module, x, sigma, cond)
        torch.testing.assert_close(
            loaded.predict(loaded.transformer, x, sigma, cond), trained, rtol=0, atol=1e-6
        )
        backend.module.disable_adapters()
        assert not torch.allclose(bundle.predict(backend.module, x, sigma, cond), trained, atol=1e-4)
