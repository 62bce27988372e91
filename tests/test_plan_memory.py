"""The memory planner (`unirl.plan_memory`, issue 45 item 7): its cost models against independent
computations (autocast's saved tensors on real CPU tensors, a flash kernel's saves by hand, a live
byte count by hand, the meta run against the same code on real tensors) and its bad input."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir

from unirl.plan_memory import (
    FlashAttentionCost,
    LiveBytes,
    _peak_while,
    largest_micro_batch,
    main,
    meta_autocast,
    plan_memory,
)

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def saved_of(fn) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """(shape, dtype) of every tensor autograd saves while `fn()` runs, sorted."""
    saved = []

    def pack(t):
        saved.append((tuple(t.shape), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sorted(saved, key=str)


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(16)
        self.up = torch.nn.Linear(16, 64)
        self.down = torch.nn.Linear(64, 16)
        self.conv = torch.nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x: torch.Tensor, img: torch.Tensor) -> torch.Tensor:
        h = self.down(F.gelu(self.up(self.norm(x))))
        return h.float().sum() + self.conv(img).float().sum()


def test_meta_autocast_saves_what_cpu_autocast_saves():
    """The same block under real bf16 autocast on CPU tensors and under `meta_autocast` on meta
    tensors: autograd saves tensors of the same shapes and dtypes (the casts included)."""
    torch.manual_seed(0)
    block = Block()
    x = torch.randn(3, 16, requires_grad=True)
    img = torch.randn(2, 4, 8, 8, requires_grad=True)

    def real():
        with torch.autocast("cpu", torch.bfloat16):
            block(x, img)

    want = saved_of(real)
    meta_block = Block().to("meta")
    xm, im = x.detach().to("meta").requires_grad_(), img.detach().to("meta").requires_grad_()

    def emulated():
        with meta_autocast(torch.bfloat16), torch.autocast("meta", torch.bfloat16):
            meta_block(xm, im)

    got = saved_of(emulated)
    assert any(dtype == torch.bfloat16 for _, dtype in want)  # the casts are there to compare
    assert got == want


def test_attention_is_costed_as_a_flash_kernel():
    q = torch.empty(2, 3, 10, 8, device="meta", dtype=torch.bfloat16, requires_grad=True)
    k = torch.empty(2, 3, 12, 8, device="meta", dtype=torch.bfloat16, requires_grad=True)
    v = torch.empty(2, 3, 12, 4, device="meta", dtype=torch.bfloat16, requires_grad=True)
    with meta_autocast(None):
        saved = saved_of(lambda: F.scaled_dot_product_attention(q, k, v))
        out = F.scaled_dot_product_attention(q, k, v)
    assert out.shape == (2, 3, 10, 4) and out.dtype == torch.bfloat16
    # q, k, v, the output and an fp32 log-sum-exp per query; no 10 x 12 probability matrix
    assert saved == sorted(
        [
            ((2, 3, 10, 8), torch.bfloat16),
            ((2, 3, 12, 8), torch.bfloat16),
            ((2, 3, 12, 4), torch.bfloat16),
            ((2, 3, 10, 4), torch.bfloat16),
            ((2, 3, 10), torch.float32),
        ],
        key=str,
    )
    assert F.scaled_dot_product_attention is not FlashAttentionCost  # restored after the context
    grads = torch.autograd.grad(FlashAttentionCost.apply(q, k, v).sum(), (q, k, v))
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]


def test_live_bytes_by_hand():
    def fn():
        a = torch.empty(1000, device="meta")  # 4000 bytes
        b = a * 2  # +4000: 8000 alive
        view = b[:10]  # a view: no new storage
        del a  # 4000
        c = torch.empty(250, dtype=torch.float64, device="meta")  # +2000: 6000
        b.mul_(3)  # in place: no new storage
        return view, c

    with LiveBytes() as tracker:
        kept = fn()
    assert tracker.peak == 8000
    assert tracker.live == 6000
    del kept
    assert tracker.live == 0


def test_the_meta_run_counts_what_real_tensors_allocate():
    """A forward and backward of the same block on real CPU tensors and on meta tensors: the same
    peak of bytes alive (the meta device's bookkeeping is the real allocations')."""
    torch.manual_seed(0)
    peaks = {}
    for device in ("cpu", "meta"):
        block = Block().to(device)
        x = torch.randn(64, 16).to(device).requires_grad_()
        img = torch.randn(4, 4, 16, 16).to(device).requires_grad_()
        peaks[device] = _peak_while(lambda b=block, x=x, img=img: b(x, img).backward())
    assert peaks["cpu"] > 0
    assert peaks["meta"] == peaks["cpu"]


def tiny_recipe(*overrides: str):
    with initialize_config_dir(config_dir=EXAMPLES, version_base=None):
        return compose(config_name="diffusion/tiny_sd3_flowgrpo", overrides=list(overrides))


def test_the_plan_of_the_tiny_recipe_against_hand_counts():
    cfg = tiny_recipe()
    plan = plan_memory(cfg)
    model = compose_model(cfg)
    weights = sum(p.numel() * p.element_size() for p in model.denoiser.parameters()) + sum(
        b.numel() * b.element_size() for b in model.denoiser.buffers()
    )
    lora = plan.trainable
    assert plan.module == weights + lora  # the module holds its LoRA adapters
    # AdamW: two fp32 moments per trainable fp32 element, and a 4-byte step count per tensor
    extra = plan.optimizer - 2 * lora
    assert extra % 4 == 0 and 0 < extra < 4096, extra
    assert plan.train_extra >= lora  # gradients at least
    assert plan.peak == plan.resident + max(plan.rollout_extra, plan.train_extra)
    halves = plan_memory(cfg, devices=2)
    assert halves.module == plan.module // 2 and halves.optimizer == plan.optimizer // 2
    assert halves.gathered > 0  # two blocks whole while they compute
    more = plan_memory(cfg, micro_batch=2 * int(cfg.train.stack.micro_batch_size))
    assert more.train_extra > plan.train_extra
    offloaded = plan_memory(tiny_recipe("+train.fsdp.offload_params=true"), devices=2)  # shards in host memory
    assert offloaded.module == offloaded.optimizer == offloaded.copies == 0
    assert offloaded.gathered == halves.gathered  # the units still gather on the device
    assert offloaded.train_extra == halves.train_extra - lora // 2  # without the gradient shards


def compose_model(cfg):
    from hydra.utils import instantiate

    return instantiate(cfg.model, _convert_="all").build()


def test_the_command_prints_the_plan_and_the_largest_micro_batch(capsys):
    main(["--config-name=diffusion/tiny_sd3_flowgrpo", "--device-gib", "0.001"])
    out = capsys.readouterr().out
    assert "memory plan: diffusion/tiny_sd3_flowgrpo, 1 device(s)" in out
    assert "peak per device" in out
    assert "largest micro-batch within 0.001 GiB: none (1 does not fit)" in out


def test_the_largest_micro_batch_is_the_last_doubling_that_fits():
    cfg = tiny_recipe("rollout.forward_batch_size=1")  # the train phase sets the peak
    one, two = (plan_memory(cfg, micro_batch=m).peak for m in (1, 2))
    assert one < two
    assert largest_micro_batch(cfg, 1, (one + two) // 2, limit=32) == 1
    assert largest_micro_batch(cfg, 1, one - 1, limit=32) is None


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--config-name=diffusion/tiny_sd3_flowgrpo", "--devices", "0"], "--devices must be >= 1, got 0"),
        (["--config-name=pe/tiny_pe_smoke"], "is not a single-track recipe"),
        (["--config-name=diffusion/tiny_sd3_flowgrpo", "sampling.height=30"], None),
    ],
)
def test_bad_input_is_named(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    if message is None:  # a recipe problem: the validator's message, exit 2
        assert exc.value.code == 2
        assert "sampling.height=30 must be a multiple of 4" in capsys.readouterr().err
    else:
        assert message in str(exc.value.code)


def test_sequence_parallel_plans_one_rank_of_the_group():
    """`train.parallel.sp=2`: the phases run as one rank of a Ulysses group (a fake process group, the
    context-parallel hooks on the meta module): its train phase holds less than the whole sequence's,
    and the process is left without a process group."""
    import torch.distributed as dist

    flux = ["num_devices=2", "launcher=ray", "model.tiny.num_attention_heads=4", "rollout.forward_batch_size=1"]
    with initialize_config_dir(config_dir=EXAMPLES, version_base=None):
        whole = compose(config_name="diffusion/tiny_flux_flowgrpo", overrides=flux)
        split = compose(config_name="diffusion/tiny_flux_flowgrpo", overrides=[*flux, "+train.parallel.sp=2"])
    plain, sharded = plan_memory(whole), plan_memory(split)
    assert not dist.is_initialized()
    assert sharded.module == plain.module  # the same sharded weights
    assert 0 < sharded.train_extra < plain.train_extra


def test_an_edit_familys_plan_carries_its_rows_references():
    """A conditioned family (FLUX.1-Kontext) is planned with what it encodes from its first prompt
    row besides the prompt (`conditions`: the reference's meta latents, shaped as the real stage
    encodes them), and the reference's tokens cost its train phase."""
    from unirl.models.flow.stage import FlowMatchingStage
    from unirl.plan_memory import conditions
    from unirl.types import DiffusionSamplingParams, RolloutReq

    with initialize_config_dir(config_dir=EXAMPLES, version_base=None):
        cfg = compose(config_name="diffusion/tiny_kontext_flowgrpo")
    from hydra.utils import instantiate

    sampling = instantiate(cfg.sampling)
    with torch.device("meta"):
        meta_stage = FlowMatchingStage(compose_model(cfg))
    planned = conditions(meta_stage, cfg, sampling)
    real = FlowMatchingStage(compose_model(cfg))
    row = instantiate(cfg.data_source).examples[:1]
    one = DiffusionSamplingParams(height=16, width=16, samples_per_prompt=1, guidance_scale=2.5)
    encoded = real.encode_conditions(RolloutReq.from_prompts(row, one, torch.linspace(1, 0, 11), 0))
    assert {k: (v.shape, v.dtype) for k, v in planned.items()} == {
        k: (v.shape, v.dtype) for k, v in encoded.items()
    }
    assert set(planned) == {"image_latents"} and all(v.is_meta for v in planned.values())
    plan = plan_memory(cfg)
    assert plan.train_extra > 0 and plan.peak == plan.resident + max(plan.rollout_extra, plan.train_extra)


def test_an_audio_video_familys_plan_costs_its_audio_tokens():
    """LTX-2 is planned on the meta device with its latent grid (the meta grid condition falls back
    to the grid `latent_shape` pinned), and a longer soundtrack (more audio tokens beside the same
    video) costs more in both phases."""
    with initialize_config_dir(config_dir=EXAMPLES, version_base=None):
        short = compose(config_name="diffusion/tiny_ltx2_flowgrpo")
        long = compose(config_name="diffusion/tiny_ltx2_flowgrpo", overrides=["model.frame_rate=5.0"])
    a, b = plan_memory(short), plan_memory(long)
    assert 0 < a.rollout_extra < b.rollout_extra and 0 < a.train_extra < b.train_extra


def test_the_real_size_ltx2_recipe_has_the_real_models_transformer_and_token_counts():
    """`diffusion/ltx2_random_flowgrpo` (built on the meta device) holds LTX-2's transformer (every
    parameter shaped as in diffusers' default config: 48 blocks, 18.9B parameters) and samples as many tokens as the released model at LTX2Pipeline's
    defaults: 512x768 x 121 frames at 24 fps under the real VAE (32x per side, 8x in time) is
    16 x 16 x 24 = 6144 video tokens, and 121 / 24 s x 25 audio latent frames a second (16 kHz,
    hop 160, 4x) rounds to 126; the recipe's 32x48 x 31 frames at 6.15 fps under the small 2x VAE
    must give the same."""
    with initialize_config_dir(config_dir=EXAMPLES, version_base=None):
        cfg = compose(config_name="diffusion/ltx2_random_flowgrpo")
    with torch.device("meta"):
        bundle = compose_model(cfg)
    real_video = ((121 - 1) // 8 + 1) * (512 // 32) * (768 // 32)
    real_audio = round(121 / 24 * 16000 / 160 / 4)
    assert (real_video, real_audio) == (6144, 126)
    assert bundle.latent_shape(cfg.sampling.height, cfg.sampling.width) == (128, real_video + real_audio)
    from diffusers import LTX2VideoTransformer3DModel

    with torch.device("meta"):
        released = LTX2VideoTransformer3DModel()  # diffusers' defaults: the released model's sizes
    shapes = {n: p.shape for n, p in bundle.transformer.named_parameters()}
    assert shapes == {n: p.shape for n, p in released.named_parameters()}
    assert len(bundle.transformer.transformer_blocks) == 48
    assert 18.8e9 < sum(p.numel() for p in released.parameters()) < 18.9e9
