"""Every transport, across processes: put in one Ray actor, get in another, same values back.

The contract (`unirl.dataplane.transport`) and the codec must make every
backend return exactly what was put: dense dense, 1-D 1-D, jagged as nested
tensors (padded on request), strings as strings. Lifecycle: exactly-once
claims per task, clear in the driver, nothing left after many steps.
"""

from __future__ import annotations

import ctypes
import gc
import re
import time
from collections.abc import Iterator

import pytest
import ray
import torch

from tests.dataplane.backends import BACKENDS, transport_cfg
from unirl.dataplane import BatchMeta, DataPlaneError, Transport, get_batch, make_transport, put_batch
from unirl.dataplane.codec import to_padded
from unirl.types.segments import TokenSegment

pytestmark = pytest.mark.ray


@ray.remote(num_cpus=0.1)
class Peer:
    """A process holding a client of the driver's transport (like a rollout or train worker);
    one process serves each transport in turn (`attach`, then `close`)."""

    def __init__(self) -> None:
        torch.set_num_threads(1)
        self.transport = None

    def attach(self, cfg: dict, info: dict) -> None:
        self.transport = make_transport(cfg)
        self.transport.attach(info)

    def put(self, partition: str, ids: list[str], fields: dict) -> BatchMeta:
        return self.transport.put(partition, ids, fields)

    def get(self, meta: BatchMeta, fields: list[str] | None = None, jagged: str = "nested") -> dict:
        out = self.transport.get(meta, fields, jagged)
        # nested tensors do not pickle: return their parts for comparison
        return {
            k: (list(v.unbind()) if isinstance(v, torch.Tensor) and v.is_nested else v)
            for k, v in out.items()
        }

    def put_track(self, partition: str, n: int) -> BatchMeta:
        from tests.dataplane.test_codec import make_track

        return put_batch(self.transport, partition, make_track(n))

    def put_audio_video_track(self, partition: str, n: int) -> BatchMeta:
        from tests.dataplane.test_codec import make_audio_video_track

        return put_batch(self.transport, partition, make_audio_video_track(n))

    def get_track_latents(self, meta: BatchMeta) -> torch.Tensor:
        return get_batch(self.transport, meta).segment.latents

    def put_token_track(self, partition: str) -> BatchMeta:
        from tests.dataplane.test_codec import make_token_track

        return put_batch(self.transport, partition, make_token_track())

    def put_image_track(self, partition: str) -> BatchMeta:
        from tests.dataplane.test_codec import make_image_track

        return put_batch(self.transport, partition, make_image_track())

    def get_track(self, meta: BatchMeta):
        return get_batch(self.transport, meta)

    def put_obj(self, partition: str, obj) -> BatchMeta:
        return put_batch(self.transport, partition, obj)

    def stats(self) -> dict:
        return self.transport.stats.drain()

    def close(self) -> None:
        self.transport.close()


def sample_fields(ids: list[str], seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    n = len(ids)
    lengths = [int(x) for x in torch.randint(1, 9, (n,), generator=g)]
    return {
        "dense": torch.randn(n, 4, 8, generator=g),
        "half": torch.randn(n, 3, generator=g).to(torch.bfloat16),
        "index": torch.arange(n) * 10 + seed,
        "tokens": [torch.randint(0, 100, (k,), generator=g) for k in lengths],
        "vectors": [torch.randn(k, 3, generator=g) for k in lengths],
        "prompt": [f"prompt {i}: a red circle" for i in ids],
        "info": [{"id": i, "k": k} for i, k in zip(ids, lengths, strict=True)],
    }


def assert_same(got: dict, want: dict, rows: list[int] | None = None) -> None:
    for name, value in got.items():
        ref = want[name]
        if rows is not None:
            ref = ref[torch.as_tensor(rows)] if isinstance(ref, torch.Tensor) else [ref[r] for r in rows]
        if isinstance(ref, torch.Tensor):
            assert isinstance(value, torch.Tensor) and value.dtype == ref.dtype, name
            assert value.shape == ref.shape and torch.equal(value, ref), name
        elif isinstance(ref[0], torch.Tensor):
            assert len(value) == len(ref), name
            for a, b in zip(value, ref, strict=True):
                assert a.dtype == b.dtype and torch.equal(a, b), name
        else:
            assert value == ref, name


@pytest.fixture(scope="module")
def cluster(ray_cluster) -> str:
    """The session's shared Ray instance (tests/ray_loopback.py)."""
    return ray_cluster


@pytest.fixture(scope="module")
def peers(cluster) -> Iterator[list]:
    """Two peer processes, which every transport's tests share (one start each, not one per transport)."""
    started = [Peer.remote() for _ in range(2)]
    yield started
    for p in started:
        ray.kill(p)


@pytest.fixture(scope="module", params=BACKENDS)
def plane(request, peers) -> Iterator[tuple[Transport, list]]:
    """The driver's transport (started) and the two peers attached to it."""
    cfg = transport_cfg(request.param)
    driver = make_transport(cfg)
    info = driver.start()
    ray.get([p.attach.remote(cfg, info) for p in peers])
    yield driver, peers
    ray.get([p.close.remote() for p in peers])
    driver.close()


def test_round_trip_across_processes(plane) -> None:
    driver, (a, b) = plane
    ids = [f"s{i}" for i in range(6)]
    fields = sample_fields(ids, 0)
    meta = ray.get(a.put.remote("p_round", ids, fields))
    assert meta.sample_ids == ids and len(meta) == 6
    assert meta.fields["dense"].kind == "dense" and meta.fields["tokens"].kind == "jagged"
    assert meta.lengths["tokens"] == [t.shape[0] for t in fields["tokens"]]
    try:
        assert_same(ray.get(b.get.remote(meta)), fields)
        assert_same(driver.get(meta, ["index", "prompt"]), fields)
        padded = ray.get(b.get.remote(meta, ["tokens"], "padded"))["tokens"]
        assert torch.equal(padded, to_padded(fields["tokens"]))
        index = driver.get(meta, ["index"])["index"]
        assert index.dim() == 1 and index.dtype == torch.int64  # 1-D stays 1-D
    finally:
        driver.clear("p_round")


def test_rank_shards_and_concat_of_producers(plane) -> None:
    driver, (a, b) = plane
    ids0, ids1 = [f"r0_{i}" for i in range(4)], [f"r1_{i}" for i in range(4)]
    f0, f1 = sample_fields(ids0, 1), sample_fields(ids1, 2)
    try:
        meta = BatchMeta.concat(
            ray.get([a.put.remote("p_shard", ids0, f0), b.put.remote("p_shard", ids1, f1)])
        )
        assert meta.sample_ids == ids0 + ids1
        shard0, shard1 = meta.split(2)
        assert_same(ray.get(b.get.remote(shard0)), f0)  # rank 1 reads rank 0's shard
        assert_same(ray.get(a.get.remote(shard1)), f1)
        mixed = meta.select([6, 1, 3])  # any subset, any order
        want = {
            k: (torch.cat([f0[k], f1[k]]) if isinstance(f0[k], torch.Tensor) else f0[k] + f1[k]) for k in f0
        }
        assert_same(ray.get(a.get.remote(mixed, ["dense", "tokens", "prompt"])), want, [6, 1, 3])
    finally:
        driver.clear("p_shard")


def test_batch_dataclass_round_trip(plane) -> None:
    from tests.dataplane.test_codec import make_track

    driver, (a, b) = plane
    try:
        meta = ray.get(a.put_track.remote("p_track", 4))
        got = ray.get(b.get_track_latents.remote(meta.split(2)[1]))
        want = make_track(4).segment.latents[2:]
        assert got.dtype == torch.bfloat16 and torch.equal(got, want)
        view = get_batch(driver, meta, ["sample_ids", "prompts", "media"])
        assert view.prompts == make_track(4).prompts and view.segment is None
    finally:
        driver.clear("p_track")


def test_audio_video_track_round_trip(plane) -> None:
    """An audio-video track's soundtracks and their rate reach the driver's reward fetch bit for bit."""
    from tests.dataplane.test_codec import make_audio_video_track

    driver, (a, _) = plane
    try:
        meta = ray.get(a.put_audio_video_track.remote("p_av", 4))
        view = get_batch(driver, meta.split(2)[1], ["sample_ids", "media", "audio"])
        want = make_audio_video_track(4)
        assert torch.equal(view.audio, want.audio[2:]) and view.audio_rate == 16000
        assert torch.equal(view.media, want.media[2:])
    finally:
        driver.clear("p_av")


def test_token_segment_track_round_trip(plane) -> None:
    """A text track (jagged TokenSegment, texts) comes back with identical content."""
    from tests.dataplane.test_codec import make_token_track

    driver, (a, b) = plane
    want = make_token_track()
    try:
        meta = ray.get(a.put_token_track.remote("p_text"))
        assert meta.fields["segment.response_ids"].kind == "jagged"
        assert meta.lengths["segment.response_ids"] == [1, 7, 4, 6]
        for got in (ray.get(b.get_track.remote(meta)), get_batch(driver, meta)):
            assert isinstance(got.segment, TokenSegment) and got.segment.temperature == 0.7
            assert got.texts == want.texts and got.sample_ids == want.sample_ids and got.rollout_id == 3
            assert torch.equal(got.rewards, want.rewards)
            for name in TokenSegment.PER_SAMPLE:
                rows, ref = getattr(got.segment, name), getattr(want.segment, name)
                if ref is None:  # a text-only segment has no images
                    assert rows is None, name
                    continue
                assert isinstance(rows, list) and len(rows) == len(ref), name
                for x, y in zip(rows, ref, strict=True):
                    assert x.dtype == y.dtype and torch.equal(x, y), name
            assert torch.equal(got.segment.padded("log_probs"), want.segment.padded("log_probs"))
        shard = ray.get(b.get_track.remote(meta.split(2)[1]))
        assert [r.tolist() for r in shard.segment.response_ids] == [
            r.tolist() for r in want.segment.response_ids[2:]
        ]
        view = get_batch(driver, meta, ["texts", "segment.response_ids"])
        assert view.texts == want.texts and view.segment.log_probs is None  # a partial segment view
        assert [r.tolist() for r in view.segment.response_ids] == [r.tolist() for r in want.segment.response_ids]
    finally:
        driver.clear("p_text")


def test_lineage_round_trip(plane) -> None:
    """A composed rollout's child track keeps its lineage (parent and root ids) through the plane,
    whole, by rank shard, and in the driver's scoring view."""
    from tests.dataplane.test_codec import make_track

    driver, (a, b) = plane
    child = make_track(4)
    child.parent_ids = ["u0::sample:0", "u0::sample:0", "u0::sample:1", "u0::sample:1"]
    child.root_ids = ["r0/g0:u0"] * 4
    try:
        meta = ray.get(a.put_obj.remote("p_lineage", child))
        got = ray.get(b.get_track.remote(meta))
        assert got.parent_ids == child.parent_ids and got.root_ids == child.root_ids
        shard = ray.get(b.get_track.remote(meta.split(2)[1]))
        assert shard.parent_ids == child.parent_ids[2:] and shard.sample_ids == child.sample_ids[2:]
        view = get_batch(driver, meta, ["sample_ids", "parent_ids", "root_ids"])
        assert view.parent_ids == child.parent_ids and view.root_ids == child.root_ids
    finally:
        driver.clear("p_lineage")


def test_image_inputs_round_trip_bit_exact(plane) -> None:
    """A VLM track's prompt images (pixel values [N_i, D], grids [k_i, 3]; a row without images
    holds [0, D] and [0, 3]) come back bit for bit, on a peer, by rank shard and on the driver."""
    from tests.dataplane.test_codec import make_image_track

    driver, (a, b) = plane
    want = make_image_track()
    try:
        meta = ray.get(a.put_image_track.remote("p_images"))
        for got in (ray.get(b.get_track.remote(meta)).segment, get_batch(driver, meta).segment):
            for name in ("pixel_values", "image_grid_thw", "response_ids"):
                rows, ref = getattr(got, name), getattr(want.segment, name)
                assert all(
                    x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(rows, ref, strict=True)
                ), name
        shard = ray.get(b.get_track.remote(meta.split(2)[1])).segment
        assert all(
            torch.equal(x, y) for x, y in zip(shard.pixel_values, want.segment.pixel_values[2:], strict=True)
        )
        assert [x.tolist() for x in shard.image_grid_thw] == [
            x.tolist() for x in want.segment.image_grid_thw[2:]
        ]
    finally:
        driver.clear("p_images")


def test_misuse_errors_name_what_is_wrong(plane) -> None:
    driver, (a, _) = plane
    ids = ["x0", "x1"]
    try:
        meta = ray.get(a.put.remote("p_err", ids, sample_fields(ids, 3)))
        with pytest.raises(DataPlaneError, match=r"partition 'p_err' has no fields \['nope'\]"):
            driver.get(meta, ["nope"])
        other = BatchMeta(
            "elsewhere", meta.partition, meta.sample_ids, meta.fields, meta.lengths, meta.handle
        )
        with pytest.raises(DataPlaneError, match="written by transport 'elsewhere'"):
            driver.get(other)
        with pytest.raises(DataPlaneError, match="duplicate sample ids"):
            driver.put("p_err", ["y", "y"], {"v": torch.zeros(2)})
        with pytest.raises(ValueError, match=r"field 'v': tensor of shape \[3\] is not per-sample"):
            driver.put("p_err", ["y0", "y1"], {"v": torch.zeros(3)})
        with pytest.raises(DataPlaneError, match="empty batch"):
            driver.put("p_err", [], {})
        with pytest.raises(DataPlaneError, match="cannot concatenate metas"):
            BatchMeta.concat([meta, other])
    finally:
        driver.clear("p_err")


def test_claims_are_exactly_once_per_task(plane) -> None:
    driver, (a, _) = plane
    ids = [f"c{i}" for i in range(4)]
    meta = ray.get(a.put.remote("p_claim", ids, sample_fields(ids, 4)))
    try:
        first, second = meta.split(2)
        driver.claim(first, "train")
        driver.claim(meta, "reward")  # another task may consume the same samples
        with pytest.raises(DataPlaneError, match=r"task 'train' already consumed samples \['c0', 'c1'\]"):
            driver.claim(meta, "train")
        driver.claim(second, "train")  # the rest is still available
    finally:
        driver.clear("p_claim")
    driver.claim(meta, "train")  # claims go with the partition
    driver.clear("p_claim")


def test_stats_count_bytes_and_calls(plane) -> None:
    driver, (a, b) = plane
    ids = ["m0", "m1"]
    ray.get([a.stats.remote(), b.stats.remote()])
    fields = {"x": torch.zeros(2, 256)}  # 2 KiB
    try:
        meta = ray.get(a.put.remote("p_stats", ids, fields))
        ray.get(b.get.remote(meta))
        put, got = ray.get(a.stats.remote()), ray.get(b.stats.remote())
        assert put["dataplane/put_bytes"] == 2048 and put["dataplane/put_calls"] == 1
        assert got["dataplane/get_bytes"] == 2048 and got["dataplane/get_s"] > 0
        assert ray.get(a.stats.remote()) == {}  # drained
    finally:
        driver.clear("p_stats")


def _rss_mb() -> float:
    """Driver RSS in MiB less its shared-memory pages, after handing freed heap back to the OS.

    glibc raises its mmap threshold once a large block is freed, so later 4 MiB tensors land on
    the heap; without `malloc_trim` their freed pages stay in RSS and read as growth. The shared
    pages (`RssShmem`) are Ray's object store as far as this process has read it: they grow
    with where the store places each new object (a fast loop outruns its asynchronous frees),
    not with what this process holds; objects left in the store are counted by `_plasma_objects`.
    """
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/status") as f:
        status = dict(line.split(":", 1) for line in f)
    return (int(status["VmRSS"].split()[0]) - int(status["RssShmem"].split()[0])) / 1024


def test_memory_does_not_grow_over_many_steps(plane) -> None:
    """40 steps of put (2 producers, 4 MiB) -> get (2 consumers) -> clear: no growth after warm-up.

    Each step ends with a full garbage collection of what the steps made; the objects that
    existed before the loop (the whole test session's) are frozen out of it, which makes the
    collection far cheaper (0.4 s -> ~0 a step) and does not change what it frees. Every
    transport leaves the object store (near) empty once the metas are gone: the inband metas
    carry the data through it, and a driver that kept them would pin it there."""
    driver, (a, b) = plane
    payload = {"x": torch.ones(4, 256, 1024)}  # 4 MiB per producer
    rss = []
    gc.collect()
    gc.freeze()
    try:
        _put_get_clear_steps(driver, a, b, payload, rss)
    finally:
        gc.unfreeze()
    assert rss[1] - rss[0] < 64, f"driver RSS grew {rss[1] - rss[0]:.0f} MiB over 30 steps"
    assert driver._claims == {}  # no claim ledger left behind
    if hasattr(driver, "stored_partitions"):  # TransferQueue: the controller holds nothing
        assert driver.stored_partitions() == []
    assert _wait_for(lambda: _plasma_objects() <= 2), f"{_plasma_objects()} objects left in the store"


def _put_get_clear_steps(driver: Transport, a, b, payload: dict, rss: list[float]) -> None:
    """The 40 steps of the test above; the driver's RSS after steps 10 and 39 appended to `rss`."""
    for step in range(40):
        part = f"p_mem_{step}"
        try:
            metas = ray.get(
                [
                    a.put.remote(part, [f"{step}a{i}" for i in range(4)], payload),
                    b.put.remote(part, [f"{step}b{i}" for i in range(4)], payload),
                ]
            )
            meta = BatchMeta.concat(metas)
            s0, s1 = driver.claim(meta, "train").split(2)
            ray.get([a.get.remote(s1, ["x"]), b.get.remote(s0, ["x"])])
        finally:
            driver.clear(part)
        del metas, meta, s0, s1
        gc.collect()
        if step in (10, 39):
            rss.append(_rss_mb())


def _plasma_objects() -> int:
    from ray._private.internal_api import memory_summary

    # this process's instance by address: another Ray instance on the machine would make it ambiguous
    summary = memory_summary(address=ray.get_runtime_context().gcs_address, stats_only=True)
    return int(re.search(r"Plasma memory usage \d+ MiB, (\d+) objects", summary).group(1))


def _wait_for(cond, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.2)
    return cond()
