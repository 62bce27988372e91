"""The latent geometry of families that pack 2x2 latent patches into one transformer token
(FLUX.1, Qwen-Image): shared by their bundles as a mixin."""

from __future__ import annotations

from typing import Any

import torch


class Packed2x2Bundle:
    """Geometry and module plumbing of a 2x2-packing family's bundle.

    The bundle provides `pipeline` (the diffusers pipeline owning the modules), `transformer`,
    `vae` (None in pixel space), `latent_channels`, `vae_scale_factor` and `text_encoders()`.
    A token covers a cell of 2 x vae_scale_factor pixels per side; sizes off that grid are a
    ValueError naming `sampling.height/width`.
    """

    pipeline: Any
    transformer: torch.nn.Module
    vae: torch.nn.Module | None
    latent_channels: int
    vae_scale_factor: int

    def frozen_modules(self) -> list[torch.nn.Module]:
        """The family's `text_encoders()` and the VAE: never trained."""
        return self.text_encoders() + ([self.vae] if self.vae is not None else [])

    @property
    def device(self) -> torch.device:
        return next(self.transformer.parameters()).device

    def to(self, device: str | torch.device | torch.dtype):
        self.pipeline.to(device)
        return self

    def _cell(self, height: int, width: int) -> int:
        cell = 2 * self.vae_scale_factor
        if height % cell or width % cell:
            raise ValueError(
                f"sampling.height/width ({height}x{width}) must be multiples of {cell} "
                f"(vae scale {self.vae_scale_factor} x the 2x2 packing)"
            )
        return cell

    def latent_shape(self, height: int, width: int) -> tuple[int, int, int]:
        """(C, h, w) unpacked latents, h = height / vae_scale_factor (even)."""
        cell = self._cell(height, width)
        return self.latent_channels, 2 * (height // cell), 2 * (width // cell)

    def image_seq_len(self, height: int, width: int) -> int:
        """Packed tokens per image, (height / 2s) x (width / 2s) with s the VAE scale."""
        cell = self._cell(height, width)
        return (height // cell) * (width // cell)

    def model_info(self) -> dict:
        """`patch_size` is the 2x2 packing: vae_scale_factor x patch_size pixels per token side."""
        return {"pixel_space": self.vae is None, "vae_scale_factor": self.vae_scale_factor, "patch_size": 2}
