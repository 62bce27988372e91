"""`PickScore` from local directories in the upstream layout (a transformers `CLIPModel` and its
`CLIPProcessor`), on a tiny random CLIP saved here: its scores equal Flow-GRPO's
`pickscore_scorer.py` steps written out in the test (processor, features, normalised, times
logit_scale.exp() / 26), and its preprocessing equals a hand computation (resize the short side
with bicubic, centre crop, scale, normalise)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from tests.reward.tiny_clip import SIZE, save_tiny_clip
from unirl.reward.local import PickScore
from unirl.types.reward import RewardRequest


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny random PickScore checkpoint: the model and its processor in one directory."""
    return save_tiny_clip(tmp_path_factory.mktemp("pickscore"))


def images(n: int, h: int = 40, w: int = 56, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 3, h, w), generator=g, dtype=torch.uint8)


PROMPTS = ["a red cube", "two cats on a mat", "a photo", "the sun over the sea", "a blue sphere"]


def flow_grpo_scores(path, imgs: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    """Flow-GRPO's PickScore steps, written out: the processor on PIL images and the prompts,
    normalised features, logit_scale.exp() * (text @ image.T), its diagonal, / 26."""
    from transformers import CLIPModel, CLIPProcessor

    processor, model = CLIPProcessor.from_pretrained(path), CLIPModel.from_pretrained(path).eval()
    pil = [Image.fromarray(im.permute(1, 2, 0).numpy()) for im in imgs]
    image_inputs = processor(images=pil, padding=True, truncation=True, max_length=77, return_tensors="pt")
    text_inputs = processor(text=prompts, padding=True, truncation=True, max_length=77, return_tensors="pt")
    with torch.no_grad():  # transformers 5 returns the projected embedding as pooler_output
        image_embs = model.get_image_features(**image_inputs).pooler_output
        text_embs = model.get_text_features(**text_inputs).pooler_output
    image_embs = image_embs / image_embs.norm(p=2, dim=-1, keepdim=True)
    text_embs = text_embs / text_embs.norm(p=2, dim=-1, keepdim=True)
    return (model.logit_scale.exp() * (text_embs @ image_embs.T)).diag() / 26


def test_scores_equal_flow_grpos_steps_in_any_batching(checkpoint) -> None:
    imgs = images(5)
    req = RewardRequest([f"s{i}" for i in range(5)], PROMPTS, images=imgs)
    want = flow_grpo_scores(checkpoint, imgs, PROMPTS)
    for batch_size in (16, 2):
        got = PickScore(str(checkpoint), batch_size=batch_size)(req)
        assert got.dtype == torch.float32 and got.shape == (5,)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    raw = PickScore(str(checkpoint), scale=1.0)(req)
    torch.testing.assert_close(raw, want * 26, rtol=1e-5, atol=1e-5)


def test_the_processor_is_the_documented_preprocessing(checkpoint) -> None:
    """Short side to 32 with bicubic (the long side scaled and truncated), centre crop 32 x 32,
    / 255, minus CLIP's mean over its std."""
    from transformers import CLIPProcessor

    img = images(1, h=40, w=56)[0]
    pil = Image.fromarray(img.permute(1, 2, 0).numpy())
    resized = np.asarray(pil.resize((int(56 * SIZE / 40), SIZE), Image.BICUBIC), dtype=np.float32)
    left = (resized.shape[1] - SIZE) // 2
    crop = resized[:, left : left + SIZE] / 255.0
    mean, std = np.array([0.48145466, 0.4578275, 0.40821073]), np.array([0.26862954, 0.26130258, 0.27577711])
    want = torch.from_numpy(((crop - mean) / std).transpose(2, 0, 1)).float()
    got = CLIPProcessor.from_pretrained(checkpoint)(images=[pil], return_tensors="pt")["pixel_values"][0]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_missing_files_are_named_when_built(checkpoint, tmp_path) -> None:
    with pytest.raises(
        ValueError, match=r"PickScore: missing .*config\.json.*model\.safetensors or pytorch_model\.bin"
    ):
        PickScore(str(tmp_path))
    with pytest.raises(
        ValueError, match=r"missing .*nowhere/processor_config\.json or preprocessor_config\.json"
    ):
        PickScore(str(checkpoint), processor_path=str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="dtype must be"):
        PickScore(str(checkpoint), dtype="int8")
    with pytest.raises(ValueError, match="needs images"):
        PickScore(str(checkpoint))(RewardRequest(["t"], ["x"], texts=["x"]))


def test_a_recipe_naming_a_missing_checkpoint_fails_validation_before_ray(tmp_path) -> None:
    from hydra import compose, initialize_config_dir

    from tests.conftest import EXAMPLES
    from unirl.config.validate import ConfigError, validate_recipe

    with initialize_config_dir(config_dir=EXAMPLES, version_base=None):
        cfg = compose(
            "diffusion/tiny_sd3_flowgrpo",
            [
                f"output_dir={tmp_path}",
                "~reward.backend.components.redness",
                "~reward.backend.weights",
                "+reward.backend.weights={pick: 1.0}",
                f"+reward.backend.components.pick={{_target_: unirl.reward.local.PickScore, model_path: {tmp_path}/none}}",
            ],
        )
    with pytest.raises(ConfigError, match=r"PickScore: missing .*none/config\.json"):
        validate_recipe(cfg, expect="diffusion")


def test_clipscore_is_the_clipped_cosine_times_w(checkpoint) -> None:
    from unirl.reward.local import CLIPScore

    imgs = images(5, seed=3)
    req = RewardRequest([f"s{i}" for i in range(5)], PROMPTS, images=imgs)
    raw = PickScore(str(checkpoint), scale=1.0)(req)  # logit_scale.exp() * cos
    from transformers import CLIPModel

    cos = raw / CLIPModel.from_pretrained(checkpoint).logit_scale.exp()
    got = CLIPScore(str(checkpoint), weight=2.5, batch_size=2)(req)
    torch.testing.assert_close(got, 2.5 * cos.clamp(min=0), rtol=1e-5, atol=1e-6)
    assert (got >= 0).all()
    with pytest.raises(ValueError, match="weight > 0"):
        CLIPScore(str(checkpoint), weight=0)


def test_video_pickscore_is_the_frame_mean(checkpoint) -> None:
    """VideoPickScore: `FrameMean` around PickScore, each frame scored with its video's prompt."""
    from unirl.reward.local import FrameMean

    videos = torch.stack([images(3, seed=7), images(3, seed=8)])  # [2 videos, 3 frames, 3, H, W]
    req = RewardRequest(["v0", "v1"], PROMPTS[:2], images=videos)
    pick = PickScore(str(checkpoint))
    frames = RewardRequest(
        [f"v{v}/frame{k}" for v in range(2) for k in range(3)], [p for p in PROMPTS[:2] for _ in range(3)],
        images=videos.flatten(0, 1),
    )  # fmt: skip
    torch.testing.assert_close(
        FrameMean(pick)(req), pick(frames).view(2, 3).mean(dim=1), rtol=1e-6, atol=1e-6
    )


@pytest.mark.parametrize("offload", [False, True])
def test_offload_keeps_the_model_in_host_memory_between_calls(checkpoint, offload) -> None:
    """With `offload` the model is on `device` only while it scores (a hook records where its
    forwards ran) and in host memory after; the scores are the resident model's. On a CPU-only
    machine `device` is the CPU, so only the bookkeeping is exercised; on a GPU the move is real."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    imgs = images(3)
    req = RewardRequest([f"s{i}" for i in range(3)], PROMPTS[:3], images=imgs)
    scorer = PickScore(str(checkpoint), device=device, offload=offload, batch_size=2)
    ran_on = []
    model = scorer.clip.load()[0]
    model.register_forward_pre_hook(lambda m, a: ran_on.append(next(m.parameters()).device.type))
    model.vision_model.register_forward_pre_hook(lambda m, a: ran_on.append(next(m.parameters()).device.type))
    got = scorer(req)
    assert ran_on and set(ran_on) == {device}
    assert next(model.parameters()).device.type == ("cpu" if offload else device)
    torch.testing.assert_close(got, flow_grpo_scores(checkpoint, imgs, PROMPTS[:3]), rtol=1e-5, atol=1e-6)
