"""Partial rollouts at the text stage (`CausalLMStage.draft` / `extend` / `segment_of`): a draft
sampled in segments against one `generate`, a segment resumed by other weights against
independent no-cache forwards of each version, and a draft's checkpoint state."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.models.causal_lm.test_stage import full_forward_log_probs, make_req, make_stage


def perturbed(stage, scale: float = 0.05, seed: int = 1):
    """A copy of `stage` with every weight moved by seeded noise (the "next version")."""
    other = copy.deepcopy(stage)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.module.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen))
    return other


@pytest.mark.parametrize(
    "sampling", [{"temperature": 0}, {"temperature": 1.0}, {"temperature": 0.8, "top_k": 20}]
)
def test_a_draft_sampled_in_segments_by_unchanged_weights_is_one_generate(sampling) -> None:
    """Segments of 3, 5 and the rest under the same weights draw what one `generate` draws: a
    paused sample's generator is not advanced while it waits, so its uniforms continue."""
    stage = make_stage()
    req = make_req(max_new_tokens=12, **sampling)
    whole, whole_texts = stage.generate(req)
    draft = stage.draft(req)
    for n in (3, 5):
        stage.extend(draft, n, version=0)
        assert all(t.numel() <= 8 for t in draft.tokens)
    stage.extend(draft, 12)
    assert all(draft.done)
    seg, texts = stage.segment_of(draft)
    assert texts == whole_texts
    for a, b in zip(seg.response_ids, whole.response_ids, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(seg.log_probs, whole.log_probs, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_a_resumed_segment_samples_and_records_by_the_new_weights() -> None:
    """Pause after 4 tokens, resume by other weights: the first 4 tokens are the old weights'
    (one generate's), each later token's recorded log-prob is the new weights' (an independent
    no-cache forward of the sample alone), the earlier ones the old weights', and `versions`
    says which weights sampled each token."""
    old = make_stage()
    new = perturbed(old)
    req = make_req(max_new_tokens=10, temperature=1.0)
    reference, _ = old.generate(req)
    draft = old.draft(req)
    old.extend(draft, 4, version=3)
    new.extend(draft, 10, version=4)
    seg, _ = new.segment_of(draft)
    resumed = 0
    for i in range(len(seg)):
        r = seg.response_ids[i]
        first = min(4, r.numel())
        assert torch.equal(r[:first], reference.response_ids[i][:first])
        by_old = full_forward_log_probs(old.module, seg.prompt_ids[i], r, 1.0)
        by_new = full_forward_log_probs(new.module, seg.prompt_ids[i], r, 1.0)
        torch.testing.assert_close(seg.log_probs[i][:first], by_old[:first], atol=1e-5, rtol=0)
        torch.testing.assert_close(seg.log_probs[i][first:], by_new[first:], atol=1e-5, rtol=0)
        assert draft.versions[i].tolist() == [3] * first + [4] * (r.numel() - first)
        resumed += r.numel() > first
    assert resumed > 0  # some sample was paused and resumed
    assert sum(draft.version_counts().values()) == sum(int(r.numel()) for r in seg.response_ids)
    # a token budget is the whole response's, whatever the segments
    assert all(r.numel() <= 10 for r in seg.response_ids) and all(draft.done)


def test_a_draft_saved_between_segments_resumes_identically() -> None:
    """`state_dict` after a segment, loaded into a fresh draft of the same request, continues as
    the original does (tokens, log-probs, versions, generators)."""
    stage = make_stage()
    req = make_req(max_new_tokens=10, temperature=1.0)
    draft = stage.draft(req)
    stage.extend(draft, 4, version=1)
    state = copy.deepcopy(draft.state_dict())
    stage.extend(draft, 10, version=2)
    again = stage.draft(req)
    again.load_state_dict(state)
    stage.extend(again, 10, version=2)
    for a, b in zip(
        draft.tokens + draft.log_probs + draft.versions,
        again.tokens + again.log_probs + again.versions,
        strict=True,
    ):
        assert torch.equal(a, b)
    assert draft.done == again.done


def test_extend_of_a_finished_draft_samples_nothing() -> None:
    stage = make_stage()
    req = make_req(max_new_tokens=6, temperature=0)
    draft = stage.draft(req)
    stage.extend(draft, 6)
    tokens = [t.clone() for t in draft.tokens]
    stage.extend(draft, 6, version=9)
    assert all(torch.equal(a, b) for a, b in zip(tokens, draft.tokens, strict=True))
    assert 9 not in draft.version_counts()


def test_a_segment_in_forward_batches_samples_what_one_batch_does() -> None:
    """`rows` (a forward batch of the draft's samples, as `DedicatedEngine.extend` splits a
    segment by `forward_batch_size`): each sample's tokens do not depend on its batch-mates."""
    stage = make_stage()
    req = make_req(max_new_tokens=8, temperature=1.0)
    whole = stage.draft(req)
    stage.extend(whole, 8)
    split = stage.draft(req)
    for rows in ([0, 1, 2], [3, 4], [5]):
        stage.extend(split, 8, rows=rows)
    assert all(split.done)
    for a, b in zip(split.tokens, whole.tokens, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(split.log_probs, whole.log_probs, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
