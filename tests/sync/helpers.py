"""Weight-sync test subjects: tiny real models (diffusers SD3 transformer, transformers Qwen3 with
peft LoRA) with seeded weights, and `SyncActor`, one side of a sync in its own Ray process."""

from __future__ import annotations

from typing import Any

import torch

from unirl.sync import SyncPlan, WeightSyncConfig, bind, make_receiver, make_sender, plan_for, select

SD3_LORA = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "proj_out"]
LM_LORA = ["q_proj", "v_proj", "down_proj"]


def fill(module: torch.nn.Module, seed: int, only_lora: bool = False) -> torch.nn.Module:
    """Overwrite parameters (or only the LoRA ones) with seeded normal values: no zero-init LoRA B,
    and two seeds give weights that differ everywhere."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if not only_lora or "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return module


def sd3(seed: int = 0, layers: int = 2) -> torch.nn.Module:
    from unirl.models.sd3.bundle import SD3Bundle, TinySD3Config

    return fill(
        SD3Bundle.tiny_transformer(TinySD3Config(resolution=32, patch_size=4, num_layers=layers)), seed
    )


def lm(seed: int = 0) -> torch.nn.Module:
    from unirl.models.causal_lm import TinyLMConfig
    from unirl.models.qwen import QwenBundle

    return fill(QwenBundle.tiny(TinyLMConfig()).model, seed)


def with_lora(
    module: torch.nn.Module,
    seed: int,
    targets: list[str],
    adapter: str = "default",
    alpha: float = 16.0,
    peft_model: bool = False,
) -> torch.nn.Module:
    """`module` with a peft LoRA (rank 4) on `targets`, seeded LoRA weights. `peft_model`: wrap with
    `peft.get_peft_model` (names gain `base_model.model.`) instead of the library's `add_adapter`."""
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=4, lora_alpha=alpha, target_modules=targets)
    if peft_model:
        module = get_peft_model(module, cfg, adapter_name=adapter)
    else:
        module.add_adapter(cfg, adapter_name=adapter)
    return fill(module, seed, only_lora=True)


def build(model: str, seed: int, lora: dict | None = None) -> torch.nn.Module:
    """A test subject by description: model "sd3" | "lm", base weights from `seed`, and
    `lora` ({seed, targets, adapter, alpha, peft_model}) when given."""
    module = sd3(seed) if model == "sd3" else lm(seed)
    if lora is not None:
        module = with_lora(module, **lora)
    return module


def forward(module: torch.nn.Module, model: str) -> torch.Tensor:
    """A fixed-input forward of a test subject (same inputs on every process)."""
    gen = torch.Generator().manual_seed(123)
    with torch.no_grad():
        if model == "lm":
            return module(input_ids=torch.randint(0, 250, (2, 12), generator=gen)).logits
        return module(
            hidden_states=torch.randn(2, 3, 32, 32, generator=gen),
            encoder_hidden_states=torch.randn(2, 8, 64, generator=gen),
            pooled_projections=torch.randn(2, 64, generator=gen),
            timestep=torch.tensor([500.0, 250.0]),
        ).sample


class SyncActor:
    """One side of a weight sync in its own process (a Ray actor): builds a subject module, then a
    sender or a receiver of any backend, and syncs through it."""

    def __init__(self) -> None:
        torch.set_num_threads(1)
        self.module: torch.nn.Module | None = None
        self.sender = self.receiver = None

    def build(self, model: str, seed: int, lora: dict | None = None) -> None:
        self.close()
        self.model, self.module = model, build(model, seed, lora)

    def build_fsdp(self, rank: int, world: int, port: int, seed: int) -> None:
        """Trainer rank `rank` of `world`: the SD3 subject fully fine-tuned under FSDP2 (gloo) with
        activation checkpointing, as `TrainBackend` wraps it."""
        import torch.distributed as dist

        from unirl.train.backend import OptimConfig, TrainBackend
        from unirl.train.fsdp import FSDPConfig

        self.close()
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        fsdp = FSDPConfig(block_classes=["JointTransformerBlock"], activation_checkpointing=True)
        self.backend = TrainBackend(sd3(seed), None, OptimConfig(), total_steps=1, fsdp=fsdp)
        self.model, self.module = "sd3", self.backend.module

    def full_state(self) -> dict[str, torch.Tensor]:
        """The trainer backend's consolidated weights (collective under FSDP)."""
        return self.backend.full_trainable_state()

    def plan(self, kind: str, cfg: dict) -> SyncPlan:
        return plan_for(self.module, kind, WeightSyncConfig(**cfg))

    def make_sender(
        self,
        cfg: dict,
        plan: SyncPlan,
        num_receivers: int = 1,
        source: bool = True,
        corrupt: tuple[int, int] | None = None,
    ) -> Any:
        """Become a sender; returns its endpoint. `corrupt` = (version, bucket): flip one byte of that
        bucket of that version after its checksum was written, to test the receiver's check."""
        wcfg = WeightSyncConfig(**cfg)
        self.sender = make_sender(wcfg, plan, num_receivers=num_receivers, source=source)
        if corrupt is not None:
            put = self.sender._put

            def corrupted(ticket: Any, index: int, frame: torch.Tensor) -> Any:
                if (ticket.version, index) == corrupt:
                    frame[0] ^= 1
                return put(ticket, index, frame)

            self.sender._put = corrupted
        return self.sender.endpoint()

    def make_receiver(self, cfg: dict, plan: SyncPlan, endpoint: Any, index: int = 0) -> None:
        self.receiver = make_receiver(WeightSyncConfig(**cfg), plan, endpoint, index)
        self.into = bind(self.module, plan) if self.module is not None else None

    def connect(self) -> None:
        (self.sender or self.receiver).connect()

    def send(self, version: int) -> Any:
        return self.sender.send(self.module.named_parameters(), version)

    def receive(self, ticket: Any = None) -> dict[str, float]:
        self.receiver.receive(ticket, into=self.into)
        return self.receiver.stats

    def state(self, kind: str) -> dict[str, torch.Tensor]:
        """The module's tensors a `kind` sync carries, by canonical name, as CPU copies."""
        return {n: t.detach().clone() for n, t in select(self.module.named_parameters(), kind).items()}

    def perturb(self, kind: str, seed: int) -> None:
        """A stand-in for an optimizer step: seeded noise on every tensor a `kind` sync carries."""
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in select(self.module.named_parameters(), kind).values():
                p.add_(torch.randn(p.shape, generator=gen) * 0.01)

    def forward(self) -> torch.Tensor:
        return forward(self.module, self.model)

    def close(self) -> None:
        import torch.distributed as dist

        for side in (self.sender, self.receiver):
            if side is not None:
                side.close()
        self.sender = self.receiver = None
        if dist.is_initialized():  # an FSDP trainer's group
            dist.destroy_process_group()
