"""What flow families' recipe nodes (`FlowModelConfig`s and their tiny configs) share: the body of
a family's model config (`FlowFamilyConfig`: where the weights come from, the bundle and the meta
module tree from the modeling module it names), the checks of a tiny model's VAE downsample,
video VAE scales and rotary axes, the pixels per latent cell of a 2x2-packing tiny
model (`PackedTinyConfig`), the validator's size message (`cell_size_problems`), the read of a
directory's VAE config (`read_vae_config`) and `trainable_on_meta`'s module tree on the meta
device (`transformer_on_meta`)."""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, ClassVar

import torch

from unirl.models.flow.loading import pipeline_directory_problems
from unirl.models.source import DTYPES, ModelSource, check_source
from unirl.types.constraints import AtLeastOne


@dataclass(frozen=True)
class FamilySpec:
    """What a flow family's model config names, as data (`FlowFamilyConfig.SPEC`).

    Attributes:
        name: the family (or the variant: "FLUX.1-Kontext") in the errors ("a local FLUX.1
            directory", "a diffusers FLUX.1 directory").
        bundle: the dotted path of the bundle class (`from_pretrained(path, dtype=, **options)`,
            `tiny(tiny, **options)`); its module, the family's modeling module, also holds
            `tiny_transformer(tiny)` (the tiny denoiser) and `load_checkpoint(path, **options)`, and
            optionally `prepare_transformer(module)` (what the bundle sets on every denoiser it
            builds, such as SD3's sequence-parallel plan); named, not imported, by the config.
        transformer: the diffusers class of the denoiser (`trainable_on_meta` reads its config
            from `transformer/` of a directory).
        pipeline: the pipeline class a directory's `model_index.json` must name.
    """

    name: str
    bundle: str
    transformer: str
    pipeline: str

    @property
    def modeling(self) -> str:
        """The modeling module: `bundle` without its class name."""
        return self.bundle.rpartition(".")[0]

    @property
    def bundle_class(self) -> str:
        """The bundle class's name in `modeling`."""
        return self.bundle.rpartition(".")[2]


class FlowFamilyConfig(ModelSource):
    """The shared body of a flow family's model config, a dataclass that adds its `tiny` (default
    its tiny config) to `ModelSource`'s `pretrained_path` and `dtype`: `build`, `load_checkpoint`, `trainable_on_meta`,
    `directory_problems` and the source check, from its `SPEC` (a `FamilySpec`), its tiny config
    class (the `tiny` field's default factory, `tiny_class`) and `bundle_options()`, what its
    bundle takes beyond the weights (Wan's `num_frames`, Qwen-Image's `negative_prompt`; {} by
    default). The config never imports its modeling module, so building a recipe node reads no
    weights and pulls in no bundle."""

    modality: ClassVar[str] = "diffusion"
    SPEC: ClassVar[FamilySpec]

    @classmethod
    def tiny_class(cls) -> type:
        """The family's tiny config class: the default factory of its `tiny` field."""
        return next(f.default_factory for f in dataclasses.fields(cls) if f.name == "tiny")

    def __post_init__(self) -> None:
        tiny_class = self.tiny_class()
        check_source(self, tiny_class, self.SPEC.name)
        if self.tiny is not None and not isinstance(self.tiny, tiny_class):
            raise ValueError(
                f"model.tiny: {self.SPEC.name} builds a {tiny_class.__name__} (or a mapping of its keys), "
                f"got a {type(self.tiny).__name__}"
            )

    def modeling(self) -> ModuleType:
        """The family's modeling module (`SPEC.modeling`)."""
        return importlib.import_module(self.SPEC.modeling)

    def bundle_options(self) -> dict[str, Any]:
        return {}

    def build(self) -> Any:
        """The bundle: from `pretrained_path`, else from the tiny config."""
        bundle = getattr(self.modeling(), self.SPEC.bundle_class)
        if self.pretrained_path:
            return bundle.from_pretrained(
                self.pretrained_path, dtype=DTYPES[self.dtype], **self.bundle_options()
            )
        return bundle.tiny(self.tiny, **self.bundle_options())

    def load_checkpoint(self, path: str) -> Any:
        """The bundle of a UniRL checkpoint of this family's run, fp32."""
        return self.modeling().load_checkpoint(path, **self.bundle_options())

    def trainable_on_meta(self) -> torch.nn.Module:
        """The denoiser's module tree on the meta device (no weights read)."""
        import diffusers

        module = transformer_on_meta(
            getattr(diffusers, self.SPEC.transformer),
            self.pretrained_path,
            lambda: self.modeling().tiny_transformer(self.tiny),
        )
        prepare = getattr(self.modeling(), "prepare_transformer", None)
        return prepare(module) if prepare is not None else module

    def directory_problems(self) -> list[str]:
        """`pretrained_path`, when set, is a directory whose `model_index.json` names `SPEC.pipeline`."""
        return pipeline_directory_problems(self.pretrained_path, self.SPEC.pipeline, self.SPEC.name)


class ConditionedFamilyConfig:
    """Mixin, listed before the family's config in the bases, of a model config whose prompt rows
    carry condition media (reference images, a first frame) under `condition_key`, a field the
    dataclass declares: the bundle it builds or loads reads that key of each row (`conditioned`).
    The family answers `condition_problems` itself."""

    condition_key: str

    def conditioned(self, bundle: Any) -> Any:
        """`bundle`, reading `condition_key` of each prompt row."""
        bundle.condition_key = self.condition_key
        return bundle

    def build(self) -> Any:
        return self.conditioned(super().build())

    def load_checkpoint(self, path: str) -> Any:
        return self.conditioned(super().load_checkpoint(path))


def check_vae_downsample(vae_downsample: int) -> None:
    """A tiny model's `vae_downsample` must be a power of 2 >= 2 (ValueError naming
    `model.tiny.vae_downsample`)."""
    if vae_downsample < 2 or vae_downsample & (vae_downsample - 1):
        raise ValueError(f"model.tiny.vae_downsample must be a power of 2 >= 2, got {vae_downsample}")


def check_video_vae_scales(spatial: int, temporal: int) -> None:
    """A tiny video VAE's compression (Wan, HunyuanVideo 1.5): `vae_spatial` a power of 2 >= 2,
    `vae_temporal` a power of 2 in [1, vae_spatial] (ValueErrors naming `model.tiny.<key>`)."""
    if spatial < 2 or spatial & (spatial - 1):
        raise ValueError(f"model.tiny.vae_spatial must be a power of 2 >= 2, got {spatial}")
    if temporal < 1 or temporal & (temporal - 1) or temporal > spatial:
        raise ValueError(
            f"model.tiny.vae_temporal must be a power of 2 in [1, model.tiny.vae_spatial={spatial}] "
            f"(each temporal downsample rides on a spatial one), got {temporal}"
        )


def check_axes_dims_rope(axes_dims_rope: list[int], attention_head_dim: int) -> None:
    """A tiny model's rotary axes (FLUX.1, Qwen-Image) must be 3 even sizes summing to
    `attention_head_dim` (ValueError naming `model.tiny.axes_dims_rope`)."""
    if len(axes_dims_rope) != 3 or sum(axes_dims_rope) != attention_head_dim:
        raise ValueError(
            f"model.tiny.axes_dims_rope={axes_dims_rope} must be 3 sizes summing to "
            f"model.tiny.attention_head_dim={attention_head_dim} (the rotary embedding's axes)"
        )
    if any(d % 2 for d in axes_dims_rope):
        raise ValueError(f"model.tiny.axes_dims_rope={axes_dims_rope} must be even sizes")


@dataclass
class TinyFlowConfig:
    """What every flow family's tiny config (a model of random weights built from the config, for
    CPU runs and tests) starts with; the family adds its geometry.

    Attributes:
        words: whole-word tokens of the tiny tokenizers, which are otherwise character-level: a
            small text encoder learns words far more easily, and prompts get much shorter.
        seed: the seed of the random weights.
        latent_channels: the latent channels of a latent-space model's VAE (a pixel-space model
            denoises its 3 RGB channels).
    """

    words: list[str] = field(default_factory=list)
    seed: int = 0
    latent_channels: AtLeastOne = 4


class PackedTinyConfig(TinyFlowConfig):
    """Base of a 2x2-packing family's tiny config (FLUX.1, Qwen-Image, Z-Image), a dataclass with
    `pixel_space`, `vae_downsample`, `attention_head_dim` and `axes_dims_rope`."""

    pixel_space: bool
    vae_downsample: int
    attention_head_dim: int
    axes_dims_rope: list[int]

    def check_packed_geometry(self) -> None:
        """`__post_init__`'s shared checks: `check_vae_downsample`, then `check_axes_dims_rope`
        (ValueErrors naming `model.tiny.<key>`)."""
        check_vae_downsample(self.vae_downsample)
        check_axes_dims_rope(self.axes_dims_rope, self.attention_head_dim)

    @property
    def vae_scale_factor(self) -> int:
        """Pixels per latent cell along a side (1 in pixel space)."""
        return 1 if self.pixel_space else self.vae_downsample


def cell_size_problems(height: int, width: int, cell: int, how: str, key: str = "sampling") -> list[str]:
    """The validator's size rule of a family whose denoiser takes 2x2 latent cells per token: each
    side must be a multiple of `cell` pixels (2 x the VAE's spatial scale). One problem per side
    that is not, naming `{key}.height` / `{key}.width`, saying `how` the family takes the cells
    ("FLUX packs", "Wan patches") and the nearest valid sizes below and above; [] when both fit."""
    return [
        f"{key}.{side}={value} must be a multiple of {cell} ({how} 2x2 latent cells of "
        f"{cell // 2} px), e.g. {max(cell, value // cell * cell)} or {(value // cell + 1) * cell}"
        for side, value in (("height", height), ("width", width))
        if value % cell
    ]


def clip_size_problems(
    height: int, width: int, num_frames: int, scales: tuple[int, int] | None, vae: str, key: str = "sampling"
) -> list[str]:
    """The validator's size rule of a video family whose denoiser takes one token per latent cell
    (HunyuanVideo 1.5, LTX-2): each side a multiple of the VAE's spatial scale, and
    `model.num_frames` = 1 + k x its temporal scale (a causal video VAE keeps the first frame alone
    and compresses the rest in groups). `scales` is (temporal, spatial), None when unreadable (no
    problems: the load reports it); `vae` names the VAE ("the LTX-2 VAE"); problems name
    `{key}.height` / `{key}.width` and `model.num_frames` with the nearest valid values."""
    if scales is None:
        return []
    temporal, spatial = scales
    problems = [
        f"{key}.{side}={value} must be a multiple of {spatial} ({vae}'s spatial compression: one token per "
        f"latent cell), e.g. {max(spatial, value // spatial * spatial)} or {(value // spatial + 1) * spatial}"
        for side, value in (("height", height), ("width", width))
        if value % spatial
    ]
    return problems + frames_problems(num_frames, temporal, vae)


def frames_problems(num_frames: int, temporal: int, vae: str) -> list[str]:
    """`model.num_frames` = 1 + k x `temporal` (the causal video VAE `vae`'s clip lengths: 1,
    1 + t, 1 + 2t, ...), or one problem naming the key and the nearest valid lengths."""
    if num_frames >= 1 and not (num_frames - 1) % temporal:
        return []
    below = max(1, (num_frames - 1) // temporal * temporal + 1)
    return [
        f"model.num_frames={num_frames}: {vae} (temporal compression {temporal}) takes 1 + {temporal}k frames "
        f"(1, {1 + temporal}, {1 + 2 * temporal}, ...), e.g. {below} or {below + temporal}"
    ]


def latent_frames(num_frames: int, temporal: int) -> int:
    """Latent frames of a clip of `num_frames` under a causal video VAE of temporal compression
    `temporal`: the first frame alone, then one per `temporal` frames."""
    return (num_frames - 1) // temporal + 1


def check_frames(num_frames: int, temporal: int, vae: str) -> None:
    """A video bundle's own check of its clip length: `frames_problems` as a ValueError."""
    problems = frames_problems(num_frames, temporal, vae)
    if problems:
        raise ValueError(problems[0])


def latent_patch_cell(pretrained_path: str | None, tiny) -> int | None:
    """Pixels per 2x2 patch of latent cells along a side, for a latent-space family whose VAE
    downsamples once per `block_out_channels` level after the first (Z-Image, FLUX.2): from the
    tiny config's `vae_scale_factor`, or the directory's `vae/config.json`; None when the directory
    has no VAE or it cannot be read (the load reports it)."""
    if not pretrained_path:
        return 2 * tiny.vae_scale_factor
    try:
        vae = read_vae_config(pretrained_path)
        return None if vae is None else 2 * 2 ** (len(vae["block_out_channels"]) - 1)
    except (OSError, KeyError, ValueError, TypeError):
        return None


def read_vae_config(pretrained_path: str) -> dict[str, Any] | None:
    """The `vae/config.json` of a diffusers directory, or None when it has no `vae/` directory
    (a pixel-space model). Raises what reading it raises (OSError, ValueError): the caller maps
    an unreadable directory to its own "unknown" answer."""
    if not os.path.isdir(os.path.join(pretrained_path, "vae")):
        return None
    with open(os.path.join(pretrained_path, "vae", "config.json")) as f:
        return json.load(f)


def transformer_on_meta(
    transformer_cls: type, pretrained_path: str | None, tiny_transformer: Callable[[], torch.nn.Module]
) -> torch.nn.Module:
    """A family's `trainable_on_meta`: the denoiser's module tree on the meta device, no weights
    read: `transformer_cls` from the `transformer/` config of `pretrained_path` when set, else
    `tiny_transformer()` (the tiny config's denoiser, built under the meta device)."""
    with torch.device("meta"):
        if pretrained_path:
            config = transformer_cls.load_config(os.path.join(pretrained_path, "transformer"))
            return transformer_cls.from_config(config)
        return tiny_transformer()
