"""Every tensor a worker touches is on the device it was told; what reaches the driver is on the CPU.

Drives one `RLWorker` in-process (`unirl.distributed.group.in_process`,
the same call interface as a Ray group) through rollout, transport, training,
checkpoint save and load, and walks every tensor it holds: the bundle's
modules, trainable weights and their gradients, optimizer moments, the EMA
shadow, the reference copy, prompt encodings, trajectories and fetched
tracks. On CPU this pins the walk and the contracts (fetched metas carry CPU
tensors, what the driver gets is on the CPU); the `gpu` variant runs the same
test on CUDA.
"""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from tests.conftest import KERNEL_ROUNDING
from tests.recipes import composed
from unirl.algorithms.advantages import track_advantages
from unirl.dataplane import get_batch, make_transport
from unirl.distributed.group import in_process
from unirl.trainer.modality import modality_for
from unirl.trainer.worker import RLWorker, build

EMA = "+train.ema={_target_: unirl.train.ema.EMAConfig, decay: 0.9}"
CASES = {
    # LoRA + EMA + bf16 autocast of the denoiser
    "lora_ema_bf16": [EMA, "+stage.autocast_dtype=bfloat16"],
    # full fine-tune with a KL term: the backend keeps a reference copy of the initial weights
    "full_reference": ["train.lora=null", "algorithm.config.beta=0.04", EMA],
}
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def recipe(tmp_path, overrides):
    cfg = composed("diffusion/tiny_sd3_flowgrpo", tmp_path, "transport=inband", *overrides)
    plain = OmegaConf.to_container(cfg, resolve=True)
    plain.pop("hydra", None)
    return cfg, plain


def walk(obj, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor inside nested dicts / lists / dataclasses, by a readable path."""
    out: dict[str, torch.Tensor] = {}
    if isinstance(obj, torch.Tensor):
        out[prefix] = obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out.update(walk(v, f"{prefix}.{k}"))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(walk(v, f"{prefix}[{i}]"))
    elif hasattr(obj, "__dataclass_fields__"):
        for k in obj.__dataclass_fields__:
            out.update(walk(getattr(obj, k), f"{prefix}.{k}"))
    return out


def worker_tensors(worker: RLWorker) -> dict[str, torch.Tensor]:
    """Modules of the bundle (params, buffers, grads) and the backend's whole train state."""
    found: dict[str, torch.Tensor] = {}
    for name, component in worker.bundle.pipeline.components.items():
        if isinstance(component, torch.nn.Module):
            for n, t in [*component.named_parameters(), *component.named_buffers()]:
                found[f"{name}.{n}"] = t
                if t.grad is not None:
                    found[f"{name}.{n}.grad"] = t.grad
    state = worker.backend.state_dict()
    # Adam's step counter stays a CPU scalar by PyTorch's design (non-capturable optimizers)
    tensors = {k: t for k, t in walk(state, "backend").items() if not k.endswith(".step")}
    assert any(k.startswith("backend.optim") for k in tensors), "no optimizer state was walked"
    found.update(tensors)
    return found


def off_device(tensors: dict[str, torch.Tensor], device: torch.device) -> list[str]:
    return [f"{k} on {t.device}" for k, t in tensors.items() if t.device != device]


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("device", DEVICES)
def test_every_tensor_of_a_worker_is_on_its_device(tmp_path, device, case):
    cfg, plain = recipe(tmp_path, CASES[case])
    group = in_process(RLWorker, plain, 4, str(tmp_path / "base"), {}, device=device)
    worker = group.worker
    want = torch.device(device, 0) if device == "cuda" else torch.device(device)
    assert worker.device == want and group.model_info()["device"] == str(want)
    if "full_reference" in case:
        assert worker.backend.state_dict().get("reference"), "the reference copy is not kept"
    assert worker.backend.ema is not None

    sampling, reward, advantage = build(cfg.sampling), build(cfg.reward), build(cfg.advantage)
    modality = modality_for(sampling, group.model_info())
    examples = build(cfg.data_source).next_batch(int(cfg.prompts_per_rollout))
    driver = make_transport(cfg.transport)  # the driver's own transport delivers onto the CPU
    for step in range(2):
        req = modality.request(examples, step)
        # the engine's own output: trajectories, log-probs, prompt encodings, media
        track = worker.engine.generate(req).track(worker.engine.track_name)
        assert not off_device(walk(track, "track"), want)
        meta = group.rollout(req, f"step_{step}")
        assert not off_device(walk(meta.skeleton.shared, "meta"), torch.device("cpu"))
        assert not off_device(walk(get_batch(worker.transport, meta), "fetched"), want)
        scored = get_batch(driver, meta, modality.reward_fields)
        assert scored.media.device.type == "cpu"
        reward.score_and_attach(scored)
        track_advantages(scored, advantage)
        metrics = group.train(meta, scored.rewards, scored.advantages, step / 2)
        if step == 0:  # on-policy, pi_old from the rollout: the first ratio is 1 (also in bf16)
            assert abs(metrics[0]["ratio/first_update_mean"] - 1.0) <= KERNEL_ROUNDING
    assert worker.backend.optimizer_steps == 2
    assert not off_device(worker_tensors(worker), want)

    eval_media = group.sample_eval(req, None, "rewrite", True)  # EMA weights swapped in; media reaches the driver on CPU
    assert eval_media.device.type == "cpu" and eval_media.dtype == torch.uint8
    assert not off_device(worker_tensors(worker), want)

    ckpt = str(tmp_path / "ckpt")
    group.save_checkpoint(ckpt, str(tmp_path / "base"))
    before = {k: t.detach().cpu().clone() for k, t in worker_tensors(worker).items() if "grad" not in k}
    group.train(meta, scored.rewards, scored.advantages, 1.0)
    group.load_checkpoint(ckpt)
    after = worker_tensors(worker)
    assert not off_device(after, want)
    changed = [k for k, t in before.items() if not torch.equal(after[k].detach().cpu(), t)]
    assert not changed, changed[:5]
    group.teardown()
