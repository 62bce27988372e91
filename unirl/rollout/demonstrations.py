"""`DemonstrationEngine`: the rollout of a supervised track, teacher-forced demonstrations.

A supervised objective (`unirl.algorithms.sft`) trains on the same machinery as RL (the
worker's train backend with FSDP2, LoRA, EMA, exact resume, trackers); only its batch
differs: each sample's output is the demonstration its prompt row carries
(`metadata[target_key]`: a text for a text stage, an image for a diffusion stage), not a sample
of the policy. This engine builds that track. With a list of keys a row carries a group of
demonstrations (preference pairs: `[chosen, rejected]`), one per sample of its group, each sample
labelled with its key (`metadata["demonstration"]`): a preference loss that compares the samples of
a group (`unirl.algorithms.diffusion_dpo.DiffusionDPO`) then trains offline on the data's pairs,
ranked by a reward that reads the label (`unirl.reward.local.preference.PreferredDemonstration`).
"""

from __future__ import annotations

from typing import Any, ClassVar

from unirl.models.flow.stage import EMPTY
from unirl.models.stage import TextStage
from unirl.types.rollout_req import RolloutReq
from unirl.types.rollout_resp import RolloutResp, RolloutTrack

DEMONSTRATION = "demonstration"  # a sample's metadata key naming which of its row's demonstrations it is


class DemonstrationEngine:
    """Builds each request's track from its rows' demonstrations.

    Args:
        stage: a stage that teacher-forces (`teacher_forced(req, demonstrations)`): a causal-LM
            stage (texts) or a flow-matching stage (images of a pixel-space model).
        target_key: the prompt rows' metadata key holding the demonstration (the arithmetic
            world's rows carry the correct completion as "answer"; the shapes world's
            demonstration rows their rendered scene as "image"); or a list of keys, one per sample
            of a row's group in order (`sampling.samples_per_prompt` of them: a preference pair's
            `[chosen, rejected]`).
        track_name: name of the produced track (default "text" or "diffusion").

    A text track is the one a `TrainsideEngine` would give for the same request with the
    demonstrations as its responses (prompt ids as sampling encodes them, the demonstration's
    tokens + EOS, zero `log_probs`), texts the demonstrations. A diffusion track holds each image
    as its final latent (`FlowMatchingStage.teacher_forced`), the prompts' conditions as sampling
    encodes them, and beside them the empty prompt's under `empty_<key>` (what condition dropout
    trains on; one more [B, ...] copy of the conditions), media the images. A row without the key
    is an error naming the sample. `samples_policy` is False: evaluation samples the policy on the
    worker's own module instead.
    """

    samples_policy: ClassVar[bool] = False
    kept = None  # no sampling graphs: nothing was sampled

    def __init__(
        self, stage: Any, target_key: str | list[str] = "answer", track_name: str | None = None
    ) -> None:
        if not callable(getattr(stage, "teacher_forced", None)):
            raise TypeError(
                f"rollout: DemonstrationEngine teacher-forces demonstrations; {type(stage).__name__} has no "
                "`teacher_forced` (the causal-LM and flow-matching stages have)"
            )
        self.stage = stage
        self.text = isinstance(stage, TextStage)
        self.target_key = target_key
        self.track_name = track_name or ("text" if self.text else "diffusion")

    def keys(self, req: RolloutReq) -> list[str]:
        """The metadata key of every sample's demonstration: `target_key`, or with a list the j-th
        key for the j-th sample of its group (a group of another size is named)."""
        if isinstance(self.target_key, str):
            return [self.target_key] * len(req)
        out, seen = [], {}
        for sid, gid in zip(req.sample_ids, req.group_ids, strict=True):
            j = seen[gid] = seen.get(gid, -1) + 1
            if j >= len(self.target_key):
                raise ValueError(
                    f"sample {sid!r}: its group {gid!r} has more samples than rollout.target_key names "
                    f"demonstrations ({list(self.target_key)}); set sampling.samples_per_prompt to {len(self.target_key)}"
                )
            out.append(self.target_key[j])
        return out

    def demonstrations(self, req: RolloutReq) -> list:
        """The demonstration of every sample of `req`, in order (a missing one is named)."""
        out = []
        for sid, meta, key in zip(req.sample_ids, req.metadata, self.keys(req), strict=True):
            if key not in meta:
                raise ValueError(
                    f"sample {sid!r}: its prompt row has no demonstration under metadata[{key!r}] "
                    f"(it has {sorted(meta)}); set rollout.target_key to the key that holds it"
                )
            out.append(str(meta[key]) if self.text else meta[key])
        return out

    def generate(self, req: RolloutReq, keep: bool = False) -> RolloutResp:
        """The track of `req` with its demonstrations as outputs (`keep` is accepted for the
        worker's call and ignored: there are no sampling graphs)."""
        demos = self.demonstrations(req)
        segment = self.stage.teacher_forced(req, demos)
        if self.text:
            extra = {"texts": demos}
        else:
            sp = req.sampling
            cond = self.stage.encode_request(req)
            empty = self.stage.encode_prompts([""] * len(req), 1.0, sp.max_sequence_length)
            cond.update({EMPTY + k: v for k, v in empty.items()})
            extra = {"conditions": cond, "media": self.stage.decode(segment.final)}
        track = RolloutTrack.of_request(self.track_name, req, segment, **extra)
        if not isinstance(self.target_key, str):  # each sample says which of its row's demonstrations it is
            track.metadata = [{**m, DEMONSTRATION: k} for m, k in zip(track.metadata, self.keys(req), strict=True)]
        return RolloutResp(tracks={self.track_name: track})
