"""What the trusted-peer scripts (`flowgrpo_wan_peer.py`, `flowgrpo_ocr_peer.py`) share: loading a
trainer and one of its configs from a checkout of the official Flow-GRPO code, and setting config
keys by dotted name. Nothing of that code is copied here; it is executed from the checkout."""

from __future__ import annotations

import importlib.util
import os
import sys
import types


def set_key(config, dotted: str, value) -> None:
    """config[a][b][c] = value for `dotted` "a.b.c"."""
    node = config
    *parents, leaf = dotted.split(".")
    for part in parents:
        node = node[part]
    node[leaf] = value


def load_source(name: str, path: str) -> types.ModuleType:
    """The module in the file `path`, executed under `name`."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_trainer(checkout: str, script: str, config_name: str):
    """(the trainer module `scripts/<script>.py`, `config/grpo.py`'s `<config_name>()`) of the
    checkout; config/grpo.py loads base.py with `imp.load_source`, which Python 3.12 removed, so
    `load_source` stands in for it there."""
    sys.path.insert(0, checkout)
    try:
        import imp  # noqa: F401
    except ImportError:
        sys.modules["imp"] = types.SimpleNamespace(load_source=load_source)
    config_module = load_source("flow_grpo_config_grpo", os.path.join(checkout, "config", "grpo.py"))
    trainer = load_source(script, os.path.join(checkout, "scripts", f"{script}.py"))
    return trainer, getattr(config_module, config_name)()
