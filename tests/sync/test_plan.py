"""Weight-sync plans, names, bucket layout, checksums, binding and config (no Ray, no processes)."""

from __future__ import annotations

import pickle
import random

import pytest
import torch

from tests.sync.helpers import LM_LORA, SD3_LORA, lm, sd3, with_lora
from unirl.sync import (
    SyncPlan,
    TensorSpec,
    WeightSyncConfig,
    WeightSyncError,
    bind,
    canonical_name,
    checksum,
    make_receiver,
    make_sender,
    select,
    weight_sync_problems,
)
from unirl.sync.frames import TRAILER, pack, piece_checksums, unpack
from unirl.sync.plan import ALIGN

# ---- names ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "canon"),
    [
        (
            "_fsdp_wrapped_module.blocks.0._checkpoint_wrapped_module.attn.to_q.weight",
            "blocks.0.attn.to_q.weight",
        ),
        ("_orig_mod.proj_out.bias", "proj_out.bias"),
        (
            "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight",
            "model.layers.0.self_attn.q_proj.lora_A.weight",
        ),
        ("blocks.1.attn.to_q.lora_B.engine.weight", "blocks.1.attn.to_q.lora_B.weight"),
        ("embed.lora_embedding_A.default", "embed.lora_embedding_A"),
        ("attn.to_k.lora_magnitude_vector.default.weight", "attn.to_k.lora_magnitude_vector.weight"),
        ("transformer_blocks.0.norm1.linear.weight", "transformer_blocks.0.norm1.linear.weight"),
    ],
)
def test_canonical_name(raw: str, canon: str) -> None:
    assert canonical_name(raw) == canon
    assert canonical_name(canon) == canon  # idempotent: a canonical name stays as it is


def test_rename_rules_apply_after_the_builtin_ones() -> None:
    rules = (("^transformer\\.", ""), ("\\.to_out\\.0\\.", ".to_out."))
    assert (
        canonical_name("base_model.model.transformer.a.to_out.0.lora_A.x.weight", rules)
        == "a.to_out.lora_A.weight"
    )


def test_real_peft_names_meet_across_wrappers_and_adapter_names() -> None:
    """diffusers' add_adapter vs another adapter name; transformers' add_adapter vs peft's PeftModel."""
    a = select(with_lora(sd3(0), 1, SD3_LORA).named_parameters(), "lora")
    b = select(with_lora(sd3(0), 2, SD3_LORA, adapter="engine").named_parameters(), "lora")
    assert a and list(a) == list(b) and all(".default." not in n for n in a)
    c = select(with_lora(lm(0), 1, LM_LORA).named_parameters(), "lora")
    d = select(with_lora(lm(0), 2, LM_LORA, adapter="rollout", peft_model=True).named_parameters(), "lora")
    assert c and list(c) == list(d) and not any(n.startswith("base_model") for n in d)
    # every LoRA parameter and no base weight is selected
    raw = [n for n, _ in with_lora(lm(0), 1, LM_LORA).named_parameters() if "lora_" in n]
    assert len(c) == len(raw) == 2 * 3 * 2  # 2 layers x 3 targets x (A, B)


@pytest.mark.filterwarnings("ignore:Already found a `peft_config`")
def test_two_adapters_on_one_module_are_ambiguous() -> None:
    module = with_lora(with_lora(sd3(0), 1, ["to_q"]), 2, ["to_q"], adapter="second")
    with pytest.raises(
        WeightSyncError, match=r"lora_A\.default\.weight.*lora_A\.second\.weight.*one LoRA adapter"
    ):
        select(module.named_parameters(), "lora")


# ---- layout ---------------------------------------------------------------------------------------


def _specs(shapes: list[tuple[int, ...]], dtype: torch.dtype = torch.float32) -> tuple[TensorSpec, ...]:
    return tuple(TensorSpec(f"t{i}", s, dtype) for i, s in enumerate(shapes))


def _check_layout(plan: SyncPlan) -> None:
    """Invariants: pieces aligned, inside their bucket, not overlapping; each tensor covered
    exactly once, in order; every bucket within capacity."""
    covered = {i: 0 for i in range(len(plan.tensors))}
    for b, pieces in enumerate(plan.buckets):
        assert 0 < plan.bucket_sizes[b] <= plan.bucket_bytes and plan.bucket_sizes[b] % ALIGN == 0
        end = 0
        for p in pieces:
            size = plan.wire_of(p.tensor).itemsize
            assert p.offset % ALIGN == 0 and p.offset >= end and p.count > 0
            end = p.offset + p.count * size
            assert end <= plan.bucket_sizes[b]
            assert p.start == covered[p.tensor]
            covered[p.tensor] += p.count
    assert covered == {i: t.numel for i, t in enumerate(plan.tensors)}


def test_many_small_tensors_share_buckets() -> None:
    # 100 tensors of 3 fp32 (12 bytes, padded to 16): 16 per 256-byte bucket
    plan = SyncPlan("full", _specs([(3,)] * 100), None, 256)
    _check_layout(plan)
    assert [len(b) for b in plan.buckets] == [16] * 6 + [4]
    assert [p.offset for p in plan.buckets[0]] == [16 * k for k in range(16)]
    assert plan.bucket_sizes == (256,) * 6 + (64,)


@pytest.mark.parametrize(("wire", "counts"), [(None, [256, 256, 256, 232]), (torch.bfloat16, [512, 488])])
def test_a_tensor_larger_than_a_bucket_is_split_between_buckets(
    wire: torch.dtype | None, counts: list[int]
) -> None:
    plan = SyncPlan("full", _specs([(10, 100)]), wire, 1024)
    _check_layout(plan)
    assert [b[0].count for b in plan.buckets] == counts
    assert all(len(b) == 1 and b[0].offset == 0 for b in plan.buckets)


def test_random_layouts_hold_their_invariants() -> None:
    rng = random.Random(0)
    for _ in range(50):
        shapes = [
            tuple(rng.randint(1, 40) for _ in range(rng.randint(0, 3))) for _ in range(rng.randint(1, 30))
        ]
        plan = SyncPlan(
            "full", _specs(shapes), rng.choice([None, torch.bfloat16]), ALIGN * rng.randint(1, 64)
        )
        _check_layout(plan)


def _round_trip(plan: SyncPlan, sources: list[torch.Tensor]) -> list[torch.Tensor]:
    dests = [torch.full(s.shape, 7, dtype=s.dtype) for s in plan.tensors]
    for index, frame in enumerate(pack(plan, lambda i: sources[i], torch.device("cpu"))):
        assert frame.numel() == plan.bucket_sizes[index] + TRAILER
        unpack(plan, index, frame, [d.view(-1) for d in dests], version=0)
    return dests


@pytest.mark.parametrize("wire", [None, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bucket_bytes", [64, 1024, 1 << 20])
def test_pack_unpack_round_trip(wire: torch.dtype | None, bucket_bytes: int) -> None:
    gen = torch.Generator().manual_seed(0)
    sources = [
        torch.randn(33, 17, generator=gen),
        torch.randn((), generator=gen),
        torch.randn(0, 4, generator=gen),
        torch.randn(5, 3, generator=gen).to(torch.bfloat16),
        torch.randn(2, 7, generator=gen).to(torch.float16),
        torch.randint(-(2**40), 2**40, (9,), generator=gen),
        torch.randn(300, generator=gen)[::2],  # a strided view
    ]
    plan = SyncPlan(
        "full",
        tuple(TensorSpec(f"t{i}", tuple(t.shape), t.dtype) for i, t in enumerate(sources)),
        wire,
        bucket_bytes,
    )
    for src, got in zip(sources, _round_trip(plan, sources), strict=True):
        expected = src.to(wire).to(src.dtype) if wire is not None and src.is_floating_point() else src
        assert got.dtype == src.dtype and torch.equal(got, expected)
    if wire is torch.bfloat16:  # the cast is really lossy here, so the test above is not vacuous
        assert not torch.equal(sources[0].to(torch.bfloat16).float(), sources[0])


def test_a_corrupted_or_truncated_bucket_is_refused() -> None:
    plan = SyncPlan("full", _specs([(40,), (40,)]), None, 128)
    sources = [torch.randn(40), torch.randn(40)]
    frames = list(pack(plan, lambda i: sources[i], torch.device("cpu")))
    dests = [torch.empty(40), torch.empty(40)]
    bad = frames[1].clone()
    bad[5] ^= 4
    with pytest.raises(WeightSyncError, match=r"bucket 1 of version 3 arrived corrupted.*holds t0, t1"):
        unpack(plan, 1, bad, dests, version=3)
    with pytest.raises(WeightSyncError, match="bucket 0 of version 3: 100 bytes arrived, the plan says 152"):
        unpack(plan, 0, frames[0][:100], dests, version=3)


# ---- checksum -------------------------------------------------------------------------------------


def _words(data: bytes) -> list[int]:
    """`data` as little-endian signed int64 words, a short tail zero-padded."""
    data += bytes(-len(data) % 8)
    return [int.from_bytes(data[i : i + 8], "little", signed=True) for i in range(0, len(data), 8)]


def _wrap(x: int) -> int:
    """`x` mod 2^64, as a signed int64."""
    x %= 1 << 64
    return x - (1 << 64) if x >= 1 << 63 else x


def _reference_checksum(data: bytes) -> list[int]:
    """The checksum written out with Python integers."""
    words = _words(data)
    rows = [sum(words[i : i + 1024]) for i in range(0, len(words), 1024)]
    cols = [sum(words[j::1024]) for j in range(1024)]
    return [
        _wrap(sum(rows)),
        _wrap(sum((2 * i + 1) * r for i, r in enumerate(rows))),
        _wrap(sum((2 * j + 1) * c for j, c in enumerate(cols))),
    ]


@pytest.mark.parametrize("length", [0, 1, 7, 8, 9, 8 * 1024, 8 * 1024 + 3, 8 * 2500 + 16])
def test_checksum_matches_a_python_reference(length: int) -> None:
    data = torch.randint(
        0, 256, (length,), dtype=torch.uint8, generator=torch.Generator().manual_seed(length)
    )
    data[:8] = 255  # words near -1 and big ones make the sums wrap
    assert checksum(data).tolist() == _reference_checksum(bytes(data.tolist()))


def test_checksum_sees_flips_swaps_and_shifts() -> None:
    gen = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (8 * 3000,), dtype=torch.uint8, generator=gen)
    base = checksum(data)
    for pos in torch.randint(0, data.numel(), (20,), generator=gen).tolist():
        for bit in (0, 7):
            flipped = data.clone()
            flipped[pos] ^= 1 << bit
            assert not torch.equal(checksum(flipped), base)
    words = data.view(torch.int64)
    for i, j in [(3, 9), (5, 1029), (0, 2999)]:  # same row, next row, first and last
        swapped = words.clone()
        swapped[i], swapped[j] = words[j], words[i]
        assert not torch.equal(checksum(swapped.view(torch.uint8)), base)
    shifted = torch.cat([words[1:], words[:1]]).view(torch.uint8)
    assert not torch.equal(checksum(shifted), base)


def _reference_piece_checksum(data: bytes) -> list[int]:
    """`piece_checksums`' definition written out with Python integers."""
    words = _words(data)
    return [
        _wrap(sum(words)),
        _wrap(sum((2 * k + 1) * w for k, w in enumerate(words))),
        _wrap(sum(k * k * w for k, w in enumerate(words))),
    ]


@pytest.mark.parametrize("wire", [None, torch.bfloat16])
@pytest.mark.parametrize("bucket_bytes", [64, 8 * 1500, 1 << 20])
def test_piece_checksums_match_a_python_reference(wire: torch.dtype | None, bucket_bytes: int) -> None:
    """Each piece's checksum from the frame's prefix sums equals the definition applied to the
    piece's own bytes: pieces of odd byte length (bf16), long pieces, tensors split between
    buckets, sums that wrap."""
    gen = torch.Generator().manual_seed(1)
    sources = [
        torch.randn(3000, generator=gen),
        torch.randn(5, 3, generator=gen),
        torch.randn(7, generator=gen),
    ]
    sources[0][:4] = torch.tensor([float("nan"), -1.0, 2.0**100, -(2.0**-100)])
    plan = SyncPlan("full", _specs([tuple(t.shape) for t in sources]), wire, bucket_bytes)
    for index, frame in enumerate(pack(plan, lambda i: sources[i], torch.device("cpu"))):
        got = piece_checksums(plan, index, frame)
        assert got.shape == (len(plan.buckets[index]), 3)
        for row, piece in zip(got.tolist(), plan.buckets[index], strict=True):
            itemsize = plan.wire_of(piece.tensor).itemsize
            assert row == _reference_piece_checksum(
                bytes(frame[piece.offset : piece.offset + piece.count * itemsize].tolist())
            )


def test_piece_checksums_see_a_changed_swapped_or_shifted_word() -> None:
    gen = torch.Generator().manual_seed(2)
    sources = [torch.randn(600, generator=gen), torch.randn(600, generator=gen)]
    plan = SyncPlan("full", _specs([(600,), (600,)]), None, 1 << 20)
    base = piece_checksums(plan, 0, next(pack(plan, lambda i: sources[i], torch.device("cpu"))))

    def sums_with(first: torch.Tensor) -> torch.Tensor:
        frame = next(pack(plan, lambda i: first if i == 0 else sources[1], torch.device("cpu")))
        return piece_checksums(plan, 0, frame)

    changed, swapped, shifted = sources[0].clone(), sources[0].clone(), sources[0].roll(2)
    changed[17] += 1.0
    swapped[[3, 400]] = swapped[[400, 3]]
    for variant in (changed, swapped, shifted):
        got = sums_with(variant)
        assert not torch.equal(got[0], base[0]) and torch.equal(got[1], base[1])


# ---- plans and binding ----------------------------------------------------------------------------


def test_plan_digest_and_pickling() -> None:
    module = sd3(0)
    a = SyncPlan.for_module(module, "full", bucket_bytes=4096)
    b = pickle.loads(pickle.dumps(a))
    assert b.digest == a.digest and b.buckets == a.buckets
    assert SyncPlan.for_module(module, "full", bucket_bytes=8192).digest != a.digest
    assert (
        SyncPlan.for_module(module, "full", bucket_bytes=4096, wire_dtype=torch.bfloat16).digest != a.digest
    )
    assert a.nbytes == sum(p.numel() * 4 for p in module.parameters())


def test_plan_errors() -> None:
    with pytest.raises(WeightSyncError, match="has no LoRA parameters"):
        SyncPlan.for_module(sd3(0), "lora")
    with pytest.raises(WeightSyncError, match="kind must be one of"):
        SyncPlan.for_module(sd3(0), "merged")
    with pytest.raises(WeightSyncError, match="multiple of 16"):
        SyncPlan("full", _specs([(3,)]), None, 100)
    with pytest.raises(WeightSyncError, match="wire dtype"):
        SyncPlan("full", _specs([(3,)]), torch.float16, 128)


def test_bind_writes_through_to_the_module() -> None:
    sender = with_lora(sd3(0), 1, SD3_LORA)
    receiver = with_lora(sd3(0), 2, SD3_LORA, adapter="engine")
    plan = SyncPlan.for_module(sender, "lora")
    into = bind(receiver, plan)
    assert list(into) == plan.names
    name = plan.names[0]
    into[name].fill_(0.5)
    assert torch.all(dict(receiver.named_parameters())[name.replace(".lora_A.", ".lora_A.engine.")] == 0.5)


def test_zero_module_lora_sync_is_an_error_naming_the_targets() -> None:
    plan = SyncPlan.for_module(with_lora(sd3(0), 1, SD3_LORA), "lora")
    with pytest.raises(
        WeightSyncError,
        match=r"bind zero modules.*targets \['add_q_proj', 'proj_out', 'to_k'.*LoRA modules: none",
    ):
        bind(sd3(0), plan)  # the engine has no adapter at all
    other = with_lora(sd3(0), 2, ["ff.net.0.proj"])
    with pytest.raises(
        WeightSyncError,
        match=r"bind zero modules.*\(11 modules, e.g. proj_out, transformer_blocks\.0\.attn\.add_q_proj.*ff\.net\.0\.proj.*\['ff\.net\.0\.proj'\]",
    ):
        bind(other, plan)  # an adapter on other modules


def test_bind_lists_missing_extra_shape_dtype_and_scaling_problems() -> None:
    plan = SyncPlan.for_module(with_lora(sd3(0), 1, ["to_q", "to_k"]), "lora")
    with pytest.raises(
        WeightSyncError, match=r"missing on the engine: transformer_blocks\.0\.attn\.to_k\.lora_A"
    ):
        bind(with_lora(sd3(0), 2, ["to_q"]), plan)
    with pytest.raises(
        WeightSyncError,
        match=r"lora tensor\(s\) of the engine not in the plan: transformer_blocks\.0\.attn\.to_v",
    ):
        bind(with_lora(sd3(0), 2, ["to_q", "to_k", "to_v"]), plan)
    with pytest.raises(
        WeightSyncError, match=r"scaling \(alpha / rank\) 2\.0 on the engine, 4\.0 on the trainer"
    ):
        bind(
            with_lora(sd3(0), 2, ["to_q", "to_k"], alpha=8.0),
            with_plan := SyncPlan.for_module(with_lora(sd3(0), 1, ["to_q", "to_k"], alpha=16.0), "lora"),
        )
    assert with_plan.lora_scaling["transformer_blocks.0.attn.to_q"] == 4.0
    full = SyncPlan.for_module(sd3(0), "full")
    with pytest.raises(WeightSyncError, match=r"dtype torch\.bfloat16 on the engine, plan torch\.float32"):
        bind(sd3(0).to(torch.bfloat16), full)
    from unirl.models.sd3.bundle import SD3Bundle, TinySD3Config

    wider = SD3Bundle.tiny_transformer(
        TinySD3Config(resolution=32, patch_size=4, num_layers=2, attention_head_dim=16)
    )
    with pytest.raises(
        WeightSyncError,
        match=r"pos_embed\.proj\.weight: shape \[64, 3, 4, 4\] on the engine, plan \[128, 3, 4, 4\]",
    ):
        bind(wider, full)
    with pytest.raises(
        WeightSyncError, match=r"missing on the engine: .*transformer_blocks\.1\.norm1\.linear\.weight"
    ):
        bind(sd3(0, layers=1), full)


# ---- config and validation ------------------------------------------------------------------------


def test_config_validation() -> None:
    cfg = WeightSyncConfig(backend="broadcast", bucket_mb=0.5, wire_dtype="bfloat16", rename=[["^a\\.", ""]])
    assert (
        cfg.bucket_bytes == 1 << 19
        and cfg.wire_torch_dtype is torch.bfloat16
        and cfg.rename_rules == (("^a\\.", ""),)
    )
    for bad, match in [
        (dict(backend="nccl"), "exactly one of"),
        (dict(backend=["broadcast", "object_store"]), "exactly one of"),
        (dict(backend="broadcast", bucket_mb=0), "bucket_mb must be > 0"),
        (dict(backend="broadcast", wire_dtype="float16"), "wire_dtype must be null or one of"),
        (dict(backend="broadcast", timeout_s=0), "timeout_s must be > 0"),
        (dict(backend="broadcast", rename=[["a"]]), r"rename\[0\] must be \[regex, replacement\]"),
        (dict(backend="broadcast", rename=[["(", ""]]), r"rename\[0\]: bad regex"),
    ]:
        with pytest.raises(ValueError, match=match):
            WeightSyncConfig(**bad)


def test_weight_sync_problems() -> None:
    assert weight_sync_problems(None, dedicated=False) == []
    assert "nothing to sync" in weight_sync_problems({"backend": "broadcast"}, dedicated=False)[0]
    assert "needs one sync backend" in weight_sync_problems(None, dedicated=True)[0]
    assert (
        weight_sync_problems(
            {"backend": "object_store", "verify": True}, dedicated=True, placement="separate"
        )
        == []
    )
    assert "exactly one of" in weight_sync_problems({"backend": "carrier_pigeon"}, dedicated=True)[0]
    assert (
        "unexpected keyword argument 'bucket'"
        in weight_sync_problems({"backend": "broadcast", "bucket": 1}, dedicated=True)[0]
    )
    ipc = weight_sync_problems(
        {"backend": "cuda_ipc"}, dedicated=True, placement="separate", device_type="cpu"
    )
    assert len(ipc) == 2 and "placement: colocate" in ipc[0] and "needs GPUs" in ipc[1]
    assert (
        weight_sync_problems(
            {"backend": "cuda_ipc"}, dedicated=True, placement="colocate", device_type="cuda"
        )
        == []
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_cuda_ipc_refuses_to_run_without_cuda() -> None:
    cfg = WeightSyncConfig(backend="cuda_ipc")
    plan = SyncPlan.for_module(sd3(0), "full")
    for make in (
        lambda: make_sender(cfg, plan, device="cpu"),
        lambda: make_receiver(cfg, plan, None, device="cpu"),
    ):
        with pytest.raises(
            WeightSyncError,
            match=r"cuda_ipc.*sees no CUDA device.*placement: colocate.*broadcast or object_store",
        ):
            make()
