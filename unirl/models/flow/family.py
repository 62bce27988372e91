"""What a flow-matching model family supplies: the contract between a family's package
(`unirl/models/<family>/`) and everything shared (the stage, the validator, the evaluator,
the engines, the supervised losses).

Two protocols, checked structurally (no base class to inherit):

- `FlowFamily`, the bundle of built modules: prompt encoding, the one-branch network call,
  the latent geometry and the decode to pixels. `FlowMatchingStage` (`stage.py`) runs
  sampling, SDE log-probs, replay, kept graphs and reward-backprop denoising over it.
- `FlowModelConfig`, the recipe's `model` node: builds a bundle, and answers the validator's
  questions about its own directory and geometry before any work starts.

Shapes: B samples; a latent sample has the family's `latent_shape` (images: [C, h, w]; videos:
[C, f, h, w]); conditioning tensors are [B, ...] with the family's own keys. A video family decodes
to frames [B, F, 3, H, W] where an image family gives [B, 3, H, W]; rewards, the data plane and
the gallery take either (`RewardRequest.is_video`). An audio-video family (LTX-2) also has
`audio(latents) -> [B, A, T]` fp32 soundtracks and `audio_sample_rate` (Hz; also in its
`model_info`): the stage's `decode_audio` puts them on the track and the reward request carries them.
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol, runtime_checkable

import torch

from unirl.models.flow.guidance import NEGATIVE, Uncond
from unirl.models.flow.loading import write_diffusers_weights
from unirl.models.stage import module_device

__all__ = ["NEGATIVE", "DiffusersBundle", "FlowFamily", "FlowModelConfig", "training_guidance"]


@runtime_checkable
class FlowFamily(Protocol):
    """The built modules of one flow-matching model and what its family does differently.

    Attributes:
        denoiser: the trainable network (the train backend wraps it; `predict` is given the
            wrapped module).
        device: where the denoiser's parameters live.
        sample_size: the square image side in pixels the denoiser is built for.
        cond_keys: the conditioning keys `predict` reads (`encode_text` returns them, and
            their `NEGATIVE` twins when guided); a conditions dict may hold other entries.
        guidance: the name of the family's guidance style ("cfg", "embedded", "true_cfg", or
            its own), and `encodes_uncond` / `guided_velocity`: how the stage guides it
            (`unirl.models.flow.guidance`: the family inherits a style or writes its own).

    It is moved and saved whole: `to(device_or_dtype)` returns it, `save_pretrained(dir)`
    writes the family's library layout, which its model config loads back.
    """

    denoiser: torch.nn.Module
    device: torch.device
    sample_size: int
    cond_keys: tuple[str, ...]
    guidance: str
    encodes_uncond: bool

    def encode_text(
        self, prompts: list[str], guided: bool, max_sequence_length: int
    ) -> dict[str, torch.Tensor]:
        """Conditioning tensors of `prompts` (U distinct prompts), each [U, ...], any dtype;
        with `guided` also the unconditional twins under `NEGATIVE`-prefixed keys (the uncond
        branch of classifier-free guidance; only a family that `encodes_uncond` is asked for them);
        `max_sequence_length` is the text token budget.
        Differentiable in the text encoders (the stage calls it under `no_grad`; supervised
        training may train the encoders through it)."""
        ...

    def predict(
        self, module: torch.nn.Module, x: torch.Tensor, sigma: torch.Tensor, cond: dict
    ) -> torch.Tensor:
        """One unguided network call: the velocity of `module` (the denoiser, possibly wrapped)
        at latents x [B, *latent_shape] fp32 and noise levels sigma [B] fp32 in [0, 1], under
        the conditioning `cond` (the `cond_keys` entries, [B, ...] fp32). Casts
        its inputs to the module's dtype and returns [B, *latent_shape] in any float dtype (the
        stage runs it under autocast when asked and casts the result to fp32). An "embedded"
        family is also given `guidance=` [B] fp32, the guidance scale of each row."""
        ...

    def guided_velocity(
        self, forward: Any, x: torch.Tensor, sigma: torch.Tensor, cond: dict, scale: float, uncond: Uncond
    ) -> torch.Tensor:
        """The guided velocity [B, *latent_shape] fp32 at guidance `scale` from the stage's network
        call `forward(x, sigma, cond, **extra)`, its uncond branch run as `uncond` says
        (`unirl.models.flow.guidance`: the shared styles and their arithmetic)."""
        ...

    def latent_shape(self, height: int, width: int) -> tuple[int, ...]:
        """The shape of one latent sample for an image of height x width pixels (images:
        (C, h, w); videos (C, f, h, w), the clip length being the model config's); an error naming
        `sampling.height/width` when the geometry cannot take it."""
        ...

    def image_seq_len(self, height: int, width: int) -> int:
        """Tokens the denoiser sees for one sample of that size (dynamic sigma shift uses it)."""
        ...

    def pixels(self, latents: torch.Tensor) -> torch.Tensor:
        """[B, 3, H, W] fp32 RGB in about [-1, 1] (unclamped) from latents [B, *latent_shape]
        (a video family: frames [B, F, 3, H, W]), differentiable: the VAE decode with the family's
        scaling and shift, or the identity in pixel space."""
        ...

    def model_info(self) -> dict[str, Any]:
        """What the driver needs to pin a sigma schedule: `vae_scale_factor` and `patch_size`
        (their product is the pixels per denoiser token along a side), `pixel_space`."""
        ...

    def to(self, device: str | torch.device | torch.dtype) -> FlowFamily: ...

    def save_pretrained(self, path: str) -> None: ...

    @staticmethod
    def write_weights(path: str, kind: str, state: dict[str, torch.Tensor], module: torch.nn.Module) -> None:
        """The train backend's exporter: a LoRA (`kind` "lora") or full state of `module` written
        under `path` in the format the family's library loads."""
        ...

    def text_encoders(self) -> list[torch.nn.Module]:
        """The prompt encoders `encode_text` runs (supervised training may train them)."""
        ...

    def frozen_modules(self) -> list[torch.nn.Module]:
        """The modules that are not trained (text encoders, VAE): the dedicated engine syncs
        them once."""
        ...


@runtime_checkable
class FlowModelConfig(Protocol):
    """A recipe's `model` node for a flow-matching family (a dataclass next to its bundle).

    The validator asks it, before Ray starts, whether its directory is one of its family and
    whether an image size fits its geometry; it never reads a family's files itself.
    """

    modality: ClassVar[str]  # "diffusion"
    pretrained_path: str | None

    def build(self) -> FlowFamily:
        """The bundle: from `pretrained_path`, else from the tiny config."""
        ...

    def load_checkpoint(self, path: str) -> FlowFamily:
        """A bundle with the trained weights of a UniRL checkpoint directory (its base model
        read from the checkpoint's `unirl_checkpoint.json`)."""
        ...

    def trainable_on_meta(self) -> torch.nn.Module:
        """The denoiser's module tree on the meta device (no weights read): LoRA target and
        FSDP block names are checked against it."""
        ...

    def directory_problems(self) -> list[str]:
        """Problems with `pretrained_path` (missing, or not a directory of this family), each
        naming `model.pretrained_path` and what it should be; [] when unset or fine."""
        ...

    def size_problems(self, height: int, width: int, key: str = "sampling") -> list[str]:
        """Problems with sampling at height x width pixels (not a multiple of the pixels per
        latent patch, larger than a tiny model's position embedding), each naming
        `{key}.height` or `{key}.width` (`sampling`, or `eval.sampling` for the evaluation size)
        and the valid values; [] when it fits or the geometry cannot be read (an unreadable
        directory is `directory_problems`' report)."""
        ...

    def guidance_problems(self, guidance_scale: float, key: str) -> list[str]:
        """Problems with sampling at `guidance_scale` (the recipe key `key`, e.g.
        `sampling.guidance_scale`), each naming `key` and the values the model takes; []
        when it takes it or the model cannot be read."""
        ...


def training_guidance(bundle: FlowFamily, sigma: torch.Tensor, scale: float) -> dict[str, torch.Tensor]:
    """`predict`'s guidance keyword for training the denoiser on its own (the supervised losses:
    flow-matching SFT, offline Diffusion-DPO): {"guidance": `scale` per row, [B] like `sigma`}
    for an "embedded" family (FLUX.1-dev takes the scale as a network input, so it is trained at
    one), {} for a "cfg" or "true_cfg" family, whose network takes no scale and trains unguided.

    Raises:
        ValueError: `scale` is not 1.0 for a family that trains unguided (it would be ignored),
            naming `sft.guidance_scale`.
    """
    if bundle.guidance == "embedded":
        return {"guidance": torch.full_like(sigma, scale)}
    if scale != 1.0:
        raise ValueError(
            f"sft.guidance_scale={scale}: {type(bundle).__name__} guides by {bundle.guidance!r} "
            "(two branches at sampling), so it trains unguided and the scale would be ignored; "
            "only an 'embedded' family (FLUX.1-dev) trains at a guidance scale. Set sft.guidance_scale: 1.0"
        )
    return {}


class DiffusersBundle:
    """The module plumbing every bundle over a diffusers pipeline shares (SD3, FLUX.1, Qwen-Image,
    Wan): a mixin, not part of the `FlowFamily` contract (a family may write its own).

    The bundle provides `pipeline` (the diffusers pipeline that owns every module), `transformer`
    (the trainable denoiser), `vae` (None in pixel space), `TEXT_ENCODERS` (the pipeline's
    attributes holding the prompt encoders, in `encode_prompt`'s order; `("text_encoder",)` by
    default) and `LORA_PIPELINE` (the diffusers pipeline class whose `load_lora_weights` reads the
    exported LoRA). This gives `denoiser` (the transformer), `text_encoders()` (those of
    `TEXT_ENCODERS` the pipeline has), `frozen_modules()` (the text encoders and the VAE), `device`
    (the transformer's), `to` (moves or casts the whole pipeline, returns the bundle),
    `save_pretrained` (the pipeline's diffusers layout, what the family's `from_pretrained`
    reads) and `write_weights` (the train backend's exporter). `freeze_frozen_modules()`, called
    at the end of a bundle's `__init__`, turns off the gradients of the frozen modules and puts
    them in eval mode.
    """

    pipeline: Any
    transformer: torch.nn.Module
    vae: torch.nn.Module | None
    LORA_PIPELINE: ClassVar[type]
    TEXT_ENCODERS: ClassVar[tuple[str, ...]] = ("text_encoder",)

    @property
    def denoiser(self) -> torch.nn.Module:
        """The trainable network (`FlowFamily.denoiser`): the transformer."""
        return self.transformer

    def text_encoders(self) -> list[torch.nn.Module]:
        """The pipeline's modules named in `TEXT_ENCODERS` that it has (SD3.5 may drop T5)."""
        modules = (getattr(self.pipeline, name, None) for name in self.TEXT_ENCODERS)
        return [m for m in modules if m is not None]

    def encode_text_keys(
        self, prompts: list[str], guided: bool, max_sequence_length: int
    ) -> dict[str, torch.Tensor]:
        """`encode_text` of a family whose encoding is a tuple of tensors (`_encode(prompts,
        length)`, one per key of its `TEXT_KEYS`): the prompts' under `TEXT_KEYS`; with `guided`
        the empty prompt's under the `NEGATIVE` twins (the pipelines' default negative prompt)."""
        out = dict(zip(self.TEXT_KEYS, self._encode(list(prompts), max_sequence_length), strict=True))
        if guided:
            negative = self._encode([""] * len(prompts), max_sequence_length)
            out.update(zip((NEGATIVE + k for k in self.TEXT_KEYS), negative, strict=True))
        return out

    def frozen_modules(self) -> list[torch.nn.Module]:
        """The family's `text_encoders()` and the VAE (if any): everything but the transformer."""
        return self.text_encoders() + ([self.vae] if self.vae is not None else [])

    def freeze_frozen_modules(self) -> None:
        for module in self.frozen_modules():
            module.requires_grad_(False)
            module.eval()

    @property
    def device(self) -> torch.device:
        """Where the denoiser computes (the bundle is moved as a whole by `to`; `module_device`)."""
        return module_device(self.transformer)

    def to(self, device: str | torch.device | torch.dtype):
        """Move (or cast) every module of the bundle (denoiser, text encoders, VAE) to `device`
        (or a dtype); returns self."""
        self.pipeline.to(device)
        return self

    def save_pretrained(self, path: str) -> None:
        """Write the whole bundle in the diffusers layout (the family's `from_pretrained`, and its
        pipeline class's, reads it back)."""
        self.pipeline.save_pretrained(path)

    @classmethod
    def write_weights(
        cls, path: str, kind: str, state: dict[str, torch.Tensor], module: torch.nn.Module
    ) -> None:
        """The train backend's exporter: a LoRA as `pytorch_lora_weights.safetensors` with its
        adapter config (alpha) in the metadata, what `LORA_PIPELINE.load_lora_weights` reads; a
        full state as a `transformer/` directory (`unirl.models.flow.loading.write_diffusers_weights`)."""
        write_diffusers_weights(cls.LORA_PIPELINE, path, kind, state, module)
