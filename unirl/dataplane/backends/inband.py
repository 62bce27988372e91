"""`inband`: the meta carries the data itself, so it travels through the driver.

The debugging baseline: no shared service, nothing to leak (clearing a
partition only resets its claims; the data goes when the metas are dropped).
"""

from __future__ import annotations

from typing import Any

from unirl.dataplane.transport import BatchMeta, Transport


class InbandTransport(Transport):
    """Handle = the wire columns themselves ({field: [B, ...] tensor | per-sample list})."""

    name = "inband"

    def _put(self, partition: str, sample_ids: list[str], wire: dict[str, Any]) -> Any:
        return wire

    def _get(self, meta: BatchMeta, names: list[str]) -> dict[str, Any]:
        return {n: meta.handle[n] for n in names}

    def _clear(self, partition: str) -> None:
        """Nothing is stored outside the metas: the data goes when the driver drops them."""
