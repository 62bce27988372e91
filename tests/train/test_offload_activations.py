"""Activation offload (`train.stack.offload_activations`): the saved tensors of the train forward
go to pinned host memory and back; the gradients are the same and the GPU holds less (GPU tests,
`pytest -m gpu`); a CPU worker refuses the option, naming the key (issue 45, item 6)."""

from __future__ import annotations

import pytest
import torch

from tests.algorithms.test_flow_grpo import make_setup, scored_track
from unirl.algorithms.flow_grpo import FlowGRPOConfig
from unirl.train.stack import TrainStack, TrainStackConfig


def test_a_cpu_worker_refuses_activation_offload():
    stage, backend, stack, _ = make_setup(FlowGRPOConfig())
    with pytest.raises(
        ValueError, match="train.stack.offload_activations needs a GPU worker; this one computes on cpu"
    ):
        TrainStack(
            stage, backend, stack.algorithm, TrainStackConfig(micro_batch_size=4, offload_activations=True)
        )


@pytest.mark.gpu
def test_offloaded_activations_train_like_kept_ones_with_less_gpu_memory():
    torch.manual_seed(0)
    stage, backend, stack, sp = make_setup(FlowGRPOConfig(clip_range=0.2))
    device = torch.device("cuda", 0)
    stage.bundle.to(device)  # in place: the backend's parameters and optimizer follow
    track = scored_track(stage, sp)
    assert track.segment.log_probs.device == device
    results = {}
    for offload in (False, True, False):
        stack.config = TrainStackConfig(micro_batch_size=4, offload_activations=offload)
        backend.optimizer.zero_grad(set_to_none=True)
        micro, ctx = stack.prepare(track, 0.0)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        stack.backward(micro, ctx)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(device) - base
        grads = [p.grad.detach().clone() for p in backend.params]
        results.setdefault(offload, []).append((peak, grads))
    (peak_kept, grads_kept), (peak_kept2, _) = results[False]
    ((peak_off, grads_off),) = results[True]
    for a, b in zip(grads_off, grads_kept, strict=True):
        torch.testing.assert_close(a, b)
    assert peak_off < min(peak_kept, peak_kept2), (peak_off, peak_kept, peak_kept2)
