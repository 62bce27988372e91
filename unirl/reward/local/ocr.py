"""The OCR reward of Flow-GRPO, read by PaddleOCR's PP-OCRv4 (ONNX, through `rapidocr-onnxruntime`).

The score of an image is `1 - min(d, n) / n`, `n` the length of the target text and `d` the edit
(Levenshtein) distance from the recognised text to it, both with spaces removed and lower-cased,
and `d = 0` when the target appears inside the recognised text (Flow-GRPO's `flow_grpo/ocr.py`).
The target is the text between the first pair of double quotes of the prompt (`a sign that says
"OPEN"` -> OPEN), as there, or a metadata key. The recogniser's weights (PP-OCRv4 detection,
recognition and direction classifier, about 15 MB of ONNX) ship inside the `rapidocr-onnxruntime`
wheel: nothing is downloaded. Its recogniser is PP-OCRv4's Chinese one (Chinese and Latin
characters; Flow-GRPO runs PaddleOCR's English one, which the wheel does not hold): in the blank
space after a word it can add a CJK character or an ideographic space, so by default the
reading keeps ASCII characters only (`ascii_only`), which an English target is made of.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from unirl.types.reward import RewardRequest

MODES = ("rec", "det_rec")


def ocr_score(recognized: str, target: str) -> float:
    """Flow-GRPO's OCR reward of `recognized` text against a non-empty `target`, in [0, 1]."""
    from Levenshtein import distance

    seen, want = recognized.replace(" ", "").lower(), target.replace(" ", "").lower()
    if not want:
        raise ValueError(f"the OCR target {target!r} has no characters besides spaces")
    d = 0 if want in seen else min(distance(seen, want), len(want))
    return 1.0 - d / len(want)


def quoted_text(prompt: str) -> str | None:
    """The text between the first pair of double quotes of `prompt`, or None without a pair."""
    parts = prompt.split('"')
    return parts[1] if len(parts) >= 3 else None


class OCRReward:
    """Scorer: Flow-GRPO's OCR reward of each image (`ocr_score`) against its target text.

    Args:
        mode: "rec" (default): the recogniser reads the whole image as one line, the whole batch
            in one call (about 25 ms an image on a CPU core); "det_rec": PP-OCRv4 detects the
            text boxes first and the texts read in them are joined in reading order (0.1-0.9 s an
            image; for images with text anywhere in a scene, as Flow-GRPO's PaddleOCR call).
        text_key: the metadata key that holds each sample's target text; None (default): the
            text between the first pair of double quotes of the prompt.
        min_confidence: recognitions at or below this confidence count as no text (Flow-GRPO
            keeps those above 0).
        ascii_only: drop the characters of a reading outside ASCII (default; see the module
            docstring); false for targets in other scripts.

    A sample without a target (no quoted text, or an empty one) raises `ValueError` naming it.
    """

    def __init__(
        self,
        mode: str = "rec",
        text_key: str | None = None,
        min_confidence: float = 0.0,
        ascii_only: bool = True,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"OCRReward mode must be one of {list(MODES)}, got {mode!r}")
        if not 0.0 <= min_confidence < 1.0:
            raise ValueError(f"OCRReward min_confidence must be in [0, 1), got {min_confidence}")
        self.mode, self.text_key, self.min_confidence = mode, text_key, float(min_confidence)
        self.ascii_only = bool(ascii_only)
        self._engine: Any = None

    @property
    def engine(self) -> Any:
        """The PP-OCRv4 engine, loaded on first use (0.15 s)."""
        if self._engine is None:
            try:
                from rapidocr_onnxruntime import RapidOCR
            except ImportError as exc:
                raise ImportError(
                    "OCRReward needs rapidocr-onnxruntime (PP-OCRv4 as ONNX) and Levenshtein: "
                    "pip install -e '.[scorers]'"
                ) from exc
            self._engine = RapidOCR()
        return self._engine

    def targets(self, req: RewardRequest) -> list[str]:
        """Each sample's target text, from its metadata key or its prompt's quotes."""
        out = []
        for i, (sid, prompt) in enumerate(zip(req.sample_ids, req.prompts, strict=True)):
            if self.text_key is not None:
                meta = req.metadata[i] if req.metadata else {}
                target = meta.get(self.text_key)
                where = f"metadata key {self.text_key!r}"
            else:
                target = quoted_text(prompt)
                where = "double quotes in its prompt"
            if not isinstance(target, str) or not target.replace(" ", ""):
                raise ValueError(
                    f"OCRReward: sample {sid} has no target text in {where} (prompt {prompt!r}); "
                    'write it as a sign that says "TEXT", or set text_key to a metadata key that holds it'
                )
            out.append(target)
        return out

    def read(self, images: torch.Tensor) -> list[str]:
        """The text recognised in each of `images` ([B, 3, H, W] uint8 RGB)."""
        # the engine takes OpenCV's channel order (BGR) for arrays
        arrays = [np.ascontiguousarray(im.permute(1, 2, 0).numpy()[..., ::-1]) for im in images.cpu()]
        if self.mode == "rec":
            results, _ = self.engine.text_rec(arrays)
            texts = [text if score > self.min_confidence else "" for text, score in results]
        else:
            texts = []
            for array in arrays:
                boxes, _ = self.engine(array)
                texts.append("".join(text for _, text, score in boxes or [] if score > self.min_confidence))
        if self.ascii_only:
            texts = [t.encode("ascii", "ignore").decode() for t in texts]
        return texts

    def __call__(self, req: RewardRequest) -> torch.Tensor:
        """[B] fp32 scores of `req.images` ([B, 3, H, W] uint8) against their targets."""
        targets = self.targets(req)
        texts = self.read(req.require_images("OCRReward"))
        return torch.tensor(
            [ocr_score(t, want) for t, want in zip(texts, targets, strict=True)], dtype=torch.float32
        )
