"""`DedicatedEngine`: a rollout engine with its own copy of the weights, fed by weight sync.

The engine owns a stage built from the recipe's model config in its own
process (a Ray actor, `unirl.trainer.engine_worker`), never the trainer's
module. It samples through `TrainsideEngine` over that stage, so rollout code
is shared: with the trainer's weights synced in and the same request, it
produces the same samples and log-probs as trainside sampling. The trainer
syncs its weights after every train phase (`unirl.sync`), and the engine
refuses to sample weights it was not given (`weights_version` is None until
the first sync, and again after a `sleep(2)`).

`sleep(level)` releases the memory of every module of the bundle while the
trainer trains on the same devices (placement `colocate`), and `wake_up()`
restores it:

- level 1: the weights are offloaded (GPU: to host memory; CPU: to a file in
  a private temporary directory) and reloaded bit-exactly on `wake_up`;
- level 2: the weights are dropped; `wake_up` rebuilds the bundle's tensors
  from the model's source (`rebuild`: the pretrained directory or the tiny
  config) and the trainable weights must be synced again before sampling.

Freed host memory goes back to the OS (glibc `malloc_trim`), so a CPU
engine's resident set shrinks while it sleeps.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from typing import Annotated, Any, Literal

import torch
from annotated_types import Ge

from unirl.models.stage import DiffusionStage, TextStage
from unirl.rollout.trainside import TrainsideEngine
from unirl.types.rollout_req import RolloutReq
from unirl.types.rollout_resp import RolloutResp, RolloutTrack

PLACEMENTS = ("colocate", "separate")
SLEEP_LEVELS = (0, 1, 2)


class EngineStateError(RuntimeError):
    """The engine was asked to sample while asleep or before it received weights."""


def _trim_host_memory() -> None:
    """Give freed heap pages back to the OS (glibc only; a no-op elsewhere)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class DedicatedEngine:
    """A rollout engine holding its own stage (own weights), for any modality.

    Args:
        stage: the engine's own `DiffusionStage` or `TextStage`, built from the
            recipe's model config in the engine's process.
        forward_batch_size: samples per forward (None: a request at once); also
            the chunk the driver scores while the rest of a rollout generates
            (`overlap_reward`).
        placement: "colocate" (the engines share the training devices and sleep
            while the trainer trains) or "separate" (engines on devices of their
            own, after the training devices in the pool). Read by the trainer.
        num_engines: engine actors; a request is split evenly over them. With
            colocate at most `num_devices`. Read by the trainer.
        max_staleness: 0 (every rollout samples the latest weights) or k >= 1
            (the next k steps' rollouts run while this step and the next ones
            train, on this step's weights: step n + j's samples are j versions
            behind, 1 <= j <= k; needs placement separate). Read by the trainer.
        partial_tokens: None (a rollout in flight finishes under the weights it
            started with; the engines sync once they are idle) or T >= 1 (partial
            rollouts, text stages, with max_staleness >= 1: the engines sync at every
            step and each rollout in flight samples at most T more tokens per sample
            between two syncs; at a sync its unfinished samples stop, and resume under
            the new weights from their prompt and tokens so far, every token's
            log-prob recorded by the weights that sampled it). Read by the trainer.
        sleep_level: what `sleep` does between rollouts on colocated engines:
            0 nothing, 1 offload and restore the weights, 2 drop them (restored
            from the model source and the next sync). Must be 0 with separate.
        overlap_reward: the driver scores each finished forward batch while
            the engines generate the next ones (the metrics equal a
            non-overlapped rollout's). Read by the trainer.
        rebuild: `() -> bundle-like` returning freshly built modules of the same
            model (`modules_of` finds them); needed for `sleep(2)`.
        track_name: name of the produced track (default as `TrainsideEngine`).
    """

    def __init__(
        self,
        stage: DiffusionStage | TextStage,
        forward_batch_size: Annotated[int, Ge(1)] | None = None,
        placement: Literal["colocate", "separate"] = "colocate",
        num_engines: Annotated[int, Ge(1)] = 1,
        max_staleness: Annotated[int, Ge(0)] = 0,
        sleep_level: Literal[0, 1, 2] = 1,
        overlap_reward: bool = True,
        rebuild: Callable[[], Any] | None = None,
        track_name: str | None = None,
        partial_tokens: Annotated[int, Ge(1)] | None = None,
    ) -> None:
        if placement not in PLACEMENTS:
            raise ValueError(f"rollout.placement must be one of {PLACEMENTS}, got {placement!r}")
        if sleep_level not in SLEEP_LEVELS:
            raise ValueError(f"rollout.sleep_level must be one of {SLEEP_LEVELS}, got {sleep_level!r}")
        if num_engines < 1:
            raise ValueError(f"rollout.num_engines must be >= 1, got {num_engines}")
        if max_staleness < 0:
            raise ValueError(f"rollout.max_staleness must be >= 0, got {max_staleness}")
        if partial_tokens is not None and (partial_tokens < 1 or not isinstance(stage, TextStage)):
            raise ValueError(
                f"rollout.partial_tokens={partial_tokens}: partial rollouts sample text stages, at least one "
                f"token per segment; got a {type(stage).__name__}"
            )
        self.sampler = TrainsideEngine(stage, forward_batch_size, track_name)
        self.stage = stage
        self.track_name = self.sampler.track_name
        self.forward_batch_size = forward_batch_size
        self.placement = placement
        self.num_engines = num_engines
        self.max_staleness = max_staleness
        self.sleep_level = sleep_level
        self.overlap_reward = overlap_reward
        self.partial_tokens = partial_tokens
        self.rebuild = rebuild
        self.weights_version: int | None = None
        self.asleep = 0  # the level it sleeps at; 0 awake
        self._offload_dir: str | None = None
        self._offloaded: dict[str, torch.Tensor] | None = None
        self._shapes: dict[str, torch.Size] = {}
        self.device = next(stage.module.parameters()).device

    # ---- sampling ---------------------------------------------------------------------------
    def generate(self, req: RolloutReq) -> RolloutResp:
        """`TrainsideEngine.generate` over the engine's own stage (see there)."""
        self._check_ready()
        return self.sampler.generate(req)

    def _check_ready(self) -> None:
        if self.asleep:
            raise EngineStateError(
                f"the rollout engine is asleep (level {self.asleep}): call wake_up() first"
            )
        if self.weights_version is None:
            raise EngineStateError(
                "the rollout engine has no synced weights: sync the trainer's weights into it before "
                "sampling (after construction and after sleep(2))"
            )

    def generate_chunks(self, req: RolloutReq) -> Iterator[RolloutTrack]:
        """`TrainsideEngine.generate_chunks` over the engine's own stage: the track of each
        forward batch as soon as it is sampled (their concatenation is `generate`'s)."""
        self._check_ready()
        yield from self.sampler.generate_chunks(req)

    # ---- partial rollouts (text) --------------------------------------------------------------
    def draft(self, req: RolloutReq) -> Any:
        """An empty `unirl.models.causal_lm.stage.Draft` of `req` for `extend` and `finish`."""
        self._check_ready()
        return self.stage.draft(req)

    def extend(self, draft: Any, max_tokens: int) -> None:
        """At most `max_tokens` more tokens for each unfinished sample of `draft`, sampled (and
        recorded) by the weights this engine holds now (`CausalLMStage.extend`), in forward
        batches of at most `forward_batch_size` unfinished samples."""
        self._check_ready()
        running = [i for i, done in enumerate(draft.done) if not done]
        size = self.forward_batch_size or max(len(running), 1)
        for k in range(0, len(running), size):
            self.stage.extend(draft, max_tokens, self.weights_version, rows=running[k : k + size])

    def finish(self, draft: Any) -> RolloutTrack:
        """Sample the draft's unfinished samples to their end with the weights held now; the
        track a rollout of its request produces."""
        self.extend(draft, draft.req.sampling.max_new_tokens)
        segment, texts = self.stage.segment_of(draft)
        return RolloutTrack.of_request(self.track_name, draft.req, segment, texts=texts)

    def weights_loaded(self, version: int) -> dict[str, float]:
        """The engine's module now holds the trainer's weights of `version` (a sync or a
        checkpoint load wrote them): sample them from now on. Returns extra `sync/...` stats
        (none here; an engine that copies the weights elsewhere, e.g. into vLLM, reports its own)."""
        self.weights_version = version
        return {}

    # ---- memory -----------------------------------------------------------------------------
    def modules(self) -> dict[str, torch.nn.Module]:
        """Every module whose memory `sleep` releases: the stage's module and the bundle's frozen ones."""
        return modules_of(self.stage.bundle, self.stage.module)

    def _state(self) -> dict[str, torch.Tensor]:
        """Every parameter and buffer of `modules()` (non-persistent buffers too), by
        `<module>.<name>` (tied tensors once)."""
        return tensors_of(self.modules())

    def sleep(self, level: int | None = None) -> None:
        """Release the weights' memory (`level` default: `sleep_level`; 0 does nothing)."""
        level = self.sleep_level if level is None else level
        if level not in SLEEP_LEVELS:
            raise ValueError(f"sleep level must be one of {SLEEP_LEVELS}, got {level}")
        if level == 0 or self.asleep:
            return
        if level == 2 and self.rebuild is None:
            raise ValueError("sleep(2) drops the weights and needs `rebuild` to restore them")
        if level == 1:
            state = {k: t.detach() for k, t in self._state().items()}
            if self.device.type == "cpu":
                self._offload_dir = tempfile.mkdtemp(prefix="unirl_engine_sleep_")
                torch.save(state, os.path.join(self._offload_dir, "weights.pt"))
            else:
                self._offloaded = {k: t.to("cpu", copy=True) for k, t in state.items()}
            del state
        # free each tensor's storage in place: parameter objects (and so tied weights) stay
        self._shapes = {}
        for key, t in self._state().items():
            self._shapes[key] = t.shape
            t.data = torch.empty(0, dtype=t.dtype, device=t.device)
        _trim_host_memory()
        self.asleep = level
        if level == 2:
            self.weights_version = None

    def wake_up(self) -> None:
        """Restore the weights released by `sleep` (level 2: from the model's source; the
        trainable weights then wait for the next sync). A no-op when awake."""
        if not self.asleep:
            return
        for key, t in self._state().items():
            t.data = torch.empty(self._shapes[key], dtype=t.dtype, device=t.device)
        if self.asleep == 1:
            if self._offload_dir is not None:
                path = os.path.join(self._offload_dir, "weights.pt")
                saved = torch.load(path, map_location=self.device, weights_only=True)
                shutil.rmtree(self._offload_dir, ignore_errors=True)
                self._offload_dir = None
            else:
                saved, self._offloaded = self._offloaded, None
            self._copy_into(saved, strict=True)
        else:
            fresh = self.rebuild()
            source = modules_of(fresh, None)
            state = tensors_of(source)
            self._copy_into(state, strict=False)
            del fresh, source, state
        _trim_host_memory()
        self.asleep = 0

    @torch.no_grad()
    def _copy_into(self, saved: dict[str, torch.Tensor], strict: bool) -> None:
        """Copy `saved` into the engine's tensors. `strict`: every tensor has a saved value;
        else (a rebuilt source) every tensor but the LoRA adapters' (which the next sync
        brings), found under its name without peft's `base_layer.`."""
        own = self._state()
        source = {k: k if strict else k.replace(".base_layer.", ".") for k in own}
        missing = [k for k in own if source[k] not in saved and (strict or ".lora_" not in k)]
        if missing:
            raise RuntimeError(
                f"wake_up: {len(missing)} engine tensor(s) have no value to restore, e.g. {missing[:3]}"
            )
        for key, t in own.items():
            if source[key] in saved:
                t.copy_(saved[source[key]])


def is_dedicated(rollout: Any, kind: type | None = None) -> bool:
    """True when a recipe's `rollout` node names a `DedicatedEngine` (or a subclass of it);
    with `kind`, a subclass of that engine class (e.g. `VLLMEngine`)."""
    from hydra.utils import get_object

    try:
        target = get_object(str(rollout["_target_"]))
    except Exception:  # noqa: BLE001 - an unknown target is reported by the validator
        return False
    return isinstance(target, type) and issubclass(target, kind or DedicatedEngine)


def modules_of(bundle: Any, module: torch.nn.Module | None) -> dict[str, torch.nn.Module]:
    """The modules of a model bundle by role: "module" (the stage's network: `module` if given,
    else the bundle's `denoiser` / LM `model`) and "frozen<i>" for the bundle's `frozen_modules()`."""
    main = module if module is not None else getattr(bundle, "denoiser", None) or bundle.model
    out = {"module": main}
    frozen = getattr(bundle, "frozen_modules", None)  # a Janus bundle's are names inside `main`
    for i, m in enumerate(frozen() if callable(frozen) else []):
        out[f"frozen{i}"] = m
    return out


def tensors_of(modules: dict[str, torch.nn.Module]) -> dict[str, torch.Tensor]:
    """Every parameter and buffer (persistent or not) of `modules`, keyed `<role>.<name>`."""
    out: dict[str, torch.Tensor] = {}
    for key, module in modules.items():
        for name, t in [*module.named_parameters(), *module.named_buffers()]:
            out[f"{key}.{name}"] = t
    return out
