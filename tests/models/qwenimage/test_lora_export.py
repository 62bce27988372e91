"""Qwen-Image's LoRA targets are its own module names, and a trained LoRA exported by the train
backend loads back through `QwenImagePipeline.load_lora_weights` (`load_checkpoint`) at the
trained scale."""

from __future__ import annotations

import torch

from tests.models.lora import trained_lora_backend
from unirl.models.qwenimage import LORA_TARGETS, QwenImageBundle, load_checkpoint
from unirl.train.backend import lora_target_problem

from .conftest import tiny_qwenimage_config

MLP = ["img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2"]


def test_lora_targets_name_qwenimage_modules() -> None:
    meta = tiny_qwenimage_config().trainable_on_meta()
    assert lora_target_problem(meta, LORA_TARGETS) is None
    assert lora_target_problem(meta, MLP) is None
    assert "proj_mlp" in lora_target_problem(meta, ["proj_mlp"])  # FLUX's single-block name is not here


def test_exported_lora_loads_back_through_qwenimage_pipeline(tmp_path) -> None:
    bundle = tiny_qwenimage_config().build()
    bundle.save_pretrained(str(tmp_path / "base"))
    backend = trained_lora_backend(bundle.transformer, LORA_TARGETS + MLP, QwenImageBundle.write_weights)
    backend.save_weights(str(tmp_path / "ckpt"), base_model=str(tmp_path / "base"))
    loaded = load_checkpoint(str(tmp_path / "ckpt"))

    x = torch.randn(2, *bundle.latent_shape(16, 16), generator=torch.Generator().manual_seed(1))
    mask = torch.tensor([[1] * 8, [1] * 5 + [0] * 3])
    cond = {"prompt_embeds": torch.randn(2, 8, 32), "prompt_embeds_mask": mask}
    sigma = torch.tensor([0.3, 0.8])
    with torch.no_grad():
        trained = bundle.predict(backend.module, x, sigma, cond)
        torch.testing.assert_close(
            loaded.predict(loaded.transformer, x, sigma, cond), trained, rtol=0, atol=1e-6
        )
        backend.module.disable_adapters()
        assert not torch.allclose(bundle.predict(backend.module, x, sigma, cond), trained, atol=1e-4)
