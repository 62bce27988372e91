"""`VLMJudge`: a vision-language model asked questions about each image (VQAScore-style).

For each sample, `questions(prompt, metadata)` gives (question, expected answer) pairs. The
judge scores a pair as the model's probability of the expected answer,

    P_q = P(answer + EOS | image, "<image>" + question)
        = exp(sum of the log-probs of the answer's tokens and of the EOS, teacher-forced),

on the tokens `TextBundle.pair_batch` makes (the ones a supervised VQA base learned on:
prompt, then answer, then EOS). The EOS term makes "2" and "20" different answers. A sample's
score aggregates its questions':

    product   prod_q P_q   (every answer right, were the answers independent: the analogue of
              a strict verdict)
    mean      mean_q P_q

Without `questions`, one question per sample, VQAScore's template:
'does this image show "<prompt>"?' -> "yes".

All (image, question) pairs of a request go through the model in forwards of at most
`batch_size` pairs, in request order. The model is a vision-language model config, as a track's
`model` node is (`unirl.models.qwen_vl.QwenVLConfig(pretrained_path=...)`, a local directory),
checked when the judge is built (recipe validation builds it) and loaded, frozen, on the first
call. Not differentiable. It runs wherever the reward
backend runs: in-process (`LocalRewardBackend`) or in the reward server
(`python -m unirl.reward.server`), whose clients send it images and prompts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from unirl.models.causal_lm.family import IMAGE_PLACEHOLDER
from unirl.models.causal_lm.loading import IGNORE_INDEX
from unirl.reward.placement import on_device_while_scoring
from unirl.types.reward import RewardRequest

Questions = Callable[[str, dict], Sequence[tuple[str, str]]]
"""(prompt, metadata) -> [(question, expected answer)]: what the judge asks about one sample."""

AGGREGATES = ("product", "mean")


def vqascore_question(prompt: str, metadata: dict) -> list[tuple[str, str]]:
    """VQAScore's single question: does the image show the prompt? Expected answer: yes."""
    return [(f'does this image show "{prompt}"?', "yes")]


class VLMJudge:
    """Scorer: `[B]` fp32 scores in [0, 1] of `req.images` against their prompts (module docstring).

    Args:
        model: the vision-language model's config (`vision` True; its `build()` gives a bundle with
            `pair_batch`), e.g. `QwenVLConfig(pretrained_path="checkpoints/shapes_vqa")`, the
            committed supervised VQA base; in a recipe a node with its `_target_`.
        questions: `(prompt, metadata) -> [(question, answer)]`, e.g. the shapes world's
            `worlds.shapes.vqa.JudgeQuestions`; None: VQAScore's one question.
        aggregate: "product" or "mean" over a sample's questions.
        batch_size: (image, question) pairs per forward.
        threads: torch threads while scoring (None: leave the process's setting).
        device: where the model scores.
        offload: keep the model in host memory between calls, on `device` only while scoring
            (a judge colocated with the rollout gives its accelerator memory back).
    """

    def __init__(
        self,
        model: Any,
        questions: Questions | None = None,
        aggregate: str = "product",
        batch_size: int = 64,
        threads: int | None = None,
        device: str = "cpu",
        offload: bool = False,
    ) -> None:
        if aggregate not in AGGREGATES:
            raise ValueError(f"VLMJudge aggregate must be one of {AGGREGATES}, got {aggregate!r}")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"VLMJudge batch_size must be an int >= 1, got {batch_size!r}")
        if threads is not None and (not isinstance(threads, int) or threads < 1):
            raise ValueError(f"VLMJudge threads must be an int >= 1 or null, got {threads!r}")
        if questions is not None and not callable(questions):
            raise ValueError(
                f"VLMJudge questions must be callable (prompt, metadata) -> pairs, got {questions!r}"
            )
        if not callable(getattr(model, "build", None)) or getattr(model, "vision", False) is not True:
            raise ValueError(
                f"VLMJudge model {model!r} is not a vision-language model config; give one, e.g. "
                "{_target_: unirl.models.qwen_vl.QwenVLConfig, pretrained_path: checkpoints/shapes_vqa}"
            )
        problems = model.directory_problems() if hasattr(model, "directory_problems") else []
        if problems:
            raise ValueError("VLMJudge model: " + "; ".join(problems))
        self.model = model
        self.questions: Questions = questions if questions is not None else vqascore_question
        self.aggregate = aggregate
        self.batch_size = batch_size
        self.threads = threads
        self.device, self.offload = torch.device(device), bool(offload)
        self._bundle: Any = None

    @property
    def bundle(self) -> Any:
        """The judge's VLM bundle, loaded (fp32, eval mode, no gradients) on first use."""
        if self._bundle is None:
            bundle = self.model.build()
            bundle.model.eval().requires_grad_(False).to("cpu" if self.offload else self.device)
            self._bundle = bundle
        return self._bundle

    def pairs(self, req: RewardRequest) -> list[list[tuple[str, str]]]:
        """Each sample's (question, answer) pairs; a sample with none is an error naming it."""
        metadata = req.metadata or [{} for _ in req.sample_ids]
        out = []
        for sid, prompt, meta in zip(req.sample_ids, req.prompts, metadata, strict=True):
            try:
                asked = [(str(q), str(a)) for q, a in self.questions(prompt, meta)]
            except ValueError as e:
                raise ValueError(f"VLMJudge: sample {sid!r}: {e}") from e
            if not asked:
                raise ValueError(f"VLMJudge: sample {sid!r}: no question was built from prompt {prompt!r}")
            out.append(asked)
        return out

    @torch.no_grad()
    def answer_probs(self, images: torch.Tensor, asked: list[tuple[int, str, str]]) -> torch.Tensor:
        """[Q] fp32 P(answer + EOS | image, question) of each (image index, question, answer),
        `images` [B, 3, H, W] uint8; forwards of at most `batch_size` pairs."""
        bundle = self.bundle
        hwc = images.permute(0, 2, 3, 1).contiguous().cpu().numpy()
        logps = []
        previous = torch.get_num_threads()
        if self.threads is not None:
            torch.set_num_threads(self.threads)
        try:
            with on_device_while_scoring(self.device, self.offload, bundle.model):
                for start in range(0, len(asked), self.batch_size):
                    rows = [
                        (IMAGE_PLACEHOLDER + q, a, [hwc[i]])
                        for i, q, a in asked[start : start + self.batch_size]
                    ]
                    inputs, labels = bundle.pair_batch(rows, "judge")
                    logits = bundle.model(**inputs).logits[:, :-1].float()
                    target = labels[:, 1:]
                    token = -F.cross_entropy(
                        logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="none"
                    ).view(target.shape)
                    logps.append((token * (target != IGNORE_INDEX)).sum(dim=1).cpu())
        finally:
            torch.set_num_threads(previous)
        return torch.cat(logps).exp()

    def __call__(self, req: RewardRequest) -> torch.Tensor:
        """[B] fp32 scores, in request order."""
        images = req.require_images("VLMJudge")
        per_sample = self.pairs(req)
        asked = [(i, q, a) for i, pairs in enumerate(per_sample) for q, a in pairs]
        probs = self.answer_probs(images, asked)
        scores, k = [], 0
        for pairs in per_sample:
            p = probs[k : k + len(pairs)]
            k += len(pairs)
            scores.append(p.prod() if self.aggregate == "product" else p.mean())
        return torch.stack(scores).float()
