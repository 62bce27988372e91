"""The check every checkpoint-loading scorer runs when it is built: a file it reads exists, so a
recipe that points at a wrong path fails validation (before Ray) with the file named."""

from __future__ import annotations

import os


def require_file(owner: str, key: str, path: str, what: str) -> None:
    """Return if `path` is a file, else raise ValueError `<owner>: <key> <path> does not exist;
    it is <what>` (`key`: the scorer's argument, `what`: the file it expects and where it comes from)."""
    if not os.path.isfile(path):
        raise ValueError(f"{owner}: {key} {path} does not exist; it is {what}")
