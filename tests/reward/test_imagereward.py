"""`ImageReward` (unirl/reward/local/imagereward.py) on a tiny random checkpoint in ImageReward.pt's
layout (`blip.visual_encoder.*`, `blip.text_encoder.*`, `mlp.layers.*`).

The `image-reward` package pins old transformers and needs torchvision, so it is not installed;
the reference is its `ImageReward.score` written out here from BLIP's code as documented: a timm
ViT (patchify conv with bias, class token, positional embeddings, pre-norm blocks with fused qkv,
LayerNorm eps 1e-6, final norm; every token kept) and BLIP's BERT (post-norm layers: self-attention
with the padding mask, cross-attention to the image tokens, GELU feed-forward; eps 1e-12), the
first token through the MLP head, then (x - 0.16717...) / 1.03333...; the prompt padded to 35
tokens. Both see the same pixels (the processor configured as the package's transform) and ids."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from unirl.reward.local.imagereward import MEAN, STD, ImageReward, blip_to_hf
from unirl.types.reward import RewardRequest

V, VL, VH, P, SIDE = 32, 2, 2, 8, 32  # ViT width, layers, heads, patch, image side
T, TL, TH, POS = 24, 2, 2, 40  # BERT width, layers, heads, positions
WORDS = ["a", "red", "cube", "two", "cats", "on", "mat", "photo", "the", "sun", "over", "sea"]
PROMPTS = ["a red cube", "two cats on a mat", "the sun over the sea"]


def tokenizer_dir(root):
    from transformers import BertTokenizer

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
    (root / "vocab.txt").write_text("\n".join(vocab) + "\n")
    BertTokenizer(str(root / "vocab.txt")).save_pretrained(root)
    return root, len(vocab) + 2  # + [DEC], [ENC]


def checkpoint_state(vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=0.2):
        return torch.randn(*shape, generator=g) * scale

    def ln(prefix, width):
        return {prefix + ".weight": 1 + rnd(width), prefix + ".bias": rnd(width)}

    grid = SIDE // P
    s = {
        "blip.visual_encoder.cls_token": rnd(1, 1, V),
        "blip.visual_encoder.pos_embed": rnd(1, grid * grid + 1, V),
        "blip.visual_encoder.patch_embed.proj.weight": rnd(V, 3, P, P),
        "blip.visual_encoder.patch_embed.proj.bias": rnd(V),
        **ln("blip.visual_encoder.norm", V),
        "blip.text_encoder.embeddings.word_embeddings.weight": rnd(vocab, T),
        "blip.text_encoder.embeddings.position_embeddings.weight": rnd(POS, T),
        **ln("blip.text_encoder.embeddings.LayerNorm", T),
        "blip.vision_proj.weight": rnd(8, V), "blip.itm_head.weight": rnd(2, T),  # unused by the score
    }  # fmt: skip
    for i in range(VL):
        p = f"blip.visual_encoder.blocks.{i}."
        s |= {**ln(p + "norm1", V), **ln(p + "norm2", V),
              p + "attn.qkv.weight": rnd(3 * V, V), p + "attn.qkv.bias": rnd(3 * V),
              p + "attn.proj.weight": rnd(V, V), p + "attn.proj.bias": rnd(V),
              p + "mlp.fc1.weight": rnd(4 * V, V), p + "mlp.fc1.bias": rnd(4 * V),
              p + "mlp.fc2.weight": rnd(V, 4 * V), p + "mlp.fc2.bias": rnd(V)}  # fmt: skip
    for i in range(TL):
        p = f"blip.text_encoder.encoder.layer.{i}."
        for att, kv in (("attention", T), ("crossattention", V)):
            s |= {p + f"{att}.self.query.weight": rnd(T, T), p + f"{att}.self.query.bias": rnd(T),
                  p + f"{att}.self.key.weight": rnd(T, kv), p + f"{att}.self.key.bias": rnd(T),
                  p + f"{att}.self.value.weight": rnd(T, kv), p + f"{att}.self.value.bias": rnd(T),
                  p + f"{att}.output.dense.weight": rnd(T, T), p + f"{att}.output.dense.bias": rnd(T),
                  **ln(p + f"{att}.output.LayerNorm", T)}  # fmt: skip
        s |= {p + "intermediate.dense.weight": rnd(4 * T, T), p + "intermediate.dense.bias": rnd(4 * T),
              p + "output.dense.weight": rnd(T, 4 * T), p + "output.dense.bias": rnd(T), **ln(p + "output.LayerNorm", T)}  # fmt: skip
    for layer, (n_in, n_out) in zip(
        (0, 2, 4, 6, 7), ((T, 1024), (1024, 128), (128, 64), (64, 16), (16, 1)), strict=True
    ):
        s |= {
            f"mlp.layers.{layer}.weight": rnd(n_out, n_in, scale=0.1),
            f"mlp.layers.{layer}.bias": rnd(n_out),
        }
    return s


def attend(q, k, v, heads, mask=None):
    split = lambda t: t.view(t.shape[0], t.shape[1], heads, -1).transpose(1, 2)  # noqa: E731
    scores = split(q) @ split(k).transpose(-1, -2) / (q.shape[-1] // heads) ** 0.5
    if mask is not None:
        scores = scores + (1.0 - mask[:, None, None, :].float()) * torch.finfo(scores.dtype).min
    return (scores.softmax(-1) @ split(v)).transpose(1, 2).reshape(q.shape)


def reference(s: dict, pixels: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """ImageReward.score, BLIP's forward written out (module docstring)."""
    ve = "blip.visual_encoder."
    x = F.conv2d(pixels, s[ve + "patch_embed.proj.weight"], s[ve + "patch_embed.proj.bias"], stride=P)
    x = (
        torch.cat([s[ve + "cls_token"].expand(len(x), 1, V), x.flatten(2).transpose(1, 2)], 1)
        + s[ve + "pos_embed"]
    )
    for i in range(VL):
        p = f"{ve}blocks.{i}."
        h = F.layer_norm(x, (V,), s[p + "norm1.weight"], s[p + "norm1.bias"], eps=1e-6)
        q, k, v = F.linear(h, s[p + "attn.qkv.weight"], s[p + "attn.qkv.bias"]).chunk(3, dim=-1)
        x = x + F.linear(attend(q, k, v, VH), s[p + "attn.proj.weight"], s[p + "attn.proj.bias"])
        h = F.layer_norm(x, (V,), s[p + "norm2.weight"], s[p + "norm2.bias"], eps=1e-6)
        x = x + F.linear(
            F.gelu(F.linear(h, s[p + "mlp.fc1.weight"], s[p + "mlp.fc1.bias"])),
            s[p + "mlp.fc2.weight"],
            s[p + "mlp.fc2.bias"],
        )
    image = F.layer_norm(x, (V,), s[ve + "norm.weight"], s[ve + "norm.bias"], eps=1e-6)

    te = "blip.text_encoder."
    t = (
        s[te + "embeddings.word_embeddings.weight"][ids]
        + s[te + "embeddings.position_embeddings.weight"][: ids.shape[1]]
    )
    t = F.layer_norm(
        t, (T,), s[te + "embeddings.LayerNorm.weight"], s[te + "embeddings.LayerNorm.bias"], eps=1e-12
    )

    def lin(p, x):
        return F.linear(x, s[p + ".weight"], s[p + ".bias"])

    for i in range(TL):
        p = f"{te}encoder.layer.{i}."
        for att, source, m in (("attention", t, mask), ("crossattention", image, None)):
            a = attend(
                lin(p + f"{att}.self.query", t),
                lin(p + f"{att}.self.key", source),
                lin(p + f"{att}.self.value", source),
                TH,
                m,
            )
            t = F.layer_norm(
                lin(p + f"{att}.output.dense", a) + t,
                (T,),
                s[p + f"{att}.output.LayerNorm.weight"],
                s[p + f"{att}.output.LayerNorm.bias"],
                eps=1e-12,
            )
        h = lin(p + "output.dense", F.gelu(lin(p + "intermediate.dense", t)))
        t = F.layer_norm(
            h + t, (T,), s[p + "output.LayerNorm.weight"], s[p + "output.LayerNorm.bias"], eps=1e-12
        )
    h = t[:, 0]
    for layer in (0, 2, 4, 6, 7):
        h = lin(f"mlp.layers.{layer}", h)
    return (h.squeeze(1) - MEAN) / STD


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("imagereward")
    (root / "bert").mkdir()
    tok, vocab = tokenizer_dir(root / "bert")
    state = checkpoint_state(vocab)
    torch.save(state, root / "ImageReward.pt")
    return root / "ImageReward.pt", tok, state


def images(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 3, 40, 56), generator=g, dtype=torch.uint8)


def test_scores_equal_the_packages_score_written_out(files):
    ckpt, tok, state = files
    imgs = images(3)
    req = RewardRequest([f"s{i}" for i in range(3)], PROMPTS, images=imgs)
    scorer = ImageReward(str(ckpt), str(tok), vision_heads=VH, text_heads=TH, batch_size=2)
    got = scorer(req)
    _, _, _, tokenizer, processor = scorer.load()
    pixels = processor(
        images=[Image.fromarray(i.permute(1, 2, 0).numpy()) for i in imgs], return_tensors="pt"
    )["pixel_values"]
    tokens = tokenizer(PROMPTS, padding="max_length", truncation=True, max_length=35, return_tensors="pt")
    assert (
        tokens["input_ids"].shape == (3, 35) and int(tokens["attention_mask"][0].sum()) == 5
    )  # [CLS] a red cube [SEP]
    want = reference(state, pixels, tokens["input_ids"], tokens["attention_mask"])
    assert got.dtype == torch.float32 and got.shape == (3,)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert float((want - want.mean()).abs().max()) > 1e-3  # the images and prompts move the score


def test_the_image_is_resized_cropped_and_normalised_as_the_package_does(files):
    """Resize the shortest side to the ViT's 32 px (bicubic), centre-crop 32x32, scale to [0, 1],
    normalise with CLIP's mean and std."""
    ckpt, tok, _ = files
    processor = ImageReward(str(ckpt), str(tok), vision_heads=VH, text_heads=TH).load()[4]
    pil = Image.fromarray(images(1)[0].permute(1, 2, 0).numpy())  # 56 x 40
    resized = pil.resize((44, 32), Image.BICUBIC)  # shortest side 40 -> 32, the other int(56 * 32 / 40) = 44
    left = round((44 - 32) / 2)  # torchvision's CenterCrop
    crop = torch.from_numpy(np.asarray(resized.crop((left, 0, left + 32, 32)))).float()
    mean, std = (
        torch.tensor([0.48145466, 0.4578275, 0.40821073]),
        torch.tensor([0.26862954, 0.26130258, 0.27577711]),
    )
    want = ((crop / 255 - mean) / std).permute(2, 0, 1)
    got = processor(images=[pil], return_tensors="pt")["pixel_values"][0]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_every_checkpoint_key_the_score_uses_lands_once(files):
    _, _, state = files
    hf = blip_to_hf(state, "t")
    used = [k for k in state if not k.startswith(("blip.vision_proj", "blip.itm_head"))]
    assert len(hf) == len(used)
    assert torch.equal(
        hf["vision.encoder.layers.1.self_attn.projection.weight"],
        state["blip.visual_encoder.blocks.1.attn.proj.weight"],
    )


def test_missing_files_and_foreign_checkpoints_are_named(files, tmp_path):
    ckpt, tok, state = files
    with pytest.raises(ValueError, match="checkpoint_path .*nope.pt does not exist"):
        ImageReward(str(tmp_path / "nope.pt"), str(tok))
    with pytest.raises(ValueError, match="holds no vocab.txt or tokenizer.json"):
        ImageReward(str(ckpt), str(tmp_path))
    req = RewardRequest(["s0"], PROMPTS[:1], images=images(1))
    clip = tmp_path / "clip.pt"
    torch.save({"visual.conv1.weight": torch.zeros(1)}, clip)
    with pytest.raises(
        ValueError, match="no vision.embeddings.position_embedding .* is this an ImageReward checkpoint"
    ):
        ImageReward(str(clip), str(tok), vision_heads=VH, text_heads=TH)(req)
    bigger = tmp_path / "bigger.pt"
    words = state["blip.text_encoder.embeddings.word_embeddings.weight"]
    torch.save(
        state | {"blip.text_encoder.embeddings.word_embeddings.weight": torch.cat([words, words[:3]])}, bigger
    )
    with pytest.raises(ValueError, match=r"has 22 token embeddings but the tokenizer .* has 19"):
        ImageReward(str(bigger), str(tok), vision_heads=VH, text_heads=TH)(req)


def test_offload_scores_as_resident_and_rests_in_host_memory(files):
    ckpt, tok, _ = files
    req = RewardRequest([f"s{i}" for i in range(3)], PROMPTS, images=images(3))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    resident = ImageReward(str(ckpt), str(tok), vision_heads=VH, text_heads=TH)(req)
    scorer = ImageReward(str(ckpt), str(tok), vision_heads=VH, text_heads=TH, device=device, offload=True)
    ran_on = []
    scorer.load()[0].register_forward_pre_hook(lambda m, a: ran_on.append(next(m.parameters()).device.type))
    torch.testing.assert_close(scorer(req), resident, rtol=1e-5, atol=1e-5)
    assert ran_on == [device] and next(scorer.load()[0].parameters()).device.type == "cpu"


def test_an_unreadable_checkpoint_is_named(files, tmp_path):
    _, tok, _ = files
    junk = tmp_path / "ImageReward.pt"
    junk.write_text("not a checkpoint")
    with pytest.raises(ValueError, match="ImageReward .*ImageReward.pt: not a readable torch checkpoint"):
        ImageReward(str(junk), str(tok), vision_heads=VH, text_heads=TH)(
            RewardRequest(["s0"], ["a"], images=images(1))
        )
