"""The codec: field kinds, decoding of every shape a backend may hand back, dataclass flatten/unflatten."""

from __future__ import annotations

import pytest
import torch

from unirl.dataplane.codec import FieldSpec, decode_field, flatten, spec_of, to_padded, unflatten
from unirl.types.rollout_resp import RolloutTrack
from unirl.types.segments import LatentSegment, TokenSegment


def make_track(n: int = 4) -> RolloutTrack:
    g = torch.Generator().manual_seed(0)
    seg = LatentSegment(
        latents=torch.randn(n, 3, 2, 4, 4, generator=g).to(torch.bfloat16),
        positions=[1, 2, 5],
        sigmas=torch.linspace(1, 0, 6),
        sde_indices=[1],
        log_probs=torch.randn(n, 1, generator=g),
        eta=0.7,
        guidance_scale=2.0,
    )
    return RolloutTrack(
        name="diffusion",
        sample_ids=[f"s{i}" for i in range(n)],
        group_ids=[f"g{i // 2}" for i in range(n)],
        prompts=[f"a red circle {i}" for i in range(n)],
        metadata=[{"i": i, "tags": ["x"] * i} for i in range(n)],
        segment=seg,
        conditions={
            "prompt_embeds": torch.randn(n, 5, 8, generator=g),
            "pooled": torch.randn(n, 8, generator=g),
        },
        media=torch.randint(0, 255, (n, 3, 4, 4), dtype=torch.uint8, generator=g),
        rollout_id=7,
    )


def make_token_track(n: int = 4) -> RolloutTrack:
    """A text track: jagged prompts, responses and log-probs of different lengths, texts, rewards."""
    g = torch.Generator().manual_seed(3)
    p_len, r_len = [5, 2, 9, 3], [1, 7, 4, 6]
    seg = TokenSegment(
        prompt_ids=[torch.randint(0, 259, (k,), generator=g) for k in p_len[:n]],
        response_ids=[torch.randint(0, 259, (k,), generator=g) for k in r_len[:n]],
        log_probs=[-torch.rand(k, generator=g) for k in r_len[:n]],
        temperature=0.7,
        ref_log_probs=[-torch.rand(k, generator=g) for k in r_len[:n]],
    )
    return RolloutTrack(
        name="text",
        sample_ids=[f"t{i}" for i in range(n)],
        group_ids=[f"g{i // 2}" for i in range(n)],
        prompts=[f"prompt {i}" for i in range(n)],
        metadata=[{"i": i} for i in range(n)],
        segment=seg,
        texts=[f"response {'x' * i}" for i in range(n)],
        rewards=torch.rand(n, generator=g),
        rollout_id=3,
    )


def make_image_track(n: int = 4) -> RolloutTrack:
    """A VLM text track: `make_token_track` plus prompt images per sample (pixel values [N_i, 12],
    grids [k_i, 3]; sample 1 has no image: [0, 12] and [0, 3]; sample 2 has two)."""
    track = make_token_track(n)
    g = torch.Generator().manual_seed(5)
    grids = [[[1, 2, 2]], [], [[1, 4, 2], [1, 2, 2]], [[1, 2, 6]]][:n]
    track.segment.image_grid_thw = [torch.tensor(x, dtype=torch.long).reshape(-1, 3) for x in grids]
    track.segment.pixel_values = [
        torch.randn(int(x.prod(-1).sum()), 12, generator=g) for x in track.segment.image_grid_thw
    ]
    return track


def test_spec_kinds() -> None:
    assert spec_of("a", torch.zeros(3, 4, 5), 3) == FieldSpec("dense", "float32", (4, 5))
    assert spec_of("b", torch.zeros(3, dtype=torch.long), 3) == FieldSpec("dense", "int64", ())
    jag = [torch.zeros(2, 3), torch.zeros(5, 3), torch.zeros(1, 3)]
    assert spec_of("c", jag, 3) == FieldSpec("jagged", "float32", (3,))
    nested = torch.nested.nested_tensor(jag, layout=torch.jagged)
    assert spec_of("c", nested, 3) == FieldSpec("jagged", "float32", (3,))
    assert spec_of("d", ["x", "y", "z"], 3) == FieldSpec("object")


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (
            torch.zeros(2, 4),
            r"field 'f': tensor of shape \[2, 4\] is not per-sample \(expected first dim 3\)",
        ),
        (torch.tensor(1.0), "not per-sample"),
        (["a", "b"], r"field 'f': 2 samples, expected 3"),
        (
            [torch.zeros(2), torch.zeros(2, 1), torch.zeros(1)],
            r"sample 1 is float32\[2, 1\].*differ only in dim 0",
        ),
        ([torch.zeros(2), torch.zeros(2, dtype=torch.long), torch.zeros(1)], "sample 1 is int64"),
        ({"a": 1}, "unsupported type dict"),
    ],
)
def test_bad_fields_name_the_field(value, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        spec_of("f", value, 3)


def test_decode_dense_from_per_sample_forms() -> None:
    x = torch.arange(24.0).reshape(3, 2, 4)
    spec = FieldSpec("dense", "float32", (2, 4))
    assert torch.equal(decode_field(x, spec, "x"), x)
    assert torch.equal(decode_field(list(x.unbind()), spec, "x"), x)
    assert torch.equal(
        decode_field(torch.nested.nested_tensor(list(x.unbind()), layout=torch.jagged), spec, "x"), x
    )
    one_d = torch.arange(3)
    got = decode_field([t.reshape(1) for t in one_d], FieldSpec("dense", "int64", ()), "n")
    assert got.shape == (3,) and torch.equal(got, one_d)  # 1-D fields stay 1-D


def test_decode_jagged_nested_padded_list() -> None:
    parts = [torch.tensor([1, 2, 3]), torch.tensor([4]), torch.tensor([5, 6])]
    spec = FieldSpec("jagged", "int64", ())
    nested = decode_field(parts, spec, "ids")
    assert nested.is_nested and [t.tolist() for t in nested.unbind()] == [[1, 2, 3], [4], [5, 6]]
    padded = decode_field(parts, spec, "ids", jagged="padded")
    assert padded.tolist() == [[1, 2, 3], [4, 0, 0], [5, 6, 0]]
    assert torch.equal(to_padded(nested, -1), torch.tensor([[1, 2, 3], [4, -1, -1], [5, 6, -1]]))
    assert [t.tolist() for t in decode_field(parts, spec, "ids", jagged="list")] == [[1, 2, 3], [4], [5, 6]]
    with pytest.raises(ValueError, match="jagged must be"):
        decode_field(parts, spec, "ids", jagged="ragged")


def test_decode_rejects_wrong_kind() -> None:
    with pytest.raises(TypeError, match="field 'p'.*object field"):
        decode_field(torch.zeros(2), FieldSpec("object"), "p")
    with pytest.raises(TypeError, match="field 'x'.*dense field"):
        decode_field("nope", FieldSpec("dense", "float32", ()), "x")


def test_flatten_unflatten_round_trip() -> None:
    track = make_track()
    fields, skeleton = flatten(track)
    assert sorted(fields) == sorted(
        [
            "sample_ids",
            "group_ids",
            "prompts",
            "metadata",
            "segment.latents",
            "segment.log_probs",
            "conditions.prompt_embeds",
            "conditions.pooled",
            "media",
        ]
    )
    back = unflatten(skeleton, fields)
    assert isinstance(back, RolloutTrack) and isinstance(back.segment, LatentSegment)
    assert back.sample_ids == track.sample_ids and back.metadata == track.metadata
    assert (
        torch.equal(back.segment.latents, track.segment.latents)
        and back.segment.latents.dtype == torch.bfloat16
    )
    assert back.segment.positions == [1, 2, 5] and back.segment.eta == 0.7 and back.rollout_id == 7
    assert back.rewards is None
    assert list(back.conditions) == ["prompt_embeds", "pooled"]


def test_video_track_round_trips_bit_exact() -> None:
    """A video family's track: latents [n, positions, C, f, h, w] and frames [n, F, 3, H, W] come
    back bit for bit through the codec, and through a split and concat (the data-parallel path)."""
    track = make_track()
    g = torch.Generator().manual_seed(1)
    track.segment.latents = torch.randn(4, 3, 4, 3, 2, 2, generator=g)
    track.media = torch.randint(0, 256, (4, 5, 3, 4, 4), dtype=torch.uint8, generator=g)
    back = unflatten(*reversed(flatten(track)))
    assert torch.equal(back.media, track.media) and torch.equal(back.segment.latents, track.segment.latents)
    parts = [unflatten(*reversed(flatten(part))) for part in track.split(2)]
    joined = RolloutTrack.concat(parts)
    assert torch.equal(joined.media, track.media) and joined.media.shape == (4, 5, 3, 4, 4)


def make_audio_video_track(n: int = 4) -> RolloutTrack:
    """An audio-video family's track (LTX-2): frames [n, F, 3, H, W] and soundtracks [n, 2, 68] at
    16 kHz beside them."""
    track = make_track(n)
    g = torch.Generator().manual_seed(2)
    track.media = torch.randint(0, 256, (n, 5, 3, 4, 4), dtype=torch.uint8, generator=g)
    track.audio, track.audio_rate = torch.randn(n, 2, 68, generator=g).tanh(), 16000
    return track


def test_audio_video_track_round_trips_bit_exact() -> None:
    """The soundtracks come back bit for bit with their rate, alone in a partial view (the driver's
    reward fetch) and through a split and concat."""
    track = make_audio_video_track()
    fields, skeleton = flatten(track)
    assert "audio" in fields and skeleton.shared["audio_rate"] == 16000
    view = unflatten(skeleton, {k: fields[k] for k in ("sample_ids", "media", "audio")}, partial=True)
    assert torch.equal(view.audio, track.audio) and view.audio_rate == 16000
    joined = RolloutTrack.concat([unflatten(*reversed(flatten(part))) for part in track.split(2)])
    assert torch.equal(joined.audio, track.audio) and joined.audio_rate == 16000
    assert flatten(make_track())[1].children["audio"] == ("none", None)  # an image track has none


def test_unflatten_partial_view_and_missing_field() -> None:
    fields, skeleton = flatten(make_track())
    view = unflatten(
        skeleton, {k: fields[k] for k in ("sample_ids", "group_ids", "prompts", "media")}, partial=True
    )
    assert view.segment is None and view.conditions == {} and len(view) == 4
    with pytest.raises(KeyError, match="segment.latents"):
        unflatten(skeleton, {k: v for k, v in fields.items() if k != "segment.latents"})


def test_token_track_flattens_to_jagged_fields_and_back() -> None:
    track = make_token_track()
    fields, skeleton = flatten(track)
    assert spec_of("segment.prompt_ids", fields["segment.prompt_ids"], 4).kind == "jagged"
    assert fields["texts"] == track.texts and skeleton.children["segment"][1].shared == {
        "temperature": 0.7,
        "guidance_scale": None,  # a text segment; an image-token segment carries its CFG scale
    }
    jagged = ("segment.prompt_ids", "segment.response_ids", "segment.log_probs", "segment.ref_log_probs")
    nested = {
        k: torch.nested.nested_tensor(v, layout=torch.jagged) if k in jagged else v for k, v in fields.items()
    }
    back = unflatten(skeleton, nested)
    for name in TokenSegment.PER_SAMPLE:  # nested tensors from a transport become lists again
        if getattr(track.segment, name) is None:  # a text-only segment has no images
            assert getattr(back.segment, name) is None
            continue
        assert all(
            torch.equal(a, b)
            for a, b in zip(getattr(back.segment, name), getattr(track.segment, name), strict=True)
        )
