"""EMA of trainable weights: update math, swap, state round trip, LoRA and FSDP2 DTensor params."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.gloo import join_gloo
from unirl.train.backend import LoRAConfig, OptimConfig, TrainBackend
from unirl.train.ema import EMA, EMAConfig


def _linear() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(3, 2)


def _step(module: torch.nn.Module, seed: int) -> None:
    """Stand-in for an optimizer step: move every parameter by a seeded random amount."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=gen))


def _snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


@pytest.mark.parametrize(
    "config, expected_decays",
    [
        (EMAConfig(decay=0.9), [0.9, 0.9, 0.9]),
        # (1 + t) / (10 + t) = 0.1, 2/11, 0.25 -> the third is capped at decay
        (EMAConfig(decay=0.2, schedule="warmup"), [0.1, 2 / 11, 0.2]),
    ],
)
def test_update_matches_hand_computation(config: EMAConfig, expected_decays: list[float]) -> None:
    module = _linear()
    ema = EMA(list(module.named_parameters()), config)
    hand = {n: p.detach().double() for n, p in module.named_parameters()}
    for t, expected in enumerate(expected_decays):
        _step(module, seed=t)
        d = ema.update()
        assert d == pytest.approx(expected) and ema.decay_at(t) == d
        for n, p in module.named_parameters():
            hand[n] = expected * hand[n] + (1 - expected) * p.detach().double()
    assert ema.num_updates == 3
    shadow = ema.state_dict()["shadow"]
    for n, value in hand.items():
        assert shadow[n].dtype == torch.float32
        torch.testing.assert_close(shadow[n].double(), value, rtol=0, atol=1e-6)


def test_warmup_steps_copy_the_weights_first() -> None:
    ema = EMA(list(_linear().named_parameters()), EMAConfig(decay=0.3, schedule="warmup", warmup_steps=2))
    assert [ema.decay_at(t) for t in range(4)] == pytest.approx([0.0, 0.0, 0.25, 0.3])


def test_swap_yields_shadow_and_restores_live_bit_equal() -> None:
    module = _linear()
    ema = EMA(list(module.named_parameters()), EMAConfig(decay=0.5))
    _step(module, seed=0)
    ema.update()
    _step(module, seed=1)
    live = _snapshot(module)
    shadow = {n: t.clone() for n, t in ema.state_dict()["shadow"].items()}

    with ema.swap():
        for n, p in module.named_parameters():
            assert torch.equal(p, shadow[n])
        with pytest.raises(RuntimeError, match="inside EMA.swap"):
            ema.update()
    for n, p in module.named_parameters():
        assert torch.equal(p, live[n])

    with pytest.raises(ValueError, match="boom"), ema.swap():
        raise ValueError("boom")
    for n, p in module.named_parameters():
        assert torch.equal(p, live[n])

    ema.copy_to_params()
    for n, p in module.named_parameters():
        assert torch.equal(p, shadow[n])


def test_state_dict_round_trip_reproduces_next_update() -> None:
    module = _linear()
    config = EMAConfig(decay=0.99, schedule="warmup")
    ema = EMA(list(module.named_parameters()), config)
    for seed in range(2):
        _step(module, seed)
        ema.update()
    state = copy.deepcopy(ema.state_dict())

    _step(module, seed=5)  # the fresh EMA starts from different values: loading must overwrite them
    fresh = EMA(list(module.named_parameters()), config)
    fresh.load_state_dict(state)
    assert fresh.num_updates == 2
    assert fresh.update() == ema.update()
    for n, t in ema.state_dict()["shadow"].items():
        assert torch.equal(fresh.state_dict()["shadow"][n], t)


def test_load_state_dict_names_wrong_keys_and_shapes() -> None:
    ema = EMA(list(_linear().named_parameters()), EMAConfig())
    state = ema.state_dict()
    renamed = {
        "num_updates": 0,
        "shadow": {"wieght" if n == "weight" else n: t for n, t in state["shadow"].items()},
    }
    with pytest.raises(KeyError, match=r"missing \['weight'\], unexpected \['wieght'\]"):
        ema.load_state_dict(renamed)
    reshaped = {"num_updates": 0, "shadow": {**state["shadow"], "bias": torch.zeros(5)}}
    with pytest.raises(ValueError, match="'bias' has shape"):
        ema.load_state_dict(reshaped)


@pytest.mark.parametrize(
    "field, value",
    [("decay", 1.0), ("decay", 0.0), ("schedule", "cosine"), ("warmup_steps", -1), ("update_on", "epoch")],
)
def test_invalid_config_names_the_key(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"train.ema.{field}"):
        EMAConfig(**{field: value})


def test_ema_over_lora_tracks_only_adapter_params() -> None:
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(0)
    model = SD3Transformer2DModel(
        sample_size=8,
        patch_size=2,
        in_channels=3,
        out_channels=3,
        num_layers=1,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=16,
        caption_projection_dim=16,
        pooled_projection_dim=16,
        pos_embed_max_size=4,
    )
    backend = TrainBackend(model, LoRAConfig(rank=2), OptimConfig(), total_steps=1)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert [id(p) for _, p in named] == [id(p) for p in backend.params]
    ema = EMA(named, EMAConfig(decay=0.5))
    assert set(ema.state_dict()["shadow"]) == {n for n, _ in named}
    assert all("lora_" in n for n, _ in named)

    adapter_before = {n: p.detach().clone() for n, p in named}
    _step(model, seed=0)  # moves base and adapter weights alike
    ema.update()
    after = _snapshot(model)
    with ema.swap():
        for n, p in model.named_parameters():
            if p.requires_grad:  # decay 0.5: halfway between the initial and the moved weights
                torch.testing.assert_close(p.detach(), 0.5 * (adapter_before[n] + after[n]))
            else:  # base weights are not tracked and stay as they are
                assert torch.equal(p, after[n])


def test_ema_over_fsdp2_dtensor_params(tmp_path) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    join_gloo(0, 1, str(tmp_path))
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        plain = copy.deepcopy(model)  # same weights, for forwards with given full tensors
        fully_shard(model)
        named = list(model.named_parameters())
        assert all(isinstance(p, DTensor) for _, p in named)
        ema = EMA(named, EMAConfig(decay=0.5))
        shadow = ema.state_dict()["shadow"]
        assert all(isinstance(shadow[n], DTensor) and shadow[n].placements == p.placements for n, p in named)

        # on one rank full_tensor() may alias the local shard: clone to keep a snapshot
        before = {n: p.full_tensor().clone() for n, p in named}
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(3, 4)
        model(x).square().sum().backward()
        optimizer.step()
        assert ema.update() == 0.5
        live = {n: p.full_tensor().clone() for n, p in named}
        expected = {n: 0.5 * (before[n] + live[n]) for n in live}
        for n in live:
            torch.testing.assert_close(shadow[n].full_tensor(), expected[n])

        with torch.no_grad():
            model(x)  # a no_grad forward leaves the root all-gathered: swap must reshard
            with ema.swap(fsdp_module=model):
                torch.testing.assert_close(model(x), torch.func.functional_call(plain, expected, (x,)))
            for n, p in named:
                assert torch.equal(p.full_tensor(), live[n])
            torch.testing.assert_close(model(x), torch.func.functional_call(plain, live, (x,)))
    finally:
        dist.destroy_process_group()
