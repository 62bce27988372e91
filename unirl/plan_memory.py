"""Plan a diffusion recipe's memory per device before running it.

    python -m unirl.plan_memory --config-name=<recipe> [key=value ...] [--devices N] [--device-gib G]

The recipe is composed and validated as the trainer would, then its real-size models are built on
PyTorch's meta device (shapes and dtypes, no storage: a 20B-parameter transformer in seconds) and
the worker's own pieces act on it: the train backend (LoRA, activation checkpointing, AdamW, EMA /
reference copies) and the stage's `velocity` and `decode`. Two phases run under
`torch.distributed._tools.mem_tracker.MemTracker`, which follows every tensor allocated and freed:

- rollout: one no-grad guided forward of `rollout.forward_batch_size` samples (classifier-free
  guidance as the family does it), then a decode of them;
- train: one replay forward of `micro_batch_size x steps per forward` (latent, sigma) pairs with
  autograd (`stage.replay_steps_per_forward` / `replay_token_budget`), its backward and an AdamW step;
  with `train.stack.offload_activations` the saved tensors leave the device as they are saved
  (`host_saved_tensors`).

On the meta device two things differ from a GPU, and the plan models them: `torch.autocast` does not
run there, so `meta_autocast` casts the inputs of linear, convolution and attention calls to the
autocast dtype above autograd (what autocast does: the casts are what autograd saves) and runs layer
and group norms in fp32; and attention is costed as the flash / memory-efficient kernels a GPU runs
(`FlashAttentionCost`: q, k, v, the output and a log-sum-exp saved, no L x L matrix).

The planned peak of a device is the larger phase's peak (trained module, its optimizer state and the
phase's tensors) plus what lives beside the module all run long: the frozen modules (text encoders,
VAE), EMA / reference copies, the rollout's stored latents and media, and kept graphs. With N > 1
data-parallel ranks (FSDP2), the module's weights, gradients and optimizer state are divided by the
shard degree (N, or N / `train.parallel.replicate` under HSDP) and two of its largest blocks are counted
whole (the one computing and the one prefetched); with `train.fsdp.offload_params` the shards, their
gradients, the AdamW moments and the EMA / reference copies are in host memory and count nothing on
the device. With Ulysses sequence parallelism
(`train.parallel.sp`) the phases run as one rank of the group (`sequence_parallel_group`: a fake
process group and diffusers' context parallelism on the meta module). `--device-gib` also prints
the largest micro-batch whose plan fits the device.

Checked against the peaks measured on an H200 in `docs/results/devices.md` (`tests/test_plan_memory.py`
checks the arithmetic on a tiny model against a hand count; `docs/results/memory_plan.md` the
real-size comparisons).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import sys
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from unirl.train.fsdp import ParallelConfig
from unirl.train.sequence_parallel import sequence_parallel_degree

GIB = 2**30
_CASTS = {"linear", "conv1d", "conv2d", "conv3d"}
_FP32 = {"layer_norm", "group_norm"}


class FlashAttentionCost(torch.autograd.Function):
    """`scaled_dot_product_attention` as a GPU's flash / memory-efficient kernel costs it: the
    output [..., Lq, Dv] in q's dtype, and q, k, v, the output and an fp32 log-sum-exp [..., Lq]
    saved for backward (the meta device's math kernel would save the L x L probabilities)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = q.new_empty((*q.shape[:-1], v.shape[-1]))
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q, k, v, _, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


@contextlib.contextmanager
def meta_autocast(dtype: torch.dtype | None) -> Iterator[None]:
    """Run meta-device code as it would run on a GPU under `torch.autocast(dtype)`: the inputs of
    `F.linear` / `F.conv*d` / `F.scaled_dot_product_attention` are cast to `dtype` and those of
    `F.layer_norm` / `F.group_norm` to fp32, above autograd as autocast does (so autograd saves the
    casts). `torch.autocast` on the meta device (which the meta device refuses) is a no-op meanwhile:
    the whole region counts as the stage's autocast region, backward's recomputation of
    checkpointed blocks included. None: no casts. Attention is always `FlashAttentionCost`."""
    saved = {name: getattr(F, name) for name in _CASTS | _FP32 | {"scaled_dot_product_attention"}}
    real_autocast = torch.autocast

    def cast(values: Any, to: torch.dtype) -> Any:
        if isinstance(values, torch.Tensor) and values.is_floating_point():
            return values.to(to)
        return values

    def casting(name: str) -> Any:
        to = torch.float32 if name in _FP32 else dtype

        def call(*args: Any, **kwargs: Any) -> Any:
            args = tuple(cast(a, to) for a in args)
            kwargs = {key: cast(v, to) for key, v in kwargs.items()}
            return saved[name](*args, **kwargs)

        return call

    def attention(
        query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any
    ) -> Any:
        if dtype is not None:
            query, key, value = (cast(t, dtype) for t in (query, key, value))
        return FlashAttentionCost.apply(query, key, value)

    def autocast(device_type: str, *args: Any, **kwargs: Any) -> Any:
        if device_type == "meta":
            return contextlib.nullcontext()
        return real_autocast(device_type, *args, **kwargs)

    try:
        if dtype is not None:
            for name in _CASTS | _FP32:
                setattr(F, name, casting(name))
        F.scaled_dot_product_attention = attention
        torch.autocast = autocast
        yield
    finally:
        for name, fn in saved.items():
            setattr(F, name, fn)
        torch.autocast = real_autocast


@contextlib.contextmanager
def meta_answers_yes() -> Iterator[None]:
    """`bool()` and `.item()` of a meta tensor answer True / 1 meanwhile (they have no data): a
    text encoder's data-dependent shortcut ("is the padding mask all ones?") takes its yes branch,
    and `nonzero` finds every element non-zero (a mask of all ones: every prompt is
    `max_sequence_length` tokens long, the most memory). Used around prompt encoding only."""
    from torch.fx.experimental import _config as fx_config

    real_bool, real_item = torch.Tensor.__bool__, torch.Tensor.item
    torch.Tensor.__bool__ = lambda t: True if t.is_meta else real_bool(t)
    torch.Tensor.item = lambda t: 1 if t.is_meta else real_item(t)
    try:
        flag = (
            {"meta_nonzero_assume_all_nonzero": True}
            if hasattr(fx_config, "meta_nonzero_assume_all_nonzero")
            else {}
        )
        with fx_config.patch(**flag):
            yield
    finally:
        torch.Tensor.__bool__, torch.Tensor.item = real_bool, real_item


def host_saved_tensors() -> Any:
    """`torch.autograd.graph.save_on_cpu` as the device sees it: a saved tensor leaves the device
    when saved (only its shape and dtype are kept here) and comes back, newly allocated, when
    backward unpacks it (`train.stack.offload_activations`)."""

    def pack(t: torch.Tensor) -> tuple:
        return t.shape, t.dtype, t.device

    def unpack(packed: tuple) -> torch.Tensor:
        shape, dtype, device = packed
        return torch.empty(shape, dtype=dtype, device=device)

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def nbytes(tensors: Iterator[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def module_bytes(module: torch.nn.Module) -> int:
    return nbytes(module.parameters()) + nbytes(module.buffers())


@dataclasses.dataclass
class MemoryPlan:
    """Bytes per device of a recipe, by part (see the module docstring for what each holds)."""

    recipe: str
    devices: int
    micro_batch: int
    steps_per_forward: int
    forward_batch: int
    module: int  # the trained module's weights (sharded under FSDP)
    gathered: int  # FSDP: two largest blocks whole
    frozen: int  # text encoders, VAE
    trainable: int  # trainable parameters' bytes (inside `module` already)
    optimizer: int  # AdamW's moments (sharded under FSDP)
    copies: int  # EMA, reference, snapshots
    store: int  # the rollout's stored latents, conditions and media
    kept: int  # kept graphs (rollout.keep_graph)
    rollout_extra: int  # the rollout phase's peak over the module
    train_extra: int  # the train phase's peak over the module (grads, AdamW, activations)

    @property
    def resident(self) -> int:
        return (
            self.module + self.gathered + self.frozen + self.optimizer + self.copies + self.store + self.kept
        )

    @property
    def peak(self) -> int:
        return self.resident + max(self.rollout_extra, self.train_extra)

    def table(self) -> str:
        rows = [
            ("trained module (weights)", self.module),
            ("FSDP gathered blocks", self.gathered),
            ("frozen modules (text encoders, VAE)", self.frozen),
            ("AdamW moments", self.optimizer),
            ("EMA / reference / snapshot copies", self.copies),
            ("rollout store (latents, conditions, media)", self.store),
            ("kept graphs", self.kept),
            (f"rollout phase over the module (forward batch {self.forward_batch})", self.rollout_extra),
            (
                f"train phase over the module (micro-batch {self.micro_batch} x {self.steps_per_forward} "
                "step(s): grads, activations)",
                self.train_extra,
            ),
        ]
        lines = [f"memory plan: {self.recipe}, {self.devices} device(s)"]
        lines += [f"  {name:<78} {b / GIB:8.2f} GiB" for name, b in rows]
        lines.append(f"  {'peak per device':<78} {self.peak / GIB:8.2f} GiB")
        return "\n".join(lines)


def _build(node: Any, **kwargs: Any) -> Any:
    from hydra.utils import instantiate

    return None if node is None else instantiate(node, _convert_="all", **kwargs)


class LiveBytes(TorchDispatchMode):
    """Bytes of the tensors allocated while active and still alive: each new storage an op
    returns is counted once until it is freed (views and in-place results are not new storage); `peak` is the most at any op.
    Tensors that existed before (weights) are not counted. The autograd engine carries the mode
    into backward, so gradients and the tensors backward allocates are counted too."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}

    def _free(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if any(r.alias_info is not None for r in func._schema.returns):
            return out  # a view or an in-place result: storage that exists already
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage._cdata
                if key not in self._sizes:
                    self._sizes[key] = storage.nbytes()
                    self.live += storage.nbytes()
                    weakref.finalize(storage, self._free, key)
        self.peak = max(self.peak, self.live)
        return out


def _peak_while(fn: Any) -> int:
    """The most bytes alive at once among those `fn()` allocates (`LiveBytes`)."""
    with LiveBytes() as tracker:
        fn()
    return tracker.peak


def plan_memory(cfg: DictConfig, devices: int | None = None, micro_batch: int | None = None) -> MemoryPlan:
    """The memory plan of a single-track diffusion recipe (validated by the caller) on `devices`
    data-parallel ranks (default the recipe's `num_devices`) at `micro_batch` (default the
    recipe's `train.stack.micro_batch_size`)."""
    from unirl.train.backend import TrainBackend
    from unirl.train.ema import EMAConfig
    from unirl.train.fsdp import checkpoint_blocks

    devices = devices or int(cfg.num_devices)
    stack = cfg.train.stack
    micro = micro_batch or int(stack.micro_batch_size)
    sampling = _build(cfg.sampling)
    with torch.device("meta"):
        bundle = _build(cfg.model).build()
    stage = _build(cfg.stage, bundle=bundle)
    algorithm = _build(cfg.algorithm)
    train = cfg.train
    denoiser = stage.module
    frozen = sum(module_bytes(m) for m in bundle.frozen_modules())
    fsdp = _build(train.get("fsdp"))
    seq_parallel = sequence_parallel_degree(cfg)
    backend = TrainBackend(  # one rank here; its checkpoint wrappers after SP's hooks, as the backend orders them
        denoiser,
        _build(train.get("lora")),
        _build(train.optim),
        1,
        fsdp=dataclasses.replace(fsdp, activation_checkpointing=False) if fsdp is not None else None,
        ema=_build(train.get("ema")),
        snapshots={name: EMAConfig(**spec) for name, spec in algorithm.snapshots.items()},
        keep_reference=algorithm.needs_reference_policy,
    )
    module = backend.module
    stage.module = module
    trainable = nbytes(backend.params)
    copies = trainable * (
        (backend.ema is not None) + len(backend.snapshots) + (backend._reference is not None)
    )

    latent = bundle.latent_shape(sampling.height, sampling.width)
    forward_batch = int(cfg.rollout.get("forward_batch_size") or 0) or int(
        cfg.prompts_per_rollout * sampling.samples_per_prompt
    )
    # samples a rank holds: a sequence-parallel group of ranks holds one shard together
    per_rank = int(cfg.prompts_per_rollout) * int(sampling.samples_per_prompt) // max(1, devices // seq_parallel)
    prompts = ["a prompt"] * max(forward_batch, micro)

    references = conditions(stage, cfg, sampling)

    def rollout() -> None:
        with torch.no_grad(), meta_autocast(stage.autocast_dtype):
            cond = encode(stage, prompts[:forward_batch], sampling.guidance_scale, sampling.max_sequence_length)
            cond.update({key: t.expand(forward_batch, *t.shape[1:]) for key, t in references.items()})
            x = torch.empty(forward_batch, *latent, device="meta")
            v = stage.velocity(x, torch.full((forward_batch,), 0.5, device="meta"), cond, sampling.guidance_scale)
            del v
            stage.decode(x)

    k = _steps_per_forward(stage, sampling, micro, latent)

    def train_step() -> None:
        with torch.no_grad():
            cond = encode(stage, prompts[:micro], sampling.guidance_scale, sampling.max_sequence_length)
            cond.update({key: t.expand(micro, *t.shape[1:]) for key, t in references.items()})
        cond = {key: t.repeat(k, *([1] * (t.dim() - 1))) for key, t in cond.items()}
        x = torch.empty(micro * k, *latent, device="meta")
        offload = host_saved_tensors() if stack.get("offload_activations") else contextlib.nullcontext()
        with meta_autocast(stage.autocast_dtype), offload:
            v = stage.velocity(x, torch.full((micro * k,), 0.5, device="meta"), cond, sampling.guidance_scale)
            v.float().square().mean().backward()
        backend.optimizer.step()

    weights = module_bytes(module)
    group = sequence_parallel_group(module, seq_parallel) if seq_parallel > 1 else contextlib.nullcontext()
    with group, meta_answers_yes():
        if fsdp is not None and fsdp.activation_checkpointing:
            checkpoint_blocks(module, fsdp.block_classes)
        measured = _phases(train_step, rollout, backend)
    optimizer_state, rollout_extra, train_extra = measured
    for p in backend.params:
        p.grad = None


    latent_bytes = 4 * math.prod(latent)
    sde_steps = len(sampling.resolve_sde_indices(0))
    with torch.no_grad():
        cond_one = encode(stage, prompts[:1], sampling.guidance_scale, sampling.max_sequence_length)
    media = 3 * sampling.height * sampling.width * int(bundle.model_info().get("num_frames", 1) or 1)
    store = per_rank * ((sde_steps + 1) * latent_bytes + nbytes(iter(cond_one.values())) + media)
    kept = 0
    if cfg.rollout.get("keep_graph"):
        pairs = per_rank * sde_steps
        cap = cfg.rollout.get("keep_graph_max_pairs")
        pairs = min(pairs, int(cap)) if cap else pairs
        kept = (train_extra - trainable) * pairs // (micro * k)  # activations per (sample, step) pair

    gathered = 0
    if devices > 1:
        shard = devices // ParallelConfig.of(train.get("parallel")).replicate  # HSDP: within a replica group
        size = torch.empty((), dtype=getattr(torch, fsdp.param_dtype)).element_size()
        blocks = [m for m in denoiser.modules() if type(m).__name__ in set(fsdp.block_classes)]
        gathered = 2 * size * max((sum(p.numel() for p in b.parameters()) for b in blocks), default=0)
        train_extra -= trainable - trainable // shard  # gradients are sharded too
        weights //= shard
        optimizer_state //= shard
        if fsdp.offload_params:  # shards, their gradients, AdamW and copies of them: in host memory
            train_extra -= trainable // shard
            weights = optimizer_state = copies = 0
    return MemoryPlan(
        recipe=str(cfg.get("output_dir", "")),
        devices=devices,
        micro_batch=micro,
        steps_per_forward=k,
        forward_batch=forward_batch,
        module=weights,
        gathered=gathered,
        frozen=frozen,
        trainable=trainable,
        optimizer=optimizer_state,
        copies=copies,
        store=store,
        kept=kept,
        rollout_extra=rollout_extra,
        train_extra=train_extra,
    )


def conditions(stage: Any, cfg: DictConfig, sampling: Any) -> dict:
    """What an edit or image-to-video family encodes from a prompt row besides its prompt
    (`FlowMatchingStage.encode_conditions`: reference latents, a first frame's latents and mask),
    for the recipe's first row, as [1, ...] meta tensors (the VAE runs on the meta device); {} for
    a family conditioned on text alone. A family whose prompt encoder reads the references
    (`prompt_reads_conditions`) is planned with its text-only prompt encoding."""
    from unirl.types.rollout_req import RolloutReq

    if getattr(stage.bundle, "encode_conditions", None) is None:
        return {}
    examples = list(getattr(_build(cfg.data_source), "examples", []))[:1]
    if not examples:
        return {}
    one = dataclasses.replace(sampling, samples_per_prompt=1)
    req = RolloutReq.from_prompts(examples, one, torch.linspace(1, 0, one.num_steps + 1), 0)
    with torch.no_grad(), meta_answers_yes():
        cond = stage.encode_conditions(req)
    return {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in cond.items()}


def encode(stage: Any, prompts: list[str], guidance_scale: float, max_sequence_length: int) -> dict:
    """`stage.encode_prompts` as meta tensors: on the meta device (`meta_answers_yes`), or, for a
    text encoder whose code needs its data there too (Qwen-Image's splits prompts by their mask's
    lengths), on the CPU after the text encoders are given empty CPU storage (`to_empty`; their
    outputs are then meta tensors of the shapes and dtypes the CPU computed)."""
    encoders = stage.bundle.text_encoders()
    if all(p.is_meta for m in encoders for p in m.parameters()):
        try:
            with meta_answers_yes():
                return stage.encode_prompts(prompts, guidance_scale, max_sequence_length)
        except (NotImplementedError, RuntimeError):
            for m in encoders:
                m.to_empty(device="cpu")
    cls = type(stage.bundle)
    own = cls.__dict__.get("device")
    cls.device = property(lambda _: torch.device("cpu"))  # where the family puts its token ids
    try:
        cond = stage.encode_prompts(prompts, guidance_scale, max_sequence_length)
    finally:
        if own is None:
            del cls.device
        else:
            cls.device = own
    return {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in cond.items()}


def _phases(train_step: Any, rollout: Any, backend: Any) -> tuple[int, int, int]:
    """(AdamW's moments, the rollout phase's peak, the train phase's peak): a first train step
    allocates the moments (resident from then on, counted apart), then each phase is measured."""
    train_step()
    for p in backend.params:
        p.grad = None
    optimizer_state = nbytes(
        t for state in backend.optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)
    )
    return optimizer_state, _peak_while(rollout), _peak_while(train_step)


@contextlib.contextmanager
def sequence_parallel_group(module: torch.nn.Module, sp: int) -> Iterator[None]:
    """Plan one rank of a Ulysses group of `sp` (`train.parallel.sp`): a fake process group of `sp`
    ranks in this process (`torch.testing._internal.distributed.fake_pg`: collectives return
    tensors of the right shapes and do nothing) and diffusers' context parallelism on the meta
    module, so each phase holds what one rank of the group holds (its share of the tokens, the
    all-to-all buffers, the gathered output)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from unirl.train.sequence_parallel import enable_ulysses

    if dist.is_initialized():
        raise RuntimeError("the memory planner needs a process without a process group")
    dist.init_process_group("fake", rank=0, world_size=sp, store=FakeStore())
    try:
        enable_ulysses(module, sp, device_type="cpu")
        yield
    finally:
        dist.destroy_process_group()


def _steps_per_forward(stage: Any, sampling: Any, micro: int, latent: tuple[int, ...]) -> int:
    """The SDE steps one replay forward stacks (`stage.steps_per_forward`) for a micro-batch of
    `micro`, capped by the steps a rollout trains."""
    trained = max(1, len(sampling.resolve_sde_indices(0)))
    return min(trained, stage.steps_per_forward(micro, latent))


def largest_micro_batch(cfg: DictConfig, devices: int, device_bytes: int, limit: int) -> int | None:
    """The largest micro-batch (a power of two, at most `limit`) whose plan fits `device_bytes`;
    None if even 1 does not."""
    best, m = None, 1
    while m <= limit:
        if plan_memory(cfg, devices, m).peak > device_bytes:
            break
        best, m = m, m * 2
    return best


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m unirl.plan_memory", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--config-name", required=True, help="a recipe under examples/, e.g. diffusion/tiny_sd3_flowgrpo"
    )
    parser.add_argument(
        "--devices", type=int, default=None, help="data-parallel ranks (default: num_devices)"
    )
    parser.add_argument(
        "--device-gib", type=float, default=None, help="print the largest micro-batch that fits"
    )
    args, overrides = parser.parse_known_args(argv)
    import os

    from hydra import compose, initialize_config_dir

    from unirl.config.validate import ConfigError, validate_recipe

    examples = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
    with initialize_config_dir(config_dir=examples, version_base=None):
        cfg = compose(config_name=args.config_name, overrides=overrides)
    if "tracks" in cfg or "sft" in cfg:
        sys.exit(
            f"error: {args.config_name} is not a single-track recipe: the planner covers diffusion tracks"
        )
    if args.devices is not None and args.devices < 1:
        sys.exit(f"error: --devices must be >= 1, got {args.devices}")
    try:
        validate_recipe(cfg, expect="diffusion", on_this_machine=False)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    plan = plan_memory(cfg, args.devices)
    plan.recipe = args.config_name
    print(plan.table())

    if args.device_gib is not None:
        groups = max(1, plan.devices // sequence_parallel_degree(cfg))
        per_rank = int(cfg.prompts_per_rollout) * int(cfg.sampling.samples_per_prompt) // groups
        best = largest_micro_batch(cfg, plan.devices, int(args.device_gib * GIB), per_rank)
        print(
            f"  largest micro-batch within {args.device_gib:g} GiB: {best if best else 'none (1 does not fit)'}"
        )


if __name__ == "__main__":
    main()
