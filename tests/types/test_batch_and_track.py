"""Per-sample split/concat of tracks and requests, request expansion, segment validation."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from typing import Any

import pytest
import torch

from unirl.types import (
    DiffusionSamplingParams,
    LatentSegment,
    PromptExample,
    RolloutReq,
    RolloutTrack,
    TokenSegment,
)

B = 8
T = 4
C, H, W = 2, 3, 3
SDE = [1, 2]
POSITIONS = [1, 2, 3, 4]


def _sigmas(num_steps: int = T) -> torch.Tensor:
    return torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float32)


def make_latent_segment(batch: int = B) -> LatentSegment:
    g = torch.Generator().manual_seed(0)
    return LatentSegment(
        latents=torch.randn(batch, len(POSITIONS), C, H, W, generator=g).to(torch.bfloat16),
        positions=list(POSITIONS),
        sigmas=_sigmas(),
        sde_indices=list(SDE),
        log_probs=torch.randn(batch, len(SDE), generator=g),
        eta=0.7,
        guidance_scale=4.5,
    )


def make_track(batch: int = B) -> RolloutTrack:
    g = torch.Generator().manual_seed(1)
    return RolloutTrack(
        name="diffusion",
        sample_ids=[f"s{i}" for i in range(batch)],
        group_ids=[f"g{i // 2}" for i in range(batch)],
        prompts=[f"prompt {i // 2}" for i in range(batch)],
        metadata=[{"idx": i, "tags": [i, i + 1]} for i in range(batch)],
        segment=make_latent_segment(batch),
        conditions={
            "prompt_embeds": torch.randn(batch, 5, 6, generator=g),
            "pooled": torch.randn(batch, 6, generator=g),
        },
        media=torch.randint(0, 256, (batch, 3, 4, 4), generator=g, dtype=torch.int64).to(torch.uint8),
        rewards=torch.arange(batch, dtype=torch.float32) * 0.5,
        reward_components={"brightness": torch.rand(batch, generator=g)},
        advantages=None,
        parent_ids=[f"p{i}" for i in range(batch)],
        rollout_id=3,
    )


def assert_same(a: Any, b: Any, path: str = "") -> None:
    """Deep equality: tensors equal in value and dtype, lists/dicts/dataclasses field by field."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype, f"{path}: dtype {a.dtype} != {b.dtype}"
        assert a.shape == b.shape, f"{path}: shape {tuple(a.shape)} != {tuple(b.shape)}"
        assert torch.equal(a, b), f"{path}: tensor values differ"
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}")
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, list):
        assert len(a) == len(b), f"{path}: len {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


# ---------------------------------------------------------------- RolloutTrack


def test_assert_same_detects_differences() -> None:
    """The comparison helper itself must catch a one-element change."""
    a, b = make_track(), make_track()
    assert_same(a, b)
    b.segment.latents[3, 1, 0, 0, 0] += 1
    with pytest.raises(AssertionError, match="segment.latents"):
        assert_same(a, b)


@pytest.mark.parametrize("parts", [1, 2, 4, 8])
def test_track_split_then_concat_is_identity(parts: int) -> None:
    track = make_track()
    shards = track.split(parts)
    assert len(shards) == parts
    assert [len(s) for s in shards] == [B // parts] * parts
    assert_same(RolloutTrack.concat(shards), track)


@pytest.mark.parametrize("parts", [2, 4])
def test_track_split_shards_hold_contiguous_slices(parts: int) -> None:
    track = make_track()
    size = B // parts
    for r, shard in enumerate(track.split(parts)):
        lo, hi = r * size, (r + 1) * size
        assert shard.sample_ids == track.sample_ids[lo:hi]
        assert shard.group_ids == track.group_ids[lo:hi]
        assert shard.prompts == track.prompts[lo:hi]
        assert shard.metadata == track.metadata[lo:hi]
        assert shard.parent_ids == track.parent_ids[lo:hi]
        assert torch.equal(shard.segment.latents, track.segment.latents[lo:hi])
        assert torch.equal(shard.segment.log_probs, track.segment.log_probs[lo:hi])
        for k, v in track.conditions.items():
            assert torch.equal(shard.conditions[k], v[lo:hi])
        assert torch.equal(shard.media, track.media[lo:hi])
        assert torch.equal(shard.rewards, track.rewards[lo:hi])
        assert torch.equal(
            shard.reward_components["brightness"], track.reward_components["brightness"][lo:hi]
        )
        assert shard.advantages is None
        # shared (non per-sample) fields are kept whole
        assert torch.equal(shard.segment.sigmas, track.segment.sigmas)
        assert shard.segment.sigmas.dtype == torch.float32
        assert shard.segment.sde_indices == SDE
        assert shard.segment.positions == POSITIONS
        assert shard.segment.eta == 0.7 and shard.segment.guidance_scale == 4.5
        assert shard.name == "diffusion" and shard.rollout_id == 3
        # a shard is still a valid segment: at() indexes the stored positions
        assert torch.equal(shard.segment.final, track.segment.latents[lo:hi, -1])


def test_track_select_reorders_every_per_sample_field() -> None:
    track = make_track()
    idx = [5, 0, 7]
    sub = track.select(idx)
    assert sub.sample_ids == ["s5", "s0", "s7"]
    assert torch.equal(sub.rewards, torch.tensor([2.5, 0.0, 3.5]))
    assert torch.equal(sub.segment.latents, track.segment.latents[idx])
    assert torch.equal(sub.conditions["pooled"], track.conditions["pooled"][idx])
    assert len(sub) == 3 and len(sub.segment) == 3


def test_track_concat_of_shuffled_shards_follows_part_order() -> None:
    track = make_track()
    a, b = track.split(2)
    swapped = RolloutTrack.concat([b, a])
    assert swapped.sample_ids == track.sample_ids[4:] + track.sample_ids[:4]
    assert torch.equal(
        swapped.segment.latents, torch.cat([track.segment.latents[4:], track.segment.latents[:4]])
    )


def test_track_with_token_segment_round_trips() -> None:
    """Jagged responses split and concatenate by sample; padding and masks follow each sample's length."""
    lengths = [1 + i % 4 for i in range(B)]
    responses = [torch.arange(n) + 10 * i for i, n in enumerate(lengths)]
    seg = TokenSegment(
        prompt_ids=[torch.arange(2 + i % 3) for i in range(B)],
        response_ids=responses,
        log_probs=[-torch.rand(n) for n in lengths],
        temperature=0.7,
    )
    track = RolloutTrack(
        name="ar",
        sample_ids=[str(i) for i in range(B)],
        group_ids=[str(i // 4) for i in range(B)],
        prompts=["p"] * B,
        metadata=[{} for _ in range(B)],
        segment=seg,
        texts=[f"t{i}" for i in range(B)],
    )
    shards = track.split(4)
    assert [r.tolist() for r in shards[2].segment.response_ids] == [r.tolist() for r in responses[4:6]]
    assert shards[2].texts == ["t4", "t5"] and shards[2].segment.temperature == 0.7
    assert shards[2].media is None and shards[2].rewards is None
    back = RolloutTrack.concat(shards)
    assert [r.tolist() for r in back.segment.response_ids] == [r.tolist() for r in responses]
    mask = seg.response_mask()
    assert mask.shape == (B, max(lengths)) and mask.sum(1).tolist() == lengths
    assert seg.response_lengths.tolist() == lengths
    padded = seg.padded("response_ids", -1)
    assert padded[0].tolist() == [0, -1, -1, -1] and padded[3].tolist() == [30, 31, 32, 33]


@pytest.mark.parametrize("parts", [3, 5, 0])
def test_uneven_split_raises_naming_sizes(parts: int) -> None:
    with pytest.raises(ValueError, match=rf"batch of {B} samples does not split evenly over {parts} ranks"):
        make_track().split(parts)


@pytest.mark.parametrize(
    "none_part",
    [0, 1],
)
@pytest.mark.parametrize("field", ["rewards", "parent_ids", "conditions"])
def test_concat_rejects_field_set_in_only_some_parts(none_part: int, field: str) -> None:
    parts = make_track().split(2)
    setattr(parts[none_part], field, None)
    with pytest.raises(ValueError, match="set in some parts and None in others"):
        RolloutTrack.concat(parts)


def test_concat_of_nothing_raises() -> None:
    with pytest.raises(ValueError, match="empty"):
        RolloutTrack.concat([])


# ---------------------------------------------------------------- RolloutReq


def _examples(n: int = 3) -> list[PromptExample]:
    return [PromptExample(prompt=f"a photo of {i}", prompt_id=f"id{i}", metadata={"k": i}) for i in range(n)]


def _request(n_prompts: int = 3, k: int = 4, rollout_id: int = 7, seed: int = 0) -> RolloutReq:
    sampling = DiffusionSamplingParams(num_steps=T, samples_per_prompt=k, seed=seed)
    return RolloutReq.from_prompts(_examples(n_prompts), sampling, _sigmas(), rollout_id)


def test_from_prompts_is_group_major() -> None:
    req = _request(n_prompts=3, k=4)
    assert len(req) == 12
    assert req.prompts == [f"a photo of {g}" for g in range(3) for _ in range(4)]
    assert req.metadata == [{"k": g} for g in range(3) for _ in range(4)]
    # groups contiguous, one id per prompt, ids name the rollout and the prompt id
    assert req.group_ids == [req.group_ids[4 * g] for g in range(3) for _ in range(4)]
    assert len(set(req.group_ids)) == 3
    for g in range(3):
        gid = req.group_ids[4 * g]
        assert "r7" in gid and f"id{g}" in gid
        for s in range(4):
            assert req.sample_ids[4 * g + s].startswith(gid)
    assert len(set(req.sample_ids)) == 12
    assert req.rollout_id == 7
    assert req.sde_indices == req.sampling.resolve_sde_indices(7) == list(range(T))


def test_from_prompts_metadata_is_copied_per_sample() -> None:
    req = _request()
    req.metadata[0]["k"] = "changed"
    assert req.metadata[1] == {"k": 0}


def test_from_prompts_ids_differ_across_rollouts() -> None:
    assert set(_request(rollout_id=1).group_ids).isdisjoint(_request(rollout_id=2).group_ids)


def test_seeds_do_not_depend_on_how_the_request_is_split() -> None:
    req = _request(n_prompts=4, k=4)
    seeds = req.seeds
    assert len(set(seeds)) == len(seeds), "per-sample seeds should be distinct"
    assert all(0 <= s <= 0x7FFF_FFFF for s in seeds)
    idx = [13, 2, 7, 0]
    assert req.select(idx).seeds == [seeds[i] for i in idx]
    for parts in (2, 4, 8):
        shards = req.split(parts)
        assert [s for sh in shards for s in sh.seeds] == seeds
        assert_same(RolloutReq.concat(shards), req)
        for sh in shards:
            assert torch.equal(sh.sigmas, req.sigmas) and sh.sde_indices == req.sde_indices
    # the global sample index fixes a seed: a smaller request is a prefix of a larger one
    assert _request(n_prompts=2, k=4).seeds == seeds[:8]
    assert _request(n_prompts=4, k=4).seeds == seeds  # deterministic
    # but the seeds move with the rollout id and the base seed
    assert _request(n_prompts=4, k=4, rollout_id=8).seeds != seeds
    assert _request(n_prompts=4, k=4, seed=1).seeds != seeds


def test_same_initial_noise_gives_siblings_their_group_first_seed() -> None:
    req = _request(n_prompts=3, k=4)
    assert req.init_seeds == req.seeds  # default: one x_T per sample
    sampling = DiffusionSamplingParams(num_steps=T, samples_per_prompt=4, same_initial_noise=True)
    shared = RolloutReq.from_prompts(_examples(3), sampling, _sigmas(), 7)
    assert shared.seeds == req.seeds  # the SDE noise stays per sample
    assert shared.init_seeds == [req.seeds[4 * g] for g in range(3) for _ in range(4)]
    assert [s for sh in shared.split(4) for s in sh.init_seeds] == shared.init_seeds


def test_seeds_do_not_depend_on_python_hash_seed() -> None:
    """Workers are separate processes: the seeds must not vary with PYTHONHASHSEED (string hashing)."""
    code = (
        "import torch\n"
        "from unirl.types import DiffusionSamplingParams, PromptExample, RolloutReq\n"
        "s = DiffusionSamplingParams(num_steps=2, samples_per_prompt=2, seed=5)\n"
        "ex = [PromptExample(prompt='a', prompt_id='x'), PromptExample(prompt='b', prompt_id='y')]\n"
        "print(RolloutReq.from_prompts(ex, s, torch.linspace(1, 0, 3), 11).seeds)\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    sampling = DiffusionSamplingParams(num_steps=2, samples_per_prompt=2, seed=5)
    ex = [PromptExample(prompt="a", prompt_id="x"), PromptExample(prompt="b", prompt_id="y")]
    here = RolloutReq.from_prompts(ex, sampling, torch.linspace(1, 0, 3), 11).seeds
    assert res.stdout.strip() == str(here)


def test_from_prompts_rejects_non_fp32_sigmas() -> None:
    sampling = DiffusionSamplingParams(num_steps=T)
    with pytest.raises(ValueError, match=r"fp32.*torch\.float64"):
        RolloutReq.from_prompts(_examples(), sampling, _sigmas().double(), 0)
    with pytest.raises(ValueError, match=rf"num_steps\+1={T + 1}.*with {T}"):
        RolloutReq.from_prompts(_examples(), sampling, _sigmas(T - 1), 0)


# ---------------------------------------------------------------- segments


def test_latent_segment_accessors() -> None:
    seg = make_latent_segment()
    assert len(seg) == B and seg.num_steps == T
    assert torch.equal(seg.at(3), seg.latents[:, 2])
    assert torch.equal(seg.final, seg.latents[:, 3])


def test_latent_segment_missing_positions() -> None:
    with pytest.raises(ValueError, match=r"lacks trajectory positions \[3\]"):
        LatentSegment(
            latents=torch.zeros(2, 3, C, H, W),
            positions=[1, 2, 4],
            sigmas=_sigmas(),
            sde_indices=[1, 2],
            log_probs=torch.zeros(2, 2),
            eta=0.7,
            guidance_scale=1.0,
        )


def test_latent_segment_latents_positions_mismatch() -> None:
    with pytest.raises(ValueError, match="holds 3 positions but positions lists 4"):
        LatentSegment(
            latents=torch.zeros(2, 3, C, H, W),
            positions=POSITIONS,
            sigmas=_sigmas(),
            sde_indices=[1, 2],
            log_probs=torch.zeros(2, 2),
            eta=0.7,
            guidance_scale=1.0,
        )


@pytest.mark.parametrize("shape", [(2, 3), (2,), (1, 2), (2, 2, 1)])
def test_latent_segment_log_probs_shape(shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match=re.escape(f"log_probs must be [B=2, K=2], got {list(shape)}")):
        LatentSegment(
            latents=torch.zeros(2, 4, C, H, W),
            positions=POSITIONS,
            sigmas=_sigmas(),
            sde_indices=[1, 2],
            log_probs=torch.zeros(shape),
            eta=0.7,
            guidance_scale=1.0,
        )


def _tokens(**over) -> TokenSegment:
    fields = {
        "prompt_ids": [torch.zeros(2, dtype=torch.long)] * 3,
        "response_ids": [torch.zeros(n, dtype=torch.long) for n in (1, 2, 3)],
        "log_probs": [torch.zeros(n) for n in (1, 2, 3)],
    }
    fields.update(over)
    return TokenSegment(**fields)


def test_token_segment_valid() -> None:
    assert len(_tokens()) == 3


def test_token_segment_rejects_mismatches() -> None:
    with pytest.raises(ValueError, match=r"TokenSegment\.log_probs\[1\] has shape \[3\], its response \[2\]"):
        _tokens(log_probs=[torch.zeros(1), torch.zeros(3), torch.zeros(3)])
    with pytest.raises(ValueError, match=r"TokenSegment has 2 prompts for 3 responses"):
        _tokens(prompt_ids=[torch.zeros(2, dtype=torch.long)] * 2)
    with pytest.raises(ValueError, match=r"response_ids\[0\] must be 1-D with >= 1 token"):
        _tokens(response_ids=[torch.zeros(0, dtype=torch.long), torch.zeros(2), torch.zeros(3)])
