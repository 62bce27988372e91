"""save_train_state / load_train_state on one process: what a resumed backend gets back."""

from __future__ import annotations

import random

import numpy as np
import torch

from tests.conftest import tiny_model_config
from unirl.models.sd3.bundle import SD3Bundle
from unirl.train.backend import OptimConfig, TrainBackend
from unirl.train.checkpoint import load_train_state, save_train_state
from unirl.train.ema import EMAConfig

SNAPSHOT = EMAConfig(
    decay=0.9, schedule="linear", decay_start=0.25, decay_slope=0.1
)  # a loss's (CRD's old policy)


def full_finetune(seed: int) -> TrainBackend:
    """A full fine-tune keeping its reference (as Flow-GRPO with beta > 0), an EMA and a loss snapshot."""
    module = tiny_model_config(seed=seed).build().transformer
    return TrainBackend(
        module,
        None,
        OptimConfig(lr=1e-2),
        10,
        ema=EMAConfig(decay=0.5),
        snapshots={"old": SNAPSHOT},
        keep_reference=True,
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


def draws() -> tuple[torch.Tensor, float, float]:
    return torch.rand(4), random.random(), float(np.random.rand())


def test_full_finetune_state_round_trip_keeps_the_initial_reference(tmp_path):
    """A backend built from different weights, loaded from a checkpoint of a trained one, gets the
    trained weights, optimizer, counters and EMA, and its reference is the *initial* weights of
    the run that saved it (not its own initial weights, not the trained ones)."""
    saved = full_finetune(seed=0)
    initial = [p.detach().clone() for p in saved.params]
    one_step(saved)
    one_step(saved)
    trained = [p.detach().clone() for p in saved.params]
    assert not any(torch.equal(a, b) for a, b in zip(initial, trained, strict=True) if a.numel() > 1)
    save_train_state(str(tmp_path), saved, rank=0)

    resumed = full_finetune(seed=1)
    assert not torch.equal(resumed.params[0], initial[0])  # a different starting point
    load_train_state(str(tmp_path), resumed, rank=0)
    assert all(torch.equal(p, t) for p, t in zip(resumed.params, trained, strict=True))
    with resumed.reference():
        assert all(torch.equal(p, a) for p, a in zip(resumed.params, initial, strict=True))
    assert all(torch.equal(p, t) for p, t in zip(resumed.params, trained, strict=True))
    assert resumed.optimizer_steps == 2 and resumed.scheduler.last_epoch == 2
    assert resumed.ema.num_updates == 2
    for name, shadow in saved.ema.state_dict()["shadow"].items():
        assert torch.equal(resumed.ema.state_dict()["shadow"][name], shadow), name
    old = saved.snapshots["old"].state_dict()
    assert resumed.snapshots["old"].num_updates == 2 and old["num_updates"] == 2
    with resumed.snapshot_weights(
        "old"
    ):  # the snapshot (decays 0.25 then 0.35) is neither the weights nor the EMA
        assert all(torch.equal(p, old["shadow"][n]) for n, p in resumed.named_params)
        assert not torch.equal(resumed.params[0], trained[0])
    for p, q in zip(saved.params, resumed.params, strict=True):
        for key, value in saved.optimizer.state[p].items():
            assert torch.equal(resumed.optimizer.state[q][key], value), key
    # and the next step matches bit for bit
    one_step(saved)
    one_step(resumed)
    assert all(torch.equal(p, q) for p, q in zip(saved.params, resumed.params, strict=True))


def test_rng_states_come_back_and_the_file_loads_weights_only(tmp_path):
    """torch, Python and NumPy draws after a load repeat the draws after the save; the per-rank
    file holds only tensors and plain containers (`torch.load(weights_only=True)` reads it)."""
    b = TrainBackend(tiny_model_config().build().transformer, None, OptimConfig(), 10)
    torch.manual_seed(3), random.seed(3), np.random.seed(3)
    np.random.randn()  # leaves a cached Gaussian in NumPy's state
    save_train_state(str(tmp_path), b, rank=0)
    expected = draws()
    draws()
    load_train_state(str(tmp_path), b, rank=0)
    got = draws()
    assert torch.equal(got[0], expected[0]) and got[1:] == expected[1:]
    extra = torch.load(tmp_path / "rank0.pt", map_location="cpu", weights_only=True)
    assert set(extra) == {"scheduler", "counters", "rng"}


def test_exported_lora_loads_back_at_the_trained_scale(tmp_path):
    """`save_weights` + `load_checkpoint` reproduce the trained module's output: the LoRA file
    carries alpha, so diffusers scales the update by alpha / rank (here 4), not by 1."""
    from unirl.models.sd3 import load_checkpoint
    from unirl.train.backend import LoRAConfig

    bundle = tiny_model_config().build()
    bundle.save_pretrained(str(tmp_path / "base"))
    b = TrainBackend(
        bundle.transformer,
        LoRAConfig(rank=2, alpha=8),
        OptimConfig(lr=1e-2),
        10,
        writer=SD3Bundle.write_weights,
    )
    one_step(b)
    b.save_weights(str(tmp_path / "ckpt"), base_model=str(tmp_path / "base"))
    loaded = load_checkpoint(str(tmp_path / "ckpt")).transformer
    kw = dict(
        hidden_states=torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1)),
        timestep=torch.tensor([300.0, 700.0]),
        encoder_hidden_states=torch.ones(2, 16, 64),
        pooled_projections=torch.ones(2, 64),
        return_dict=False,
    )
    with torch.no_grad():
        torch.testing.assert_close(loaded(**kw)[0], b.module(**kw)[0], rtol=0, atol=1e-6)
        b.module.disable_adapters()
        assert not torch.allclose(loaded(**kw)[0], b.module(**kw)[0], atol=1e-4)  # the LoRA matters


def test_a_parameter_that_never_had_a_gradient_resumes_without_optimizer_state(tmp_path):
    """LoRA on Qwen-Image's last block's `to_add_out` (the text stream's output, which no later
    layer reads) gets no gradient, so the saving run holds no optimizer state for it; a fresh
    backend's load template has one. The load keeps what was saved: the resumed backend has the
    saved optimizer state (none for that parameter) and trains on as the run that never stopped."""
    from unirl.models.qwenimage.bundle import tiny_transformer
    from unirl.models.qwenimage.config import TinyQwenImageConfig
    from unirl.train.backend import LoRAConfig

    def backend() -> TrainBackend:
        torch.manual_seed(0)
        module = tiny_transformer(TinyQwenImageConfig(num_layers=1))
        lora = LoRAConfig(rank=2, alpha=4, target_modules=["to_q", "to_add_out"])
        return TrainBackend(module, lora, OptimConfig(lr=1e-2), 10)

    def step(b: TrainBackend) -> None:
        out = b.module(
            hidden_states=torch.ones(1, 16, 12), timestep=torch.tensor([0.5]),
            encoder_hidden_states=torch.ones(1, 4, 32), img_shapes=[[(1, 4, 4)]], return_dict=False,
        )[0]  # fmt: skip
        out.square().mean().backward()
        b.optimizer_step()

    saved, straight = backend(), backend()
    for b in (saved, straight):
        step(b)
        step(b)
    stateless = [n for n, p in saved.named_params if p not in saved.optimizer.state]
    assert stateless and all("to_add_out" in n for n in stateless)
    save_train_state(str(tmp_path), saved, rank=0)
    resumed = backend()
    load_train_state(str(tmp_path), resumed, rank=0)
    assert len(resumed.optimizer.state) == len(saved.optimizer.state)
    step(resumed)
    step(straight)
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(resumed.named_params, straight.named_params, strict=True))
