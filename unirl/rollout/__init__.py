"""Rollout engines: adapt a backend's samples into `RolloutResp` tracks."""
