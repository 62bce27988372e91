"""One codec for every transport: batch dataclasses <-> named per-sample fields.

A batch dataclass (`RolloutTrack`, `LatentSegment`, ...; see
`unirl.types.batch`) is flattened into *fields*, each a per-sample column keyed
by a dotted name (``segment.latents``, ``conditions.prompt_embeds``,
``prompts``), plus a small picklable `Skeleton` holding the type, the shared
(non-per-sample) values and where each field goes back. Field kinds:

- ``dense``: a tensor [B, ...]; comes back as the same dense tensor.
- ``jagged``: one tensor per sample whose first dim varies (token ids,
  variable-length trajectories). Given as a list of tensors or a jagged
  ``torch.nested`` tensor; comes back as a jagged nested tensor
  ([B, j, ...]), as padded on request (`to_padded`), or as a list.
- ``object``: one picklable Python value per sample (strings, metadata
  dicts); comes back as a list.

Backends store and return exactly these three kinds (dense tensor, list of
per-sample tensors, list of objects); `decode_field` turns whatever a backend
hands back into the canonical form, so every transport returns the same thing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

KINDS = ("dense", "jagged", "object")


@dataclass(frozen=True)
class FieldSpec:
    """Schema of one field.

    Attributes:
        kind: "dense", "jagged" or "object".
        dtype: torch dtype name ("float32", ...) for tensor kinds, None for objects.
        shape: per-sample shape for dense fields; for jagged fields the
            trailing shape after the ragged first dim; () for objects.
    """

    kind: str
    dtype: str | None = None
    shape: tuple[int, ...] = ()

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, str(self.dtype))


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def as_jagged_list(value: Any) -> list[torch.Tensor] | None:
    """The per-sample tensors of a jagged value (nested tensor or list of tensors), else None."""
    if isinstance(value, torch.Tensor) and value.is_nested:
        return list(value.unbind())
    if isinstance(value, list) and value and all(isinstance(v, torch.Tensor) for v in value):
        return value
    return None


def spec_of(name: str, value: Any, batch_size: int) -> FieldSpec:
    """The `FieldSpec` of per-sample `value`; raises ValueError naming `name` if it is not one."""
    jag = as_jagged_list(value)
    if jag is not None:
        if len(jag) != batch_size:
            raise ValueError(f"field {name!r}: {len(jag)} samples, expected {batch_size}")
        first = jag[0]
        if first.dim() == 0:
            raise ValueError(f"field {name!r}: jagged samples must have at least 1 dim, got scalars")
        for i, t in enumerate(jag):
            if t.dtype != first.dtype or tuple(t.shape[1:]) != tuple(first.shape[1:]):
                raise ValueError(
                    f"field {name!r}: sample {i} is {_dtype_name(t)}{list(t.shape)} but sample 0 is "
                    f"{_dtype_name(first)}{list(first.shape)}; jagged samples may differ only in dim 0"
                )
        return FieldSpec("jagged", _dtype_name(first), tuple(first.shape[1:]))
    if isinstance(value, torch.Tensor):
        if value.dim() == 0 or value.shape[0] != batch_size:
            raise ValueError(
                f"field {name!r}: tensor of shape {list(value.shape)} is not per-sample "
                f"(expected first dim {batch_size})"
            )
        return FieldSpec("dense", _dtype_name(value), tuple(value.shape[1:]))
    if isinstance(value, list):
        if len(value) != batch_size:
            raise ValueError(f"field {name!r}: {len(value)} samples, expected {batch_size}")
        return FieldSpec("object")
    raise ValueError(
        f"field {name!r}: unsupported type {type(value).__name__} (expected a [B, ...] tensor, "
        "a list of per-sample tensors, a nested tensor or a list of objects)"
    )


def encode_field(value: Any, spec: FieldSpec) -> Any:
    """Canonical wire value: dense -> contiguous host tensor, jagged -> list of those, object -> list."""
    if spec.kind == "dense":
        return value.detach().cpu().contiguous()
    if spec.kind == "jagged":
        return [t.detach().cpu().contiguous() for t in as_jagged_list(value)]
    return list(value)


def decode_field(
    value: Any, spec: FieldSpec, name: str, jagged: str = "nested", device: torch.device | None = None
) -> Any:
    """Canonical value of a field from what a backend returned, on `device` (None: where it is).

    dense: a [B, ...] tensor (a backend may hand back a per-sample list or a
    nested tensor of equal shapes; they are stacked). jagged: a jagged nested
    tensor (`jagged="nested"`), a zero-padded dense tensor ("padded") or a
    list of tensors ("list"). object: a list.
    """
    if spec.kind == "object":
        if isinstance(value, (list, tuple)):
            return list(value)
        raise TypeError(f"field {name!r}: backend returned {type(value).__name__} for an object field")
    parts = as_jagged_list(value)
    if spec.kind == "dense":
        t = torch.stack(parts) if parts is not None else value
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"field {name!r}: backend returned {type(value).__name__} for a dense field")
        return t.reshape(t.shape[0], *spec.shape).to(device=device, dtype=spec.torch_dtype)
    if parts is None:
        raise TypeError(f"field {name!r}: backend returned {type(value).__name__} for a jagged field")
    parts = [p.reshape(-1, *spec.shape).to(device=device, dtype=spec.torch_dtype) for p in parts]
    if jagged == "list":
        return parts
    if jagged == "padded":
        return to_padded(parts)
    if jagged == "nested":
        return torch.nested.nested_tensor(parts, layout=torch.jagged)
    raise ValueError(f"jagged must be 'nested', 'padded' or 'list', got {jagged!r}")


def to_padded(value: Any, padding: float = 0.0) -> torch.Tensor:
    """[B, max_len, ...] padded tensor of a jagged field (nested tensor or list of tensors)."""
    parts = as_jagged_list(value)
    if parts is None:
        raise TypeError(f"to_padded takes a nested tensor or a list of tensors, got {type(value).__name__}")
    return torch.nn.utils.rnn.pad_sequence(parts, batch_first=True, padding_value=padding)


def nbytes(value: Any) -> int:
    """Tensor bytes of a wire value (objects count as 0: they are small by contract)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, list):
        return sum(nbytes(v) for v in value if isinstance(v, torch.Tensor))
    return 0


# ---------------------------------------------------------------- batch dataclasses


@dataclass
class Skeleton:
    """Everything of a batch dataclass except its per-sample columns (small, picklable).

    Attributes:
        cls: the dataclass type.
        shared: values of the non-per-sample fields.
        children: per-sample field name -> ("field", dotted field name) |
            ("dict", {key: dotted field name}) | ("batch", Skeleton) | ("none", None).
    """

    cls: type
    shared: dict[str, Any]
    children: dict[str, tuple[str, Any]] = field(default_factory=dict)


def flatten(obj: Any, prefix: str = "") -> tuple[dict[str, Any], Skeleton]:
    """(fields, skeleton) of batch dataclass `obj`: fields maps dotted names to per-sample values."""
    if not hasattr(obj, "PER_SAMPLE"):
        raise TypeError(f"{type(obj).__name__} is not a batch dataclass (no PER_SAMPLE)")
    per_sample = set(obj.PER_SAMPLE)
    shared = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if f.name not in per_sample}
    fields: dict[str, Any] = {}
    children: dict[str, tuple[str, Any]] = {}
    for name in obj.PER_SAMPLE:
        value, path = getattr(obj, name), f"{prefix}{name}"
        if value is None:
            children[name] = ("none", None)
        elif hasattr(value, "PER_SAMPLE"):
            sub_fields, sub = flatten(value, f"{path}.")
            fields.update(sub_fields)
            children[name] = ("batch", sub)
        elif isinstance(value, dict):
            keys = {}
            for key, v in value.items():
                fields[f"{path}.{key}"] = v
                keys[key] = f"{path}.{key}"
            children[name] = ("dict", keys)
        else:
            fields[path] = value
            children[name] = ("field", path)
    return fields, Skeleton(type(obj), shared, children)


def _fetched(skeleton: Skeleton, fields: dict[str, Any]) -> str | None:
    """Which per-sample fields of the (nested) batch `skeleton` are in `fields`: "all" (also when
    it has none), "some" or None."""
    found: list[str | None] = []
    for how, where in skeleton.children.values():
        if how == "field":
            found.append("all" if where in fields else None)
        elif how == "dict":
            found.extend("all" if f in fields else None for f in where.values())
        elif how == "batch":
            found.append(_fetched(where, fields))
    if all(f == "all" for f in found):
        return "all"
    return "some" if any(found) else None


def unflatten(skeleton: Skeleton, fields: dict[str, Any], partial: bool = False) -> Any:
    """Rebuild the batch dataclass from `fields` (decoded values) and its skeleton.

    With `partial`, per-sample fields missing from `fields` are left None and the
    dataclass is built without running its validation (a driver-side view holding
    only what it fetched); a nested batch none of whose fields was fetched is None,
    one with some of them a partial view too (``segment.values`` alone gives a
    segment holding only its values). Otherwise a missing field raises KeyError.
    """
    kwargs = dict(skeleton.shared)
    for name, (how, where) in skeleton.children.items():
        if how == "none":
            kwargs[name] = None
        elif how == "field":
            if where not in fields and not partial:
                raise KeyError(f"field {where!r} was not fetched")
            kwargs[name] = fields.get(where)
        elif how == "dict":
            kwargs[name] = {k: fields[f] for k, f in where.items() if f in fields or not partial}
        elif partial:
            fetched = _fetched(where, fields)
            kwargs[name] = unflatten(where, fields, partial=fetched != "all") if fetched else None
        else:
            kwargs[name] = unflatten(where, fields)
    if partial:
        obj = object.__new__(skeleton.cls)
        obj.__dict__.update(kwargs)
        return obj
    return skeleton.cls(**kwargs)
