"""What a weight sync moves: names, shapes and dtypes both sides agree on, and the bucket layout.

A `SyncPlan` is built once from the trainer's module, handed (by the driver)
to every engine, and bound there to the engine's own module (`bind`). Both
sides look at parameters through the same canonical names (`canonical_name`),
so wrappers and adapter names on either side do not matter. The layout (which
bytes of which tensor go where in which bucket) is a pure function of the
plan, so nothing but the bytes and two checksums per bucket has to travel per
sync; `plan.digest` lets a receiver refuse a stream built from another plan.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

KINDS = ("full", "lora")
WIRE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# every piece starts at a multiple of this many bytes in its bucket (and buckets hold a multiple of it),
# so a piece can be viewed as any wire dtype and a tensor split between buckets splits between elements
ALIGN = 16
# wrapper segments FSDP1, activation checkpointing and torch.compile put into parameter names
WRAPPER_SEGMENTS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")
PEFT_PREFIX = "base_model.model."  # peft's PeftModel wrapper
# peft adapter names: `<module>.lora_A.<adapter>.weight` and `<module>.lora_embedding_A.<adapter>`
_ADAPTER_MODULE = re.compile(r"\.(lora_A|lora_B|lora_magnitude_vector)\.[^.]+(?=\.)")
_ADAPTER_PARAM = re.compile(r"\.(lora_embedding_A|lora_embedding_B)\.[^.]+$")
_LORA = re.compile(r"\.(lora_A|lora_B|lora_embedding_A|lora_embedding_B|lora_magnitude_vector)(\.|$)")


class WeightSyncError(RuntimeError):
    """A weight sync cannot run or did not arrive intact; the message names the tensors or buckets."""


Rename = tuple[tuple[str, str], ...]


def canonical_name(name: str, rename: Rename = ()) -> str:
    """The name both sides of a sync use for a parameter.

    Drops wrapper segments (`_fsdp_wrapped_module.`, `_checkpoint_wrapped_module.`,
    `_orig_mod.`), a leading `base_model.model.` (peft's `PeftModel`) and peft
    adapter names (`to_q.lora_A.default.weight` -> `to_q.lora_A.weight`), then
    applies each `(regex, replacement)` of `rename` in order (`re.sub`).
    Idempotent when `rename` is.
    """
    for segment in WRAPPER_SEGMENTS:
        name = name.replace(segment, "")
    if name.startswith(PEFT_PREFIX):
        name = name[len(PEFT_PREFIX) :]
    name = _ADAPTER_PARAM.sub(r".\1", _ADAPTER_MODULE.sub(r".\1", name))
    for pattern, replacement in rename:
        name = re.sub(pattern, replacement, name)
    return name


def is_lora_name(name: str) -> bool:
    """True for a (canonical) peft LoRA / DoRA parameter name."""
    return _LORA.search(name) is not None


def lora_module_of(name: str) -> str:
    """`a.b.to_q.lora_A.weight` -> `a.b.to_q`: the module a LoRA parameter adapts."""
    match = _LORA.search(name)
    return name[: match.start()] if match else name


def _listing(names: Iterable[str], limit: int = 8) -> str:
    names = list(names)
    head = ", ".join(names[:limit])
    return head + (f", ... ({len(names)} in all)" if len(names) > limit else "")


def select(
    named_tensors: Iterable[tuple[str, torch.Tensor]], kind: str, rename: Rename = ()
) -> dict[str, torch.Tensor]:
    """{canonical name: tensor} of the tensors a `kind` payload carries: every one for "full",
    the LoRA parameters for "lora". Two names that become one canonical name are an error
    (e.g. two LoRA adapters on one module: which one to sync is ambiguous)."""
    out: dict[str, torch.Tensor] = {}
    source: dict[str, str] = {}
    for name, tensor in named_tensors:
        canon = canonical_name(name, rename)
        if kind == "lora" and not is_lora_name(canon):
            continue
        if canon in out:
            raise WeightSyncError(
                f"parameters {source[canon]!r} and {name!r} both map to {canon!r}: keep one LoRA adapter "
                "per module, or add a weight_sync.rename rule that tells them apart"
            )
        out[canon], source[canon] = tensor, name
    return out


def lora_scalings(module: torch.nn.Module, rename: Rename = ()) -> dict[str, float]:
    """{canonical module name: scaling} of every peft LoRA layer of `module` with one adapter.
    The scaling (alpha / rank) multiplies B @ A: equal weights with another scaling sample differently."""
    out: dict[str, float] = {}
    for name, sub in module.named_modules():
        scaling = getattr(sub, "scaling", None)
        if isinstance(scaling, dict) and len(scaling) == 1 and hasattr(sub, "lora_A"):
            # canonicalize as one of its parameters would be, then take the module part back
            out[lora_module_of(canonical_name(name + ".lora_A.x.weight", rename))] = float(
                next(iter(scaling.values()))
            )
    return out


def lora_targets(module: torch.nn.Module) -> tuple[str, ...]:
    """The `target_modules` of the module's peft adapter config(s), or ()."""
    configs = getattr(module, "peft_config", None) or {}
    targets: set[str] = set()
    for cfg in configs.values():
        t = getattr(cfg, "target_modules", None)
        targets.update([t] if isinstance(t, str) else (t or ()))
    return tuple(sorted(targets))


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the payload: canonical name, shape, and the dtype it has on both sides."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


class Piece(NamedTuple):
    """Elements `[start, start + count)` of flat tensor `tensor` (its index in the plan), stored
    at byte `offset` of a bucket in the tensor's wire dtype."""

    tensor: int
    start: int
    count: int
    offset: int


@dataclass(frozen=True)
class SyncPlan:
    """The agreement between a trainer (sender) and its engines (receivers).

    Attributes:
        kind: "full" (every parameter) or "lora" (the peft LoRA parameters only).
        tensors: the payload, in wire order.
        wire_dtype: floating tensors travel in this dtype and are cast back to
            their own on arrival (None: each in its own dtype, bit-exact).
            Non-floating tensors always travel as they are.
        bucket_bytes: capacity of one bucket (a positive multiple of `ALIGN`).
            Tensors are packed in order; one that does not fit is split between
            buckets at an element boundary, so no bucket exceeds the capacity.
        rename: extra `(regex, replacement)` rules of `canonical_name`, applied on both sides.
        lora_scaling: {canonical module: alpha / rank} of the sender's LoRA layers
            (checked against the receiver's in `bind`).
        lora_targets: the sender's LoRA `target_modules` (for error messages).

    Derived: `buckets` (the pieces of each bucket, in order), `bucket_sizes`
    (bytes each bucket carries, a multiple of ALIGN), `digest` (an int64 of
    the layout; equal plans give equal digests).
    """

    kind: str
    tensors: tuple[TensorSpec, ...]
    wire_dtype: torch.dtype | None
    bucket_bytes: int
    rename: Rename = ()
    lora_scaling: Mapping[str, float] = field(default_factory=dict)
    lora_targets: tuple[str, ...] = ()
    buckets: tuple[tuple[Piece, ...], ...] = field(init=False)
    bucket_sizes: tuple[int, ...] = field(init=False)
    digest: int = field(init=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise WeightSyncError(f"sync plan kind must be one of {KINDS}, got {self.kind!r}")
        if self.wire_dtype is not None and self.wire_dtype not in WIRE_DTYPES.values():
            raise WeightSyncError(
                f"wire dtype must be one of {sorted(WIRE_DTYPES)} or None, got {self.wire_dtype}"
            )
        if self.bucket_bytes < ALIGN or self.bucket_bytes % ALIGN:
            raise WeightSyncError(
                f"bucket_bytes must be a positive multiple of {ALIGN}, got {self.bucket_bytes}"
            )
        if not self.tensors:
            raise WeightSyncError(f"an empty {self.kind} sync plan: the sender's module has nothing to sync")
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            raise WeightSyncError(
                "sync plan names repeat: " + _listing(sorted({n for n in names if names.count(n) > 1}))
            )
        buckets, sizes = self._layout()
        object.__setattr__(self, "buckets", buckets)
        object.__setattr__(self, "bucket_sizes", sizes)
        key = repr(
            (
                self.kind,
                [(t.name, t.shape, str(t.dtype)) for t in self.tensors],
                str(self.wire_dtype),
                self.bucket_bytes,
            )
        )
        object.__setattr__(
            self, "digest", int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little", signed=True)
        )

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def for_module(
        cls,
        module: torch.nn.Module,
        kind: str,
        *,
        wire_dtype: torch.dtype | None = None,
        bucket_bytes: int = 64 << 20,
        rename: Rename = (),
    ) -> SyncPlan:
        """The plan of `module`'s parameters (the trainer's module; DTensors count with their
        global shape). A "lora" plan of a module with no LoRA parameters is an error."""
        rename = tuple(tuple(r) for r in rename)
        if kind not in KINDS:
            raise WeightSyncError(f"sync plan kind must be one of {KINDS}, got {kind!r}")
        found = select(module.named_parameters(), kind, rename)
        if kind == "lora" and not found:
            raise WeightSyncError(
                f"a lora sync plan of {type(module).__name__}, which has no LoRA parameters: "
                "inject the adapter first (train.lora), or sync kind 'full'"
            )
        specs = tuple(TensorSpec(n, tuple(t.shape), t.dtype) for n, t in found.items())
        return cls(
            kind,
            specs,
            wire_dtype,
            bucket_bytes,
            rename,
            lora_scalings(module, rename) if kind == "lora" else {},
            lora_targets(module) if kind == "lora" else (),
        )

    def _layout(self) -> tuple[tuple[tuple[Piece, ...], ...], tuple[int, ...]]:
        buckets: list[tuple[Piece, ...]] = []
        sizes: list[int] = []
        pieces: list[Piece] = []
        offset = 0
        for index, spec in enumerate(self.tensors):
            size = self.wire_of(index).itemsize
            done = 0
            while done < spec.numel:
                if offset == self.bucket_bytes:
                    buckets.append(tuple(pieces))
                    sizes.append(offset)
                    pieces, offset = [], 0
                count = min(spec.numel - done, (self.bucket_bytes - offset) // size)
                pieces.append(Piece(index, done, count, offset))
                done += count
                offset = -(-(offset + count * size) // ALIGN) * ALIGN
        if pieces:
            buckets.append(tuple(pieces))
            sizes.append(offset)
        return tuple(buckets), tuple(sizes)

    # ---- queries ------------------------------------------------------------------------------
    def wire_of(self, index: int) -> torch.dtype:
        """The dtype tensor `index` travels in."""
        dtype = self.tensors[index].dtype
        return self.wire_dtype if self.wire_dtype is not None and dtype.is_floating_point else dtype

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.tensors]

    @property
    def nbytes(self) -> int:
        """Bytes of the payload in the tensors' own dtypes."""
        return sum(t.numel * t.dtype.itemsize for t in self.tensors)

    @property
    def wire_nbytes(self) -> int:
        """Bytes on the wire (bucket payloads, alignment padding included)."""
        return sum(self.bucket_sizes)

    @property
    def pieces(self) -> list[Piece]:
        """Every piece of every bucket, bucket after bucket: the rows of verify's checksums."""
        return [piece for bucket in self.buckets for piece in bucket]

    def bucket_tensors(self, bucket: int) -> list[str]:
        """Names of the tensors with bytes in `bucket`."""
        return list(dict.fromkeys(self.tensors[p.tensor].name for p in self.buckets[bucket]))

    def mismatches(self, found: Mapping[str, torch.Tensor], side: str) -> list[str]:
        """Problems of `found` ({canonical name: tensor}, one side's tensors) against the plan:
        missing and extra names, shape and dtype mismatches. `side` names that side in messages."""
        specs = {t.name: t for t in self.tensors}
        problems = []
        missing = [n for n in specs if n not in found]
        extra = [n for n in found if n not in specs]
        if missing:
            problems.append(f"{len(missing)} planned tensor(s) missing on the {side}: {_listing(missing)}")
        if extra:
            problems.append(
                f"{len(extra)} {self.kind} tensor(s) of the {side} not in the plan: {_listing(extra)}"
            )
        for name, tensor in found.items():
            spec = specs.get(name)
            if spec is None:
                continue
            if tuple(tensor.shape) != spec.shape:
                problems.append(f"{name}: shape {list(tensor.shape)} on the {side}, plan {list(spec.shape)}")
            if tensor.dtype != spec.dtype:
                problems.append(f"{name}: dtype {tensor.dtype} on the {side}, plan {spec.dtype}")
        return problems


def bind(module: torch.nn.Module, plan: SyncPlan) -> dict[str, torch.Tensor]:
    """{canonical name: parameter data} of the receiver's `module` that a sync with `plan` writes
    into (plan order). Writing into these tensors updates the module's parameters in place.

    Raises:
        WeightSyncError: a lora plan binds none of the module's LoRA parameters (naming the
            plan's target modules and the module's LoRA modules); names missing or extra on the
            module; shape, dtype or LoRA scaling mismatches; a sharded (DTensor) or
            non-contiguous parameter. Every problem is listed.
    """
    found = select(module.named_parameters(), plan.kind, plan.rename)
    if plan.kind == "lora" and not set(found) & set(plan.names):
        planned = sorted({lora_module_of(n) for n in plan.names})
        have = sorted({lora_module_of(n) for n in found})
        raise WeightSyncError(
            f"the LoRA sync would bind zero modules of the engine's {type(module).__name__}: the trainer's "
            f"adapter targets {list(plan.lora_targets) or 'modules'} ({len(planned)} modules, e.g. "
            f"{_listing(planned, 3)}); the engine's LoRA modules: {_listing(have, 3) if have else 'none'} "
            f"(targets {list(lora_targets(module))}). Inject the same LoRA config (target_modules, rank) "
            "into the engine's module, or fix weight_sync.rename"
        )
    problems = plan.mismatches(found, "engine")
    for name, tensor in found.items():
        if hasattr(tensor, "full_tensor"):
            problems.append(
                f"{name}: the engine's parameter is sharded (DTensor); engines hold whole weights"
            )
        elif not tensor.is_contiguous():
            problems.append(f"{name}: the engine's parameter is not contiguous")
    theirs = lora_scalings(module, plan.rename)
    for mod, scaling in plan.lora_scaling.items():
        if mod in theirs and theirs[mod] != scaling:
            problems.append(
                f"{mod}: LoRA scaling (alpha / rank) {theirs[mod]} on the engine, {scaling} on the trainer"
            )
    if problems:
        raise WeightSyncError(
            f"the {plan.kind} sync plan does not fit the engine's {type(module).__name__}:\n  "
            + "\n  ".join(problems)
        )
    return {name: found[name].detach() for name in plan.names}
