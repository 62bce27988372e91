"""The trusted-peer check of the OCR world: the official Flow-GRPO SD3 trainer on the same base and reward.

Runs `scripts/train_sd3.py` of the official Flow-GRPO code (github.com/yifan123/flow_grpo, a checkout
given by `--flow_grpo`; it is not a UniRL dependency and none of it is copied here) unchanged, on
`checkpoints/ocr_sd3` with the OCR world's training words and UniRL's `OCRReward` (PP-OCRv4; the
trainer's own `flow_grpo/ocr.py` calls PaddleOCR with the same formula, which does not install
here). Its `general_ocr_sd3` config (`config/grpo.py`) is taken as written, then only what this base
and this machine need is set (each override is listed in `OVERRIDES` with its reason).

What is put around the trainer, nothing inside it:
- the pipeline is loaded with a pass-through `PixelVAE` (the base is pixel space, no vae/; scaling
  factor 1, shift 0, one block so the pipeline's vae_scale_factor is 1): the trainer's decode then
  gives the images UniRL's stage gives, (x + 1) / 2 clamped;
- the trainer's `encode_prompt` (padding CLIP to 77 tokens, more than the base's 16 positions) is
  replaced by diffusers' own `StableDiffusion3Pipeline.encode_prompt` at the base's 16 tokens;
- its `pipeline_with_logprob` is called at 32x64 (the trainer passes `config.resolution` as both
  height and width; the world's images are 32x64);
- `flow_grpo.rewards.multi_score` is replaced by the OCR reward (the same contract:
  `(images, prompts, metadata, only_strict) -> ({"avg": [...], "ocr", "accuracy"}, {})`);
- W&B is replaced by a writer of `<out>/metrics.jsonl` (scalars only).

    pip install --target <dir> ml_collections      # absl-py, accelerate, peft, wandb: UniRL's env
    PYTHONPATH=<dir> python scripts/flowgrpo_ocr_peer.py --flow_grpo <checkout> --minutes 20 \
        --out outputs/flowgrpo_ocr_peer [--random_reward] [--train_split length_rl --eval_split heldout_length]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import types

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the shared checkout helpers
from flowgrpo_checkout import load_trainer, set_key  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from worlds.ocr import HEIGHT, WIDTH, OCRWords  # noqa: E402

BASE = "checkpoints/ocr_sd3"
TEXT_TOKENS = 16  # the base's pretraining max_sequence_length (the retired examples/sft/ocr_pretrain.yaml; diffusion/ocr_sft today)

OVERRIDES = {
    # the base and the world (examples/diffusion/ocr_flowgrpo.yaml)
    "resolution": WIDTH,  # only sizes the logged thumbnails; sampling is forced to 32x64 (module doc)
    "sample.num_steps": 10,  # the recipe's 10 sampling steps (the config's own value too)
    "sample.eval_num_steps": 20,  # the recipe's evaluation
    "sample.guidance_scale": 3.0,  # the recipe's CFG (the base was pretrained with 10% prompt dropout)
    # 64 images per epoch in 8 groups of 8, as the recipe's 8 prompts x 8 (the trainer's sampler
    # draws k = num_image_per_prompt copies of total / k prompts per batch)
    "sample.train_batch_size": 8,
    "sample.num_image_per_prompt": 8,
    "sample.num_batches_per_epoch": 8,
    "sample.test_batch_size": 16,
    "train.batch_size": 8,
    "train.learning_rate": 1e-3,  # the recipe's LoRA learning rate for this tiny base (the config's 3e-4 is SD3.5-M's)
    # this machine: CPU, one process
    "mixed_precision": "no",  # bf16 autocast on a CPU is slow and not what the UniRL runs use
    "allow_tf32": False,
    "train.beta": 0.0,  # with one process the trainer's KL path calls `transformer.module`, which exists only under DDP
    "train.ema": False,  # the recipe evaluates the trained weights, not an EMA
    "eval_freq": 8,
    "save_freq": 100000,  # no LoRA checkpoints
}


def pixel_vae_class():
    from diffusers import ConfigMixin, ModelMixin
    from diffusers.configuration_utils import register_to_config

    class PixelVAE(ModelMixin, ConfigMixin):
        """Pixel space as a VAE: decode(z) = z, scaling factor 1, shift 0, one block (so the SD3
        pipeline's vae_scale_factor is 2**0 = 1)."""

        @register_to_config
        def __init__(self, latent_channels: int = 3, block_out_channels: tuple = (3,),
                     scaling_factor: float = 1.0, shift_factor: float = 0.0):  # fmt: skip
            super().__init__()
            self.register_buffer("anchor", torch.zeros(1))  # gives the module a dtype and a device

        def decode(self, z, return_dict: bool = True):
            return (z,)

    return PixelVAE


def ocr_scorer(random_reward: bool):
    """`multi_score`'s contract on the OCR reward: images [B, 3, H, W] in [0, 1] -> ({"avg",
    "ocr", "accuracy"}, {}). `random_reward`: the control (uniform draws, UniRL's `RandomReward`;
    the OCR reward still logged)."""
    from unirl.reward.local.control import RandomReward
    from unirl.reward.local.ocr import OCRReward
    from unirl.types import RewardRequest

    ocr, control, counter = OCRReward(), RandomReward(seed=0), [0]

    def multi_score(device, score_dict):
        def _fn(images, prompts, metadata, only_strict=True):
            pixels = (torch.as_tensor(images).float().cpu().clamp(0, 1) * 255).round().to(torch.uint8)
            ids = [f"img{counter[0] + i}" for i in range(len(prompts))]
            counter[0] += len(prompts)
            req = RewardRequest(sample_ids=ids, prompts=list(prompts), images=pixels)
            scores = ocr(req)
            avg = control(req).tolist() if random_reward else scores.tolist()
            return {"avg": avg, "ocr": scores.tolist(), "accuracy": (scores == 1.0).float().tolist()}, {}

        return _fn

    return multi_score


class Budget(Exception):
    """Raised by the metrics writer once the wall-clock budget is spent (the trainer loops forever)."""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--flow_grpo", required=True, help="a checkout of the official Flow-GRPO code")
    p.add_argument("--minutes", type=float, default=20.0, help="wall-clock budget, evaluation included")
    p.add_argument("--out", default="outputs/flowgrpo_ocr_peer")
    p.add_argument("--base", default=BASE)
    p.add_argument("--random_reward", action="store_true", help="the control: uniform random rewards")
    p.add_argument("--train_split", default="train", help="the OCR world's split the trainer samples")
    p.add_argument(
        "--eval_split", default="heldout", help="the split its test set is drawn from (64 words x 2)"
    )
    p.add_argument(
        "--set", nargs="*", default=[], metavar="KEY=VALUE", help="more config overrides (JSON values)"
    )
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    os.environ["WANDB_MODE"] = "disabled"
    torch.set_num_threads(int(os.environ.get("PEER_THREADS", "2")))

    from diffusers import StableDiffusion3Pipeline

    trainer, config = load_trainer(os.path.abspath(args.flow_grpo), "train_sd3", "general_ocr_sd3")

    # the prompts: the trainer reads <dataset>/train.txt and test.txt
    data = os.path.join(os.path.abspath(args.out), "dataset")
    os.makedirs(data, exist_ok=True)
    with open(os.path.join(data, "train.txt"), "w") as f:
        f.write("\n".join(e.prompt for e in OCRWords(args.train_split).examples) + "\n")
    with open(os.path.join(data, "test.txt"), "w") as f:  # the recipe's eval: 64 held-out words x 2
        test = OCRWords(args.eval_split, limit=64).examples
        f.write("\n".join(e.prompt for e in test for _ in range(2)) + "\n")
    overrides = dict(OVERRIDES)
    overrides.update(
        {
            "pretrained.model": os.path.abspath(args.base),
            "dataset": data,
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
        config.train.gradient_accumulation_steps = config.sample.num_batches_per_epoch // 2

    # what is put around the trainer (module doc)
    vae = pixel_vae_class()()

    class BasePipeline:
        @staticmethod
        def from_pretrained(path, **kwargs):
            # fp32, as UniRL loads the base (its weights are stored in fp16)
            return StableDiffusion3Pipeline.from_pretrained(
                path, vae=vae, torch_dtype=torch.float32, **kwargs
            )

    trainer.StableDiffusion3Pipeline = BasePipeline
    encoder = BasePipeline.from_pretrained(config.pretrained.model)

    def encode_prompt(text_encoders, tokenizers, prompt, max_sequence_length):
        embeds, _, pooled, _ = encoder.encode_prompt(
            prompt=prompt, prompt_2=None, prompt_3=None, do_classifier_free_guidance=False,
            max_sequence_length=TEXT_TOKENS, device="cpu",
        )  # fmt: skip
        return embeds, pooled

    trainer.encode_prompt = encode_prompt
    sample = trainer.pipeline_with_logprob

    def pipeline_with_logprob(pipeline, *a, **kw):
        kw.update(height=HEIGHT, width=WIDTH)
        return sample(pipeline, *a, **kw)

    trainer.pipeline_with_logprob = pipeline_with_logprob
    trainer.flow_grpo.rewards.multi_score = ocr_scorer(args.random_reward)
    log_path = os.path.join(args.out, "metrics.jsonl")
    deadline = time.perf_counter() + 60 * args.minutes

    def log(values, step=None, **kwargs):
        row = {"step": step, "wall_s": round(time.perf_counter() - deadline + 60 * args.minutes, 1)}
        for key, value in values.items():
            try:
                row[key] = float(torch.as_tensor(value).float().mean())
            except (TypeError, ValueError, RuntimeError):
                continue
        with open(log_path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if time.perf_counter() > deadline:
            if any(k.startswith("eval_") for k in row):
                raise Budget
            config.eval_freq = 1  # the trainer evaluates at the start of its next epoch, then stops

    trainer.wandb = types.SimpleNamespace(init=lambda **k: None, log=log, Image=lambda *a, **k: None)
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(config.to_dict(), f, indent=1, default=str)
    trainer.FLAGS = types.SimpleNamespace(config=config)
    try:
        trainer.main(None)
    except Budget:
        print(
            f"flowgrpo_ocr_peer: stopped at the evaluation that follows {args.minutes:g} minutes", flush=True
        )


if __name__ == "__main__":
    main()
