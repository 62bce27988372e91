"""Human Preference Score v2 / v2.1 (HPSv2, Wu et al. 2023) from local files, without open_clip.

HPSv2 is open_clip's ViT-H-14 fine-tuned on human preferences; its checkpoints
(`HPS_v2_compressed.pt`, `HPS_v2.1_compressed.pt`) are open_clip state dicts (under `state_dict`,
or bare). The score of an image is the `hpsv2` package's: the cosine of the unit-norm image and
text embeddings (`image_features @ text_features.T`, its diagonal; no logit scale), about 0.2-0.3
for real images. Here the checkpoint is converted to a transformers `CLIPModel` (`open_clip_to_hf`:
open_clip's OpenAI-layout names, fused q/k/v split, projections transposed) whose architecture
comes from `clip_path`'s `config.json`, and the inputs are made by `clip_path`'s `CLIPProcessor`:
both the files of `laion/CLIP-ViT-H-14-laion2B-s32B-b79K` (the base HPS was trained from; its
processor is open_clip's eval transform: shortest side to 224 bicubic, centre crop, OpenAI mean /
std; the same BPE vocabulary, pooled at the end-of-text token).
"""

from __future__ import annotations

import re

import torch

from unirl.reward.local.clip import ClipBackbone
from unirl.reward.local.files import require_file
from unirl.types.reward import RewardRequest

_BLOCK = re.compile(r"^(visual\.)?transformer\.resblocks\.(\d+)\.(.+)$")
_BLOCK_PARTS = {
    "ln_1": "layer_norm1",
    "ln_2": "layer_norm2",
    "attn.out_proj": "self_attn.out_proj",
    "mlp.c_fc": "mlp.fc1",
    "mlp.c_proj": "mlp.fc2",
}
_TOP = {
    "visual.conv1.weight": "vision_model.embeddings.patch_embedding.weight",
    "visual.class_embedding": "vision_model.embeddings.class_embedding",
    "visual.positional_embedding": "vision_model.embeddings.position_embedding.weight",
    "visual.ln_pre.weight": "vision_model.pre_layrnorm.weight",
    "visual.ln_pre.bias": "vision_model.pre_layrnorm.bias",
    "visual.ln_post.weight": "vision_model.post_layernorm.weight",
    "visual.ln_post.bias": "vision_model.post_layernorm.bias",
    "token_embedding.weight": "text_model.embeddings.token_embedding.weight",
    "positional_embedding": "text_model.embeddings.position_embedding.weight",
    "ln_final.weight": "text_model.final_layer_norm.weight",
    "ln_final.bias": "text_model.final_layer_norm.bias",
    "logit_scale": "logit_scale",
}
_PROJECTIONS = {"visual.proj": "visual_projection.weight", "text_projection": "text_projection.weight"}
_IGNORED = ("attn_mask",)  # a buffer older open_clip versions saved


def open_clip_to_hf(state: dict[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    """A transformers `CLIPModel` state dict from an open_clip (OpenAI-layout ViT) one; a key it
    does not know raises naming `where` and the key (e.g. a ResNet or a timm tower)."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        key = key.removeprefix("module.")
        if key in _IGNORED:
            continue
        if key in _TOP:
            out[_TOP[key]] = value
            continue
        if key in _PROJECTIONS:  # open_clip multiplies x @ proj; a Linear holds proj.T
            out[_PROJECTIONS[key]] = value.t().contiguous()
            continue
        block = _BLOCK.match(key)
        if block is None:
            raise ValueError(
                f"{where}: {key!r} is not a key of open_clip's ViT CLIP (is this an HPS checkpoint?)"
            )
        tower = "vision_model" if block.group(1) else "text_model"
        prefix, rest = f"{tower}.encoder.layers.{block.group(2)}", block.group(3)
        if rest.startswith("attn.in_proj_"):
            kind = rest.removeprefix("attn.in_proj_")  # weight [3D, D] or bias [3D]: q, k, v stacked
            for name, part in zip(("q", "k", "v"), value.chunk(3, dim=0), strict=True):
                out[f"{prefix}.self_attn.{name}_proj.{kind}"] = part.contiguous()
            continue
        module, _, leaf = rest.rpartition(".")
        if module not in _BLOCK_PARTS:
            raise ValueError(f"{where}: {key!r} is not a key of open_clip's ViT CLIP block")
        out[f"{prefix}.{_BLOCK_PARTS[module]}.{leaf}"] = value
    return out


def load_open_clip_state(path: str) -> dict[str, torch.Tensor]:
    """The open_clip state dict in `path` (a torch file holding it bare or under `state_dict`)."""
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file is the same user error
        raise ValueError(
            f"HPSv2: {path} is not a readable torch checkpoint ({type(e).__name__}: {e})"
        ) from None
    state = blob.get("state_dict", blob) if isinstance(blob, dict) else None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"HPSv2: {path} holds no state dict (a dict of tensors, bare or under 'state_dict')")
    return state


class HPSv2:
    """Scorer: HPSv2 / v2.1 of each image against its prompt, [B] fp32 (module docstring).

    Args:
        checkpoint_path: the HPS checkpoint file (`HPS_v2_compressed.pt` or `HPS_v2.1_compressed.pt`).
        clip_path: a directory with the CLIP `config.json` of its architecture and its
            `CLIPProcessor` files (laion/CLIP-ViT-H-14-laion2B-s32B-b79K's; its weights are not read).
        batch_size, device, dtype, offload: as `PickScore`'s.

    Missing files are named when the scorer is built; a checkpoint whose keys or shapes are not
    the configured CLIP's fails its first call naming the file and the keys.
    """

    def __init__(
        self,
        checkpoint_path: str,
        clip_path: str,
        batch_size: int = 16,
        device: str = "cpu",
        dtype: str = "float32",
        offload: bool = False,
    ) -> None:
        require_file(
            "HPSv2",
            "checkpoint_path",
            checkpoint_path,
            "HPS_v2_compressed.pt or HPS_v2.1_compressed.pt (xswu/HPSv2)",
        )
        self.checkpoint_path = checkpoint_path
        what = " (laion/CLIP-ViT-H-14-laion2B-s32B-b79K's config, preprocessor and tokenizer files)"
        self.clip = ClipBackbone(
            "HPSv2", clip_path, None, device, dtype, what, batch_size, offload, state_dict=self._weights
        )

    def _weights(self) -> dict[str, torch.Tensor]:
        state = open_clip_to_hf(load_open_clip_state(self.checkpoint_path), f"HPSv2 {self.checkpoint_path}")
        return _checked(state, self.checkpoint_path, self.clip.model_path)

    def __call__(self, req: RewardRequest) -> torch.Tensor:
        """[B] fp32 scores of `req.images` ([B, 3, H, W] uint8) against `req.prompts`."""
        return self.clip.cosines(req.require_images("HPSv2"), req.prompts).float().cpu()


def _checked(state: dict[str, torch.Tensor], path: str, config_dir: str) -> dict[str, torch.Tensor]:
    """`state`, or a ValueError naming what does not fit the CLIP that `config_dir` configures."""
    from transformers import CLIPConfig, CLIPModel

    with torch.device("meta"):
        want = CLIPModel(CLIPConfig.from_pretrained(config_dir)).state_dict()
    want = {k: v for k, v in want.items() if not k.endswith("position_ids")}
    missing, unexpected = sorted(set(want) - set(state)), sorted(set(state) - set(want))
    wrong = sorted(k for k in set(want) & set(state) if tuple(want[k].shape) != tuple(state[k].shape))
    if missing or unexpected or wrong:
        raise ValueError(
            f"HPSv2: {path} does not fit the CLIP of {config_dir}/config.json: missing {missing[:4]}, "
            f"unexpected {unexpected[:4]}, other shapes {wrong[:4]}; pair the checkpoint with its CLIP's config"
        )
    return state
