"""Supervised causal-LM training: the masked loss against an independent computation, the same
prompt tokens as the rollout stage, learning a toy task, exact resume, fp16 export, config errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from unirl.models.causal_lm import CausalLMStage, TinyLMConfig
from unirl.models.qwen import QwenBundle, QwenConfig
from unirl.train.lm_sft import CausalLMSFT, CausalLMSFTConfig, completion_loss, encode_pairs
from unirl.train_sft import trainer_class
from unirl.trainer.text_eval import LMEvaluator, TextEvalSampling
from unirl.types.rollout_req import PromptExample, RolloutReq
from unirl.types.sampling import TextSamplingParams

PAIRS = [("ab>", "ab"), ("hello world>", "x"), ("q>", "longer one")]


class CopySource:
    """`sample_batch(n, rng)`: (s + ">", s) for random 4-letter strings s over "abcdef"."""

    def sample_batch(self, n: int, rng: np.random.Generator) -> list[tuple[str, str]]:
        words = ["".join(rng.choice(list("abcdef"), size=4)) for _ in range(n)]
        return [(w + ">", w) for w in words]


def exact_match(req) -> list[float]:
    """1 when the response is the example's target string."""
    return [float(t == m["target"]) for t, m in zip(req.texts, req.metadata, strict=True)]


@pytest.fixture
def one_thread():
    """Tiny matmuls gain nothing from a second torch thread and lose much when another process
    holds the second core."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_bundle(**kw) -> QwenBundle:
    return QwenBundle.tiny(TinyLMConfig(max_position_embeddings=32, **kw))


def make_sft(tmp_path, steps: int, **kw) -> CausalLMSFT:
    cfg = CausalLMSFTConfig(
        **{"num_steps": steps, "batch_size": 8, "warmup_steps": 1, "checkpoint_every": 2, "log_every": 1} | kw
    )
    return CausalLMSFT(tiny_bundle(), CopySource(), cfg, str(tmp_path))


def test_prompt_tokens_are_the_rollout_stages():
    bundle = tiny_bundle()
    input_ids, _, labels = encode_pairs(bundle.tokenizer, PAIRS, 32)
    examples = [PromptExample(p, str(i)) for i, (p, _) in enumerate(PAIRS)]
    req = RolloutReq.from_prompts(
        examples, TextSamplingParams(samples_per_prompt=1, chat_template=False), None, 0
    )
    for row, lab, prompt, (_, completion) in zip(
        input_ids, labels, CausalLMStage(bundle).encode_prompts(req), PAIRS, strict=True
    ):
        n = prompt.numel()
        assert torch.equal(row[:n], prompt) and (lab[:n] == -100).all()
        target = bundle.tokenizer(completion, add_special_tokens=False)["input_ids"] + [
            bundle.tokenizer.eos_token_id
        ]
        assert lab[n : n + len(target)].tolist() == target and (lab[n + len(target) :] == -100).all()


def test_loss_and_gradient_come_from_completion_and_eos_only():
    """Batched, padded loss == the per-pair sum of -log p(completion + EOS | prompt) over the
    batch's completion tokens, in value and parameter gradient; d loss / d logits is zero
    at every position that does not predict a completion or EOS token."""
    bundle = tiny_bundle(hidden_size=32, num_layers=1)
    model, tok = bundle.model, bundle.tokenizer
    input_ids, mask, labels = encode_pairs(tok, PAIRS, 32)
    logits = model(input_ids=input_ids, attention_mask=mask).logits
    logits.retain_grad()
    loss = completion_loss(logits, labels)
    loss.backward()
    batched = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    total, count = torch.zeros(()), 0
    for prompt, completion in PAIRS:
        p = tok(prompt, add_special_tokens=False)["input_ids"]
        c = tok(completion, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        seq = torch.tensor([p + c])
        logp = torch.log_softmax(model(input_ids=seq).logits[0].double(), dim=-1)
        total = total - sum(logp[len(p) - 1 + k, t] for k, t in enumerate(c))
        count += len(c)
    independent = total / count
    independent.backward()
    assert loss.item() == pytest.approx(independent.item(), rel=1e-5)
    for g, p in zip(batched, model.parameters(), strict=True):
        torch.testing.assert_close(g, p.grad.float(), rtol=1e-4, atol=1e-6)

    for i, (prompt, completion) in enumerate(PAIRS):
        start = len(tok(prompt, add_special_tokens=False)["input_ids"]) - 1
        end = start + len(tok(completion, add_special_tokens=False)["input_ids"]) + 1
        row = logits.grad[i].abs().sum(-1)
        assert (row[start:end] > 0).all() and (row[:start] == 0).all() and (row[end:] == 0).all()


def test_learns_to_copy_and_stops_at_eos(tmp_path, one_thread):
    held_out = [PromptExample(w + ">", w, {"target": w}) for w in ("fade", "cafe", "beef", "dabc")]
    evaluator = LMEvaluator(
        held_out, exact_match, TextEvalSampling(max_new_tokens=8, pass_k=2, max_prompt_length=16)
    )
    sft = make_sft(tmp_path, 250, batch_size=32, lr=3e-3, warmup_steps=10, log_every=25, checkpoint_every=250)
    sft.evaluate = evaluator
    rows = sft.run()
    losses = [r["loss"] for r in rows if "loss" in r]
    assert losses[-1] < 0.05 * losses[0]
    assert rows[-1]["final"] and rows[-1]["eval/accuracy/greedy"] == 1.0
    assert all(r["tokens_per_s"] > 0 for r in rows if "loss" in r)
    req = RolloutReq.from_prompts(
        held_out, TextSamplingParams(samples_per_prompt=1, temperature=0.0, chat_template=False), None, 0
    )
    segment, texts = CausalLMStage(sft.bundle).generate(req)
    assert texts == [ex.prompt_id for ex in held_out]
    assert all(int(r[-1]) == sft.bundle.tokenizer.eos_token_id for r in segment.response_ids)


def test_resumed_run_matches_uninterrupted_run(tmp_path):
    full = make_sft(tmp_path / "full", 4)
    full.run()
    part = make_sft(tmp_path / "part", 4)
    part.run(max_seconds=0.0)  # stops after its first step, state saved
    assert part.step == 1
    with open(tmp_path / "part" / "metrics.jsonl", "a") as f:  # logged, then stopped before a checkpoint
        f.write(json.dumps({"step": 2, "loss": 9.0, "lr": 0.0}) + "\n")
    resumed = make_sft(tmp_path / "part", 4)
    resumed.run()
    assert resumed.step == 4
    for a, b in zip(full.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b)
    rows = [json.loads(line) for line in open(tmp_path / "full" / "metrics.jsonl")]
    resumed_rows = [json.loads(line) for line in open(tmp_path / "part" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [r["step"] for r in resumed_rows] == [1, 2, 3, 4]
    assert [r["loss"] for r in resumed_rows] == [r["loss"] for r in rows]


def test_export_loads_back_as_fp16_model_and_tokenizer(tmp_path):
    sft = make_sft(tmp_path, 1)
    sft.run()
    sft.export(str(tmp_path / "export"))
    assert next(sft.model.parameters()).dtype == torch.float32
    loaded = QwenConfig(pretrained_path=str(tmp_path / "export")).build()
    for p, q in zip(sft.model.parameters(), loaded.model.parameters(), strict=True):
        assert torch.equal(p.detach().half().float(), q.detach())
    text = "12+3=45<|endoftext|>"
    assert loaded.tokenizer(text)["input_ids"] == sft.bundle.tokenizer(text)["input_ids"]
    assert loaded.tokenizer.eos_token_id == sft.bundle.tokenizer.eos_token_id


def test_too_long_pair_is_named():
    with pytest.raises(ValueError, match=r"'abc>'.*max_position_embeddings \(6\)"):
        encode_pairs(tiny_bundle().tokenizer, [("abc>", "abc")], 6)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("num_steps", 0),
        ("batch_size", 0),
        ("lr", 0.0),
        ("weight_decay", -1.0),
        ("warmup_steps", -1),
        ("lr_schedule", "step"),
        ("max_grad_norm", 0.0),
        ("checkpoint_every", 0),
        ("eval_every", -1),
        ("log_every", 0),
    ],
)
def test_config_errors_name_the_key(key, value):
    with pytest.raises(ValueError, match=f"sft.{key}"):
        CausalLMSFTConfig(**{key: value})


def test_entry_point_picks_the_trainer_by_config_type():
    from unirl.models.sd3 import SD3ModelConfig
    from unirl.train.sft import FlowMatchingSFT, FlowMatchingSFTConfig

    lm = QwenConfig(tiny=TinyLMConfig())
    assert trainer_class(CausalLMSFTConfig(), lm) is CausalLMSFT
    assert trainer_class(FlowMatchingSFTConfig(), SD3ModelConfig(pretrained_path="x")) is FlowMatchingSFT
    with pytest.raises(TypeError, match="CausalLMSFTConfig trains text models"):
        trainer_class(CausalLMSFTConfig(), SD3ModelConfig(pretrained_path="x"))
    with pytest.raises(TypeError, match="sft._target_ builds int"):
        trainer_class(3, lm)


def test_vlm_loss_is_the_mean_over_samples_forwarded_alone_with_their_images(tmp_path):
    """A VLM batch (prompt, completion, images): the padded batch loss equals the completion
    cross-entropy summed over each sample's own no-padding forward with its image, divided by
    the batch's completion (+ EOS) tokens; the image reaches the loss (the vision tower gets
    gradient); a text-only model refuses image rows."""
    from unirl.models.causal_lm import TinyVLMConfig
    from unirl.models.qwen_vl import QwenVLConfig
    from worlds.shapes.vqa import ShapesVQASFTSource

    tiny = TinyVLMConfig(patch_size=8, min_pixels=256, max_pixels=1024)
    bundle = QwenVLConfig(tiny=tiny).build()
    cfg = CausalLMSFTConfig(num_steps=1, batch_size=3, warmup_steps=0, eval_every=0)
    run = CausalLMSFT(bundle, ShapesVQASFTSource(), cfg, str(tmp_path))
    rows = ShapesVQASFTSource().sample_batch(3, np.random.default_rng(run.cfg.seed))
    run.rng = np.random.default_rng(run.cfg.seed)
    loss, stats = run.batch_loss()
    total, count = 0.0, 0
    for prompt, answer, images in rows:
        text, pixels, grid = bundle.prepare(prompt, images, "s")
        ids, _, labels = encode_pairs(bundle.tokenizer, [(text, answer)], 128)
        pos, _ = bundle.model.model.get_rope_index(
            ids, (ids == bundle.image_token_id).int(), image_grid_thw=grid
        )
        logits = bundle.model(
            input_ids=ids, position_ids=pos, pixel_values=pixels, image_grid_thw=grid
        ).logits
        n = int((labels[:, 1:] != -100).sum())
        total += float(completion_loss(logits, labels)) * n
        count += n
    torch.testing.assert_close(float(loss), total / count, atol=1e-5, rtol=1e-5)
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in bundle.model.model.visual.parameters())
    text_run = CausalLMSFT(tiny_bundle(), ShapesVQASFTSource(), cfg, str(tmp_path / "text"))
    with pytest.raises(
        ValueError, match="images with its pairs but the model is a text-only causal LM.*QwenVLConfig"
    ):
        text_run.batch_loss()
