"""The rollout engine contract."""

from __future__ import annotations

from typing import Protocol

from unirl.types.rollout_req import RolloutReq
from unirl.types.rollout_resp import RolloutResp


class RolloutEngine(Protocol):
    """Generates a `RolloutResp` for a `RolloutReq`.

    An engine adapts whatever its backend produces into the typed boundary:
    one `RolloutTrack` per generation stage, with the segment replay needs,
    the condition tensors and the decoded media. Nothing backend-specific may
    cross into training code.
    """

    def generate(self, req: RolloutReq) -> RolloutResp: ...
