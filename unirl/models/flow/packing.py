"""The latent geometry bundles share as mixins: of the families that pack 2x2 latent patches into
one transformer token (FLUX.1, Qwen-Image; `Packed2x2Bundle`, with the packing itself, `pack` and
`unpack`), and of the video families whose latent is a clip of latent frames (Wan, HunyuanVideo
1.5; `VideoClipBundle`)."""

from __future__ import annotations

from typing import ClassVar

import torch

from unirl.models.flow.config import check_frames, latent_frames
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


class VideoClipBundle(DiffusersBundle):
    """Geometry of a video family's bundle whose latent is a clip [C, f, h, w] of latent frames
    (and, from `DiffusersBundle`, its module plumbing).

    The bundle provides `num_frames` (the clip length), `temporal` and `spatial` (its VAE's
    compression; 1 and 1 in pixel space), `latent_channels` and `vae` (None in pixel space);
    `patch` is the side of the square of latent cells a token takes (Wan 2, HunyuanVideo 1.5 1).
    Sizes off that grid are a ValueError naming `sampling.height/width`.
    """

    patch: ClassVar[int] = 1
    num_frames: int
    temporal: int
    spatial: int
    latent_channels: int

    def set_clip(self, num_frames: int, sample_size: int, temporal: int, spatial: int, vae: str) -> None:
        """The end of a video bundle's constructor: the clip's geometry (`num_frames` checked
        against the `vae`'s `temporal` compression, `check_frames`) and the frozen modules frozen."""
        check_frames(num_frames, temporal, vae)
        self.num_frames, self.sample_size = num_frames, sample_size
        self.temporal, self.spatial = temporal, spatial
        self.freeze_frozen_modules()

    def _cell(self, height: int, width: int) -> int:
        cell = self.spatial * self.patch
        if height % cell or width % cell:
            raise ValueError(
                f"sampling.height/width ({height}x{width}) must be multiples of {cell} "
                f"(vae spatial scale {self.spatial} x the {self.patch}x{self.patch} patch of latent cells a token takes)"
            )
        return cell

    @property
    def latent_frames(self) -> int:
        """Latent frames of a clip: the first frame alone, then one per `temporal` frames."""
        return latent_frames(self.num_frames, self.temporal)

    def latent_shape(self, height: int, width: int) -> tuple[int, int, int, int]:
        """(C, f, h, w): C latent channels (3 in pixel space), f latent frames, h = height / spatial."""
        self._cell(height, width)
        return self.latent_channels, self.latent_frames, height // self.spatial, width // self.spatial

    def image_seq_len(self, height: int, width: int) -> int:
        """Transformer tokens per clip: f x (h / patch) x (w / patch)."""
        cell = self._cell(height, width)
        return self.latent_frames * (height // cell) * (width // cell)

    def model_info(self) -> dict:
        """`patch_size` is the token's square of latent cells; `num_frames` the clip length."""
        return {
            "pixel_space": self.vae is None,
            "vae_scale_factor": self.spatial,
            "patch_size": self.patch,
            "num_frames": self.num_frames,
        }
