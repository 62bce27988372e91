"""The trusted-peer check of the moving-squares world: the official Flow-GRPO Wan trainer on the same base.

Runs `scripts/train_wan2_1.py` of the official Flow-GRPO code (github.com/yifan123/flow_grpo, a checkout
given by `--flow_grpo`; it is not a UniRL dependency and none of it is copied here) unchanged, on
`checkpoints/squares_wan` with the moving-squares prompts and UniRL's `ColorMotion([1, 0, 0], right)`
reward. Its `general_ocr_wan2_1` config (`config/grpo.py`) is taken as written, then only what this
base and this machine need is set (each override is listed in `OVERRIDES` with its reason).

What is put around the trainer, nothing inside it:
- the pipeline is loaded with the base's scheduler at its pretraining shift 1.0 (the directory's
  scheduler config says 3.0, as the recipe's `sampling.shift` overrides) and, since the base is
  pixel space (no vae/), a pass-through `PixelVAE` (z_dim 3, latents mean 0 / std 1, scale factors 1):
  the trainer's decode arithmetic then gives the frames UniRL's stage gives, (x + 1) / 2 clamped;
- the prompt encoder pads to 8 tokens, the length the base was pretrained with (the trainer pads to
  512, which changes what a tiny cross-attention sees);
- `flow_grpo.rewards.multi_score` is replaced by the moving-squares scorer (the same contract:
  `(videos, prompts, metadata, only_strict) -> ({"avg": [...], ...}, {})`);
- W&B is disabled and the trainer's `accelerator.log` scalars go to `<out>/metrics.jsonl`; its mp4
  writer and `wandb.Video` (for logged clips only) are no-ops.

The base's own evaluation (the trainer evaluates only from its first `eval_freq` epoch on) is
computed the same way, with the trainer's sampler in its deterministic mode, and logged as step 0.
The trainer skips its first two epochs (its comment: group sizes settle), so epoch e trains on the
(e - 1)-th batch of clips.

    pip install --target <dir> ml_collections imageio    # absl-py, accelerate, peft, wandb: UniRL's env
    PYTHONPATH=<dir> python scripts/flowgrpo_wan_peer.py --flow_grpo <checkout> --epochs 62 \
        --out outputs/flowgrpo_wan_peer [--random_reward]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import types

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the shared checkout helpers
from flowgrpo_checkout import load_trainer, set_key  # noqa: E402

from worlds.shapes.motion import SQUARE_SIDES, square_prompt

BASE = "checkpoints/squares_wan"
TEXT_TOKENS = 8  # the base's pretraining max_sequence_length (the retired examples/sft/squares_wan_pretrain.yaml; diffusion/squares_wan_sft today)
BASE_SHIFT = 1.0  # the base's pretraining noise levels (sft.shift; the recipe's sampling.shift)

OVERRIDES = {
    # the base and the world (examples/diffusion/squares_wan_flowgrpo.yaml)
    "height": 16,  # frames of 16x16 px
    "width": 16,
    "frames": 5,
    "sample.num_steps": 8,  # the recipe's 8 sampling steps; the trainer trains int(8 x 0.99) = 7 of them
    "sample.eval_num_steps": 16,  # the recipe's evaluation
    "sample.guidance_scale": 2.0,  # the recipe's CFG (the base was pretrained with 10% prompt dropout)
    # 32 clips per epoch in 4 groups of 8, as the recipe's 4 prompts x 8 (the trainer's sampler
    # draws k = num_image_per_prompt copies of total / k prompts per batch)
    "sample.train_batch_size": 8,
    "sample.num_image_per_prompt": 8,
    "sample.num_batches_per_epoch": 4,
    "sample.test_batch_size": 16,
    "train.batch_size": 8,
    # this machine: CPU, one process
    "mixed_precision": "no",  # bf16 autocast on a CPU is slow and not what the UniRL runs use
    "allow_tf32": False,
    "train.beta": 0.0,  # with one process the trainer's KL path calls `transformer.module`, which exists only under DDP
    "eval_freq": 10,
    "save_freq": 100000,  # no LoRA checkpoints
}


def pixel_vae_class():
    from diffusers import ConfigMixin, ModelMixin
    from diffusers.configuration_utils import register_to_config

    class PixelVAE(ModelMixin, ConfigMixin):
        """Pixel space as a VAE: decode(z) = z. Latents mean 0 / std 1 and scale factors 1, so the
        trainer's `latents / (1 / std) + mean` and `prepare_latents` leave RGB frames [B, 3, F, H, W]."""

        @register_to_config
        def __init__(self, z_dim: int = 3, scale_factor_temporal: int = 1, scale_factor_spatial: int = 1,
                     latents_mean: tuple = (0.0, 0.0, 0.0), latents_std: tuple = (1.0, 1.0, 1.0)):  # fmt: skip
            super().__init__()
            self.register_buffer("anchor", torch.zeros(1))  # gives the module a dtype and a device

        def decode(self, z, return_dict: bool = True):
            return (z,)

    return PixelVAE


def squares_scorer(random_reward: bool, floor: float | None):
    """`multi_score`'s contract on the moving-squares reward: videos [B, F, 3, H, W] in [0, 1] ->
    ({"avg", "motion", "redness"}, {}). `random_reward`: the control (uniform draws, UniRL's
    `RandomReward`, the motion still logged)."""
    from unirl.reward.local.color import ColorTarget
    from unirl.reward.local.control import RandomReward
    from unirl.reward.local.video import ColorMotion, FrameMean
    from unirl.types import RewardRequest

    motion = ColorMotion([1.0, 0.0, 0.0], "right", floor=floor)
    redness = FrameMean(ColorTarget([1.0, 0.0, 0.0]))
    control = RandomReward(seed=0)
    counter = [0]

    def multi_score(device, score_dict):
        def _fn(videos, prompts, metadata, ref_images=None, only_strict=True):
            frames = (torch.as_tensor(videos).float().cpu().clamp(0, 1) * 255).round().to(torch.uint8)
            ids = [f"clip{counter[0] + i}" for i in range(len(prompts))]
            counter[0] += len(prompts)
            req = RewardRequest(sample_ids=ids, prompts=list(prompts), images=frames)
            m, r = motion(req).tolist(), redness(req).tolist()
            avg = control(req).tolist() if random_reward else m
            return {"avg": avg, "motion": m, "redness": r}, {}

        return _fn

    return multi_score


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--flow_grpo", required=True, help="a checkout of the official Flow-GRPO code")
    p.add_argument(
        "--epochs", type=int, default=62, help="the trainer's epochs (its first two neither sample nor train)"
    )
    p.add_argument("--out", default="outputs/flowgrpo_wan_peer")
    p.add_argument("--random_reward", action="store_true", help="the control: uniform random rewards")
    p.add_argument(
        "--floor", type=float, default=None, help="ColorMotion floor (0.0: wrong-way motion scores 0)"
    )
    p.add_argument(
        "--set", nargs="*", default=[], metavar="KEY=VALUE", help="more config overrides (JSON values)"
    )
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    os.environ["WANDB_MODE"] = "disabled"
    torch.set_num_threads(int(os.environ.get("PEER_THREADS", "1")))

    import accelerate
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

    trainer, config = load_trainer(os.path.abspath(args.flow_grpo), "train_wan2_1", "general_ocr_wan2_1")
    fg_rewards = trainer.flow_grpo.rewards  # the checkout's module, which the trainer calls

    # the prompts: the trainer reads <dataset>/train.txt and test.txt
    data = os.path.join(os.path.abspath(args.out), "dataset")
    os.makedirs(data, exist_ok=True)
    prompts = [square_prompt(w) for w in SQUARE_SIDES]
    with open(os.path.join(data, "train.txt"), "w") as f:
        f.write("\n".join(prompts) + "\n")
    with open(os.path.join(data, "test.txt"), "w") as f:
        f.write("\n".join(p for p in prompts for _ in range(16)) + "\n")
    overrides = dict(OVERRIDES)
    overrides.update(
        {
            "pretrained.model": os.path.abspath(BASE),
            "dataset": data,
            "num_epochs": args.epochs,
            "logdir": os.path.join(args.out, "logs"),
            "save_dir": os.path.join(args.out, "save"),
            "run_name": "peer",
        }
    )
    for item in args.set:
        key, value = item.split("=", 1)
        overrides[key] = json.loads(value)
    for key, value in overrides.items():
        set_key(config, key, value)
    if "train.gradient_accumulation_steps" not in overrides:  # the config's own formula, on the new batches
        n = config.sample.num_batches_per_epoch * config.sample.sample_time_per_prompt
        config.train.gradient_accumulation_steps = n // 2 if n > 1 else 1

    # what is put around the trainer (module doc)
    vae_class = pixel_vae_class()

    class BasePipeline:
        @staticmethod
        def from_pretrained(path, **kwargs):
            return WanPipeline.from_pretrained(
                path, vae=vae_class(), scheduler=FlowMatchEulerDiscreteScheduler(shift=BASE_SHIFT), **kwargs
            )

    trainer.WanPipeline = BasePipeline
    encode = trainer.encode_prompt
    trainer.encode_prompt = lambda encoders, tokenizers, prompt, max_sequence_length=TEXT_TOKENS: encode(
        encoders, tokenizers, prompt, TEXT_TOKENS
    )
    fg_rewards.multi_score = squares_scorer(args.random_reward, args.floor)
    trainer.wandb = types.SimpleNamespace(Video=lambda *a, **k: None)
    trainer.imageio = types.SimpleNamespace(mimsave=lambda *a, **k: None)
    log_path = os.path.join(args.out, "metrics.jsonl")
    original_log = accelerate.Accelerator.log

    def log(self, values, step=None, log_kwargs=None):
        row = {"step": step}
        for key, value in values.items():
            try:
                row[key] = float(torch.as_tensor(value).float().mean())
            except (TypeError, ValueError, RuntimeError):
                continue
        with open(log_path, "a") as f:
            f.write(json.dumps(row) + "\n")
        return original_log(self, values, step=step, log_kwargs=log_kwargs or {})

    accelerate.Accelerator.log = log
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(config.to_dict(), f, indent=1, default=str)

    evaluate_base(trainer, config, args, log_path)
    trainer.FLAGS = types.SimpleNamespace(config=config)
    trainer.main(None)


def evaluate_base(trainer, config, args, log_path: str) -> None:
    """The base's evaluation (step 0): the trainer's sampler in deterministic mode on the test
    prompts, its eval settings, one fixed generator."""
    pipe = trainer.WanPipeline.from_pretrained(config.pretrained.model)
    pipe.set_progress_bar_config(disable=True)
    with open(os.path.join(config.dataset, "test.txt")) as f:
        prompts = [line.strip() for line in f if line.strip()]
    encoders, tokenizers = [pipe.text_encoder], [pipe.tokenizer]
    neg = trainer.compute_text_embeddings([""], encoders, tokenizers, max_sequence_length=512, device="cpu")
    scorer = trainer.flow_grpo.rewards.multi_score("cpu", config.reward_fn)
    generator = torch.Generator().manual_seed(1234)
    scores: dict[str, list[float]] = {}
    bs = config.sample.test_batch_size
    for i in range(0, len(prompts), bs):
        batch = prompts[i : i + bs]
        embeds = trainer.compute_text_embeddings(
            batch, encoders, tokenizers, max_sequence_length=512, device="cpu"
        )
        with torch.no_grad():
            videos, _, _, _ = trainer.wan_pipeline_with_logprob(
                pipe, prompt_embeds=embeds, negative_prompt_embeds=neg.repeat(len(batch), 1, 1),
                num_inference_steps=config.sample.eval_num_steps, guidance_scale=config.sample.guidance_scale,
                output_type="pt", return_dict=False, num_frames=config.frames, height=config.height,
                width=config.width, determistic=True, generator=generator,
            )  # fmt: skip
        details, _ = scorer(videos, batch, [{}] * len(batch), only_strict=False)
        for key, values in details.items():
            scores.setdefault(key, []).extend(values)
    row = {"step": 0, **{f"eval_reward_{k}": sum(v) / len(v) for k, v in scores.items()}}
    with open(log_path, "a") as f:
        f.write(json.dumps(row) + "\n")
    print("base evaluation:", row, flush=True)


if __name__ == "__main__":
    main()
