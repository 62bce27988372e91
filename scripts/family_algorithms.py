"""Every diffusion algorithm on one model family through the shared stage: each named recipe
(default: one per algorithm) with its model swapped for the family's tiny pixel-space model and
the family's sampling, 2 steps in this process; prints OK / FAIL per recipe. The reward-backprop
recipes score 32 px images (their learned reward), the rest 16 px.

    python scripts/family_algorithms.py FAMILY [recipe ...]    # FAMILY: flux | kontext | wan | wan22 | qwenimage | qwen_edit | zimage | flux2 | flux2_klein | flux2_edit | hunyuanvideo15 | hunyuanvideo15_i2v | ltx2

- flux: embedded guidance 3.5, `sigma_grid: steps`, dynamic shift.
- kontext: FLUX.1-Kontext, flux's settings at guidance 2.5, the prompts of datasets/tiny_edit (each
  row an edit instruction and its 16 px source image, which rides with every rollout and replay).
- wan: 5-frame videos, classifier-free guidance with the empty prompt, the Euler grid shifted by
  3.0, and every image reward component wrapped in `FrameMean` (its score averaged over frames).
- wan22: wan's settings with two experts (Wan 2.2 A14B-style, boundary 0.875): each expert's LoRA
  trains on the SDE steps on its side.
- qwenimage: true CFG 4.0 against the negative prompt " ", norm rescaled; `sigma_grid: steps`,
  dynamic shift on Qwen-Image's (256, 0.5) - (8192, 0.9) line.
- zimage: Z-Image (latent space: the pipeline decodes with its VAE), CFG 2.0 against the empty
  prompt (the pipeline's guidance 1.0), `sigma_grid: steps` through shift 3.0.
- flux2: FLUX.2-dev (latent space: the pipeline decodes with its VAE), embedded guidance 4.0,
  `sigma_grid: steps` under FLUX.2's empirical mu; flux2_klein: FLUX.2-Klein, the same schedule,
  classifier-free guidance 4.0 against the empty prompt; flux2_edit: FLUX.2-dev reading two
  reference images per row (the rows of datasets/tiny_edit/two_picture_prompts.jsonl, the edits'
  redness).
- hunyuanvideo15: HunyuanVideo 1.5 T2V (latent space), 5-frame videos, CFG 2.0 against the empty
  prompt, the Euler grid shifted by 5.0, image rewards wrapped in `FrameMean` as for wan.
- hunyuanvideo15_i2v: HunyuanVideo 1.5 image-to-video, hunyuanvideo15's settings from the first
  frames of datasets/tiny_edit/first_frame_prompts.jsonl (latents and SigLIP image stream), the
  edits' redness per frame.
- ltx2: LTX-2 audio-video (latent space), 5-frame clips at 25 fps with their soundtracks, CFG 2.0
  in x0 form against the empty prompt, image rewards wrapped in `FrameMean` plus the soundtrack's
  `ToneScore` (weight 5) in the rollout reward (a reward-backprop algorithm's loss scores the frames
  alone: `decode_float` gives pixels).
- qwen_edit: Qwen-Image-Edit-Plus (latent space: the pipeline VAE-encodes its references),
  qwenimage's settings, the rows of datasets/tiny_edit/two_picture_prompts.jsonl (a source and a
  red swatch each, read by the prompt encoder and riding as packed tokens), the edits' redness.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import tempfile
import time

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf, open_dict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo's tests/

from tests.conftest import EXAMPLES  # noqa: E402
from unirl.config.validate import validate_recipe  # noqa: E402
from unirl.trainer.trainer import Trainer  # noqa: E402

RECIPES = [
    "tiny_sd3_flowgrpo", "tiny_sd3_ddpo", "tiny_sd3_dpok", "tiny_sd3_flowdppo", "tiny_sd3_diffusiondpo",
    "shapes_nft", "shapes_dancegrpo", "shapes_mixgrpo", "shapes_draft", "shapes_refl", "shapes_alignprop",
]  # fmt: skip
LEARNED_REWARD = {"shapes_draft", "shapes_refl", "shapes_alignprop"}  # SceneNet scores 32 px


def flux(cfg, size: int, lora_targets: list[str]) -> None:
    cfg.model = {
        "_target_": "unirl.models.flux.FluxModelConfig",
        "pretrained_path": None,
        "tiny": {"resolution": size, "num_layers": 1, "num_single_layers": 1, "clip_max_length": 8},
    }
    cfg.stage._target_ = "unirl.models.flux.FluxStage"
    cfg.sampling.guidance_scale = 3.5
    cfg.sampling.dynamic_shift = True
    cfg.sampling.sigma_grid = "steps"
    lora_targets.append("proj_out")
    cfg.train.fsdp.block_classes = ["FluxTransformerBlock", "FluxSingleTransformerBlock"]


REDNESS = {
    "_target_": "unirl.reward.RewardService",
    "backend": {
        "_target_": "unirl.reward.LocalRewardBackend",
        "components": {"redness": {"_target_": "unirl.reward.local.color.ColorTarget", "target": [1.0, 0.0, 0.0]}},
        "weights": {"redness": 1.0},
    },
}


def kontext(cfg, size: int, lora_targets: list[str]) -> None:
    flux(cfg, size, lora_targets)
    cfg.model._target_ = "unirl.models.flux.FluxKontextModelConfig"
    cfg.sampling.guidance_scale = 2.5
    edit_rows(cfg, "datasets/tiny_edit/prompts.jsonl")


def edit_rows(cfg, path: str) -> None:
    """The edit rows of `path` as the prompts, scored by the edits' redness: the shapes scorers
    parse scene prompts, not edit instructions (redness is differentiable, so the reward-backprop
    algorithms take it too)."""
    cfg.data_source = {"_target_": "unirl.data.PromptDataSource", "data_path": path, "seed": cfg.seed}
    cfg.reward = REDNESS
    if "reward" in cfg.algorithm:
        cfg.algorithm.reward = REDNESS


def wan(cfg, size: int, lora_targets: list[str]) -> None:
    cfg.model = {
        "_target_": "unirl.models.wan.WanModelConfig",
        "pretrained_path": None,
        "num_frames": 5,
        "tiny": {"resolution": size, "num_layers": 1},
    }
    cfg.stage._target_ = "unirl.models.wan.WanStage"
    cfg.sampling.shift = 3.0
    cfg.sampling.dynamic_shift = False
    cfg.sampling.sigma_grid = "scheduler"
    cfg.train.fsdp.block_classes = ["WanTransformerBlock"]
    per_frame(cfg)


def per_frame(cfg) -> None:
    """A video family's reward: every image reward component averaged over the frames."""
    cfg.reward = OmegaConf.to_container(cfg.reward, resolve=True)
    components = cfg.reward.backend.components
    for name in list(components):
        components[name] = {"_target_": "unirl.reward.local.video.FrameMean", "scorer": components[name]}
    if "reward" in cfg.algorithm:  # the reward-backprop algorithms differentiate the same reward
        cfg.algorithm.reward = OmegaConf.to_container(cfg.reward)


def wan22(cfg, size: int, lora_targets: list[str]) -> None:
    wan(cfg, size, lora_targets)
    cfg.model.tiny.boundary_ratio = 0.875  # two experts; the 2-step runs' SDE steps fall on both sides


def qwenimage(cfg, size: int, lora_targets: list[str]) -> None:
    cfg.model = {
        "_target_": "unirl.models.qwenimage.QwenImageModelConfig",
        "pretrained_path": None,
        "negative_prompt": " ",
        "tiny": {"resolution": size, "num_layers": 1},
    }
    cfg.stage._target_ = "unirl.models.qwenimage.QwenImageStage"
    cfg.sampling.guidance_scale = 4.0
    cfg.sampling.dynamic_shift = True
    cfg.sampling.max_seq_len = 8192
    cfg.sampling.max_shift = 0.9
    cfg.sampling.sigma_grid = "steps"
    cfg.train.fsdp.block_classes = ["QwenImageTransformerBlock"]


def qwen_edit(cfg, size: int, lora_targets: list[str]) -> None:
    qwenimage(cfg, size, lora_targets)
    cfg.model._target_ = "unirl.models.qwenimage.QwenImageEditPlusModelConfig"
    cfg.model.condition_area = 56 * 56
    cfg.model.vae_area = 32 * 32
    cfg.model.tiny.pixel_space = False
    cfg.model.tiny.words = ["make", "the", "blue", "green", "yellow", "grey", "square", "in", "picture", "colour", "of"]
    cfg.sampling.max_sequence_length = 48  # the instruction with both references' vision tokens
    edit_rows(cfg, "datasets/tiny_edit/two_picture_prompts.jsonl")


def zimage(cfg, size: int, lora_targets: list[str]) -> None:
    cfg.model = {
        "_target_": "unirl.models.zimage.ZImageModelConfig",
        "pretrained_path": None,
        "tiny": {"resolution": size, "num_layers": 1},
    }
    cfg.stage._target_ = "unirl.models.zimage.ZImageStage"
    cfg.sampling.guidance_scale = 2.0
    cfg.sampling.shift = 3.0
    cfg.sampling.dynamic_shift = False
    cfg.sampling.sigma_grid = "steps"
    cfg.sampling.max_sequence_length = 64  # the tiny tokenizer's bytes of a scene prompt in the chat template
    cfg.train.fsdp.block_classes = ["ZImageTransformerBlock"]


def flux2(cfg, size: int, lora_targets: list[str], klein: bool = False) -> None:
    cfg.model = {
        "_target_": f"unirl.models.flux2.{'Flux2KleinModelConfig' if klein else 'Flux2ModelConfig'}",
        "pretrained_path": None,
        "tiny": {"resolution": size, "num_layers": 1},
    }
    cfg.stage._target_ = "unirl.models.flux2.Flux2Stage"
    cfg.sampling.guidance_scale = 4.0
    cfg.sampling.dynamic_shift = True
    cfg.sampling.mu_rule = "empirical"
    cfg.sampling.sigma_grid = "steps"
    cfg.sampling.max_sequence_length = 32 if klein else 48  # FLUX.2-dev's system message takes 26 tokens
    cfg.train.fsdp.block_classes = ["Flux2TransformerBlock", "Flux2SingleTransformerBlock"]


def flux2_klein(cfg, size: int, lora_targets: list[str]) -> None:
    flux2(cfg, size, lora_targets, klein=True)


def flux2_edit(cfg, size: int, lora_targets: list[str]) -> None:
    flux2(cfg, size, lora_targets)
    cfg.model._target_ = "unirl.models.flux2.Flux2EditModelConfig"
    cfg.model.tiny.words = ["make", "the", "blue", "green", "yellow", "square", "in", "picture", "colour", "of"]
    edit_rows(cfg, "datasets/tiny_edit/two_picture_prompts.jsonl")


def one_token_video(cfg, size: int, model: dict, stage: str, shift: float, block: str) -> None:
    """A tiny one-token-per-cell video family (HunyuanVideo 1.5, LTX-2): 5-frame clips, CFG 2.0
    against the empty prompt, the `steps` grid at a static `shift`, image rewards per frame."""
    cfg.model = {"pretrained_path": None, "num_frames": 5, "tiny": {"resolution": size, "num_layers": 1}, **model}
    cfg.stage._target_ = stage
    cfg.sampling.guidance_scale = 2.0
    cfg.sampling.shift = shift
    cfg.sampling.dynamic_shift = False
    cfg.sampling.sigma_grid = "steps"
    cfg.train.fsdp.block_classes = [block]
    per_frame(cfg)


def hunyuanvideo15(cfg, size: int, lora_targets: list[str]) -> None:
    model = {"_target_": "unirl.models.hunyuanvideo.HunyuanVideo15ModelConfig"}
    one_token_video(cfg, size, model, "unirl.models.hunyuanvideo.HunyuanVideo15Stage", 5.0, "HunyuanVideo15TransformerBlock")


def hunyuanvideo15_i2v(cfg, size: int, lora_targets: list[str]) -> None:
    hunyuanvideo15(cfg, size, lora_targets)
    cfg.model._target_ = "unirl.models.hunyuanvideo.HunyuanVideo15I2VModelConfig"
    cfg.model.tiny.words = ["the", "blue", "green", "yellow", "grey", "square", "turns", "red", "and", "slides", "right"]
    edit_rows(cfg, "datasets/tiny_edit/first_frame_prompts.jsonl")
    per_frame(cfg)


def ltx2(cfg, size: int, lora_targets: list[str]) -> None:
    model = {"_target_": "unirl.models.ltx2.LTX2ModelConfig", "frame_rate": 25.0}
    one_token_video(cfg, size, model, "unirl.models.ltx2.LTX2Stage", 1.0, "LTX2VideoTransformerBlock")
    lora_targets.extend(["ff.net.0.proj", "ff.net.2", "audio_ff.net.0.proj", "audio_ff.net.2"])
    cfg.reward.backend.components.tone = {"_target_": "unirl.reward.local.audio.ToneScore", "frequency": 4000.0, "bandwidth": 1000.0}
    cfg.reward.backend.weights.tone = 5.0


FAMILIES = {
    "flux": flux, "kontext": kontext, "wan": wan, "wan22": wan22, "qwenimage": qwenimage, "qwen_edit": qwen_edit,
    "zimage": zimage, "flux2": flux2, "flux2_klein": flux2_klein, "flux2_edit": flux2_edit,
    "hunyuanvideo15": hunyuanvideo15, "hunyuanvideo15_i2v": hunyuanvideo15_i2v, "ltx2": ltx2,
}  # fmt: skip
PACKAGES = {
    "kontext": "flux", "qwen_edit": "qwenimage", "wan22": "wan", "flux2_klein": "flux2", "flux2_edit": "flux2",
    "hunyuanvideo15": "hunyuanvideo", "hunyuanvideo15_i2v": "hunyuanvideo",
}  # fmt: skip  # the package whose LORA_TARGETS a family uses, when not its own


def run(family: str, name: str, out: str) -> list[dict]:
    size = 32 if name in LEARNED_REWARD else 16
    with initialize_config_dir(config_dir=EXAMPLES, version_base=None):
        cfg = compose(
            f"diffusion/{name}",
            overrides=[
                "++launcher=in_process", "transport=inband", "num_devices=1", "num_steps=2", "threads_per_worker=1",
                f"output_dir={out}", "logging.progress=false", "logging.save_images_every=0", "prompts_per_rollout=2",
                "sampling.samples_per_prompt=4", f"sampling.height={size}", f"sampling.width={size}",
                "sampling.max_sequence_length=8", "train.stack.micro_batch_size=4",
            ],
        )  # fmt: skip
    lora_targets = list(importlib.import_module(f"unirl.models.{PACKAGES.get(family, family)}").LORA_TARGETS)
    with open_dict(cfg):
        FAMILIES[family](cfg, size, lora_targets)
        if cfg.train.get("lora") is not None:
            cfg.train.lora.target_modules = lora_targets
        cfg.pop("eval", None)
    validate_recipe(cfg, expect="diffusion")
    Trainer(cfg).run()
    with open(f"{out}/metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in FAMILIES:
        print(
            f"usage: python scripts/family_algorithms.py {{{'|'.join(FAMILIES)}}} [recipe ...]",
            file=sys.stderr,
        )
        return 2
    family, names = argv[0], argv[1:]
    failed = 0
    for name in names or RECIPES:
        start = time.time()
        try:
            rows = run(family, name, tempfile.mkdtemp(prefix=f"{family}_{name}_"))
            losses = [round(r["loss"], 5) for r in rows]
            print(f"OK   {name}: {len(rows)} steps, loss {losses}, {time.time() - start:.0f} s", flush=True)
        except Exception as e:  # report every recipe, then fail
            failed += 1
            print(f"FAIL {name}: {type(e).__name__}: {e}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
