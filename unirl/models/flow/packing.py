"""The latent geometry of families that pack 2x2 latent patches into one transformer token
(FLUX.1, Qwen-Image): shared by their bundles as a mixin, with the packing itself (`pack`,
`unpack`)."""

from __future__ import annotations

import torch

from unirl.models.flow.family import DiffusersBundle


def pack(x: torch.Tensor) -> torch.Tensor:
    """[B, C, h, w] -> [B, h/2 * w/2, 4C]: each 2x2 cell one token (FluxPipeline's and
    QwenImagePipeline's packing)."""
    b, c, h, w = x.shape
    return x.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), c * 4)


def unpack(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """[B, h/2 * w/2, 4C] -> [B, C, h, w], the inverse of `pack`."""
    b, _, d = tokens.shape
    return tokens.view(b, h // 2, w // 2, d // 4, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, d // 4, h, w)


class Packed2x2Bundle(DiffusersBundle):
    """Geometry of a 2x2-packing family's bundle (and, from `DiffusersBundle`, its module
    plumbing).

    The bundle provides `pipeline` (the diffusers pipeline owning the modules), `transformer`,
    `vae` (None in pixel space), `latent_channels`, `vae_scale_factor` and `text_encoders()`.
    A token covers a cell of 2 x vae_scale_factor pixels per side; sizes off that grid are a
    ValueError naming `sampling.height/width`.
    """

    latent_channels: int
    vae_scale_factor: int

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
