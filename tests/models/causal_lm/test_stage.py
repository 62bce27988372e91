"""CausalLMStage against independent computations: a no-cache forward per sample, a
no-cache greedy loop, the same sample alone and batched."""

from __future__ import annotations

import pytest
import torch

from unirl.models.causal_lm import CausalLMStage, TinyLMConfig
from unirl.models.qwen import QwenConfig
from unirl.models.stage import TextStage
from unirl.types.rollout_req import PromptExample, RolloutReq
from unirl.types.sampling import TextSamplingParams
from unirl.types.segments import TokenSegment

PROMPTS = ["Hi", "Name a colour, please.", "What is 2 + 2? Answer briefly and politely."]


def make_stage(arch: str = "qwen3", **tiny) -> CausalLMStage:
    return CausalLMStage(QwenConfig(tiny=TinyLMConfig(architecture=arch, **tiny)).build())


def make_req(prompts=PROMPTS, rollout_id: int = 0, **sampling) -> RolloutReq:
    examples = [PromptExample(p, f"p{i}") for i, p in enumerate(prompts)]
    sp = TextSamplingParams(**{"samples_per_prompt": 2, "max_new_tokens": 12, **sampling})
    return RolloutReq.from_prompts(examples, sp, None, rollout_id)


def full_forward_log_probs(model, prompt: torch.Tensor, response: torch.Tensor, t: float) -> torch.Tensor:
    """[R] log-probs of `response` after `prompt` from one no-cache forward of the sample alone."""
    ids = torch.cat([prompt, response])[None]
    with torch.no_grad():
        logits = model(ids, use_cache=False).logits[0].float()
    p = prompt.numel()
    logp = torch.log_softmax(logits[p - 1 : p - 1 + response.numel()] / t, dim=-1)
    return logp.gather(-1, response[:, None]).squeeze(-1)


@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])
def test_recorded_log_probs_equal_a_fresh_full_forward(arch) -> None:
    stage = make_stage(arch)
    assert isinstance(stage, TextStage)
    seg, texts = stage.generate(make_req(temperature=0.7, top_k=40, top_p=0.9))
    assert len(seg) == len(texts) == 6 and seg.temperature == 0.7
    for i in range(len(seg)):
        assert seg.response_ids[i].dtype == torch.long and seg.log_probs[i].dtype == torch.float32
        want = full_forward_log_probs(stage.module, seg.prompt_ids[i], seg.response_ids[i], 0.7)
        torch.testing.assert_close(seg.log_probs[i], want, atol=1e-5, rtol=0)
    # replay of the whole batch gives the same values (the first on-policy ratio is 1)
    replay = stage.token_log_probs(seg)
    assert replay.dtype == torch.float32 and replay.shape == seg.padded("log_probs").shape
    torch.testing.assert_close(replay, seg.padded("log_probs"), atol=1e-5, rtol=0)


def test_top_k_restricts_the_choice_but_not_the_recorded_log_prob() -> None:
    stage = make_stage()
    seg, _ = stage.generate(make_req(temperature=1.0, top_k=1))
    greedy, _ = stage.generate(make_req(temperature=0))
    for a, b in zip(seg.response_ids, greedy.response_ids, strict=True):
        assert torch.equal(a, b)  # top-1 sampling is greedy
    # the log-prob is the plain softmax's (< 0), not the top-1 distribution's (= 0)
    assert all(bool((lp < -1e-3).all()) for lp in seg.log_probs)


@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])
def test_kv_cache_greedy_equals_a_no_cache_greedy_loop(arch) -> None:
    stage = make_stage(arch)
    model, eos = stage.module, stage.tokenizer.eos_token_id
    seg, texts = stage.generate(make_req(temperature=0, max_new_tokens=16))
    assert seg.temperature == 1.0
    for i in range(len(seg)):
        ids = seg.prompt_ids[i]
        for _ in range(16):
            with torch.no_grad():
                nxt = model(ids[None], use_cache=False).logits[0, -1].argmax()
            ids = torch.cat([ids, nxt[None]])
            if int(nxt) == eos:
                break
        assert torch.equal(seg.response_ids[i], ids[seg.prompt_ids[i].numel() :]), i
        assert texts[i] == stage.tokenizer.decode(seg.response_ids[i])


def test_a_sample_is_the_same_alone_and_batched() -> None:
    stage = make_stage()
    req = make_req(temperature=1.0, top_p=0.95, max_new_tokens=10)
    seg, texts = stage.generate(req)
    for i in (0, 3, 5):  # the shortest, middle and longest prompts
        alone, alone_texts = stage.generate(req.select([i]))
        assert torch.equal(alone.response_ids[0], seg.response_ids[i]) and alone_texts[0] == texts[i]
        torch.testing.assert_close(alone.log_probs[0], seg.log_probs[i], atol=1e-5, rtol=0)


def test_token_log_probs_do_not_depend_on_batch_mates() -> None:
    stage = make_stage()
    g = torch.Generator().manual_seed(0)

    def row(p: int, r: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randint(0, 256, (p,), generator=g), torch.randint(0, 256, (r,), generator=g)

    mine, shorter, longer = row(7, 5), row(3, 2), row(12, 9)

    def seg_of(rows) -> TokenSegment:
        return TokenSegment(
            prompt_ids=[p for p, _ in rows],
            response_ids=[r for _, r in rows],
            log_probs=[torch.zeros(r.numel()) for _, r in rows],
            temperature=0.8,
        )

    alone = stage.token_log_probs(seg_of([mine]))[0]
    batched = stage.token_log_probs(seg_of([shorter, mine, longer]))
    torch.testing.assert_close(batched[1, :5], alone, atol=1e-6, rtol=0)
    assert torch.equal(batched[1, 5:], torch.zeros(4)) and torch.equal(batched[0, 2:], torch.zeros(7))
    want = full_forward_log_probs(stage.module, *mine, 0.8)
    torch.testing.assert_close(alone, want, atol=1e-5, rtol=0)


def test_token_log_probs_are_differentiable() -> None:
    stage = make_stage()
    seg, _ = stage.generate(make_req(max_new_tokens=4))
    stage.module.train()
    lp = stage.token_log_probs(seg)
    (lp * seg.response_mask()).sum().backward()
    grads = [p.grad for p in stage.module.parameters()]
    assert all(g is not None for g in grads) and any(bool(g.abs().sum() > 0) for g in grads)
    assert stage.module.training  # generate restored the mode it found
    stage.generate(make_req(max_new_tokens=2))
    assert stage.module.training


def test_seeds_fix_the_tokens() -> None:
    stage = make_stage()
    a, _ = stage.generate(make_req(temperature=1.0))
    b, _ = stage.generate(make_req(temperature=1.0))
    c, _ = stage.generate(make_req(temperature=1.0, rollout_id=1))
    assert all(torch.equal(x, y) for x, y in zip(a.response_ids, b.response_ids, strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(a.response_ids, c.response_ids, strict=True))
    # siblings of a prompt draw different tokens
    assert not torch.equal(a.response_ids[0], a.response_ids[1])


def test_max_new_tokens_and_stop_tokens() -> None:
    stage = make_stage()
    tok = stage.tokenizer
    seg, _ = stage.generate(make_req(temperature=0, max_new_tokens=16))
    assert all(r.numel() == 16 for r in seg.response_ids)  # the random model never says EOS here
    # stop at the first token of a greedy response that is a one-token string
    resp = seg.response_ids[2].tolist()
    stop = next(t for t in resp if tok.encode(tok.decode([t]), add_special_tokens=False) == [t])
    j = resp.index(stop)
    req = make_req(temperature=0, max_new_tokens=16, stop_tokens=["<|im_end|>", tok.decode([stop])])
    assert stage.stop_token_ids(req.sampling) == [tok.eos_token_id, 258, stop]
    stopped, texts = stage.generate(req)
    assert stopped.response_ids[2].tolist() == resp[: j + 1]  # the stop token is kept in the ids
    assert texts[2] == tok.decode(resp[:j])  # and left out of the text
    torch.testing.assert_close(stopped.log_probs[2], seg.log_probs[2][: j + 1], atol=1e-6, rtol=0)


def test_eos_ends_a_response() -> None:
    stage = make_stage()
    first, _ = stage.generate(make_req(temperature=0, max_new_tokens=1))
    head = stage.module.lm_head.weight
    eos = stage.tokenizer.eos_token_id
    with torch.no_grad():  # make EOS the argmax wherever sample 0's first greedy token was
        head[eos] = 10 * head[int(first.response_ids[0][0])]
    seg, texts = stage.generate(make_req(temperature=0, max_new_tokens=8))
    assert seg.response_ids[0].tolist() == [eos] and texts[0] == ""
    assert max(r.numel() for r in seg.response_ids) <= 8


def test_errors_name_the_sample_and_the_key() -> None:
    stage = make_stage(max_position_embeddings=48)
    req = make_req(max_prompt_length=45, max_new_tokens=4)
    with pytest.raises(ValueError, match=r"sample 'r0/g2:p2::sample:0'.*sampling\.max_prompt_length=45"):
        stage.generate(req)
    req = make_req(prompts=PROMPTS[:2], max_prompt_length=64, max_new_tokens=20)
    with pytest.raises(ValueError, match=r"sample 'r0/g1:p1::sample:0'.*max_position_embeddings \(48\)"):
        stage.generate(req)
    with pytest.raises(ValueError, match=r"sampling\.stop_tokens entry 'ab' is 2 tokens"):
        stage.generate(make_req(prompts=PROMPTS[:1], stop_tokens=["ab"]))
    with pytest.raises(ValueError, match="stage.autocast_dtype must be one of"):
        CausalLMStage(stage.bundle, autocast_dtype="float64")


def test_bf16_autocast_runs_and_returns_fp32() -> None:
    stage = CausalLMStage(make_stage().bundle, autocast_dtype="bfloat16")
    seg, _ = stage.generate(make_req(max_new_tokens=6))
    replay = stage.token_log_probs(seg)
    assert seg.log_probs[0].dtype == replay.dtype == torch.float32
    # the same bf16 forward, with and without the KV cache
    torch.testing.assert_close(replay, seg.padded("log_probs"), atol=0.1, rtol=0)


def test_no_chat_template_tokenizes_the_raw_prompt() -> None:
    stage = make_stage()
    seg, _ = stage.generate(make_req(prompts=["abc"], chat_template=False, max_new_tokens=2))
    assert seg.prompt_ids[0].tolist() == stage.tokenizer.encode("abc", add_special_tokens=False)
    seg, _ = stage.generate(make_req(prompts=["abc"], max_new_tokens=2))
    assert (
        stage.tokenizer.decode(seg.prompt_ids[0])
        == "<|im_start|>user\nabc<|im_end|>\n<|im_start|>assistant\n"
    )


def test_sampling_probs_and_draw_by_hand() -> None:
    from unirl.models.causal_lm.stage import draw, sampling_probs

    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    torch.testing.assert_close(sampling_probs(logits, 1.0, 0, 0.8), torch.tensor([[0.625, 0.375, 0, 0]]))
    torch.testing.assert_close(
        sampling_probs(logits, 1.0, 0, 0.81), torch.tensor([[0.5, 0.3, 0.15, 0]]) / 0.95
    )
    torch.testing.assert_close(sampling_probs(logits, 1.0, 2, 1.0), torch.tensor([[0.625, 0.375, 0, 0]]))
    torch.testing.assert_close(sampling_probs(logits, 1.0, 0, 1e-3), torch.tensor([[1.0, 0, 0, 0]]))
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5]]).expand(4, 4)
    u = torch.tensor([[0.0], [0.49], [0.5], [0.999999]], dtype=torch.float64)
    assert draw(probs, u).tolist() == [1, 1, 3, 3]  # zero-mass tokens are never drawn
