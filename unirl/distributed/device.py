"""Where a process computes: the one place that picks a worker's device and its process-group backend.

A worker's device is the GPU Ray assigned it when it has one (Ray exports
``CUDA_VISIBLE_DEVICES`` with the assigned ids, so the first visible GPU is
``cuda:0`` inside the actor), else the CPU. Outside Ray (an in-process worker:
benchmarks, the GPU test tier) it is ``cuda:<LOCAL_RANK>`` when CUDA is
available, else the CPU. The process-group backend follows the device: NCCL for
CUDA tensors, gloo for CPU tensors; FSDP2's device mesh uses the device type.

A process that resolves a CUDA device also turns off PyTorch's cuDNN backend of
``scaled_dot_product_attention`` (`avoid_cudnn_attention`); flash, memory-efficient
and math attention remain.
"""

from __future__ import annotations

import os
from typing import Any

import torch

BACKENDS = {"cuda": "nccl", "cpu": "gloo"}


def _ray_gpu_ids() -> list[str] | None:
    """GPU ids Ray assigned this process, or None outside a Ray worker."""
    try:
        import ray
    except ImportError:  # the GPU tier may run in-process without Ray
        return None
    if not ray.is_initialized():
        return None
    return [str(i) for i in ray.get_gpu_ids()]


def resolve_device(requested: str | torch.device | None = None) -> torch.device:
    """The device this process computes on.

    Args:
        requested: an explicit device ("cpu", "cuda", "cuda:1"; a worker told
            its device; "cuda" resolves to ``cuda:<LOCAL_RANK>``, always indexed) or
            None / "auto" (decide as the module docstring says).

    Raises:
        RuntimeError: a CUDA device is requested and CUDA is not available, or
            Ray assigned this process a GPU that torch cannot see.
    """
    if requested not in (None, "auto"):
        device = torch.device(requested)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"device {str(device)!r} requested but torch sees no CUDA device")
        if device.type not in BACKENDS:
            raise ValueError(f"device {str(device)!r}: UniRL workers run on {sorted(BACKENDS)}")
        if device.type == "cuda" and device.index is None:  # "cuda": this process's GPU, by its index
            device = _local_gpu()
        return avoid_cudnn_attention(device)
    gpu_ids = _ray_gpu_ids()
    if gpu_ids:
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"Ray assigned GPU(s) {gpu_ids} to this worker but torch sees no CUDA device "
                f"(torch {torch.__version__}, CUDA build: {torch.version.cuda}); install a CUDA build of torch"
            )
        return avoid_cudnn_attention(torch.device("cuda", 0))
    if gpu_ids is None and torch.cuda.is_available():
        return avoid_cudnn_attention(_local_gpu())
    return torch.device("cpu")


def build_bundle(model_cfg: Any, device: torch.device) -> Any:
    """`model_cfg.build()` on `device`. A model with random weights (`pretrained_path` unset: a
    tiny or a real-size random config) is constructed on a GPU directly, under
    ``torch.device(device)``: its initialisation runs there, and no copy is held in host memory
    (a Qwen-Image-sized fp32 transformer is 82 GB and minutes of CPU initialisation). A checkpoint,
    and any model on the CPU, is built where it is read, then moved. The dtypes are the builder's
    in both cases; the random draws on a GPU differ from the CPU's (another generator)."""
    if device.type != "cpu" and getattr(model_cfg, "pretrained_path", None) is None:
        with torch.device(device):
            return model_cfg.build().to(device)
    return model_cfg.build().to(device)


def avoid_cudnn_attention(device: torch.device) -> torch.device:
    """`device`, after turning off the cuDNN backend of `scaled_dot_product_attention` in this
    process when `device` is a GPU (process-wide; CPU devices change nothing).

    On an H200 (torch 2.11, cu130) the FLUX.1-dev-sized recipe's first backward failed in the
    cuDNN attention kernel (``mha_graph.execute(...).is_good()``, then an illegal memory
    access), a known cuDNN SDPA defect (pytorch/pytorch#134001, #190321); with cuDNN attention
    off it trains (docs/results/devices.md). SDPA then picks flash, memory-efficient or math.
    """
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)
    return device


def _local_gpu() -> torch.device:
    """``cuda:<LOCAL_RANK>`` (modulo the visible GPUs): always with its index, so a worker's
    device compares equal to the device of every tensor it allocates (a tensor on "cuda" reports
    ``cuda:0``)."""
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())


def process_group_backend(device: torch.device) -> str:
    """ "nccl" for a CUDA device, "gloo" for the CPU."""
    return BACKENDS[device.type]


def init_process_group(device: torch.device, host_collectives: bool = False) -> None:
    """Join the default process group (env:// rendezvous, see `Worker`) with the
    backend of `device`, binding a CUDA device first so NCCL uses it. `host_collectives`: on a
    GPU, also gloo for collectives of host tensors (FSDP2 parameter offload keeps the gradient
    shards there, and clipping reduces their norms: `cpu:gloo,cuda:nccl`)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
        backend = process_group_backend(device)
        dist.init_process_group(f"cpu:gloo,cuda:{backend}" if host_collectives else backend, device_id=device)
    else:
        dist.init_process_group(process_group_backend(device))
