"""The stage contract per modality: what the rollout engine, the train stack and
the algorithms may call on a model family's stage.

A family implements one of these protocols (structural typing: no base class to
inherit). Every stage exposes `module`, the network actually called; the train
backend replaces it with its wrapped (LoRA / FSDP2) module, so sampling and
replay run the trained weights directly.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

import torch

from unirl.sde.strategies import StepOutput
from unirl.types.rollout_req import RolloutReq
from unirl.types.segments import LatentSegment, TokenSegment

AUTOCAST_DTYPES = {None: None, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""The `autocast_dtype` names a stage takes: the dtype its forwards run under `torch.autocast` in
(None: no autocast, the parameters' dtype)."""


def autocast_dtype_of(name: str | None, key: str = "stage.autocast_dtype") -> torch.dtype | None:
    """The torch dtype of an `autocast_dtype` name (`AUTOCAST_DTYPES`); a ValueError naming the
    recipe key `key` and the names it takes for any other."""
    if name not in AUTOCAST_DTYPES:
        raise ValueError(f"{key} must be one of {list(AUTOCAST_DTYPES)}, got {name!r}")
    return AUTOCAST_DTYPES[name]


def module_device(module: torch.nn.Module) -> torch.device:
    """The device `module` computes on: the one FSDP2 parameter offload recorded
    (`compute_device`, set by `unirl.train.fsdp.shard_module`: the parameters' shards then live in
    host memory), else its parameters' device."""
    device = getattr(module, "compute_device", None)
    return device if device is not None else next(module.parameters()).device


class ModuleDevice:
    """Mixin of a stage that calls one `module` (the train backend may replace it with its wrapped
    module): `device`, where that module's parameters live."""

    module: torch.nn.Module

    @property
    def device(self) -> torch.device:
        return module_device(self.module)


class TokenModelStage(ModuleDevice):
    """What a token stage (text, image tokens) starts with: the bundle, checked against its family
    protocol when built (`problems`: a TypeError naming every missing member), the autocast dtype
    of its forwards (`autocast_dtype_of`), and `module`, the bundle's model, which the train backend
    may replace with its wrapped one. `model_info` begins with what every such stage reports."""

    def __init__(self, bundle: Any, autocast_dtype: str | None, problems: list[str]) -> None:
        if problems:
            raise TypeError("; ".join(problems))
        self.autocast_dtype = autocast_dtype_of(autocast_dtype)
        self.bundle = bundle
        self.module: torch.nn.Module = bundle.model

    def model_info(self) -> dict[str, Any]:
        """The model's class, parameter count, and the dtype and device of its parameters."""
        params = list(self.module.parameters())
        return {
            "architecture": type(self.bundle.model).__name__,
            "num_params": sum(p.numel() for p in params),
            "num_trainable_params": sum(p.numel() for p in params if p.requires_grad),
            "dtype": str(params[0].dtype).removeprefix("torch."),
            "device": str(params[0].device),
        }


class ModuleOwner(ModuleDevice):
    """A `ModuleDevice` that is moved as its module (the value stages): `to(device)` moves
    `module` and returns the stage."""

    def to(self, device: str | torch.device):
        self.module.to(device)
        return self


class GraphKeeper(Protocol):
    """Where a sampling forward's graphs are kept for the loss (`unirl.rollout.kept.KeptGraphs`
    is the one the rollout engine builds): the stage writes into it, an on-policy loss reads it.

    - `room(n) -> bool`: whether a forward of `n` samples still fits.
    - `add(step, sample_ids, out)`: keep one SDE step's values (the strategy's `StepOutput`: log_prob
      [b], mean [b, ...], std_dev_t) with their graphs.
    - `lookup(sample_ids, steps) -> (log_probs [b, k], means [b, k, ...], std_dev_t [k]) | None`:
      what `DiffusionStage.replay` would return for those steps, or None when any pair is missing.
    """

    def room(self, n: int) -> bool: ...

    def add(self, step: int, sample_ids: list[str], out: StepOutput) -> None: ...

    def lookup(
        self, sample_ids: list[str], steps: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None: ...


@runtime_checkable
class DiffusionStage(Protocol):
    """Sampling and replay of a flow-matching denoiser (see `unirl/models/README.md`)."""

    module: torch.nn.Module

    def encode_prompts(self, prompts: list[str], guidance_scale: float, max_sequence_length: int) -> dict: ...

    def encode_conditions(self, req: RolloutReq) -> dict:
        """What the request's rows condition on besides the prompt (an edit's reference image), as
        per-sample tensors merged into `encode_prompts`' conditions; {} for text alone."""
        ...

    def encode_request(self, req: RolloutReq) -> dict:
        """Every per-sample condition of a request: its prompts' and its rows' (what a rollout
        samples with)."""
        ...

    def velocity(
        self, x: torch.Tensor, sigma: torch.Tensor, cond: dict, guidance_scale: float
    ) -> torch.Tensor: ...

    def diffuse(self, req: RolloutReq, cond: dict, *, kept: GraphKeeper | None = None) -> LatentSegment: ...

    def replay(
        self, segment: LatentSegment, cond: dict, steps: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...

    def replay_chunks(self, steps: list[int], segment: LatentSegment) -> Iterator[list[int]]: ...

    def decode(self, latents: torch.Tensor) -> torch.Tensor: ...

    def model_info(self) -> dict[str, Any]: ...


@runtime_checkable
class DifferentiableDiffusionStage(DiffusionStage, Protocol):
    """A `DiffusionStage` a reward can be differentiated through (the reward-backprop losses).

    - `denoise(x, sigmas, cond, guidance_scale, steps, checkpoint=False) -> x'`: the ODE
      steps `steps` (a range of step indices) from x, the latent before `steps.start`,
      with the autograd graph when grad is enabled; the same arithmetic as `diffuse`'s
      ODE steps, so from a stored position it reproduces an ODE rollout's later latents.
      `checkpoint` recomputes each step's forward in the backward pass.
    - `decode_float(latents) -> [B, 3, H, W]` fp32 RGB in [0, 1], differentiable;
      `decode` is its rounding to uint8.
    - `store_trajectory`: when true, `diffuse` stores the latent before every step, so
      a loss can restart the sampler from any step of a rollout.
    """

    store_trajectory: bool

    def denoise(
        self,
        x: torch.Tensor,
        sigmas: torch.Tensor,
        cond: dict,
        guidance_scale: float,
        steps: range,
        checkpoint: bool = False,
    ) -> torch.Tensor: ...

    def decode_float(self, latents: torch.Tensor) -> torch.Tensor: ...


@runtime_checkable
class TextStage(Protocol):
    """Generation and replay of a causal LM.

    - `generate(req) -> (TokenSegment, texts)`: batched sampling with a KV cache
      under `req.sampling` (`TextSamplingParams`); the segment records each
      sampled token's log-prob under `log_softmax(logits / temperature)`; texts
      are the decoded responses (stop token excluded).
    - `token_log_probs(segment) -> [B, Lmax]` fp32 log-probs of the response
      tokens under the current `module` at the segment's temperature, right-padded
      with 0 (mask: `segment.response_mask()`); differentiable; a sample's values
      do not depend on what it is batched with.
    """

    module: torch.nn.Module

    def generate(self, req: RolloutReq) -> tuple[TokenSegment, list[str]]: ...

    def token_log_probs(self, segment: TokenSegment) -> torch.Tensor: ...

    def model_info(self) -> dict[str, Any]: ...


@runtime_checkable
class ImageTokenStage(Protocol):
    """What a unified model's image stage answers (`unirl.models.image_tokens.VQImageStage` is one).

    - `image_context(prompt_ids [P], plan_ids [R]) -> [C]`: the text context an image is drawn after.
    - `generate(contexts, seeds, sampling) -> (TokenSegment, media [B, 3, H, W] uint8)`.
    - `token_log_probs(segment) -> [B, N]` fp32, differentiable (replay).
    - `check_tokens(segment, sample_ids)`: raise naming the sample whose image tokens are not
      the model's count of codebook indices.
    """

    module: torch.nn.Module

    def image_context(self, prompt_ids: torch.Tensor, plan_ids: torch.Tensor) -> torch.Tensor: ...

    def generate(
        self, contexts: list[torch.Tensor], seeds: list[int], sampling: Any
    ) -> tuple[TokenSegment, Any]: ...

    def token_log_probs(self, segment: TokenSegment) -> torch.Tensor: ...

    def check_tokens(self, segment: TokenSegment, sample_ids: list[str] | None = None) -> None: ...

    def model_info(self) -> dict[str, Any]: ...
