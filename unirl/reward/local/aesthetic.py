"""The LAION aesthetic predictor v2 (improved-aesthetic-predictor), DDPO's and Flow-GRPO's
aesthetic reward, from local files.

The score of an image is an MLP over its unit-norm CLIP image embedding: CLIP ViT-L/14
(`openai/clip-vit-large-patch14`, a transformers `CLIPModel` + `CLIPProcessor` directory, loaded
by `ClipBackbone`) and the predictor's `sac+logos+ava1-l14-linearMSE.pth` (a state dict of
`layers.{0,2,4,6,7}`: Linear(768, 1024), Dropout, Linear(1024, 128), Dropout, Linear(128, 64),
Dropout, Linear(64, 16), Linear(16, 1), with no activations, as published). Scores are on the
AVA scale (about 1-10; 5-6 for ordinary photographs). The MLP's input width is read from the file,
so a smaller CLIP with a predictor trained on its embeddings loads the same way.
"""

from __future__ import annotations

import torch
from torch import nn

from unirl.reward.local.clip import ClipBackbone
from unirl.reward.local.files import require_file
from unirl.types.reward import RewardRequest

LAYERS = (
    "layers.0",
    "layers.2",
    "layers.4",
    "layers.6",
    "layers.7",
)  # the Linear layers of the published MLP


def aesthetic_mlp(width: int) -> nn.Sequential:
    """The published predictor's MLP over `width`-dim embeddings (dropout is off in eval)."""
    return nn.Sequential(
        nn.Linear(width, 1024), nn.Dropout(0.2), nn.Linear(1024, 128), nn.Dropout(0.2),
        nn.Linear(128, 64), nn.Dropout(0.1), nn.Linear(64, 16), nn.Linear(16, 1),
    )  # fmt: skip


class AestheticScore:
    """Scorer: the LAION aesthetic predictor v2's score of each image, [B] fp32.

    Args:
        clip_path: local directory of the CLIP ViT-L/14 `CLIPModel` (and its processor, unless
            `processor_path` names another).
        mlp_path: the predictor's state dict file (`sac+logos+ava1-l14-linearMSE.pth`).
        processor_path, batch_size, device, dtype, offload: as `PickScore`'s (with `offload` the
            MLP moves with the CLIP model).

    Missing files, or a state dict that is not the published MLP's (its keys and shapes), are a
    `ValueError` naming the path when the scorer is built.
    """

    def __init__(
        self,
        clip_path: str,
        mlp_path: str,
        processor_path: str | None = None,
        batch_size: int = 16,
        device: str = "cpu",
        dtype: str = "float32",
        offload: bool = False,
    ) -> None:
        what = " (openai/clip-vit-large-patch14's files)"
        self.clip = ClipBackbone(
            "AestheticScore", clip_path, processor_path, device, dtype, what, batch_size, offload
        )
        require_file(
            "AestheticScore",
            "mlp_path",
            mlp_path,
            "the predictor's sac+logos+ava1-l14-linearMSE.pth (improved-aesthetic-predictor)",
        )
        state = torch.load(mlp_path, map_location="cpu", weights_only=True)
        want = {f"{name}.{p}" for name in LAYERS for p in ("weight", "bias")}
        if not isinstance(state, dict) or set(state) != want:
            got = sorted(state)[:6] if isinstance(state, dict) else type(state).__name__
            raise ValueError(
                f"AestheticScore: {mlp_path} is not the aesthetic predictor's state dict (keys {sorted(want)}); got {got}"
            )
        self.mlp = aesthetic_mlp(state["layers.0.weight"].shape[1])
        try:
            self.mlp.load_state_dict({k.removeprefix("layers."): v for k, v in state.items()})
        except RuntimeError as exc:
            raise ValueError(f"AestheticScore: {mlp_path} does not fit the predictor's MLP: {exc}") from exc
        self.mlp = (
            self.mlp.eval().requires_grad_(False).to("cpu" if offload else self.clip.device, self.clip.dtype)
        )

    @torch.no_grad()
    def __call__(self, req: RewardRequest) -> torch.Tensor:
        """[B] fp32 scores of `req.images` ([B, 3, H, W] uint8)."""
        images = req.require_images("AestheticScore")
        with self.clip.on_device(self.mlp):
            return self.mlp(self.clip.images(images)).squeeze(1).float().cpu()
