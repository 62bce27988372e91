"""The Janus family on a tiny random model: image tokens against the library's own generation
and decode, log-prob parity of both segments (KV-cache rollout vs no-cache replay vs lone
per-sample forwards written here), CFG batching, the heads each segment reads, save / load,
bad input naming the sample."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers.models.janus.image_processing_pil_janus import JanusImageProcessorPil

from unirl.models.causal_lm import CausalLMStage
from unirl.models.image_tokens import VQImageStage
from unirl.models.janus import JanusModelConfig
from unirl.types import ImageTokenSamplingParams, PromptExample, RolloutReq, TextSamplingParams
from unirl.types.segments import TokenSegment

TINY = {"hidden_size": 32, "num_layers": 1, "max_position_embeddings": 128, "seed": 3}


@pytest.fixture(scope="module")
def bundle():
    return JanusModelConfig(tiny=TINY).build()


def contexts(bundle, stage):
    tok = bundle.tokenizer
    pairs = [("a red circle", "big red<end_of_plan>"), ("blue", "x"), ("two green squares", "left and right")]
    return [stage.image_context(torch.tensor(tok.encode(p)), torch.tensor(tok.encode(q))) for p, q in pairs]


def lone_guided_log_probs(bundle, context, image, scale, temperature):
    """[N] log-probs of one sample's image tokens, written out: the cond row and Janus's uncond row
    (pad everywhere but BOI) each in its own unpadded forward, guided u + s (c - u)."""
    model = bundle.model
    uncond = torch.where(
        context == bundle.boi_token_id, context, torch.full_like(context, bundle.tokenizer.pad_token_id)
    )
    heads = []
    for row in (context, uncond):
        embeds = torch.cat(
            [
                model.get_input_embeddings()(row),
                model.model.generation_aligner(model.model.generation_embeddings(image[:-1])),
            ]
        )[None]
        hidden = model.model.language_model(inputs_embeds=embeds).last_hidden_state[0]
        heads.append(model.model.generation_head(hidden[row.numel() - 1 :]).double())
    c, u = heads
    guided = u + scale * (c - u)
    return torch.log_softmax(guided / temperature, -1).gather(-1, image[:, None].long()).squeeze(-1)


def test_greedy_cfg_equals_library_generate(bundle):
    """Greedy image tokens through the stage (cond + uncond rows batched, KV cache) equal
    `JanusForConditionalGeneration.generate(generation_mode="image")`'s for the same context."""
    stage = VQImageStage(bundle)
    ctx = contexts(bundle, stage)[0]
    seg, _ = stage.generate([ctx], [0], ImageTokenSamplingParams(temperature=0, guidance_scale=3.0))
    gen = bundle.model.generation_config
    gen.pad_token_id, gen.bos_token_id = bundle.tokenizer.pad_token_id, bundle.tokenizer.eos_token_id
    gen.generation_kwargs = {"boi_token_id": bundle.boi_token_id}
    ref = bundle.model.generate(
        ctx[None],
        attention_mask=torch.ones_like(ctx[None]),
        generation_mode="image",
        guidance_scale=3.0,
        do_sample=False,
    )
    assert torch.equal(ref[0], seg.response_ids[0])


@pytest.mark.parametrize("scale", [1.0, 4.0])
def test_image_log_probs_recorded_replayed_and_lone_agree(bundle, scale):
    """Three contexts of different lengths sampled in one left-padded batch with a KV cache: the
    recorded log-probs equal the batched no-cache replay and each sample's own cond / uncond
    forwards written above (CFG batching equals separate passes)."""
    stage = VQImageStage(bundle)
    ctx = contexts(bundle, stage)
    sampling = ImageTokenSamplingParams(temperature=0.7, top_k=8, guidance_scale=scale)
    seg, media = stage.generate(ctx, [1, 2, 3], sampling)
    assert media.shape == (3, 3, bundle.image_size, bundle.image_size) and media.dtype == torch.uint8
    replayed = stage.token_log_probs(seg)
    torch.testing.assert_close(replayed, seg.padded("log_probs"), atol=2e-5, rtol=0)
    with torch.no_grad():
        for i in range(3):
            lone = lone_guided_log_probs(bundle, ctx[i], seg.response_ids[i], scale, 0.7)
            torch.testing.assert_close(replayed[i].double(), lone, atol=2e-5, rtol=0)
    alone, _ = stage.generate(ctx[1:2], [2], sampling)  # a sample's tokens do not depend on its batch
    assert torch.equal(alone.response_ids[0], seg.response_ids[1])


def plan_request(n_new: int = 6) -> RolloutReq:
    sampling = TextSamplingParams(
        samples_per_prompt=2, max_new_tokens=n_new, stop_tokens=["<end_of_plan>"], chat_template=False, seed=5
    )
    examples = [PromptExample("a red circle", "p0"), PromptExample("three blue squares", "p1")]
    return RolloutReq.from_prompts(examples, sampling, None, rollout_id=0)


def test_plan_log_probs_cache_vs_replay(bundle):
    """The plan through the shared text stage on the Janus backbone: KV-cache log-probs equal the
    no-cache replay; image tokens of the text vocabulary are never sampled."""
    stage = CausalLMStage(bundle)
    seg, texts = stage.generate(plan_request())
    torch.testing.assert_close(stage.token_log_probs(seg), seg.padded("log_probs"), atol=1e-5, rtol=0)
    ids = torch.cat(seg.response_ids)
    assert not torch.isin(ids, torch.tensor(bundle.vision_token_ids)).any() and len(texts) == 4


def test_each_segment_reads_only_its_own_head(bundle):
    """Masks: the image loss never sees a plan token's prediction and the reverse. The image
    log-probs' gradient reaches the image head and not the text head (lm_head); the plan's
    reaches the text head and not the image head."""
    plan_stage, image_stage = CausalLMStage(bundle), VQImageStage(bundle)
    plan, _ = plan_stage.generate(plan_request())
    ctx = [image_stage.image_context(p, r) for p, r in zip(plan.prompt_ids, plan.response_ids, strict=True)]
    image, _ = image_stage.generate(ctx, [0, 1, 2, 3], ImageTokenSamplingParams(guidance_scale=2.0))
    model = bundle.model
    text_head, image_head = model.lm_head.weight, model.model.generation_head.vision_head.weight
    for stage, seg, used, unused in (
        (image_stage, image, image_head, text_head),
        (plan_stage, plan, text_head, image_head),
    ):
        model.zero_grad(set_to_none=True)
        (stage.token_log_probs(seg) * seg.response_mask()).sum().backward()
        assert used.grad is not None and used.grad.abs().sum() > 0
        assert unused.grad is None
    model.zero_grad(set_to_none=True)
    # the plan conditions the image: its tokens are context, not loss positions
    assert image.response_mask().shape == (4, bundle.num_image_tokens)
    assert all(
        torch.equal(c[-r.numel() - 1 : -1], r)
        for c, r in zip(image.prompt_ids, plan.response_ids, strict=True)
    )


def test_vq_decode_equals_the_library(bundle):
    """The stage's images are the library's VQ-VAE decode (`JanusVQVAE.decode`) through its image
    processor's postprocess (with Janus-Pro's normalization, mean 0.5 / std 0.5), pixel for pixel."""
    tokens = torch.randint(
        0, bundle.codebook_size, (3, bundle.num_image_tokens), generator=torch.Generator().manual_seed(0)
    )
    ours = VQImageStage(bundle).decode(tokens)
    with torch.no_grad():
        pixels = bundle.model.model.vqmodel.decode(tokens).numpy()  # [B, 3, S, S]
    ref = JanusImageProcessorPil(image_mean=[0.5] * 3, image_std=[0.5] * 3).postprocess(
        list(pixels), return_tensors="np"
    )["pixel_values"]
    assert np.array_equal(ours.numpy(), np.asarray(ref))


def test_out_of_codebook_token_names_the_sample(bundle):
    stage = VQImageStage(bundle)
    n = bundle.num_image_tokens
    bad = torch.zeros(n, dtype=torch.long)
    bad[3] = bundle.codebook_size
    seg = TokenSegment(
        prompt_ids=[torch.tensor([1, bundle.boi_token_id])] * 2,
        response_ids=[torch.zeros(n, dtype=torch.long), bad],
        log_probs=[torch.zeros(n)] * 2,
        guidance_scale=1.0,
    )
    with pytest.raises(
        ValueError, match=r"sample 'p/1/0': image token id 32 is outside the codebook \[0, 32\)"
    ):
        stage.check_tokens(seg, ["p/0/0", "p/1/0"])


def test_save_and_load_round_trip(bundle, tmp_path):
    """`save_pretrained` then `JanusModelConfig(pretrained_path=dir)`: the same weights, tokens and
    image geometry; a directory of another model is refused naming its type."""
    bundle.save_pretrained(tmp_path / "janus")
    cfg = JanusModelConfig(pretrained_path=str(tmp_path / "janus"))
    assert cfg.directory_problems() == []
    loaded = cfg.build()
    a, b = bundle.model.state_dict(), loaded.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (loaded.boi_token_id, loaded.num_image_tokens, loaded.image_size) == (
        bundle.boi_token_id,
        bundle.num_image_tokens,
        bundle.image_size,
    )
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text('{"model_type": "qwen3"}')
    (problem,) = JanusModelConfig(pretrained_path=str(tmp_path / "other")).directory_problems()
    assert "'qwen3' model, not a Janus" in problem


def test_pretraining_losses_are_the_stages_own_log_probs(bundle):
    """`teacher_forced_losses` trains what the stage samples: its image term is minus the mean of
    `VQImageStage.token_log_probs` at guidance 1 over the same contexts (an unconditional row
    replayed as its uncond twin), its plan term the text head's cross-entropy of the plan tokens in
    a plain `model(input_ids=prompt + plan)` forward, unconditional rows left out."""
    from unirl.models.janus.pretrain import plan_ids, teacher_forced_losses

    stage = VQImageStage(bundle)
    tok = bundle.tokenizer
    prompts = [torch.tensor(tok.encode(p)) for p in ("draw a red ball.", "two blue boxes, please.", "x.")]
    plans = [plan_ids(bundle, t) for t in ("a red circle", "two blue squares", "a green triangle")]
    assert int(plans[0][-1]) == tok.convert_tokens_to_ids("<end_of_plan>")
    images = torch.randint(
        0, bundle.codebook_size, (3, bundle.num_image_tokens), generator=torch.Generator().manual_seed(0)
    )
    uncond = [False, True, False]
    plan_ce, image_ce = teacher_forced_losses(stage, prompts, plans, images, uncond)

    ctx = [stage.image_context(p, q) for p, q in zip(prompts, plans, strict=True)]
    ctx = [stage.unconditional(c) if u else c for c, u in zip(ctx, uncond, strict=True)]
    segment = TokenSegment(
        prompt_ids=ctx, response_ids=list(images), log_probs=None, temperature=1.0, guidance_scale=1.0
    )
    torch.testing.assert_close(image_ce, -stage.token_log_probs(segment).mean(), rtol=0, atol=1e-5)

    nll = []
    for p, q, u in zip(prompts, plans, uncond, strict=True):
        if u:
            continue
        logits = bundle.model(input_ids=torch.cat([p, q])[None]).logits[0].double()
        lp = torch.log_softmax(logits[p.numel() - 1 : -1], -1)
        nll.append(-lp.gather(-1, q[:, None]).squeeze(-1))
    torch.testing.assert_close(plan_ce.double(), torch.cat(nll).mean(), rtol=0, atol=1e-5)


def test_nearest_codes_are_the_closest_normalised_codebook_vectors(bundle):
    """The pretraining quantizer's code of each latent is the codebook vector nearest it in
    Euclidean distance once both are l2-normalised (computed here by brute force), row-major."""
    from unirl.models.janus.pretrain import nearest_codes

    vq = bundle.model.model.vqmodel
    x = (
        torch.rand(2, 3, bundle.image_size, bundle.image_size, generator=torch.Generator().manual_seed(1)) * 2
        - 1
    )
    with torch.no_grad():
        got = nearest_codes(vq, x)
        z = torch.nn.functional.normalize(vq.quant_conv(vq.encoder(x)), dim=1)  # [B, D, h, w]
        e = torch.nn.functional.normalize(vq.quantize.embedding.weight, dim=-1)
        dist = ((z.permute(0, 2, 3, 1)[..., None, :] - e) ** 2).sum(-1)  # [B, h, w, K]
    assert got.shape == (2, bundle.num_image_tokens)
    assert torch.equal(got, dist.argmin(-1).reshape(2, -1))


def test_committed_shapes_base_encodes_plans_and_draws_the_world():
    """checkpoints/shapes_janus (TRAINING.md there): its VQ round-trips held-out renders through
    codes and the library's decode (GenEvalMini strict 0.996 on 256 when made), its greedy plan
    restates training scenes asked in SFT forms, and its images after the right plan (CFG 3, as
    the recipe samples) draw the asked scene far above the random-VQ Janus's 0."""
    import random

    from unirl.models.janus.pretrain import nearest_codes, pixels, plan_ids
    from worlds.shapes import GenEvalMini, ShapesDataset
    from worlds.shapes.paraphrase import paraphrase
    from worlds.shapes.world import split_scenes

    base = JanusModelConfig(pretrained_path="checkpoints/shapes_janus").build()
    base.model.eval()
    images, prompts = ShapesDataset("eval", 0).sample_batch(32, np.random.default_rng(5), base.image_size)
    with torch.no_grad():
        decoded = base.decode(nearest_codes(base.model.model.vqmodel, pixels(images)))
    assert GenEvalMini().evaluate(decoded, prompts)["accuracy_strict_samples"] >= 0.9

    py = random.Random(3)
    scenes = split_scenes(0)[0]
    pairs = [paraphrase(scenes[py.randrange(len(scenes))], py) for _ in range(32)]
    tok = base.tokenizer
    stop = tok.convert_tokens_to_ids("<end_of_plan>")
    right = 0
    for text, meta in pairs[:8]:
        ids = tok.encode(text)
        for _ in range(48):
            with torch.no_grad():
                nxt = int(base.model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
            ids.append(nxt)
            if nxt == stop:
                break
        right += tok.decode(ids[len(tok.encode(text)) : -1]) == meta["canonical"]
    assert right >= 6, f"{right} of 8 greedy plans restate their training scene"

    stage = VQImageStage(base)
    contexts = [
        stage.image_context(torch.tensor(tok.encode(t)), plan_ids(base, m["canonical"])) for t, m in pairs
    ]
    _, media = stage.generate(
        contexts, list(range(32)), ImageTokenSamplingParams(temperature=1.0, guidance_scale=3.0)
    )
    strict = GenEvalMini().evaluate(media, [m["canonical"] for _, m in pairs])["accuracy_strict_samples"]
    assert strict >= 0.1, strict


class NoImageHead:
    """A bundle with every image-token member but the image head, and a `decode` that is data."""

    def __init__(self, bundle) -> None:
        kept = ("model", "tokenizer", "boi_token_id", "uncond_keep_ids", "num_image_tokens", "codebook_size")
        for name in (*kept, "image_size", "backbone", "embed_text", "embed_image"):
            setattr(self, name, getattr(bundle, name))
        self.decode = 0


def test_janus_is_an_image_token_family_and_a_bundle_missing_a_member_is_refused(bundle):
    """`JanusBundle` satisfies the shared image-token stage's contract (what an unconditional
    context keeps: BOS and BOI); a bundle without `image_logits`, or whose `decode` is not
    callable, is refused when the stage is built, each member named."""
    from unirl.models.image_tokens import ImageTokenFamily, image_token_family_problems

    assert isinstance(bundle, ImageTokenFamily) and image_token_family_problems(bundle) == []
    tok = bundle.tokenizer
    assert bundle.uncond_keep_ids == [i for i in (tok.bos_token_id, bundle.boi_token_id) if i is not None]
    bad = NoImageHead(bundle)
    family = "which the image-token stage calls (unirl.models.image_tokens.family.ImageTokenFamily)"
    assert image_token_family_problems(bad) == [
        f"NoImageHead lacks `image_logits`, {family}",
        f"NoImageHead lacks `decode`, {family}",
    ]
    with pytest.raises(TypeError, match="NoImageHead lacks `image_logits`"):
        VQImageStage(bad)
