"""FLUX's LoRA targets are its own module names, and a trained LoRA exported by the train backend
loads back through `FluxPipeline.load_lora_weights` (`load_checkpoint`) at the trained scale."""

from __future__ import annotations

import torch

from tests.models.lora import trained_lora_backend
from unirl.models.flux import LORA_TARGETS, FluxBundle, load_checkpoint
from unirl.train.backend import lora_target_problem

from .conftest import tiny_flux_config


def test_lora_targets_name_flux_modules() -> None:
    meta = tiny_flux_config().trainable_on_meta()
    assert lora_target_problem(meta, LORA_TARGETS) is None
    assert lora_target_problem(meta, ["proj_mlp", "proj_out"]) is None
    assert "attn_proj_x" in lora_target_problem(meta, ["attn_proj_x"])


def test_exported_lora_loads_back_through_flux_pipeline(tmp_path) -> None:
    bundle = tiny_flux_config().build()
    bundle.save_pretrained(str(tmp_path / "base"))
    backend = trained_lora_backend(bundle.transformer, LORA_TARGETS, FluxBundle.write_weights)
    backend.save_weights(str(tmp_path / "ckpt"), base_model=str(tmp_path / "base"))
    loaded = load_checkpoint(str(tmp_path / "ckpt"))

    x = torch.randn(2, *bundle.latent_shape(16, 16), generator=torch.Generator().manual_seed(1))
    cond = {"prompt_embeds": torch.randn(2, 8, 32), "pooled_prompt_embeds": torch.randn(2, 32)}
    sigma, guidance = torch.tensor([0.3, 0.8]), torch.full([2], 3.5)
    with torch.no_grad():
        trained = bundle.predict(backend.module, x, sigma, cond, guidance=guidance)
        torch.testing.assert_close(
            loaded.predict(loaded.transformer, x, sigma, cond, guidance=guidance), trained, rtol=0, atol=1e-6
        )
        backend.module.disable_adapters()
        assert not torch.allclose(
            bundle.predict(backend.module, x, sigma, cond, guidance=guidance), trained, atol=1e-4
        )
