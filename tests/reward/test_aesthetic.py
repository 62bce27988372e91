"""`AestheticScore`: the LAION aesthetic predictor v2 over a local CLIP, on a tiny random CLIP and
a random predictor saved in the published layout; its scores equal the predictor's steps written
out here (the processor, the unit-norm image embedding, then the five Linear layers with no
activation in between)."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from tests.reward.tiny_clip import save_tiny_clip
from unirl.reward.local import AestheticScore
from unirl.types.reward import RewardRequest

WIDTH = 16  # the tiny CLIP's projection: the predictor's input (768 for ViT-L/14)
SHAPES = {
    "layers.0": (1024, WIDTH),
    "layers.2": (128, 1024),
    "layers.4": (64, 128),
    "layers.6": (16, 64),
    "layers.7": (1, 16),
}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    path = tmp_path_factory.mktemp("aesthetic")
    save_tiny_clip(path / "clip", projection_dim=WIDTH)
    g = torch.Generator().manual_seed(1)
    state = {}
    for name, (out, inp) in SHAPES.items():
        state[f"{name}.weight"] = torch.randn(out, inp, generator=g) / inp**0.5
        state[f"{name}.bias"] = torch.randn(out, generator=g) * 0.1
    torch.save(state, path / "sac+logos+ava1-l14-linearMSE.pth")
    return path / "clip", path / "sac+logos+ava1-l14-linearMSE.pth", state


def reference(clip_dir, state, images: torch.Tensor) -> torch.Tensor:
    from transformers import CLIPModel, CLIPProcessor

    processor, model = CLIPProcessor.from_pretrained(clip_dir), CLIPModel.from_pretrained(clip_dir).eval()
    pil = [Image.fromarray(im.permute(1, 2, 0).numpy()) for im in images]
    with torch.no_grad():
        emb = model.get_image_features(**processor(images=pil, return_tensors="pt")).pooler_output
    x = emb / emb.norm(dim=-1, keepdim=True)
    for name in SHAPES:
        x = x @ state[f"{name}.weight"].T + state[f"{name}.bias"]
    return x[:, 0]


def test_scores_equal_the_predictors_steps(files) -> None:
    clip_dir, mlp, state = files
    images = torch.randint(
        0, 256, (5, 3, 48, 40), generator=torch.Generator().manual_seed(0), dtype=torch.uint8
    )
    req = RewardRequest([f"s{i}" for i in range(5)], ["p"] * 5, images=images)
    want = reference(clip_dir, state, images)
    for batch_size in (16, 2):
        got = AestheticScore(str(clip_dir), str(mlp), batch_size=batch_size)(req)
        assert got.dtype == torch.float32 and got.shape == (5,)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_missing_or_foreign_files_are_named(files, tmp_path) -> None:
    clip_dir, mlp, state = files
    with pytest.raises(ValueError, match=r"mlp_path .*nope\.pth does not exist"):
        AestheticScore(str(clip_dir), str(tmp_path / "nope.pth"))
    with pytest.raises(ValueError, match=r"AestheticScore: missing .*config\.json"):
        AestheticScore(str(tmp_path), str(mlp))
    torch.save({"fc.weight": torch.zeros(1, 16)}, tmp_path / "other.pth")
    with pytest.raises(ValueError, match="is not the aesthetic predictor's state dict"):
        AestheticScore(str(clip_dir), str(tmp_path / "other.pth"))
    wrong = dict(state, **{"layers.2.weight": torch.zeros(128, 512)})
    torch.save(wrong, tmp_path / "wrong.pth")
    with pytest.raises(ValueError, match="does not fit the predictor's MLP"):
        AestheticScore(str(clip_dir), str(tmp_path / "wrong.pth"))
