"""`HPSv2` (unirl/reward/local/hps.py) on a tiny random checkpoint saved in open_clip's layout.

open_clip needs torchvision, which this project does not install, so the reference is open_clip's
ViT CLIP forward written out here from its documented architecture (OpenAI layout: patchify conv,
class token, positional embeddings, ln_pre, pre-norm residual blocks with fused q/k/v attention and
a GELU MLP, ln_post on the class token times `proj`; the text tower causal, ln_final, pooled at the
end-of-text token times `text_projection`) and the `hpsv2` package's score (the diagonal of the
unit-norm image features times the text features' transpose). The scorer converts the checkpoint to
a transformers CLIPModel; both see the same processor outputs (its preprocessing is the one
`test_pickscore.py` checks)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from tests.reward.tiny_clip import SIZE
from unirl.models.flow.loading import tiny_clip_t5_tokenizers
from unirl.reward.local.hps import HPSv2, open_clip_to_hf
from unirl.types.reward import RewardRequest

WIDTH, LAYERS, HEADS, PATCH, EMBED = 32, 2, 2, 8, 16
PROMPTS = ["a red cube", "two cats on a mat", "the sun over the sea"]


def open_clip_state(vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under open_clip's names and shapes for the tiny ViT CLIP."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=0.2):
        return torch.randn(*shape, generator=g) * scale

    grid = SIZE // PATCH
    state = {
        "visual.conv1.weight": rnd(WIDTH, 3, PATCH, PATCH),
        "visual.class_embedding": rnd(WIDTH),
        "visual.positional_embedding": rnd(grid * grid + 1, WIDTH),
        "visual.ln_pre.weight": 1 + rnd(WIDTH), "visual.ln_pre.bias": rnd(WIDTH),
        "visual.ln_post.weight": 1 + rnd(WIDTH), "visual.ln_post.bias": rnd(WIDTH),
        "visual.proj": rnd(WIDTH, EMBED),
        "token_embedding.weight": rnd(vocab, WIDTH),
        "positional_embedding": rnd(77, WIDTH),
        "ln_final.weight": 1 + rnd(WIDTH), "ln_final.bias": rnd(WIDTH),
        "text_projection": rnd(WIDTH, EMBED),
        "logit_scale": torch.tensor(4.6052),
    }  # fmt: skip
    for tower in ("visual.", ""):
        for i in range(LAYERS):
            p = f"{tower}transformer.resblocks.{i}."
            state |= {
                p + "ln_1.weight": 1 + rnd(WIDTH), p + "ln_1.bias": rnd(WIDTH),
                p + "attn.in_proj_weight": rnd(3 * WIDTH, WIDTH), p + "attn.in_proj_bias": rnd(3 * WIDTH),
                p + "attn.out_proj.weight": rnd(WIDTH, WIDTH), p + "attn.out_proj.bias": rnd(WIDTH),
                p + "ln_2.weight": 1 + rnd(WIDTH), p + "ln_2.bias": rnd(WIDTH),
                p + "mlp.c_fc.weight": rnd(4 * WIDTH, WIDTH), p + "mlp.c_fc.bias": rnd(4 * WIDTH),
                p + "mlp.c_proj.weight": rnd(WIDTH, 4 * WIDTH), p + "mlp.c_proj.bias": rnd(WIDTH),
            }  # fmt: skip
    return state


def blocks(s: dict, prefix: str, x: torch.Tensor, causal: bool) -> torch.Tensor:
    """open_clip's residual attention blocks on x [B, L, D]."""
    for i in range(LAYERS):
        p = f"{prefix}transformer.resblocks.{i}."
        h = F.layer_norm(x, (WIDTH,), s[p + "ln_1.weight"], s[p + "ln_1.bias"])
        q, k, v = F.linear(h, s[p + "attn.in_proj_weight"], s[p + "attn.in_proj_bias"]).chunk(3, dim=-1)
        split = lambda t: t.view(t.shape[0], t.shape[1], HEADS, WIDTH // HEADS).transpose(1, 2)  # noqa: E731
        scores = split(q) @ split(k).transpose(-1, -2) / (WIDTH // HEADS) ** 0.5
        if causal:
            scores = scores.masked_fill(torch.ones(x.shape[1], x.shape[1]).triu(1).bool(), float("-inf"))
        att = (scores.softmax(-1) @ split(v)).transpose(1, 2).reshape(x.shape)
        x = x + F.linear(att, s[p + "attn.out_proj.weight"], s[p + "attn.out_proj.bias"])
        h = F.layer_norm(x, (WIDTH,), s[p + "ln_2.weight"], s[p + "ln_2.bias"])
        h = F.linear(
            F.gelu(F.linear(h, s[p + "mlp.c_fc.weight"], s[p + "mlp.c_fc.bias"])),
            s[p + "mlp.c_proj.weight"],
            s[p + "mlp.c_proj.bias"],
        )
        x = x + h
    return x


def reference_scores(s: dict, pixels: torch.Tensor, ids: torch.Tensor, eot: int) -> torch.Tensor:
    """hpsv2's score: diag(normalize(encode_image) @ normalize(encode_text).T), open_clip's forward."""
    x = F.conv2d(pixels, s["visual.conv1.weight"], stride=PATCH).flatten(2).transpose(1, 2)
    x = (
        torch.cat([s["visual.class_embedding"].expand(len(x), 1, WIDTH), x], dim=1)
        + s["visual.positional_embedding"]
    )
    x = blocks(
        s, "visual.", F.layer_norm(x, (WIDTH,), s["visual.ln_pre.weight"], s["visual.ln_pre.bias"]), False
    )
    image = (
        F.layer_norm(x[:, 0], (WIDTH,), s["visual.ln_post.weight"], s["visual.ln_post.bias"])
        @ s["visual.proj"]
    )
    t = s["token_embedding.weight"][ids] + s["positional_embedding"][: ids.shape[1]]
    t = F.layer_norm(blocks(s, "", t, True), (WIDTH,), s["ln_final.weight"], s["ln_final.bias"])
    end = (
        (ids == eot).int().argmax(dim=1)
    )  # open_clip: argmax of the ids, the EOT being the vocabulary's last
    text = t[torch.arange(len(ids)), end] @ s["text_projection"]
    return (F.normalize(image, dim=-1) * F.normalize(text, dim=-1)).sum(-1)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(checkpoint file in open_clip's layout, CLIP config + processor directory)."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPProcessor

    root = tmp_path_factory.mktemp("hps")
    tokenizer, _ = tiny_clip_t5_tokenizers(77, 8)
    config = CLIPConfig(
        text_config={"vocab_size": len(tokenizer), "hidden_size": WIDTH, "intermediate_size": 4 * WIDTH,
                     "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "max_position_embeddings": 77,
                     "hidden_act": "gelu", "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 1},
        vision_config={"hidden_size": WIDTH, "intermediate_size": 4 * WIDTH, "num_hidden_layers": LAYERS,
                       "num_attention_heads": HEADS, "image_size": SIZE, "patch_size": PATCH, "hidden_act": "gelu"},
        projection_dim=EMBED,
    )  # fmt: skip
    config.save_pretrained(root / "clip")
    CLIPProcessor(
        image_processor=CLIPImageProcessor(
            size={"shortest_edge": SIZE}, crop_size={"height": SIZE, "width": SIZE}
        ),
        tokenizer=tokenizer,
    ).save_pretrained(root / "clip")
    state = open_clip_state(len(tokenizer))
    torch.save(
        {"epoch": 1, "state_dict": {f"module.{k}": v for k, v in state.items()}},
        root / "HPS_v2_compressed.pt",
    )
    return root / "HPS_v2_compressed.pt", root / "clip", state


def images(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 3, 40, 56), generator=g, dtype=torch.uint8)


def test_scores_equal_open_clips_forward_and_hpsv2s_score(files):
    ckpt, clip_dir, state = files
    imgs = images(3)
    req = RewardRequest([f"s{i}" for i in range(3)], PROMPTS, images=imgs)
    scorer = HPSv2(str(ckpt), str(clip_dir), batch_size=2)
    got = scorer(req)
    processor = scorer.clip.load()[1]
    pixels = processor(
        images=[Image.fromarray(i.permute(1, 2, 0).numpy()) for i in imgs], return_tensors="pt"
    )
    ids = processor(text=PROMPTS, padding=True, truncation=True, max_length=77, return_tensors="pt")[
        "input_ids"
    ]
    want = reference_scores(state, pixels["pixel_values"], ids, eot=1)
    assert got.dtype == torch.float32 and got.shape == (3,)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert float(want.abs().min()) > 1e-3  # a real signal, not zeros on both sides


def test_every_open_clip_key_lands_once_and_qkv_are_split_in_order(files):
    _, _, state = files
    hf = open_clip_to_hf(state, "t")
    assert len(hf) == len(state) + 2 * 2 * LAYERS * 2  # each fused q/k/v weight and bias became three
    fused = state["transformer.resblocks.1.attn.in_proj_weight"]
    assert torch.equal(hf["text_model.encoder.layers.1.self_attn.k_proj.weight"], fused[WIDTH : 2 * WIDTH])
    assert torch.equal(hf["visual_projection.weight"], state["visual.proj"].t())


def test_missing_files_and_foreign_checkpoints_are_named(files, tmp_path):
    ckpt, clip_dir, state = files
    with pytest.raises(ValueError, match="checkpoint_path .*nope.pt does not exist"):
        HPSv2(str(tmp_path / "nope.pt"), str(clip_dir))
    with pytest.raises(ValueError, match=r"missing .*config.json"):
        HPSv2(str(ckpt), str(tmp_path))
    resnet = tmp_path / "rn50.pt"
    torch.save({"visual.layer1.0.conv1.weight": torch.zeros(1)}, resnet)
    scorer = HPSv2(str(resnet), str(clip_dir))
    req = RewardRequest(["s0"], PROMPTS[:1], images=images(1))
    with pytest.raises(
        ValueError, match="'visual.layer1.0.conv1.weight' is not a key of open_clip's ViT CLIP"
    ):
        scorer(req)
    wider = tmp_path / "wider.pt"
    torch.save(
        {
            k: (torch.zeros(v.shape[0] + 1, *v.shape[1:]) if k == "visual.proj" else v)
            for k, v in state.items()
        },
        wider,
    )
    with pytest.raises(
        ValueError, match=r"does not fit the CLIP of .*other shapes \['visual_projection.weight'\]"
    ):
        HPSv2(str(wider), str(clip_dir))(req)
