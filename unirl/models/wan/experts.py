"""Wan 2.2's two experts as one trainable module.

Wan 2.2 A14B (T2V and I2V) denoises with two `WanTransformer3DModel`s of one architecture:
`transformer` at high noise, `transformer_2` at low noise, switched at the boundary timestep
`boundary_ratio x 1000` (`WanPipeline`: `transformer` for timesteps >= the boundary). `WanExperts`
holds both under those names and routes each row of a batch by its own timestep, so the stage,
replay (which may batch rows of several steps), LoRA, FSDP, checkpoints and weight sync see one
module whose parameters are both experts'. A LoRA injected into it puts an adapter on each
expert, and each expert's adapter is trained by the steps on its side of the boundary only (the
other expert does not run on them). Exported, the LoRA is two diffusers files: the high-noise
expert's in the checkpoint directory, the low-noise expert's under `transformer_2/` (what
`WanPipeline.load_lora_weights(..., load_into_transformer_2=True)` reads).
"""

from __future__ import annotations

import torch
from diffusers import WanTransformer3DModel
from diffusers.loaders.peft import PeftAdapterMixin

EXPERTS = ("transformer", "transformer_2")
"""The experts' names: the module's attribute names, their parameters' name prefixes, and their
pipeline components (high noise, then low noise)."""


class WanExperts(torch.nn.Module, PeftAdapterMixin):
    """Two Wan transformers switched at a boundary timestep (module doc).

    Attributes:
        transformer: the high-noise expert (timesteps >= `boundary_timestep`).
        transformer_2: the low-noise expert.
        boundary_timestep: the switch, `boundary_ratio x 1000` (the scheduler's timesteps).
    """

    def __init__(
        self,
        transformer: WanTransformer3DModel,
        transformer_2: WanTransformer3DModel,
        boundary_timestep: float,
    ) -> None:
        super().__init__()
        self.transformer = transformer
        self.transformer_2 = transformer_2
        self.boundary_timestep = boundary_timestep

    @property
    def config(self):
        """The high-noise expert's config (both experts share the architecture)."""
        return self.transformer.config

    def forward(
        self,
        hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        return_dict: bool = False,
        **kwargs,
    ) -> tuple[torch.Tensor]:
        """The high-noise expert on the rows whose `timestep` [B] is >= the boundary, the low-noise
        one on the rest, each row's output in its place: ([B, C_out, f, h, w],). A batch on one
        side runs that expert alone on the whole batch, as the pipeline does."""
        high = timestep >= self.boundary_timestep

        def run(expert: torch.nn.Module, rows: torch.Tensor | slice) -> torch.Tensor:
            return expert(
                hidden_states=hidden_states[rows],
                timestep=timestep[rows],
                encoder_hidden_states=encoder_hidden_states[rows],
                return_dict=False,
                **kwargs,
            )[0]

        if bool(high.all()):
            return (run(self.transformer, slice(None)),)
        if not bool(high.any()):
            return (run(self.transformer_2, slice(None)),)
        out_high, out_low = run(self.transformer, high), run(self.transformer_2, ~high)
        out = out_high.new_empty((len(high), *out_high.shape[1:]))
        out[high], out[~high] = out_high, out_low
        return (out,)


def expert_states(state: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """A `WanExperts` state dict split per expert ({name: its state, prefix removed})."""
    return {
        name: {k[len(name) + 1 :]: v for k, v in state.items() if k.startswith(name + ".")}
        for name in EXPERTS
    }
