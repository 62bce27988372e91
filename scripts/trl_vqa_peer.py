"""The trusted-peer check of the shapes VQA world: TRL's GRPOTrainer on the same VLM base, rows and reward.

Runs TRL's GRPO on `checkpoints/shapes_vqa` (a tiny Qwen2.5-VL) over `ShapesVQADataSource(split="train")`
at the settings of `examples/vlm/shapes_vqa_grpo.yaml`: 16 prompts x 8 completions per optimizer step,
temperature 1, at most 6 new tokens ending at the tokenizer's EOS, the prompt exactly as the base was
pretrained ("<image>question" with the image's vision tokens, no chat template), reward = exact answer
+ 0.1 x answer-vocabulary format, group std scaling, token-level loss over the batch, clip 0.2, no KL,
AdamW at a constant lr 1e-4, gradient norm 1.0, one update per batch. Every `--eval_every` steps it
scores greedy answers on the recipe's held-out rows (`ShapesVQADataset(split="eval_all", size=200)`:
200 held-out combinations, 200 held-out placements) with UniRL's own stage and verifier, the way the
recipe's evaluation does. It answers one question: does the peer lift this base past where UniRL's
GRPO plateaus (docs/results/shapes_vqa.md)?

TRL is not a UniRL dependency: install it beside the project (`pip install trl datasets`) or put a
target directory holding it on PYTHONPATH. The Qwen2.5-VL processor is built without its video
processor (which needs torchvision; no video is used).

    python scripts/trl_vqa_peer.py --steps 400 --eval_every 100 --out outputs/trl_vqa_peer
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

# the prompt as UniRL's VLM bundle builds it with `chat_template: false`: the image's vision tokens, then the text
RAW_TEMPLATE = (
    "{%- for message in messages %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{%- else %}{{ part['text'] }}{%- endif %}{%- endfor %}{%- endfor %}"
)


def image_only_processor(path: str):
    """Qwen2.5-VL's processor from `path` without a video processor, with `RAW_TEMPLATE`."""
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen2_5_VLProcessor
    from transformers.processing_utils import ProcessorMixin

    class ImageOnlyProcessor(Qwen2_5_VLProcessor):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    tokenizer.padding_side = "left"  # TRL left-pads the prompts it generates from; its forward's token types must agree
    image_processor = AutoImageProcessor.from_pretrained(path, local_files_only=True)
    return ImageOnlyProcessor(image_processor, tokenizer, chat_template=RAW_TEMPLATE)


def held_out_greedy(model_dir: str, rows) -> dict[str, float]:
    """Greedy accuracy of the model in `model_dir` on `rows`, overall and by holdout / question type
    (UniRL's `CausalLMStage` and `VQAAnswer`, the recipe's evaluation settings)."""
    from unirl.models.causal_lm import CausalLMStage
    from unirl.models.qwen_vl import QwenVLConfig
    from unirl.types import RolloutReq, TextSamplingParams
    from worlds.shapes.vqa import VQAAnswer, strip_answer

    stage = CausalLMStage(QwenVLConfig(pretrained_path=model_dir).build())
    sampling = TextSamplingParams(
        samples_per_prompt=1, max_new_tokens=6, temperature=0.0, stop_tokens=[], max_prompt_length=64,
        chat_template=False, seed=0,
    )  # fmt: skip
    verifier, hits = VQAAnswer(), []
    for start in range(0, len(rows), 100):
        chunk = rows[start : start + 100]
        req = RolloutReq.from_prompts(chunk, sampling, None, rollout_id=0)
        _, texts = stage.generate(req)
        for e, t in zip(chunk, texts, strict=True):
            hits.append((e.metadata, float(strip_answer(t) == verifier.reference(e.prompt_id, e.metadata))))
    out = {"greedy": sum(h for _, h in hits) / len(hits)}
    for key in ("holdout", "qtype"):
        for value in sorted({m[key] for m, _ in hits}):
            got = [h for m, h in hits if m[key] == value]
            out[f"{key}/{value}"] = sum(got) / len(got)
    return out


def png(image) -> bytes:
    """A [H, W, 3] uint8 render as PNG bytes (lossless: the peer sees the same pixels)."""
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG")
    return buf.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="checkpoints/shapes_vqa")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--eval_every", type=int, default=100)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--prompts", type=int, default=16, help="prompts per step")
    ap.add_argument("--group", type=int, default=8, help="completions per prompt")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="outputs/trl_vqa_peer")
    args = ap.parse_args()
    import pyarrow as pa
    from transformers import Qwen2_5_VLForConditionalGeneration, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from datasets import Dataset, DatasetInfo, Features, Value
    from datasets import Image as HFImage
    from worlds.shapes.vqa import ANSWERS, ShapesVQADataset, strip_answer

    torch.manual_seed(args.seed)
    train = ShapesVQADataset("train", args.seed).examples
    rows = [
        {
            "prompt": [{"role": "user", "content": e.prompt.replace("<image>", "")}],
            "image": {"bytes": png(e.metadata["images"][0]), "path": None},
            "answer": e.metadata["answer"],
        }
        for e in train
    ]
    features = Features(
        {
            "prompt": [{"role": Value("string"), "content": Value("string")}],
            "image": HFImage(),
            "answer": Value("string"),
        }
    )
    # a fixed fingerprint: datasets' hashing of the table fails with some dill / pyarrow pairs
    dataset = Dataset(
        pa.Table.from_pylist(rows, schema=features.arrow_schema),
        info=DatasetInfo(features=features),
        fingerprint="shapes_vqa_train",
    )
    held_out = ShapesVQADataset("eval_all", 0, 200).examples

    def reward(completions, answer, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [
            float(strip_answer(t) == a) + 0.1 * float(strip_answer(t) in ANSWERS)
            for t, a in zip(texts, answer, strict=True)
        ]

    os.makedirs(args.out, exist_ok=True)
    log = open(os.path.join(args.out, "peer.jsonl"), "a")
    t0 = time.time()

    def record(step: int, model) -> None:
        path = os.path.join(args.out, f"step_{step}")
        model.save_pretrained(path)
        processor.tokenizer.save_pretrained(path)
        processor.image_processor.save_pretrained(path)
        row = {"step": step, "wall_s": round(time.time() - t0, 1), **held_out_greedy(path, held_out)}
        print(json.dumps(row), flush=True)
        log.write(json.dumps(row) + "\n")
        log.flush()

    class HeldOut(TrainerCallback):
        def on_step_end(self, _args, state, _control, model=None, **_):
            if state.global_step % args.eval_every == 0 or state.global_step == args.steps:
                record(state.global_step, model)

    processor = image_only_processor(args.model)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(args.model, dtype=torch.float32)
    record(0, model)
    config = GRPOConfig(
        output_dir=args.out,
        max_steps=args.steps,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        per_device_train_batch_size=args.prompts * args.group,
        gradient_accumulation_steps=1,
        num_generations=args.group,
        num_iterations=1,
        max_completion_length=6,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        epsilon=0.2,
        loss_type="dapo",  # token-level, normalised by the batch's tokens (UniRL's token-mean)
        scale_rewards="group",
        logging_steps=10,
        save_strategy="no",
        report_to=[],
        seed=args.seed,
        use_cpu=True,
        dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=dataset,
        processing_class=processor,
        callbacks=[HeldOut()],
    )
    trainer.train()
    for entry in trainer.state.log_history:
        log.write(json.dumps({"trl_log": entry}) + "\n")
    log.close()


if __name__ == "__main__":
    main()
