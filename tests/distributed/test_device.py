"""`resolve_device` and `avoid_cudnn_attention`: the CPU answers here, the CUDA ones in the
`gpu` tier (tests/trainer/test_device_placement.py)."""

from __future__ import annotations

import pytest
import torch

from unirl.distributed.device import (
    avoid_cudnn_attention,
    build_bundle,
    process_group_backend,
    resolve_device,
)


def test_cpu_is_resolved_and_its_backend_is_gloo() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert process_group_backend(resolve_device("cpu")) == "gloo"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_cuda_without_cuda_is_refused_naming_the_device() -> None:
    with pytest.raises(RuntimeError, match="'cuda:1' requested but torch sees no CUDA device"):
        resolve_device("cuda:1")


def test_a_device_type_workers_do_not_run_on_is_refused() -> None:
    with pytest.raises(ValueError, match="'meta'.*\\['cpu', 'cuda'\\]"):
        resolve_device("meta")


def test_a_gpu_turns_cudnn_attention_off_and_the_cpu_leaves_it() -> None:
    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        assert avoid_cudnn_attention(torch.device("cpu")) == torch.device("cpu")
        assert torch.backends.cuda.cudnn_sdp_enabled()
        assert avoid_cudnn_attention(torch.device("cuda", 0)) == torch.device("cuda", 0)
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


class _Recorder:
    """A model config whose `build` records the default device it was constructed under."""

    def __init__(self, pretrained_path: str | None) -> None:
        self.pretrained_path = pretrained_path
        self.built_under: torch.device | None = None

    def build(self) -> torch.nn.Module:
        self.built_under = torch.get_default_device()
        return torch.nn.Linear(2, 2)


def test_random_weights_are_constructed_on_the_device_and_a_checkpoint_where_it_is_read() -> None:
    random_model = _Recorder(pretrained_path=None)
    module = build_bundle(random_model, torch.device("meta"))
    assert random_model.built_under == torch.device("meta") and module.weight.device.type == "meta"
    checkpoint = _Recorder(pretrained_path="some/dir")
    module = build_bundle(checkpoint, torch.device("meta"))
    assert checkpoint.built_under == torch.device("cpu") and module.weight.device.type == "meta"
    on_cpu = _Recorder(pretrained_path=None)
    build_bundle(on_cpu, torch.device("cpu"))
    assert on_cpu.built_under == torch.device("cpu")


def test_a_tiny_model_built_for_the_cpu_is_the_plain_build() -> None:
    from unirl.models.qwen import QwenConfig

    cfg = QwenConfig(tiny={})
    torch.manual_seed(0)
    built = build_bundle(cfg, torch.device("cpu"))
    torch.manual_seed(0)
    plain = cfg.build()
    for (name, a), (_, b) in zip(built.model.named_parameters(), plain.model.named_parameters(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_tiny_model_is_built_on_the_gpu_deterministically() -> None:
    from unirl.models.sd3 import SD3ModelConfig

    cfg, device = SD3ModelConfig(), resolve_device("cuda")
    first, second = build_bundle(cfg, device), build_bundle(cfg, device)
    a, b = dict(first.denoiser.named_parameters()), dict(second.denoiser.named_parameters())
    assert all(p.device == device for p in a.values())
    assert all(torch.equal(a[k], b[k]) for k in a)
