"""Vision-language causal LMs through CausalLMStage, against independent computations:
the library's own processor path and a no-cache forward of each sample alone, the same
sample alone and batched with images of other sizes, and the bad-input errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from unirl.models.causal_lm import CausalLMStage, TinyLMConfig, TinyVLMConfig
from unirl.models.causal_lm.tiny import IMAGE_PAD, VISION_END, VISION_START
from unirl.models.qwen import QwenConfig
from unirl.models.qwen_vl import QwenVLConfig
from unirl.types.rollout_req import PromptExample, RolloutReq
from unirl.types.sampling import TextSamplingParams


def image(h: int, w: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


# three rows: images of three sizes (1, 2 and 4 vision tokens at the tiny sizes), one with two images
ROWS = [
    ("How many circles? <image>", [image(28, 28, 0)]),
    ("<image> What colour is the square?", [image(56, 30, 1)]),
    ("Left <image> or right <image>?", [image(60, 60, 2), image(28, 56, 3)]),
]


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def stage(request) -> CausalLMStage:
    return CausalLMStage(QwenVLConfig(tiny=TinyVLMConfig(architecture=request.param)).build())


def make_req(rows=ROWS, **sampling) -> RolloutReq:
    examples = [PromptExample(p, f"p{i}", {"images": ims}) for i, (p, ims) in enumerate(rows)]
    sp = TextSamplingParams(
        **{"samples_per_prompt": 2, "max_new_tokens": 8, "max_prompt_length": 128, **sampling}
    )
    return RolloutReq.from_prompts(examples, sp, None, 0)


def alone_log_probs(stage: CausalLMStage, seg, i: int) -> torch.Tensor:
    """[R_i] log-probs of sample i's response from one no-cache forward of the sample alone,
    its positions from the model's own rope index (no attention mask, no padding)."""
    model, b = stage.bundle.model, stage.bundle
    ids = torch.cat([seg.prompt_ids[i], seg.response_ids[i]])[None]
    grid = seg.image_grid_thw[i]
    with torch.no_grad():
        pos, _ = model.model.get_rope_index(ids, (ids == b.image_token_id).int(), image_grid_thw=grid)
        logits = (
            model(
                input_ids=ids,
                position_ids=pos,
                pixel_values=seg.pixel_values[i],
                image_grid_thw=grid,
                use_cache=False,
            )
            .logits[0]
            .float()
        )
    p, r = seg.prompt_ids[i].numel(), seg.response_ids[i].numel()
    logp = torch.log_softmax(logits[p - 1 : p - 1 + r] / seg.temperature, dim=-1)
    return logp.gather(-1, seg.response_ids[i][:, None]).squeeze(-1)


def test_prompt_expansion_equals_the_library_processor(stage) -> None:
    """Our `<image>` expansion and pixel values equal what the family's image processor and
    Qwen's placeholder rule (grid t*h*w / merge^2 pad tokens between vision start/end) give."""
    b = stage.bundle
    prompt, ims = ROWS[2]
    text, pixels, grids = b.prepare(prompt, ims, "s")
    from PIL import Image

    ref = b.image_processor(images=[Image.fromarray(x) for x in ims], return_tensors="pt")
    assert torch.equal(pixels, ref["pixel_values"].float()) and torch.equal(grids, ref["image_grid_thw"])
    n = [int(g.prod()) // b.merge**2 for g in ref["image_grid_thw"]]
    want = f"Left {VISION_START}{IMAGE_PAD * n[0]}{VISION_END} or right {VISION_START}{IMAGE_PAD * n[1]}{VISION_END}?"
    assert text == want and n[0] != n[1]


def test_recorded_log_probs_equal_replay_and_a_lone_forward(stage) -> None:
    """Rollout (left-padded batch, KV cache, images of different sizes) records the log-probs that
    replay (right-padded batch, no cache) and a no-cache forward of each sample alone compute."""
    seg, _ = stage.generate(make_req())
    assert seg.has_images and [int(g.shape[0]) for g in seg.image_grid_thw] == [1, 1, 1, 1, 2, 2]
    replay = stage.token_log_probs(seg)
    for i in range(len(seg)):
        r = seg.response_ids[i].numel()
        torch.testing.assert_close(replay[i, :r], seg.log_probs[i], atol=2e-5, rtol=0)
        torch.testing.assert_close(alone_log_probs(stage, seg, i), seg.log_probs[i], atol=2e-5, rtol=0)


def test_a_sample_is_the_same_alone_and_batched(stage) -> None:
    """The tokens of a sample do not depend on its batch-mates' images (padding invariance)."""
    req = make_req()
    batched, _ = stage.generate(req)
    alone, _ = stage.generate(req.select([4]))
    assert torch.equal(alone.response_ids[0], batched.response_ids[4])
    torch.testing.assert_close(alone.log_probs[0], batched.log_probs[4], atol=2e-5, rtol=0)


def test_images_change_the_response_distribution(stage) -> None:
    """The images reach the model: the same question with another image gives other log-probs."""
    a, _ = stage.generate(make_req([ROWS[0]], temperature=0))
    b, _ = stage.generate(make_req([(ROWS[0][0], [image(28, 28, 9)])], temperature=0))
    assert not torch.equal(a.pixel_values[0], b.pixel_values[0])
    assert not torch.allclose(stage.token_log_probs(a)[0, :1], stage.token_log_probs(b)[0, :1])


def test_replay_is_differentiable_into_the_vision_tower(stage) -> None:
    seg, _ = stage.generate(make_req(ROWS[:1]))
    stage.token_log_probs(seg).sum().backward()
    tower = stage.bundle.model.model.visual
    grads = [p.grad for p in tower.parameters() if p.grad is not None]
    assert grads and any(bool(g.abs().sum() > 0) for g in grads)
    stage.bundle.model.zero_grad(set_to_none=True)


def test_bad_images_name_the_sample_and_the_file(stage, tmp_path) -> None:
    corrupt = tmp_path / "corrupt.png"
    corrupt.write_bytes(b"not a png")
    cases = [
        ([str(tmp_path / "missing.png")], "no image file"),
        ([str(corrupt)], "cannot read image file"),
        ([np.zeros((0, 5, 3), np.uint8)], "zero size"),
        ([np.zeros((8, 8, 3), np.float32)], "uint8"),
        ([np.zeros((8, 8, 4), np.uint8)], "[H, W, 3]"),
    ]
    for ims, msg in cases:
        with pytest.raises(ValueError, match=r"sample 'r0/g0:p0::sample:0': images\[0\]") as e:
            stage.generate(make_req([("Q <image>", ims)]))
        assert msg in str(e.value)
    with pytest.raises(ValueError, match=r"sample 'r0/g0:p0::sample:0': the prompt has 2 <image>.*1 image"):
        stage.generate(make_req([("<image> and <image>", [image(28, 28, 0)])]))
    with pytest.raises(ValueError, match=r"has 0 <image>.*1 image"):
        stage.generate(make_req([("no placeholder", [image(28, 28, 0)])]))


def test_a_text_only_model_rejects_rows_with_images() -> None:
    text = CausalLMStage(QwenConfig(tiny=TinyLMConfig()).build())
    with pytest.raises(ValueError, match=r"sample 'r0/g0:p0::sample:0'.*text-only causal LM.*QwenVLConfig"):
        text.generate(make_req(ROWS[:1]))


def test_save_and_load_a_directory(stage, tmp_path) -> None:
    """`save_pretrained` writes what `QwenVLConfig(pretrained_path=...)` reads: same weights, same tokens."""
    stage.bundle.save_pretrained(str(tmp_path))
    loaded = CausalLMStage(QwenVLConfig(pretrained_path=str(tmp_path)).build())
    a, _ = stage.generate(make_req(ROWS[:2]))
    b, _ = loaded.generate(make_req(ROWS[:2]))
    assert all(torch.equal(x, y) for x, y in zip(a.response_ids, b.response_ids, strict=True))
    assert QwenVLConfig(pretrained_path=str(tmp_path)).directory_problems() == []
    problems = QwenConfig(pretrained_path=str(tmp_path)).directory_problems()
    assert len(problems) == 1 and "vision-language" in problems[0] and "QwenVLConfig" in problems[0]


def test_recipes_reject_the_other_kind_of_model_directory(tmp_path) -> None:
    """A text recipe pointing at a VLM directory, or a VLM recipe at a text-only one, stops before Ray
    naming the key and the model config to use."""
    from tests.recipes import recipe
    from unirl.config.validate import ConfigError

    vlm_dir, text_dir = tmp_path / "vlm", tmp_path / "text"
    QwenVLConfig(tiny=TinyVLMConfig()).build().save_pretrained(str(vlm_dir))
    QwenConfig(tiny=TinyLMConfig()).build().save_pretrained(str(text_dir))
    with pytest.raises(ConfigError, match=r"model.pretrained_path: .* holds a vision-language model.*QwenVLConfig"):
        recipe("llm/tiny_lm_grpo", tmp_path / "a", f"model.pretrained_path={vlm_dir}", "model.tiny=null")
    with pytest.raises(ConfigError, match=r"model.pretrained_path: .* holds a text-only model.*QwenConfig"):
        recipe("vlm/shapes_vqa_grpo", tmp_path / "b", f"model.pretrained_path={text_dir}")
