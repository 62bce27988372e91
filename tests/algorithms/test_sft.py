"""Supervised fine-tuning as a track's loss (issue 41, item 5): the demonstration track and
`LMSFT` give the completion cross-entropy of `unirl.train.lm_sft` (loss and gradient), through
the train stack's micro-batches; bad rows are named."""

from __future__ import annotations

import pytest
import torch

from unirl.algorithms.sft import LMSFT
from unirl.models.causal_lm import CausalLMConfig, CausalLMStage, TinyLMConfig
from unirl.models.causal_lm.bundle import encode_pairs
from unirl.rollout.demonstrations import DemonstrationEngine
from unirl.train.backend import OptimConfig, TrainBackend
from unirl.train.lm_sft import completion_loss
from unirl.train.stack import TrainStack, TrainStackConfig
from unirl.types import PromptExample, RolloutReq, TextSamplingParams

PAIRS = [("12+3=", "15"), ("7*8=", "56"), ("100-1=", "99"), ("4+4=", "8")]


def _request(pairs=PAIRS, keys=None, max_new_tokens=8) -> RolloutReq:
    keys = keys or ["answer"] * len(pairs)
    examples = [
        PromptExample(p, f"p{i}", {k: c}) for i, ((p, c), k) in enumerate(zip(pairs, keys, strict=True))
    ]
    sampling = TextSamplingParams(
        samples_per_prompt=1, max_new_tokens=max_new_tokens, max_prompt_length=16, chat_template=False
    )
    return RolloutReq.from_prompts(examples, sampling, None, rollout_id=0)


def _stage() -> CausalLMStage:
    torch.manual_seed(0)
    return CausalLMStage(CausalLMConfig(tiny=TinyLMConfig(hidden_size=32, num_layers=2)).build())


def _grads(module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in module.parameters() if p.grad is not None])


def test_the_demonstration_track_is_the_sft_row():
    stage = _stage()
    track = DemonstrationEngine(stage).generate(_request()).track("text")
    assert list(track.texts) == [c for _, c in PAIRS]
    input_ids, mask, labels = encode_pairs(stage.tokenizer, PAIRS, 64)
    for i, (p, r) in enumerate(zip(track.segment.prompt_ids, track.segment.response_ids, strict=True)):
        n = int(mask[i].sum())
        assert torch.equal(torch.cat([p, r]), input_ids[i, :n])  # prompt + completion + EOS
        assert torch.equal(r, labels[i, p.numel() : n])  # exactly the labelled positions
        assert r[-1] == stage.tokenizer.eos_token_id
    assert all(float(lp.abs().sum()) == 0 for lp in track.segment.log_probs)  # nothing was sampled
    assert track.segment.temperature == 1.0


@pytest.mark.parametrize("micro_batch_size", [4, 1])
def test_lmsft_through_the_train_stack_is_the_completion_cross_entropy(micro_batch_size):
    stage = _stage()
    reference = completion_loss(*_sft_forward(stage))
    reference.backward()
    want = _grads(stage.module).clone()
    stage.module.zero_grad(set_to_none=True)

    backend = TrainBackend(stage.module, None, OptimConfig(), total_steps=1)
    stack = TrainStack(stage, backend, LMSFT(), TrainStackConfig(micro_batch_size=micro_batch_size))
    track = DemonstrationEngine(stage).generate(_request()).track("text")
    micro, ctx = stack.prepare(track, 0.0)
    rows = stack.backward(micro, ctx)
    got = _grads(stage.module)
    assert float((got - want).norm() / want.norm()) < 1e-5
    # the stack's mean of the rows is the batch's loss, whatever the split
    assert sum(r["loss"] for r in rows) / len(rows) == pytest.approx(float(reference), rel=1e-5)


def _sft_forward(stage):
    inputs, labels = stage.bundle.pair_batch(PAIRS, "sft", 64)
    return stage.module(**inputs).logits, labels


def test_bad_rows_are_named():
    stage = _stage()
    with pytest.raises(
        ValueError, match=r"sample 'r0/g1:p1::sample:0'.*metadata\['answer'\].*rollout.target_key"
    ):
        DemonstrationEngine(stage).generate(_request(PAIRS[:2], keys=["answer", "other"]))
    long = [("1+1=", "2" * 20)]
    with pytest.raises(ValueError, match=r"demonstration '2+' is 21 tokens with EOS.*max_new_tokens=8"):
        DemonstrationEngine(stage).generate(_request(pairs=long))


def test_a_stage_that_cannot_teacher_force_is_refused():
    class Images:
        module = torch.nn.Linear(1, 1)

    with pytest.raises(TypeError, match="DemonstrationEngine teacher-forces text.*no `teacher_forced`"):
        DemonstrationEngine(Images())
