"""The remote reward service's wire schema: JSON, no pickle, one versioned format for both ends.

A score request (`POST /v1/score`) is one JSON object:

    {"schema": "unirl.reward.v1",
     "samples": [{"sample_id": str, "prompt": str,
                  "metadata": {...},                 # all samples or none (JSON object)
                  "image": {"encoding": "png", "data": <base64 of an 8-bit RGB PNG>},
                        or {"encoding": "raw", "dtype": "uint8", "shape": [3, H, W],
                            "data": <base64 of the C-order uint8 bytes>},
                  "text": str,                       # a text sample instead of an image
                  "response_length": int,            # text only; all text samples or none
                  "group_id": str}, ...]}            # the sample's group; all samples or none

Every sample carries exactly one of `image` and `text`, all samples the same one,
and all images one shape. The answer to a good request:

    {"schema": "unirl.reward.v1", "components": {name: [B numbers]}, "weights": {name: float}}

with the unweighted [B] scores of every component in request order (NaN and
Infinity as Python's `json` writes them; a scorer's NaN marks a failed sample) and
the weight of each. Any error answers `{"schema", "error", ...}`; a malformed
sample adds `sample_index`, `sample_id` and `field` (e.g. `image.data`).

Both images encodings decode to exactly the uint8 pixels that were sent, so a
remote score equals the local score of the same request.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from PIL import Image

from unirl.types.reward import RewardRequest, RewardResponse

SCHEMA = "unirl.reward.v1"
IMAGE_ENCODINGS = ("png", "raw")
SAMPLE_FIELDS = ("sample_id", "prompt", "metadata", "image", "text", "response_length", "group_id")


class WireError(ValueError):
    """A request or response that does not follow the schema.

    Attributes:
        sample_index: index of the offending sample in `samples`, or None for the whole body.
        sample_id: that sample's `sample_id` when it has a readable one.
        field: the offending field inside the sample (`image.data`), or a top-level key.
    """

    def __init__(
        self, message: str, sample_index: int | None = None, sample_id: str | None = None, field: str = ""
    ) -> None:
        self.sample_index, self.sample_id, self.field = sample_index, sample_id, field
        where = f"samples[{sample_index}].{field}" if sample_index is not None else field
        named = f" (sample_id {sample_id!r})" if sample_id is not None else ""
        super().__init__(f"{where}{named}: {message}" if where else message)

    def to_json(self) -> dict[str, Any]:
        """The error body the server answers with (status 400)."""
        body: dict[str, Any] = {"schema": SCHEMA, "error": str(self), "field": self.field}
        if self.sample_index is not None:
            body["sample_index"] = self.sample_index
            body["sample_id"] = self.sample_id
        return body


# ---- images ---------------------------------------------------------------------------------


def encode_image(image: torch.Tensor, encoding: str) -> dict[str, Any]:
    """The wire form of one [3, H, W] uint8 image: a PNG (lossless) or its raw bytes."""
    array = np.ascontiguousarray(image.detach().cpu().numpy())
    if encoding == "raw":
        data = base64.b64encode(array.tobytes()).decode("ascii")
        return {"encoding": "raw", "dtype": "uint8", "shape": list(array.shape), "data": data}
    if encoding != "png":
        raise ValueError(f"image encoding must be one of {IMAGE_ENCODINGS}, got {encoding!r}")
    buffer = io.BytesIO()
    # level 1: PNG is lossless at every level; the fastest one keeps encoding off the critical path
    Image.fromarray(array.transpose(1, 2, 0), "RGB").save(buffer, format="PNG", compress_level=1)
    return {"encoding": "png", "data": base64.b64encode(buffer.getvalue()).decode("ascii")}


def _b64(value: Any, fail) -> bytes:
    if not isinstance(value, str):
        raise fail("data", f"must be a base64 string, got {type(value).__name__}")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as e:
        raise fail("data", f"invalid base64 ({e})") from None


def decode_image(node: Any, fail, max_pixels: int) -> torch.Tensor:
    """[3, H, W] uint8 from the wire form; `fail(field, message)` builds the error to raise."""
    if not isinstance(node, dict):
        raise fail("", f"must be an object with encoding and data, got {type(node).__name__}")
    encoding = node.get("encoding")
    if encoding not in IMAGE_ENCODINGS:
        raise fail("encoding", f"must be one of {list(IMAGE_ENCODINGS)}, got {encoding!r}")
    allowed = {"encoding", "data"} | ({"dtype", "shape"} if encoding == "raw" else set())
    unknown = sorted(set(node) - allowed)
    if unknown:
        raise fail(unknown[0], f"unknown field for a {encoding} image; expected {sorted(allowed)}")
    if "data" not in node:
        raise fail("data", "missing")
    if encoding == "raw":
        if node.get("dtype") != "uint8":
            raise fail("dtype", f"must be 'uint8' (RGB pixels 0-255), got {node.get('dtype')!r}")
        shape = node.get("shape")
        if (
            not isinstance(shape, list)
            or len(shape) != 3
            or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in shape)
            or shape[0] != 3
        ):
            raise fail("shape", f"must be [3, H, W] with H, W >= 1, got {shape!r}")
        if shape[1] * shape[2] > max_pixels:
            raise fail("shape", f"{shape[1]}x{shape[2]} exceeds the server's {max_pixels} pixels per image")
        data = _b64(node["data"], fail)
        if len(data) != 3 * shape[1] * shape[2]:
            raise fail("data", f"holds {len(data)} bytes, shape {shape} needs {3 * shape[1] * shape[2]}")
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(*shape)
    data = _b64(node["data"], fail)
    try:
        with Image.open(io.BytesIO(data)) as im:
            if im.format != "PNG":
                raise fail("data", f"must be a PNG, got {im.format}")
            rawmode = im.tile[0][3] if im.tile else None  # "RGB;16B" for 16 bits per channel
            if im.mode != "RGB" or rawmode != "RGB":
                raise fail("data", f"must be an 8-bit RGB PNG, got mode {im.mode} ({rawmode})")
            if im.width * im.height > max_pixels:  # read from the header, before decoding
                raise fail(
                    "data", f"{im.height}x{im.width} exceeds the server's {max_pixels} pixels per image"
                )
            array = np.asarray(im)
    except WireError:
        raise
    except Exception as e:  # noqa: BLE001 - PIL raises many types for a corrupt file
        raise fail("data", f"not a readable PNG ({type(e).__name__}: {e})") from None
    return torch.from_numpy(array.transpose(2, 0, 1).copy())


# ---- requests -------------------------------------------------------------------------------


def encode_request(req: RewardRequest, image_encoding: str = "png") -> dict[str, Any]:
    """The JSON body scoring `req`. Metadata must be JSON (ValueError naming the sample if not);
    videos are not carried (ValueError)."""
    if req.is_video:
        raise ValueError(
            f"the remote reward wire (unirl.reward.v1) carries images and texts, not videos "
            f"{list(req.images.shape)}: score videos with a LocalRewardBackend"
        )
    samples = []
    for i, sid in enumerate(req.sample_ids):
        sample: dict[str, Any] = {"sample_id": sid, "prompt": req.prompts[i]}
        if req.group_ids:
            sample["group_id"] = req.group_ids[i]
        if req.metadata:
            meta = req.metadata[i]
            try:
                json.dumps(meta)
            except (TypeError, ValueError) as e:
                raise ValueError(
                    f"metadata of sample {sid!r} cannot be sent to a remote reward server as JSON "
                    f"({type(e).__name__}: {e}); keep metadata to JSON values (str, number, bool, list, dict)"
                ) from None
            sample["metadata"] = meta
        if req.images is not None:
            sample["image"] = encode_image(req.images[i], image_encoding)
        else:
            sample["text"] = req.texts[i]
            if req.response_lengths is not None:
                sample["response_length"] = req.response_lengths[i]
        samples.append(sample)
    return {"schema": SCHEMA, "samples": samples}


def decode_request(body: Any, max_pixels: int = 4096 * 4096) -> RewardRequest:
    """The `RewardRequest` a JSON body describes; a `WireError` naming the sample and field if malformed.

    Args:
        body: the parsed JSON.
        max_pixels: the largest H x W of one image (checked before a PNG is decoded).
    """
    if not isinstance(body, dict):
        raise WireError(f"the body must be a JSON object, got {type(body).__name__}", field="body")
    if body.get("schema") != SCHEMA:
        raise WireError(
            f"unsupported schema {body.get('schema')!r}; this server speaks {SCHEMA!r}", field="schema"
        )
    unknown = sorted(set(body) - {"schema", "samples"})
    if unknown:
        raise WireError(
            f"unknown top-level key(s) {unknown}; expected ['samples', 'schema']", field=unknown[0]
        )
    samples = body.get("samples")
    if not isinstance(samples, list) or not samples:
        raise WireError("must be a non-empty list of samples", field="samples")

    ids, prompts, metas, images, texts, lengths, groups = [], [], [], [], [], [], []
    first = samples[0] if isinstance(samples[0], dict) else {}
    kind = "image" if "image" in first else "text"
    with_meta, with_lengths, with_groups = (
        "metadata" in first,
        "response_length" in first,
        "group_id" in first,
    )
    for i, sample in enumerate(samples):
        sid = sample.get("sample_id") if isinstance(sample, dict) else None
        sid = sid if isinstance(sid, str) else None

        def fail(field: str, message: str, i=i, sid=sid, prefix: str = "") -> WireError:
            return WireError(message, i, sid, f"{prefix}{field}".rstrip("."))

        if not isinstance(sample, dict):
            raise fail("", f"must be an object, got {type(sample).__name__}")
        unknown = sorted(set(sample) - set(SAMPLE_FIELDS))
        if unknown:
            raise fail(unknown[0], f"unknown field; a sample takes {list(SAMPLE_FIELDS)}")
        for key in ("sample_id", "prompt"):
            if key not in sample:
                raise fail(key, "missing")
            if not isinstance(sample[key], str):
                raise fail(key, f"must be a string, got {type(sample[key]).__name__}")
        if ("image" in sample) == ("text" in sample):
            raise fail("image", "a sample carries exactly one of image and text")
        if kind not in sample:
            what = "an image" if kind == "image" else "a text"
            raise fail(
                kind, f"missing: samples[0] is {what} sample and every sample of a request is the same kind"
            )
        if ("metadata" in sample) != with_meta:
            has = "has it" if with_meta else "has none"
            raise fail("metadata", f"give every sample metadata or none (samples[0] {has})")
        if with_meta and not isinstance(sample["metadata"], dict):
            raise fail("metadata", f"must be a JSON object, got {type(sample['metadata']).__name__}")
        if ("group_id" in sample) != with_groups:
            raise fail("group_id", "give every sample a group_id or none")
        if with_groups:
            if not isinstance(sample["group_id"], str):
                raise fail("group_id", f"must be a string, got {type(sample['group_id']).__name__}")
            groups.append(sample["group_id"])
        ids.append(sample["sample_id"])
        prompts.append(sample["prompt"])
        if with_meta:
            metas.append(sample["metadata"])
        if kind == "image":
            if "response_length" in sample:
                raise fail("response_length", "belongs to text samples")
            image = decode_image(sample["image"], lambda f, m: fail(f, m, prefix="image."), max_pixels)
            if images and image.shape != images[0].shape:
                raise fail(
                    "image",
                    f"is {list(image.shape)} but samples[0] is {list(images[0].shape)}; "
                    "one request carries images of one size",
                )
            images.append(image)
            continue
        if not isinstance(sample["text"], str):
            raise fail("text", f"must be a string, got {type(sample['text']).__name__}")
        texts.append(sample["text"])
        if ("response_length" in sample) != with_lengths:
            raise fail("response_length", "give every text sample a response_length or none")
        if with_lengths:
            n = sample["response_length"]
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise fail("response_length", f"must be an int >= 0, got {n!r}")
            lengths.append(n)
    try:
        return RewardRequest(
            sample_ids=ids,
            prompts=prompts,
            metadata=metas,
            images=torch.stack(images) if images else None,
            texts=texts if kind == "text" else None,
            response_lengths=lengths if with_lengths else None,
            group_ids=groups,
        )
    except ValueError as e:
        raise WireError(str(e), field="samples") from None


# ---- responses ------------------------------------------------------------------------------


def encode_response(resp: RewardResponse, weights: Mapping[str, float]) -> dict[str, Any]:
    """The JSON answer: every component's [B] scores (float32 values, exact in JSON) and the weights."""
    return {
        "schema": SCHEMA,
        "components": {name: scores.to(torch.float32).tolist() for name, scores in resp.components.items()},
        "weights": {name: float(w) for name, w in weights.items()},
    }


def decode_response(body: Any, batch: int) -> tuple[RewardResponse, dict[str, float]]:
    """(response with [B] fp32 components, weights) from an answer; WireError if malformed."""
    if not isinstance(body, dict) or body.get("schema") != SCHEMA:
        got = body.get("schema") if isinstance(body, dict) else type(body).__name__
        raise WireError(f"the answer is not a {SCHEMA} response (schema {got!r})", field="schema")
    components, weights = body.get("components"), body.get("weights")
    if not isinstance(components, dict) or not isinstance(weights, dict):
        raise WireError("the answer needs the objects 'components' and 'weights'", field="components")
    out = {}
    for name, scores in components.items():
        if (
            not isinstance(scores, list)
            or len(scores) != batch
            or not all(isinstance(s, int | float) and not isinstance(s, bool) for s in scores)
        ):
            got = f"{len(scores)} values" if isinstance(scores, list) else type(scores).__name__
            raise WireError(f"component {name!r} must be {batch} numbers, got {got}", field="components")
        out[name] = torch.tensor(scores, dtype=torch.float32)
    parsed = {}
    for name, w in weights.items():
        if isinstance(w, bool) or not isinstance(w, int | float) or not math.isfinite(w):
            raise WireError(f"weight of {name!r} must be a finite number, got {w!r}", field="weights")
        parsed[name] = float(w)
    return RewardResponse(components=out), parsed
