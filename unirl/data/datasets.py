"""Load prompt files (`.txt`, `.jsonl`, `.json`) into `PromptExample` rows.

Every problem with a file raises `PromptFileError` naming the file, the line
(`.jsonl`, 1-based) or entry (`.json`, 0-based list index), what is wrong and
how to fix it. Nothing is silently skipped except blank lines.
"""

from __future__ import annotations

import json
import os
from typing import Any

from unirl.types.rollout_req import PromptExample

SUPPORTED_EXTENSIONS = (".txt", ".jsonl", ".json")
# Precomputed text embeddings are not a prompt-file feature: the model's own
# text encoder embeds prompts, so a file carrying them is from another pipeline.
LEGACY_KEYS = ("prompt_embeds", "prompt_embed_path")
_RESERVED_KEYS = ("prompt", "caption", "prompt_id", "metadata")


class PromptFileError(ValueError):
    """A prompt file is missing, unreadable or malformed; the message says where and how to fix it."""


def load_prompts(
    path: str, prompt_key: str = "prompt", path_keys: tuple[str, ...] | list[str] = ("images",)
) -> list[PromptExample]:
    """Read every prompt of `path`, in file order.

    Formats (chosen by extension):
        `.txt`: one prompt per non-empty line.
        `.jsonl`: one JSON object per non-empty line.
        `.json`: a list of strings or objects, or an object `{"prompts": [...]}`.

    Object rows: the text is `row[prompt_key]`, or `row["caption"]` when
    `prompt_key` is absent. `prompt_id` (string or int) is optional. `metadata`
    is an optional dict; without it, the row's other top-level keys become the
    metadata. Legacy keys `prompt_embeds` / `prompt_embed_path` are rejected.

    A vision-language row names its images in metadata `images`: a list of file paths,
    relative ones resolved against the prompt file's directory (so is every metadata key of
    `path_keys`, a list or one path: an edit row's `source` for a model whose `condition_key` it
    is, a preference pair's `chosen` and `rejected`) (the prompt holds one
    `<image>` per image; the model's stage reads them and names a bad one with its sample).

    Prompt text is stripped of surrounding whitespace. A row without a
    `prompt_id` gets `"{filename}:{index}"`, where `index` counts prompts
    (0-based) and `filename` is the base name of `path`.

    Returns:
        At least one `PromptExample`, ids unique within the file.

    Raises:
        PromptFileError: unknown extension, missing file, invalid UTF-8 or
            JSON, a malformed row, a duplicate `prompt_id`, or no prompts.
    """
    ext = os.path.splitext(path)[1].lower()
    if ext not in SUPPORTED_EXTENSIONS:
        raise PromptFileError(
            f"{path}: unsupported prompt file extension {ext or '(none)'!r}; "
            f"use one of {', '.join(SUPPORTED_EXTENSIONS)}"
        )
    if not os.path.isfile(path):
        raise PromptFileError(
            f"{path}: prompt file not found; check data_path (relative paths resolve from {os.getcwd()})"
        )
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise PromptFileError(f"{path}: not valid UTF-8 ({e}); re-save the file as UTF-8") from e

    filename = os.path.basename(path)
    if ext == ".txt":
        rows = [(f"line {i + 1}", line) for i, line in enumerate(text.splitlines()) if line.strip()]
    elif ext == ".jsonl":
        rows = [
            (f"line {i + 1}", _parse_jsonl_line(path, i + 1, line))
            for i, line in enumerate(text.splitlines())
            if line.strip()
        ]
    else:
        rows = [(f"entry {i}", row) for i, row in enumerate(_parse_json_list(path, text))]

    examples: list[PromptExample] = []
    first_seen: dict[str, str] = {}
    for where, row in rows:
        ex = _to_example(row, prompt_key, f"{filename}:{len(examples)}", f"{path}, {where}", ext)
        for key in path_keys:
            images = ex.metadata.get(key)
            if images is None:
                continue
            # `images` (a VLM's inputs) is a list; another key may name one file (a preference pair's `chosen`)
            one = key != "images" and isinstance(images, str) and bool(images)
            if not one and (not isinstance(images, list) or not all(isinstance(i, str) and i for i in images)):
                what = "a list of image file paths" if key == "images" else "an image file path or a list of them"
                raise PromptFileError(f"{path}, {where}: {key!r} must be {what}, got {images!r}")
            base = os.path.dirname(os.path.abspath(path))
            resolved = [i if os.path.isabs(i) else os.path.join(base, i) for i in ([images] if one else images)]
            ex.metadata[key] = resolved[0] if one else resolved
        if ex.prompt_id in first_seen:
            raise PromptFileError(
                f"{path}, {where}: duplicate prompt_id {ex.prompt_id!r} (first used at {first_seen[ex.prompt_id]}); "
                "prompt_ids must be unique within a file: rename one or drop prompt_id to use the default"
            )
        first_seen[ex.prompt_id] = where
        examples.append(ex)

    if not examples:
        hint = {
            ".txt": "write one prompt per line",
            ".jsonl": 'write one object per line, e.g. {"prompt": "a red circle"}',
            ".json": 'write a list, e.g. ["a red circle"] or [{"prompt": "a red circle"}]',
        }[ext]
        raise PromptFileError(f"{path}: file has no prompts; {hint}")
    return examples


def _parse_jsonl_line(path: str, lineno: int, line: str) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        raise PromptFileError(
            f"{path}, line {lineno}: invalid JSON ({e.msg} at column {e.colno}); "
            "each non-empty line must be one complete JSON object"
        ) from e


def _parse_json_list(path: str, text: str) -> list[Any]:
    if not text.strip():
        return []
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise PromptFileError(
            f"{path}, line {e.lineno}: invalid JSON ({e.msg} at column {e.colno}); fix the syntax at that position"
        ) from e
    if isinstance(doc, dict):
        if "prompts" not in doc:
            raise PromptFileError(
                f"{path}: top-level object has no 'prompts' key (keys: {sorted(doc)}); "
                'use {"prompts": [...]} or a top-level list'
            )
        doc = doc["prompts"]
    if not isinstance(doc, list):
        raise PromptFileError(
            f"{path}: expected a list of prompts, got {type(doc).__name__}; "
            'use ["a red circle", ...] or {"prompts": [...]}'
        )
    return doc


def _to_example(row: Any, prompt_key: str, default_id: str, where: str, ext: str) -> PromptExample:
    """Validate one row (a `.txt` line, or a parsed JSON value) and build its example."""
    if isinstance(row, str) and ext != ".jsonl":
        prompt = row.strip()
        if not prompt:
            raise PromptFileError(f"{where}: prompt is empty; write the prompt text or remove the entry")
        return PromptExample(prompt=prompt, prompt_id=default_id, metadata={})
    if not isinstance(row, dict):
        expected = "a JSON object" if ext == ".jsonl" else "a string or a JSON object"
        raise PromptFileError(
            f"{where}: row is {type(row).__name__} {json.dumps(row)[:60]}, expected {expected} "
            f'like {{"{prompt_key}": "a red circle"}}'
        )

    legacy = [k for k in LEGACY_KEYS if k in row]
    if legacy:
        raise PromptFileError(
            f"{where}: legacy key(s) {legacy} are not supported; prompts are embedded by the model's "
            "text encoder at rollout time, so remove these keys and keep the prompt text"
        )

    key = prompt_key if prompt_key in row else "caption" if "caption" in row else None
    if key is None:
        raise PromptFileError(
            f"{where}: no prompt text; add a {prompt_key!r} (or 'caption') key "
            f"(row keys: {sorted(row)}; pass prompt_key=... if the text is under another key)"
        )
    prompt = row[key]
    if not isinstance(prompt, str):
        raise PromptFileError(
            f"{where}: {key!r} must be a string, got {type(prompt).__name__}; quote the prompt text"
        )
    prompt = prompt.strip()
    if not prompt:
        raise PromptFileError(f"{where}: {key!r} is empty; write the prompt text or remove the row")

    prompt_id = row.get("prompt_id", default_id)
    if isinstance(prompt_id, bool) or not isinstance(prompt_id, (str, int)) or prompt_id == "":
        raise PromptFileError(
            f"{where}: prompt_id must be a non-empty string or an integer, got {prompt_id!r}; "
            "fix it or drop prompt_id to use the default"
        )

    if "metadata" in row:
        metadata = row["metadata"]
        if not isinstance(metadata, dict):
            raise PromptFileError(
                f"{where}: metadata must be a JSON object, got {type(metadata).__name__}; "
                'write it as {"key": value, ...} or remove it'
            )
        extra = sorted(k for k in row if k not in _RESERVED_KEYS and k != prompt_key)
        if extra:
            raise PromptFileError(
                f"{where}: row has both 'metadata' and extra top-level keys {extra}; "
                "move those keys inside 'metadata' (or drop 'metadata' to use the top-level keys)"
            )
    else:
        metadata = {k: v for k, v in row.items() if k not in _RESERVED_KEYS and k != prompt_key}
    return PromptExample(prompt=prompt, prompt_id=str(prompt_id), metadata=dict(metadata))
