"""TrainBackend: LR schedules, LoRA target checks, optimizer offload, FSDP block checks, weight export."""

from __future__ import annotations

import math

import pytest
import torch

from tests.conftest import tiny_model_config
from unirl.models.sd3.bundle import SD3Bundle
from unirl.train.backend import LoRAConfig, OptimConfig, TrainBackend, lr_factor
from unirl.train.fsdp import FSDPConfig, unmatched_block_classes


@pytest.mark.parametrize(
    ("schedule", "step", "expected"),
    [
        ("constant", 7, 1.0),
        ("linear", 0, 1.0),
        ("linear", 5, 0.5),
        ("linear", 10, 0.0),
        ("cosine", 5, 0.5),
        ("cosine", 0, 1.0),
    ],
)
def test_lr_factor(schedule, step, expected):
    assert lr_factor(schedule, step, total_steps=10, warmup_steps=0) == pytest.approx(expected)


def test_lr_warmup_then_cosine():
    assert lr_factor("cosine", 0, 12, 2) == pytest.approx(0.5)
    assert lr_factor("cosine", 1, 12, 2) == pytest.approx(1.0)
    assert lr_factor("cosine", 7, 12, 2) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))


SMALL_LORA = LoRAConfig(rank=2, alpha=4)


def backend(lora: LoRAConfig | None = SMALL_LORA, **kw) -> TrainBackend:
    return TrainBackend(
        tiny_model_config().build().transformer,
        lora,
        OptimConfig(lr=1e-2),
        10,
        writer=SD3Bundle.write_weights,
        **kw,
    )


def one_step(b: TrainBackend) -> None:
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    out = b.module(
        hidden_states=x,
        timestep=torch.tensor([500.0, 500.0]),
        encoder_hidden_states=torch.ones(2, 16, 64),
        pooled_projections=torch.ones(2, 64),
        return_dict=False,
    )[0]
    out.square().mean().backward()
    b.optimizer_step()


def test_lora_targets_that_match_nothing_are_named():
    with pytest.raises(ValueError, match=r"\['to_qq'\] match no module"):
        backend(LoRAConfig(target_modules=["to_q", "to_qq"]))


def test_lora_trains_only_adapters():
    b = backend()
    assert b.params and all("lora_" in n for n, _ in b.named_params)


def test_optimizer_offload_round_trip_keeps_state_bit_equal():
    b = backend()
    one_step(b)
    before = {id(p): {k: v.clone() for k, v in s.items()} for p, s in b.optimizer.state.items()}
    with b.optimizer_offloaded():
        assert all(v.device.type == "cpu" for s in b.optimizer.state.values() for v in s.values())
    for p, s in b.optimizer.state.items():
        for k, v in s.items():
            assert torch.equal(v, before[id(p)][k])
    one_step(b)
    assert b.optimizer_steps == 2


def test_full_finetune_reference_swaps_and_restores():
    b = backend(None, keep_reference=True)
    initial = [p.detach().clone() for p in b.params]
    one_step(b)
    trained = [p.detach().clone() for p in b.params]
    assert not all(torch.equal(a, c) for a, c in zip(initial, trained, strict=True))
    with b.reference():
        assert all(torch.equal(p, a) for p, a in zip(b.params, initial, strict=True))
    assert all(torch.equal(p, c) for p, c in zip(b.params, trained, strict=True))


def test_reference_without_keep_reference_raises():
    with pytest.raises(RuntimeError, match="keep_reference=True"):
        with backend(None).reference():
            pass


def test_fsdp_block_names_are_checked_against_the_model():
    denoiser = tiny_model_config().trainable_on_meta()
    assert unmatched_block_classes(denoiser, ["JointTransformerBlock"]) == []
    assert unmatched_block_classes(denoiser, ["DecoderLayer"]) == ["DecoderLayer"]
    with pytest.raises(ValueError, match="param_dtype"):
        FSDPConfig(param_dtype="float8")


def test_full_export_loads_with_diffusers(tmp_path):
    from diffusers import SD3Transformer2DModel

    b = backend(None)
    one_step(b)
    b.save_weights(str(tmp_path), base_model="base")
    loaded = SD3Transformer2DModel.from_pretrained(str(tmp_path / "transformer"))
    for (name, p), q in zip(b.module.named_parameters(), loaded.parameters(), strict=True):
        assert torch.equal(p.detach(), q.detach()), name
