"""PickScore (Kirstain et al. 2023), the reward of Flow-GRPO's PickScore runs, and CLIPScore, from
local directories.

A PickScore checkpoint is a transformers `CLIPModel` (the hub's `yuvalkirstain/PickScore_v1`)
with the `CLIPProcessor` of the CLIP it was tuned from (`laion/CLIP-ViT-H-14-laion2B-s32B-b79K`),
loaded by `ClipBackbone`. A sample's score is Flow-GRPO's `flow_grpo/pickscore_scorer.py`:
`logit_scale.exp() * cos(text embedding, image embedding) * scale`, with `scale` 1/26 there (a
score near 1 for a good match).
"""

from __future__ import annotations

import torch

from unirl.reward.local.clip import ClipBackbone
from unirl.types.reward import RewardRequest


class PickScore:
    """Scorer: PickScore of each image against its prompt, [B] fp32.

    Args:
        model_path: local directory of the PickScore `CLIPModel`.
        processor_path: local directory of its `CLIPProcessor` (None: `model_path`).
        scale: multiplies `logit_scale.exp() * cos` (Flow-GRPO's 1/26; 1.0 gives PickScore's raw
            logit, about 20-23 for real images).
        batch_size: images per forward.
        device, dtype: where and in what precision the model runs (loaded on the first call).
        offload: keep the model in host memory between calls (`ClipBackbone`).

    Missing files are a `ValueError` naming each path when the scorer is built (before Ray, as
    the recipe validator builds reward components).
    """

    def __init__(
        self,
        model_path: str,
        processor_path: str | None = None,
        scale: float = 1.0 / 26.0,
        batch_size: int = 16,
        device: str = "cpu",
        dtype: str = "float32",
        offload: bool = False,
    ) -> None:
        what = (
            " (yuvalkirstain/PickScore_v1's files, and laion/CLIP-ViT-H-14-laion2B-s32B-b79K's "
            "preprocessor and tokenizer files)"
        )
        self.clip = ClipBackbone(
            "PickScore", model_path, processor_path, device, dtype, what, batch_size, offload
        )
        self.scale = float(scale)

    def __call__(self, req: RewardRequest) -> torch.Tensor:
        """[B] fp32 scores of `req.images` ([B, 3, H, W] uint8) against `req.prompts`."""
        cos = self.clip.cosines(req.require_images("PickScore"), req.prompts)
        return (self.clip.logit_scale * cos * self.scale).float().cpu()


class CLIPScore:
    """Scorer: CLIPScore (Hessel et al. 2021) of each image against its prompt,
    `weight * max(cos(text embedding, image embedding), 0)`, [B] fp32.

    Args:
        model_path: local directory of a transformers `CLIPModel` (e.g. the files of
            `openai/clip-vit-large-patch14`); processor_path its `CLIPProcessor` (None: model_path).
        weight: the paper's w (2.5); 100 gives torchmetrics' scale.
        batch_size, device, dtype, offload: as `PickScore`'s.
    """

    def __init__(
        self,
        model_path: str,
        processor_path: str | None = None,
        weight: float = 2.5,
        batch_size: int = 16,
        device: str = "cpu",
        dtype: str = "float32",
        offload: bool = False,
    ) -> None:
        what = " (e.g. openai/clip-vit-large-patch14's files)"
        self.clip = ClipBackbone(
            "CLIPScore", model_path, processor_path, device, dtype, what, batch_size, offload
        )
        if not weight > 0:
            raise ValueError(f"CLIPScore needs weight > 0, got {weight}")
        self.weight = float(weight)

    def __call__(self, req: RewardRequest) -> torch.Tensor:
        """[B] fp32 scores of `req.images` ([B, 3, H, W] uint8) against `req.prompts`."""
        cos = self.clip.cosines(req.require_images("CLIPScore"), req.prompts)
        return (self.weight * cos.clamp(min=0)).float().cpu()


class PickScoreRank(PickScore):
    """Group scorer: each image's PickScore rank among its group's (the prompt's samples), in
    [0, 1]: 0 for the group's lowest score, 1 for its highest, evenly between (ties share their
    mean rank). The rank, not the score, is the reward, so a group's spread is the same whatever
    the prompt's scale of PickScore (a ranking reward as Flow-Factory's PickScore_Rank).
    Arguments as `PickScore`'s; groups need >= 2 samples and must arrive whole
    (`RewardRequest.groups`)."""

    groupwise = True

    def __call__(self, req: RewardRequest) -> torch.Tensor:
        """[B] fp32 ranks of `req.images` within their groups."""
        groups = req.groups("PickScoreRank")
        scores = super().__call__(req)
        out = torch.empty_like(scores)
        for idx in groups:
            if len(idx) < 2:
                raise ValueError(
                    f"PickScoreRank ranks a sample among its group's, but group {req.group_ids[idx[0]]!r} "
                    "has one sample; set sampling.samples_per_prompt >= 2"
                )
            s = scores[idx]
            below = (s[None, :] < s[:, None]).sum(dim=1).float()
            ties = (s[None, :] == s[:, None]).sum(dim=1).float() - 1
            out[idx] = (below + ties / 2) / (len(idx) - 1)
        return out
