"""Verifiable rewards for text responses: answers, formats, lengths, characters.

Each scorer reads `req.texts` (and `req.response_lengths` or `req.metadata`
where it says so) and returns [B] fp32 scores, weight-free. Config errors name
the recipe key `reward.backend.components.<name>.<arg>`, where `<name>` is the
component's name in the recipe (Hydra adds it as `full_key`).
"""

from __future__ import annotations

import math
import re

import torch

from unirl.types.reward import RewardRequest

_KEY = "reward.backend.components.<name>"
_AFTER = "after:"


def _compile(scorer: str, arg: str, pattern: str) -> re.Pattern[str]:
    if not isinstance(pattern, str):
        raise ValueError(f"{scorer}: {_KEY}.{arg} must be a regex string, got {type(pattern).__name__}")
    try:
        return re.compile(pattern)
    except re.error as e:
        raise ValueError(f"{scorer}: {_KEY}.{arg} is not a valid regex ({e}): {pattern!r}") from e


def extract_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` in `text` (nested braces allowed), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth = 0
    begin = start + len("\\boxed{")
    for i in range(begin, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            if depth == 0:
                return text[begin:i]
            depth -= 1
    return None


def _parse_number(text: str) -> float | None:
    try:
        value = float(text.replace(",", "").removeprefix("$"))
    except ValueError:
        return None
    return value if math.isfinite(value) else None


class ExactAnswer:
    """Scorer: 1.0 when the answer extracted from a response equals the reference, else 0.0.

    The reference is `metadata[answer_key]` of the sample, converted with
    `str` and stripped; a sample without it is a data bug and raises
    ValueError naming the sample id and the key. A response whose answer
    cannot be extracted scores 0.

    Args:
        answer_key: metadata key holding the reference answer.
        extract: how to find the answer in the response, whose result is stripped:
            "last_line": the last non-blank line;
            "boxed": the content of the last `\\boxed{...}`;
            "after:<marker>" (e.g. "after:####"): the rest of the line after the
                last occurrence of the marker;
            any other string: a regex with exactly one group; the group of its
                last match.
        numeric: compare as numbers (thousands commas and a leading "$"
            dropped, equal within 1e-6 relative or absolute) instead of as
            strings; a reference that is not a number then raises.
    """

    def __init__(self, answer_key: str = "answer", extract: str = "last_line", numeric: bool = False) -> None:
        if not isinstance(answer_key, str) or not answer_key:
            raise ValueError(f"ExactAnswer: {_KEY}.answer_key must be a non-empty string, got {answer_key!r}")
        if not isinstance(extract, str) or not extract:
            raise ValueError(f"ExactAnswer: {_KEY}.extract must be a non-empty string, got {extract!r}")
        if not isinstance(numeric, bool):
            raise ValueError(f"ExactAnswer: {_KEY}.numeric must be true or false, got {numeric!r}")
        self.answer_key = answer_key
        self.extract = extract
        self.numeric = numeric
        self._regex: re.Pattern[str] | None = None
        if extract.startswith(_AFTER):
            if extract == _AFTER:
                raise ValueError(f"ExactAnswer: {_KEY}.extract 'after:' needs a marker, e.g. 'after:####'")
        elif extract not in ("last_line", "boxed"):
            self._regex = _compile("ExactAnswer", "extract", extract)
            if self._regex.groups != 1:
                raise ValueError(
                    f"ExactAnswer: {_KEY}.extract must be 'last_line', 'boxed', 'after:<marker>' or a regex "
                    f"with exactly one group, got {extract!r} with {self._regex.groups} groups"
                )

    def answer(self, text: str) -> str | None:
        """The stripped answer extracted from one response, or None."""
        if self.extract == "last_line":
            lines = [line for line in text.splitlines() if line.strip()]
            found = lines[-1] if lines else None
        elif self.extract == "boxed":
            found = extract_boxed(text)
        elif self._regex is None:
            marker = self.extract[len(_AFTER) :]
            at = text.rfind(marker)
            found = None if at < 0 else text[at + len(marker) :].split("\n", 1)[0]
        else:
            matches = list(self._regex.finditer(text))
            found = matches[-1].group(1) if matches else None
        return None if found is None else found.strip()

    def __call__(self, req: RewardRequest) -> torch.Tensor:
        """[B] fp32 scores of `req.texts` against `req.metadata[i][answer_key]`."""
        texts = req.require_texts("ExactAnswer")
        metadata = req.metadata or [{} for _ in texts]
        scores = []
        for sid, text, meta in zip(req.sample_ids, texts, metadata, strict=True):
            if self.answer_key not in meta:
                raise ValueError(
                    f"sample {sid!r} has no reference answer: its metadata lacks key {self.answer_key!r} "
                    f"(keys: {sorted(meta)}); fix the data or set answer_key"
                )
            reference = str(meta[self.answer_key]).strip()
            answer = self.answer(text)
            if self.numeric:
                ref_value = _parse_number(reference)
                if ref_value is None:
                    raise ValueError(
                        f"sample {sid!r}: reference {self.answer_key!r} = {reference!r} is not a number "
                        "and numeric comparison is on"
                    )
                value = None if answer is None else _parse_number(answer)
                hit = value is not None and math.isclose(value, ref_value, rel_tol=1e-6, abs_tol=1e-6)
            else:
                hit = answer is not None and answer == reference
            scores.append(1.0 if hit else 0.0)
        return torch.tensor(scores, dtype=torch.float32)


class FormatCheck:
    """Scorer: 1.0 when a response matches `pattern`, else 0.0.

    Args:
        pattern: a Python regex; an invalid one is a config error.
        mode: "fullmatch" (the whole response must match) or "search" (anywhere).
            Add `(?s)` to the pattern to let `.` cross newlines.
    """

    def __init__(self, pattern: str, mode: str = "fullmatch") -> None:
        if mode not in ("fullmatch", "search"):
            raise ValueError(f"FormatCheck: {_KEY}.mode must be 'fullmatch' or 'search', got {mode!r}")
        self.regex = _compile("FormatCheck", "pattern", pattern)
        self.mode = mode

    def __call__(self, req: RewardRequest) -> torch.Tensor:
        """[B] fp32 scores of `req.texts`."""
        match = self.regex.fullmatch if self.mode == "fullmatch" else self.regex.search
        texts = req.require_texts("FormatCheck")
        return torch.tensor([1.0 if match(t) else 0.0 for t in texts], dtype=torch.float32)


class OverlongPenalty:
    """Scorer: DAPO's soft overlong punishment from response lengths in tokens.

    With L the response length and L_free = max_length - buffer_length:
    0 when L <= L_free; (L_free - L) / buffer_length * factor when
    L_free < L <= max_length (reaching -factor at max_length); -factor beyond.
    Needs `req.response_lengths`.

    Args:
        max_length: L_max, the response budget in tokens (>= 1).
        buffer_length: L_cache, the tokens before L_max over which the penalty
            ramps (1 <= buffer_length <= max_length).
        factor: the penalty at and beyond L_max (> 0).
    """

    def __init__(self, max_length: int, buffer_length: int, factor: float = 1.0) -> None:
        for arg, value in (("max_length", max_length), ("buffer_length", buffer_length)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"OverlongPenalty: {_KEY}.{arg} must be an int >= 1, got {value!r}")
        if buffer_length > max_length:
            raise ValueError(
                f"OverlongPenalty: {_KEY}.buffer_length ({buffer_length}) must be <= max_length ({max_length})"
            )
        if (
            isinstance(factor, bool)
            or not isinstance(factor, (int, float))
            or not (math.isfinite(factor) and factor > 0)
        ):
            raise ValueError(f"OverlongPenalty: {_KEY}.factor must be a finite number > 0, got {factor!r}")
        self.max_length = max_length
        self.buffer_length = buffer_length
        self.factor = float(factor)

    def __call__(self, req: RewardRequest) -> torch.Tensor:
        """[B] fp32 penalties (<= 0) of `req.response_lengths`."""
        lengths = torch.tensor(req.require_response_lengths("OverlongPenalty"), dtype=torch.float64)
        free = self.max_length - self.buffer_length
        ramp = (free - lengths) / self.buffer_length * self.factor
        penalty = torch.where(lengths <= free, torch.zeros_like(lengths), ramp)
        penalty = torch.where(lengths > self.max_length, torch.full_like(lengths, -self.factor), penalty)
        return penalty.to(torch.float32)


class TargetCharFraction:
    """Scorer: the fraction of a response's characters that are in `chars`, in [0, 1].

    Dense and trivially verifiable, so a tiny random character-level LM can
    visibly learn it (e.g. `chars="0123456789"`: emit digits). An empty
    response scores 0.

    Args:
        chars: the target character set, a non-empty string.
    """

    def __init__(self, chars: str) -> None:
        if not isinstance(chars, str) or not chars:
            raise ValueError(f"TargetCharFraction: {_KEY}.chars must be a non-empty string, got {chars!r}")
        self.chars = frozenset(chars)

    def __call__(self, req: RewardRequest) -> torch.Tensor:
        """[B] fp32 scores of `req.texts`."""
        texts = req.require_texts("TargetCharFraction")
        return torch.tensor(
            [sum(c in self.chars for c in t) / len(t) if t else 0.0 for t in texts], dtype=torch.float32
        )
