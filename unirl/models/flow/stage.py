"""The flow-matching stage: encode prompts, diffuse (rollout), replay (train), denoise, decode,
for any family that supplies a `FlowFamily` bundle (`family.py`).

`diffuse` and `replay` share one velocity function and one step strategy
(named by `sde`, from `unirl.sde.strategies.SDE_STRATEGIES`), so the log-prob a
rollout records and the one replay recomputes come from the same arithmetic.
Shapes: B samples, latents [B, *latent_shape] (images: [B, C, h, w]; videos: [B, C, f, h, w]),
K SDE steps.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Annotated, Any

import torch
from annotated_types import Ge

from unirl.models.flow.family import FlowFamily
from unirl.models.flow.guidance import Uncond
from unirl.models.images import demonstration_pixels
from unirl.models.stage import AUTOCAST_DTYPES as AUTOCAST_DTYPES
from unirl.models.stage import GraphKeeper, autocast_dtype_of
from unirl.sde.solvers import make_ode_solver
from unirl.sde.strategies import SDE_STRATEGIES, make_strategy
from unirl.types.rollout_req import RolloutReq
from unirl.types.segments import LatentSegment

EMPTY = "empty_"  # a demonstration track's empty-prompt conditions ride beside its own as `empty_<key>`


def _pixels(shape: tuple[int, ...]) -> str:
    """'W x H pixels' of a [C, H, W] image, 'F frames of W x H pixels' of a [C, F, H, W] clip."""
    frames = f"{shape[1]} frames of " if len(shape) == 4 else ""
    return f"{frames}{shape[-1]} x {shape[-2]} pixels"


class FlowMatchingStage:
    """Sampling and replay of a flow-matching model (a `DifferentiableDiffusionStage`).

    Args:
        bundle: the model bundle, a `FlowFamily` (a family's bundle).
        replay_steps_per_forward: SDE steps replayed in one denoiser
            forward (their latents stacked along the batch: batched-step
            replay); larger is faster (one forward, and under FSDP one
            all-gather, for several steps), smaller bounds memory.
        replay_token_budget: instead of a fixed count, as many steps per
            forward as keep the forward's denoiser tokens (steps x samples x
            `tokens_per_sample`) within this budget, at least one step
            (`replay_chunks`); None: `replay_steps_per_forward` decides.
        detach_uncond: stop gradients through the unconditional CFG branch
            in replay (flow_grpo's training setting).
        sde: the SDE step strategy of rollout and replay, a name in
            `unirl.sde.strategies.SDE_STRATEGIES` ("flow": Flow-GRPO's SDE),
            built per request with the request's `eta`.
        autocast_dtype: run the denoiser's forward under `torch.autocast` in
            this dtype ("bfloat16" or "float16"; None: the parameters' dtype).
            Rollout and replay share the forward, so the first on-policy ratio
            stays exactly 1; outputs and the SDE arithmetic are fp32.
        store_trajectory: `diffuse` stores the latent before every step, not
            only where SDE replay needs it, so a loss can restart the sampler
            from any step (`denoise`; the reward-backprop algorithms).

    `module` is the denoiser actually called; the train backend replaces it
    with its wrapped (LoRA / FSDP) module so rollout and replay use the
    trained weights directly.
    """

    def __init__(
        self,
        bundle: FlowFamily,
        replay_steps_per_forward: Annotated[int, Ge(1)] = 1,  # Ge: checked before any bundle exists
        replay_token_budget: Annotated[int, Ge(1)] | None = None,
        detach_uncond: bool = True,
        autocast_dtype: str | None = None,
        sde: str = "flow",
        store_trajectory: bool = False,
    ) -> None:
        if replay_steps_per_forward < 1:
            raise ValueError(f"stage.replay_steps_per_forward must be >= 1, got {replay_steps_per_forward}")
        if replay_token_budget is not None and replay_token_budget < 1:
            raise ValueError(f"stage.replay_token_budget must be >= 1 or null, got {replay_token_budget}")
        if sde not in SDE_STRATEGIES:
            raise ValueError(f"stage.sde must be one of {sorted(SDE_STRATEGIES)}, got {sde!r}")
        self.autocast_dtype = autocast_dtype_of(autocast_dtype)
        if not callable(getattr(bundle, "guided_velocity", None)):
            raise TypeError(
                f"{type(bundle).__name__} has no guided_velocity: a flow family inherits a guidance style "
                "(unirl.models.flow.guidance) or writes its own"
            )
        self.bundle = bundle
        self.module: torch.nn.Module = bundle.denoiser
        self.replay_steps_per_forward = replay_steps_per_forward
        self.replay_token_budget = replay_token_budget
        self.detach_uncond = detach_uncond
        self.sde = sde
        self.store_trajectory = store_trajectory

    def model_info(self) -> dict:
        """What the driver needs to pin a sigma schedule: the latent grid's geometry
        (`FlowFamily.model_info`)."""
        return self.bundle.model_info()

    # ---- conditions -------------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], guidance_scale: float, max_sequence_length: int) -> dict:
        """Per-sample condition tensors [B, ...] fp32 (the family's keys; with guidance_scale > 1
        and a family that `encodes_uncond` also their `negative_` twins, the family's negative prompt's).
        Unique prompts are
        encoded once."""
        unique = list(dict.fromkeys(prompts))
        guided = self.bundle.encodes_uncond and guidance_scale > 1.0
        encoded = self.bundle.encode_text(unique, guided, max_sequence_length)
        idx = torch.tensor([unique.index(p) for p in prompts], device=next(iter(encoded.values())).device)
        return {k: v[idx].float() for k, v in encoded.items()}

    @torch.no_grad()
    def encode_conditions(self, req: RolloutReq) -> dict:
        """Per-sample condition tensors [B, ...] fp32 of what the request's rows carry besides the
        prompt (an edit family's reference images, under its `condition_key` of the metadata),
        from the family's `encode_conditions(req, guided)`; {} for a family conditioned on text
        alone."""
        encode = getattr(self.bundle, "encode_conditions", None)
        if encode is None:
            return {}
        return encode(req, self.bundle.encodes_uncond and req.sampling.guidance_scale > 1.0)

    @torch.no_grad()
    def encode_request(self, req: RolloutReq) -> dict:
        """Every per-sample condition tensor of a request: its prompts' (`encode_prompts`) and
        what its rows carry besides (`encode_conditions`). A family whose prompt encoder reads the
        rows' images (`prompt_reads_conditions`: Qwen-Image-Edit-Plus, whose vision-language
        encoder sees the references) returns the prompt keys from `encode_conditions` itself, and
        the text-only encoding is skipped."""
        sp = req.sampling
        cond = {}
        if not getattr(self.bundle, "prompt_reads_conditions", False):
            cond = self.encode_prompts(req.prompts, sp.guidance_scale, sp.max_sequence_length)
        cond.update(self.encode_conditions(req))
        return cond

    # ---- the denoiser -----------------------------------------------------------------------
    def velocity(
        self,
        x: torch.Tensor,
        sigma: torch.Tensor,
        cond: dict,
        guidance_scale: float,
        separate_uncond: bool = False,
    ) -> torch.Tensor:
        """[B, *latent_shape] guided velocity at per-row noise levels `sigma` [B]: the family's
        `guided_velocity` (`unirl.models.flow.guidance`: classifier-free, embedded, true CFG, or the
        family's own) over this stage's network call `_forward`.

        Reads the family's `cond_keys` of `cond` (other entries, such as an algorithm's
        frozen values riding with the conditions, are not the network's), and their `negative_`
        twins for an uncond branch, detached when `detach_uncond` and grad is enabled.
        `separate_uncond` runs the uncond half in a forward of its own, without autograd when
        `detach_uncond` (a sampling step whose graph is kept then keeps only the cond half's
        activations).
        """
        sigma = sigma.to(device=x.device, dtype=torch.float32)
        uncond = Uncond(detach=self.detach_uncond, separate=separate_uncond)
        return self.bundle.guided_velocity(self._forward, x, sigma, cond, guidance_scale, uncond)

    def _forward(self, x: torch.Tensor, sigma: torch.Tensor, cond: dict, **extra: Any) -> torch.Tensor:
        """The family's network call on `module`, under autocast when set; fp32 out. `extra` goes
        to the family's `predict` as it is (`guidance` [B] for an "embedded" family; a guidance
        style's own branch switches, such as LTX-2's perturbed blocks)."""
        with torch.autocast(x.device.type, self.autocast_dtype, enabled=self.autocast_dtype is not None):
            out = self.bundle.predict(self.module, x, sigma, cond, **extra)
        return out.to(torch.float32)

    # ---- rollout ----------------------------------------------------------------------------
    @torch.no_grad()
    def diffuse(
        self,
        req: RolloutReq,
        cond: dict,
        traj_dtype: torch.dtype = torch.float32,
        kept: GraphKeeper | None = None,
    ) -> LatentSegment:
        """Sample `len(req)` trajectories with the request's pinned sigmas.

        Noise comes from one generator per sample seeded by `req.seeds`, so a
        sample is the same whichever batch or rank it is generated in; x_T is
        drawn from `req.init_seeds` (shared by a group with
        `sampling.same_initial_noise`, else the sample's own seed). Stores
        the latents at every position replay needs and the log-prob of every
        SDE step; the other steps are ODE steps of `sampling.ode_solver` (or,
        with `sampling.noise_all_steps`, SDE steps without a log-prob). Noise
        is drawn on the CPU (so a seed gives the same sample on every device)
        and moved to the bundle's device, where everything is computed.

        With `kept`, each SDE step runs with autograd on while `kept` has room for
        the whole batch (the CFG halves in two forwards, `separate_uncond`) and
        its log-prob and mean go into `kept` with their graphs, keyed by
        `req.sample_ids`; the segment holds detached values either way.
        """
        sp = req.sampling
        device = self.bundle.device
        sigmas = req.sigmas.to(device)
        strategy = make_strategy(self.sde, sp.eta)
        shape = self.bundle.latent_shape(sp.height, sp.width)
        gens = [torch.Generator().manual_seed(s) for s in req.seeds]
        own = [torch.randn(shape, generator=g) for g in gens]  # also moves each generator to its SDE noise
        x = torch.stack(
            [
                x_own if s == own_seed else torch.randn(shape, generator=torch.Generator().manual_seed(s))
                for x_own, s, own_seed in zip(own, req.init_seeds, req.seeds, strict=True)
            ]
        ).to(device=device, dtype=traj_dtype)
        sde = set(req.sde_indices)
        # with sampling.noise_all_steps every step is stochastic; only the SDE steps keep a log-prob
        noisy = set(range(sp.num_steps)) if sp.noise_all_steps and sde else sde
        ode = make_ode_solver(sp.ode_solver)
        positions = sorted({p for i in sde for p in (i, i + 1)} | {sp.num_steps})
        if self.store_trajectory:
            positions = list(range(sp.num_steps + 1))
        stored, log_probs = {}, []
        for i in range(sp.num_steps):
            if i in positions:
                stored[i] = x
            keep = kept is not None and i in sde and kept.room(len(req))
            with torch.enable_grad() if keep else contextlib.nullcontext():
                v = self.velocity(
                    x, sigmas[i].expand(len(req)), cond, sp.guidance_scale, separate_uncond=keep
                )
                if i in noisy:
                    noise = torch.stack([torch.randn(shape, generator=g) for g in gens]).to(device)
                    out = strategy.step(x, v, sigmas, i, sde=True, noise=noise)
                    ode.observe(x, v.detach(), sigmas, i)
                    if i in sde:
                        if out.log_prob is None:
                            raise ValueError(strategy.noiseless_step_error(sigmas, i))
                        if keep:
                            kept.add(i, req.sample_ids, out)
                        log_probs.append(out.log_prob.detach())
                    x = out.next_sample.detach()
                else:
                    x = ode.step(x, v, sigmas, i)
        stored[sp.num_steps] = x
        return LatentSegment(
            latents=torch.stack([stored[p] for p in positions], dim=1),
            positions=positions,
            sigmas=sigmas,
            sde_indices=sorted(sde),
            log_probs=torch.stack(log_probs, dim=1) if log_probs else torch.zeros(len(req), 0, device=device),
            eta=sp.eta,
            guidance_scale=sp.guidance_scale,
        )

    @torch.no_grad()
    def teacher_forced(self, req: RolloutReq, images: list) -> LatentSegment:
        """The segment of `req` whose final samples are the given images rather than samples (a
        supervised track's demonstrations): image i ([H, W, 3] uint8 array, PIL image or file path,
        `unirl.models.images.load_image`; a video family's clip, a uint8 [F, H, W, 3] array:
        `demonstration_pixels`) as the model's x0, held at position `num_steps` alone (no
        SDE step, no log-prob). Pixel-space families only (x0 = the image in [-1, 1]); a latent
        family's demonstration needs its VAE's encoder, which the bundles do not expose: refused
        naming the key. An image of another size than `sampling.height` x `width` is an error naming
        the sample."""
        sp = req.sampling
        if not self.bundle.model_info().get("pixel_space"):
            raise ValueError(
                f"{type(self.bundle).__name__} samples in a VAE's latent space; a demonstration image enters a "
                "supervised track as a pixel-space model's x0 only (model.tiny.pixel_space: true)"
            )
        shape = tuple(self.bundle.latent_shape(sp.height, sp.width))
        rows = []
        for sid, entry in zip(req.sample_ids, images, strict=True):
            x0 = demonstration_pixels(entry, sid)
            if tuple(x0.shape) != shape:
                raise ValueError(
                    f"sample {sid!r}: the demonstration is {_pixels(tuple(x0.shape))} but the track samples "
                    f"{_pixels(shape)} (sampling.width x height = {sp.width} x {sp.height}); give demonstrations "
                    "of that size"
                )
            rows.append(x0)
        device = self.bundle.device
        return LatentSegment(
            latents=torch.stack(rows)[:, None].to(device),
            positions=[sp.num_steps],
            sigmas=req.sigmas.to(device),
            sde_indices=[],
            log_probs=torch.zeros(len(req), 0, device=device),
            eta=sp.eta,
            guidance_scale=sp.guidance_scale,
        )

    # ---- replay -----------------------------------------------------------------------------
    def replay(
        self, segment: LatentSegment, cond: dict, steps: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Recompute SDE steps `steps` (step indices, each in segment.sde_indices)
        under the current weights, with autograd if enabled, using the
        segment's pinned sigmas, eta and guidance scale.

        The steps are stacked along the batch into one forward. Returns
        (log_probs [B, k] fp32, means [B, k, *latent_shape] fp32, std_dev_t [k] fp32).
        """
        strategy = make_strategy(self.sde, segment.eta)
        b = len(segment)
        x = torch.cat([segment.at(i) for i in steps])
        sig = torch.cat([segment.sigmas[i].expand(b) for i in steps])
        rep = {k: v.repeat(len(steps), *([1] * (v.dim() - 1))) for k, v in cond.items()}
        v_all = self.velocity(x, sig, rep, segment.guidance_scale)
        lps, means, stds = [], [], []
        for j, i in enumerate(steps):
            sl = slice(j * b, (j + 1) * b)
            out = strategy.step(x[sl], v_all[sl], segment.sigmas, i, sde=True, next_sample=segment.at(i + 1))
            lps.append(out.log_prob)
            means.append(out.mean)
            stds.append(out.std_dev_t)
        return torch.stack(lps, dim=1), torch.stack(means, dim=1), torch.stack(stds)

    def denoise(
        self,
        x: torch.Tensor,
        sigmas: torch.Tensor,
        cond: dict,
        guidance_scale: float,
        steps: range,
        checkpoint: bool = False,
    ) -> torch.Tensor:
        """Run the ODE (Euler) steps `steps` of `sigmas` from x, the [B, *latent_shape] latent before
        `steps.start`, under the current weights; returns the latent after `steps.stop - 1`.

        The autograd graph is kept when grad is enabled (the reward-backprop losses
        differentiate a reward through it). Each step is `diffuse`'s ODE step: the guided
        `velocity` and the strategy's Euler step at eta 0, in the same order and dtypes, so
        from a stored position of an ODE rollout it reproduces the rollout's later latents.
        `checkpoint` recomputes each step's velocity in the backward pass instead of keeping
        its activations (`torch.utils.checkpoint`): memory for a step's input, not its forward.
        """
        strategy = make_strategy(self.sde, 0.0)
        for i in steps:
            sigma = sigmas[i].expand(x.shape[0])
            if checkpoint and torch.is_grad_enabled():
                v = torch.utils.checkpoint.checkpoint(
                    self.velocity, x, sigma, cond, guidance_scale, use_reentrant=False
                )
            else:
                v = self.velocity(x, sigma, cond, guidance_scale)
            x = strategy.step(x, v, sigmas, i, sde=False).next_sample
        return x

    def replay_chunks(self, steps: list[int], segment: LatentSegment) -> Iterator[list[int]]:
        """`steps` in the chunks `replay` runs as one forward each (`steps_per_forward`)."""
        if not steps:
            return
        n = self.steps_per_forward(len(segment), segment.at(steps[0]).shape[1:])
        for k in range(0, len(steps), n):
            yield steps[k : k + n]

    def steps_per_forward(self, samples: int, latent_shape: torch.Size | tuple[int, ...]) -> int:
        """SDE steps one replay forward stacks for `samples` latents of `latent_shape`:
        `replay_steps_per_forward`, or with `replay_token_budget` as many as keep steps x samples x
        `tokens_per_sample` within it (at least one)."""
        if self.replay_token_budget is None:
            return self.replay_steps_per_forward
        return max(1, self.replay_token_budget // (samples * self.tokens_per_sample(latent_shape)))

    def tokens_per_sample(self, latent_shape: torch.Size | tuple[int, ...]) -> int:
        """Denoiser image tokens of one latent [C, (F,) h, w]: (F x) h x w / patch_size^2 (the
        family's `model_info` patch; a video's frames are patched in time by 1)."""
        patch = self.bundle.model_info()["patch_size"]
        cells = math.prod(latent_shape[1:])
        return max(1, cells // (patch * patch))

    # ---- media ------------------------------------------------------------------------------
    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """[B, 3, H, W] uint8 RGB (a video family: [B, F, 3, H, W] frames) from final latents
        (pixel space: x in [-1, 1])."""
        return ((self.bundle.pixels(latents).clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)

    @torch.no_grad()
    def decode_audio(self, latents: torch.Tensor) -> dict:
        """The soundtracks of an audio-video family (a bundle with `audio` and `audio_sample_rate`:
        LTX-2): {"audio": [B, A, T] fp32, "audio_rate": Hz}, the track's fields beside `media`;
        {} for every other family."""
        if not hasattr(self.bundle, "audio"):
            return {}
        return {"audio": self.bundle.audio(latents), "audio_rate": int(self.bundle.audio_sample_rate)}

    def decode_float(self, latents: torch.Tensor) -> torch.Tensor:
        """[B, 3, H, W] fp32 RGB in [0, 1] (videos: [B, F, 3, H, W]) from latents, differentiable
        (through the VAE, if any): `decode` before its rounding, (clamp(x, -1, 1) + 1) / 2; the reward-backprop
        losses score it with a `DifferentiableReward`. `decode(l) == round(255 * decode_float(l))`
        up to float rounding."""
        return (self.bundle.pixels(latents).clamp(-1, 1) + 1) * 0.5
