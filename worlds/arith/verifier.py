"""Reward scorers for the arithmetic world: `scorer(req) -> [B]` fp32, weight-free.

What counts as correct (`ArithAnswer`): the response with surrounding ASCII
whitespace (space, tab, newline, carriage return, vertical tab, form feed)
stripped must equal the canonical integer string of the reference, character
for character. Canonical: ASCII digits "0"-"9", no leading zeros ("0" itself
excepted), a leading "-" only for negatives, nothing else. So for 168:
"168", " 168\\n" are right; "+168", "0168", "168.0", "1 68", "168 170",
"answer: 168", "１６８" (fullwidth), "١٦٨" (Arabic-Indic), "168\\u00a0"
(unicode whitespace is not stripped) and "" are wrong; for 0, "-0" is wrong.
The comparison is a string comparison: no int parsing, so a response of a
million digits costs one linear scan and cannot overflow.

`ArithFormat` is a shaping reward: 1.0 when the stripped response is
`-?[0-9]+` (ASCII), so "0168" and "-0" are well formed though never correct.
"""

from __future__ import annotations

import re

import torch

from unirl.types.reward import RewardRequest

_KEY = "reward.backend.components.<name>"
_ASCII_WHITESPACE = " \t\n\r\x0b\x0c"
_WELL_FORMED = re.compile(r"-?[0-9]+")
_CANONICAL = re.compile(r"0|-?[1-9][0-9]*")


def strip_answer(text: str) -> str:
    """`text` without surrounding ASCII whitespace (unicode whitespace stays)."""
    return text.strip(_ASCII_WHITESPACE)


class ArithAnswer:
    """Scorer: 1.0 when the stripped response is exactly the canonical reference integer, else 0.0.

    The reference is `metadata[answer_key]`: a canonical integer string ("168",
    "-333", "0") or an int. A sample without the key, or with a non-canonical
    reference, is a data bug and raises ValueError naming the sample id and the key.

    Args:
        answer_key: metadata key holding the reference answer.
    """

    def __init__(self, answer_key: str = "answer") -> None:
        if not isinstance(answer_key, str) or not answer_key:
            raise ValueError(f"ArithAnswer: {_KEY}.answer_key must be a non-empty string, got {answer_key!r}")
        self.answer_key = answer_key

    def reference(self, sample_id: str, metadata: dict) -> str:
        """The canonical reference string of one sample."""
        if self.answer_key not in metadata:
            raise ValueError(
                f"ArithAnswer: sample {sample_id!r} has no reference answer: its metadata lacks key "
                f"{self.answer_key!r} (keys: {sorted(metadata)}); fix the data or set answer_key"
            )
        ref = metadata[self.answer_key]
        if isinstance(ref, int) and not isinstance(ref, bool):
            ref = str(ref)
        if not isinstance(ref, str) or not _CANONICAL.fullmatch(ref):
            raise ValueError(
                f"ArithAnswer: sample {sample_id!r}: reference {self.answer_key!r} = {ref!r} is not a "
                "canonical integer (ASCII digits, optional leading '-', no leading zeros, not '-0')"
            )
        return ref

    def __call__(self, req: RewardRequest) -> torch.Tensor:
        """[B] fp32 scores of `req.texts` against `req.metadata[i][answer_key]`."""
        texts = req.require_texts("ArithAnswer")
        metadata = req.metadata or [{} for _ in texts]
        scores = [
            1.0 if strip_answer(text) == self.reference(sid, meta) else 0.0
            for sid, text, meta in zip(req.sample_ids, texts, metadata, strict=True)
        ]
        return torch.tensor(scores, dtype=torch.float32)


class ArithFormat:
    """Scorer: 1.0 when the stripped response is a well-formed integer (`-?[0-9]+`, ASCII), else 0.0."""

    def __call__(self, req: RewardRequest) -> torch.Tensor:
        """[B] fp32 scores of `req.texts`."""
        texts = req.require_texts("ArithFormat")
        scores = [1.0 if _WELL_FORMED.fullmatch(strip_answer(t)) else 0.0 for t in texts]
        return torch.tensor(scores, dtype=torch.float32)
