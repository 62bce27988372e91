"""HPSv3 (`unirl.reward.local.HPSv3`) on a tiny random Qwen2-VL saved in HPSv3's upstream layout.

The `hpsv3` package pins transformers 4.45 and needs torchvision and deepspeed, so it cannot be
installed beside this project; the reference here is its `HPSv3RewardInferencer.reward` written
out from its steps (module doc of `unirl/reward/local/hpsv3.py`): the image resized by PIL bicubic
to the 28-multiple of area 256 * 28 * 28, patches in Qwen2-VL's documented order, one chat turn
of image + instruction + `<|Reward|>`, transformers' own Qwen2-VL forward at sequential positions,
and the head on the reward token's hidden state. The checkpoint is written with transformers 4.45's
names (`model.*`, `visual.*`, `lm_head`, `rm_head.*`), as HPSv3.safetensors is.
"""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np
import pytest
import torch
from PIL import Image

from unirl.reward.local.hpsv3 import INSTRUCTION, REWARD_QUERY, HPSv3, rm_head
from unirl.types.reward import RewardRequest

# Qwen2-VL's chat template in substance: a default system turn, then the user turn with an image
# as <|vision_start|><|image_pad|><|vision_end|> before its text, then the generation prompt
TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% else %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MEAN, STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)


def tiny_hpsv3(root, seed: int = 0):
    """(base dir, checkpoint path, the full transformers model with the checkpoint's weights,
    the head) of a tiny random HPSv3 in its upstream layout."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLImageProcessorPil

    from unirl.models.causal_lm import tiny_tokenizer
    from unirl.models.causal_lm.tiny import IMAGE_PAD, VIDEO_PAD, VISION_END, VISION_START, VISION_TOKENS

    base = os.path.join(root, "Qwen2-VL-7B-Instruct")
    tokenizer = tiny_tokenizer(extra_special=VISION_TOKENS)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    config = Qwen2VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096,
            rope_parameters={"rope_type": "default", "mrope_section": [4, 6, 6], "rope_theta": 10000.0},
        ),
        vision_config=dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, in_chans=3),
        image_token_id=ids[IMAGE_PAD], video_token_id=ids[VIDEO_PAD],
        vision_start_token_id=ids[VISION_START], vision_end_token_id=ids[VISION_END],
    )  # fmt: skip
    config.save_pretrained(base)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(base)
    with open(os.path.join(base, "chat_template.json"), "w") as f:
        json.dump({"chat_template": TEMPLATE}, f)
    Qwen2VLImageProcessorPil(
        min_pixels=56 * 56, max_pixels=28 * 28 * 1280, patch_size=14, merge_size=2, temporal_patch_size=2
    ).save_pretrained(base)
    config.text_config.vocab_size = len(tokenizer) + 1  # + <|Reward|>, as the package resizes
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(config).eval()
    head = rm_head(64).eval()
    with torch.no_grad():
        for p in head.parameters():  # a head that spreads images apart (default init is near 0)
            p.normal_(0, 0.5)
    state = {}
    for key, value in model.state_dict().items():  # transformers 4.45's names
        key = key.replace("model.language_model.", "model.").replace("model.visual.", "visual.")
        state[key] = value.clone()
    state |= {f"rm_head.{k}": v.clone() for k, v in head.state_dict().items()}
    from safetensors.torch import save_file

    path = os.path.join(root, "HPSv3.safetensors")
    save_file(state, path)
    return base, path, model, head, tokenizer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_hpsv3(str(tmp_path_factory.mktemp("hpsv3")))


def req(prompts: list[str], **kw) -> RewardRequest:
    return RewardRequest(sample_ids=[f"s{i}" for i in range(len(prompts))], prompts=prompts, **kw)


def images(n: int, h: int = 32, w: int = 64, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 3, h, w), dtype=torch.uint8, generator=g)


def reference(tiny, image: torch.Tensor, prompt: str) -> float:
    """The package's score of one image, its steps written out (module doc)."""
    _, _, model, head, tokenizer = tiny
    h, w = image.shape[-2:]
    # 1. the resize: the 28-multiple closest in area to 256 * 28 * 28 (32x64 -> 336x644, by hand)
    assert (h, w) == (32, 64)
    rh, rw = 336, 644
    pil = Image.fromarray(image.permute(1, 2, 0).numpy()).resize((rw, rh), Image.BICUBIC)
    x = (np.asarray(pil, dtype=np.float32) / 255.0 - MEAN) / STD  # [H, W, 3]
    x = torch.from_numpy(x).permute(2, 0, 1).float()  # [3, H, W]
    # Qwen2-VL's patches: the still image repeated over the temporal patch, then
    # (t, c, gh/2, 2, 14, gw/2, 2, 14) -> (gh/2, gw/2, 2, 2, c, t, 14, 14) flattened
    gh, gw = rh // 14, rw // 14
    frames = x[None].repeat(2, 1, 1, 1)
    p = frames.reshape(2, 3, gh // 2, 2, 14, gw // 2, 2, 14).permute(2, 5, 3, 6, 1, 0, 4, 7)
    pixel_values = p.reshape(gh * gw, 3 * 2 * 14 * 14)
    grid = torch.tensor([[1, gh, gw]])
    # 2. the chat turn, the image placeholder repeated once per merged patch
    text = (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n<|vision_start|>"
        + "<|image_pad|>" * (gh * gw // 4)
        + "<|vision_end|>"
        + INSTRUCTION.format(text_prompt=prompt)
        + REWARD_QUERY
        + "<|im_end|>\n<|im_start|>assistant\n"
    )
    tokenizer = tokenizer.__class__.from_pretrained(tiny[0])
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|Reward|>"]})
    ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
    # 3. transformers' own forward at sequential positions in all three rotary sections
    positions = torch.arange(ids.shape[1]).view(1, 1, -1).expand(3, 1, -1)
    with torch.no_grad():
        out = model(
            input_ids=ids, pixel_values=pixel_values, image_grid_thw=grid, position_ids=positions,
            output_hidden_states=True,
        )  # fmt: skip
        at = ids[0] == tokenizer.convert_tokens_to_ids("<|Reward|>")
        # 4. the head on the reward token: (mu, sigma), the score is mu
        return float(head(out.hidden_states[-1][0, at].float())[0, 0])


def test_the_score_is_the_packages_steps_written_out(tiny):
    scorer = HPSv3(tiny[1], tiny[0])
    ims, prompts = images(2), ["a red fox", "a sign that says hello, in a longer prompt"]
    got = scorer(req(prompts, images=ims))
    want = torch.tensor([reference(tiny, im, p) for im, p in zip(ims, prompts, strict=True)])
    assert got.dtype == torch.float32 and got.shape == (2,)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got, want)
    assert abs(float(got[0] - got[1])) > 1e-3  # the images (and prompts) are told apart


def test_the_input_is_the_packages(tiny):
    # the instruction and the reward query are the checkpoint's training text, character for
    # character (its sha256 taken from the package's data_collator_qwen.py)
    digest = hashlib.sha256((INSTRUCTION + REWARD_QUERY).encode()).hexdigest()
    assert digest == "f6ee57479d4e9eee76b49c00dc962e1e696a5a2b3cc32cebd9b1fa76fe27502c"
    batch = HPSv3(tiny[1], tiny[0]).inputs(images(1), ["a fox"])
    assert batch["image_grid_thw"].tolist() == [[1, 24, 46]]  # 336 x 644 in 14 px patches
    assert int((batch["input_ids"] == tiny[2].config.image_token_id).sum()) == 24 * 46 // 4


def test_a_score_does_not_depend_on_its_batch_mates_or_the_batch_size(tiny):
    ims = images(3, seed=1)
    prompts = ["a", "a much longer prompt than the first one", "cat"]
    together = HPSv3(tiny[1], tiny[0], batch_size=3)(req(prompts, images=ims))
    alone = HPSv3(tiny[1], tiny[0], batch_size=1)(req(prompts, images=ims))
    assert torch.allclose(together, alone, atol=1e-5)


def test_the_multimodal_rotary_index_would_score_differently(tiny):
    """The package feeds sequential positions; Qwen2-VL's own image-aware positions are another
    input, so a scorer that used them would not reproduce HPSv3 (this checks the test can tell)."""
    _, _, model, head, _ = tiny
    scorer = HPSv3(tiny[1], tiny[0])
    batch = scorer.inputs(images(1), ["a fox"])
    with torch.no_grad():
        types = (batch["input_ids"] == model.config.image_token_id).int()
        out = model(**batch, mm_token_type_ids=types, output_hidden_states=True)  # get_rope_index's positions
        at = batch["input_ids"][0] == scorer.load()[5]
        mrope = float(head(out.hidden_states[-1][0, at].float())[0, 0])
    assert abs(mrope - float(scorer(req(["a fox"], images=images(1)))[0])) > 1e-4


def test_bad_files_and_inputs_are_named(tiny, tmp_path):
    base, ckpt = tiny[0], tiny[1]
    with pytest.raises(ValueError, match="checkpoint_path .* does not exist; it is HPSv3.safetensors"):
        HPSv3(str(tmp_path / "nope.safetensors"), base)
    with pytest.raises(
        ValueError, match=r"lacks \['config.json', 'preprocessor_config.json', 'tokenizer.json'\]"
    ):
        HPSv3(ckpt, str(tmp_path))
    other = tmp_path / "clip"
    other.mkdir()
    for f in ("preprocessor_config.json", "tokenizer.json"):
        (other / f).write_text("{}")
    (other / "config.json").write_text(json.dumps({"model_type": "clip"}))
    with pytest.raises(ValueError, match="is a 'clip' model; HPSv3 is built on Qwen2-VL"):
        HPSv3(ckpt, str(other))
    from safetensors.torch import load_file, save_file

    state = load_file(ckpt)
    foreign = tmp_path / "foreign.safetensors"
    save_file({**state, "text_projection": torch.zeros(2)}, str(foreign))
    with pytest.raises(ValueError, match="'text_projection' is not a key of HPSv3"):
        HPSv3(str(foreign), base)(req(["a"], images=images(1)))
    small = tmp_path / "no_reward_token.safetensors"  # embeddings without the added token
    save_file(
        {k: (v[:-1] if "embed_tokens" in k or k == "lm_head.weight" else v) for k, v in state.items()},
        str(small),
    )
    with pytest.raises(
        ValueError, match=r"do not fit the Qwen2-VL .* tokens \(its tokenizer plus <\|Reward\|>\)"
    ):
        HPSv3(str(small), base)(req(["a"], images=images(1)))
    scorer = HPSv3(ckpt, base)
    with pytest.raises(ValueError, match=r"image 0 \(1x256\) cannot be scored"):
        scorer(req(["a"], images=images(1, 1, 256)))  # aspect ratio over 200
    with pytest.raises(ValueError, match="holds <|Reward|>"):
        scorer(req(["rate <|Reward|>"], images=images(1)))
    with pytest.raises(ValueError, match="HPSv3 needs images"):
        scorer(req(prompts=["a"], texts=["b"]))


def test_offload_scores_as_resident_and_rests_in_host_memory(tiny):
    ims, prompts = images(2, seed=2), ["a", "b c"]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    resident = HPSv3(tiny[1], tiny[0])(req(prompts, images=ims))
    scorer = HPSv3(tiny[1], tiny[0], device=device, offload=True)
    backbone, head = scorer.load()[:2]
    ran_on = []
    for m in (backbone.language_model, head):
        m.register_forward_pre_hook(lambda m, a: ran_on.append(next(m.parameters()).device.type))
    torch.testing.assert_close(scorer(req(prompts, images=ims)), resident, rtol=1e-5, atol=1e-5)
    assert ran_on == [device, device]
    assert {p.device.type for p in (*backbone.parameters(), *head.parameters())} == {"cpu"}


def test_an_unreadable_checkpoint_is_named(tiny, tmp_path):
    junk = tmp_path / "HPSv3.safetensors"
    junk.write_text("not a checkpoint")
    with pytest.raises(ValueError, match="HPSv3 .*HPSv3.safetensors: not a readable checkpoint"):
        HPSv3(str(junk), tiny[0])(req(["a"], images=images(1)))
