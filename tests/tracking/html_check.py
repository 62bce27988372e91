"""Checks of the self-contained HTML pages (a run's gallery, a `unirl.view` report): a strict
parse that every element closes in order, and a render in headless Chromium
(`scripts/check_gallery_chromium.sh`)."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "check_gallery_chromium.sh"
# CI installs chromium (INSTALL_CHROMIUM=1 bash scripts/install.sh), so there a missing binary fails the test.
needs_chromium = pytest.mark.skipif(
    shutil.which("chromium") is None and os.environ.get("INSTALL_CHROMIUM") != "1",
    reason="headless check needs Debian's chromium (INSTALL_CHROMIUM=1 bash scripts/install.sh)",
)
VOID = {"meta", "img", "br", "hr", "input", "link", "source", "wbr", "col", "area", "base", "embed", "track"}
# SVG leaves written self-closing (<line/>), which html.parser reports through handle_startendtag
SVG_LEAVES = {"rect", "line", "circle", "polygon"}


class _Doc(HTMLParser):
    """Collects tags/attributes and checks that non-void elements are closed in order."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[str] = []
        self.errors: list[str] = []
        self.imgs: list[dict[str, str | None]] = []
        self.polylines: list[dict[str, str | None]] = []
        self.ids: set[str] = set()
        self.script_tags = 0
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if a.get("id"):
            self.ids.add(a["id"])
        if tag == "img":
            self.imgs.append(a)
        if tag == "polyline":
            self.polylines.append(a)
        if tag == "script":
            self.script_tags += 1
        if tag not in VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag not in VOID and tag not in SVG_LEAVES:
            self.errors.append(f"unexpected self-closing <{tag}/>")

    def handle_endtag(self, tag: str) -> None:
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.stack[-1] if self.stack else 'nothing'}")
            return
        self.stack.pop()

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def parse(path: str) -> tuple[str, _Doc]:
    src = Path(path).read_text(encoding="utf-8")
    doc = _Doc()
    doc.feed(src)
    doc.close()
    assert doc.errors == [] and doc.stack == [], (doc.errors, doc.stack)
    return src, doc


def png_pixels(data: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as im:
        return np.asarray(im.convert("RGB"))


def render_in_chromium(page: str | Path, shot: Path) -> subprocess.CompletedProcess:
    """Render `page` (an HTML file, or a run directory's gallery.html) to the screenshot `shot`
    with the script CI runs; its exit status says whether the page rendered non-blank."""
    env = {**os.environ, "PYTHON": sys.executable}
    return subprocess.run(
        ["bash", str(SCRIPT), str(page), str(shot)], capture_output=True, text=True, env=env
    )
