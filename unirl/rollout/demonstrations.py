"""`DemonstrationEngine`: the rollout of a supervised track, teacher-forced demonstrations.

A supervised objective (`unirl.algorithms.sft`) trains on the same machinery as RL (the
worker's train backend with FSDP2, LoRA, EMA, exact resume, trackers); only its batch
differs: each sample's response is the demonstration its prompt row carries
(`metadata[target_key]`), not a sample of the policy. This engine builds that track.
"""

from __future__ import annotations

from typing import ClassVar

from unirl.models.stage import TextStage
from unirl.types.rollout_req import RolloutReq
from unirl.types.rollout_resp import RolloutResp, RolloutTrack


class DemonstrationEngine:
    """Builds each request's track from its rows' demonstrations.

    Args:
        stage: a text stage that teacher-forces (`CausalLMStage.teacher_forced`).
        target_key: the prompt rows' metadata key holding the demonstration (the arithmetic
            world's rows carry the correct completion as "answer").
        track_name: name of the produced track (default "text").

    The track is the one a `TrainsideEngine` would give for the same request, with the
    demonstrations as its responses: prompt ids as sampling encodes them, response i the tokens
    of the demonstration + EOS, zero `log_probs` (no behaviour policy), texts the
    demonstrations. A row without the key is an error naming the sample. `samples_policy` is
    False: evaluation samples the policy on the worker's own module instead.
    """

    samples_policy: ClassVar[bool] = False
    kept = None  # no sampling graphs: nothing was sampled

    def __init__(self, stage: TextStage, target_key: str = "answer", track_name: str | None = None) -> None:
        if not callable(getattr(stage, "teacher_forced", None)):
            raise TypeError(
                f"rollout: DemonstrationEngine teacher-forces text demonstrations; {type(stage).__name__} has "
                "no `teacher_forced` (a causal-LM stage, unirl.models.causal_lm.CausalLMStage, has)"
            )
        self.stage = stage
        self.target_key = target_key
        self.track_name = track_name or "text"

    def demonstrations(self, req: RolloutReq) -> list[str]:
        """The demonstration of every sample of `req`, in order (a missing one is named)."""
        out = []
        for sid, meta in zip(req.sample_ids, req.metadata, strict=True):
            if self.target_key not in meta:
                raise ValueError(
                    f"sample {sid!r}: its prompt row has no demonstration under metadata[{self.target_key!r}] "
                    f"(it has {sorted(meta)}); set rollout.target_key to the key that holds the target text"
                )
            out.append(str(meta[self.target_key]))
        return out

    def generate(self, req: RolloutReq, keep: bool = False) -> RolloutResp:
        """The track of `req` with its demonstrations as responses (`keep` is accepted for the
        worker's call and ignored: there are no sampling graphs)."""
        texts = self.demonstrations(req)
        track = RolloutTrack(
            name=self.track_name,
            sample_ids=req.sample_ids,
            group_ids=req.group_ids,
            prompts=req.prompts,
            metadata=req.metadata,
            segment=self.stage.teacher_forced(req, texts),
            rollout_id=req.rollout_id,
            parent_ids=req.parent_ids,
            root_ids=req.root_ids,
            texts=texts,
        )
        return RolloutResp(tracks={self.track_name: track})
