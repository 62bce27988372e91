"""The transports every data-plane test runs against (CI installs the TQ and Mooncake extras)."""

from __future__ import annotations

import os

from omegaconf import OmegaConf

from tests.conftest import EXAMPLES

BACKENDS = ["inband", "ray", "tq_simple", "tq_mooncake"]


def transport_cfg(name: str, **overrides) -> dict:
    """The recipe node `examples/transport/<name>.yaml` (small Mooncake segments for tests)."""
    with open(os.path.join(EXAMPLES, "transport", f"{name}.yaml")) as f:
        cfg = OmegaConf.to_container(OmegaConf.load(f))
    if name == "tq_mooncake":
        cfg.update(global_segment_size=256 << 20, local_buffer_size=64 << 20)
    cfg.update(overrides)
    return cfg
