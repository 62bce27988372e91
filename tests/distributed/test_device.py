"""`resolve_device` and `avoid_cudnn_attention`: the CPU answers here, the CUDA ones in the
`gpu` tier (tests/trainer/test_device_placement.py)."""

from __future__ import annotations

import pytest
import torch

from unirl.distributed.device import avoid_cudnn_attention, process_group_backend, resolve_device


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
