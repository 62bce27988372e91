"""`UnifiedEngine`: a unified model thinks, then draws (T2I-R1's semantic-level then
token-level chain of thought) on one backbone.

Per user prompt x N (the root request): the text stage writes a semantic plan (its own
`TextSamplingParams`: budget, temperature, stop token), then the image stage draws image
tokens after prompt + plan (its own `ImageTokenSamplingParams`, Janus-style CFG) and decodes
them. Two tracks come back, linked by lineage like a composed rollout's
(`unirl.types.lineage`): `plan` (the root: `TokenSegment` of the plan tokens after the prompt)
and `image` (one child per plan: `TokenSegment` of the image tokens after prompt + plan + BOI,
its decoded images in `media`). The image of plan `p` has id `f"{p}/0"`, `parent_ids` = `p`
and, unlike a composed child, the *user prompt's* group (`group_ids` = `root_ids` = the plan's
group id): BiCoT-GRPO compares a prompt's N (plan, image) pairs with each other, so both
tracks' advantages are taken over the same group. A plan that reaches its budget without a
stop token is kept as it is (truncated) and marked: `metadata["plan_truncated"]` on both tracks.

`DedicatedUnifiedEngine` runs the same sampling in engine actors with their own copy of the
backbone, fed by weight sync (`unirl.rollout.dedicated`): the train workers then only train.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

import torch
from annotated_types import Ge

from unirl.models.stage import ImageTokenStage, TextStage
from unirl.rollout.dedicated import DedicatedEngine
from unirl.rollout.trainside import TrainsideEngine
from unirl.types.batch import concat
from unirl.types.lineage import child_seed
from unirl.types.rollout_req import RolloutReq
from unirl.types.rollout_resp import RolloutResp, RolloutTrack
from unirl.types.segments import TokenSegment


class UnifiedEngine:
    """Trainside unified sampling on the worker's one backbone.

    Args:
        tracks: [plan track, image track] names (each names a `tracks.<name>` node).
        forward_batch_size: samples per forward of each stage (None: the whole request).
        prompt_key: metadata key under which the image keeps the user prompt.

    The worker then `bind`s the two stages and sampling params.
    """

    def __init__(
        self,
        tracks: list[str] = ("plan", "image"),  # type: ignore[assignment]
        forward_batch_size: Annotated[int, Ge(1)] | None = None,
        prompt_key: str = "user_prompt",
    ) -> None:
        tracks = list(tracks)
        if len(tracks) != 2 or tracks[0] == tracks[1]:
            raise ValueError(f"rollout.tracks must name the plan track then the image track, got {tracks}")
        self.tracks = tracks
        self.forward_batch_size = forward_batch_size
        self.prompt_key = prompt_key

    def bind(self, stages: Mapping[str, Any], samplings: Mapping[str, Any]) -> UnifiedEngine:
        """Attach the worker's stages and the recipe's sampling params; returns self."""
        plan, image = self.tracks
        missing = [t for t in self.tracks if t not in stages or t not in samplings]
        if missing:
            raise ValueError(f"rollout.tracks names {missing}, which have no tracks.<name> node")
        if not isinstance(stages[plan], TextStage):
            raise ValueError(f"tracks.{plan}.stage must be a text stage (it writes the plan)")
        if not isinstance(stages[image], ImageTokenStage):
            raise ValueError(f"tracks.{image}.stage must be an image-token stage (it draws the image)")
        self.stages = dict(stages)
        self.samplings = dict(samplings)
        self.plan_engine = TrainsideEngine(stages[plan], self.forward_batch_size, track_name=plan)
        return self

    def _chunks(self, n: int) -> list[list[int]]:
        size = self.forward_batch_size or n
        return [list(range(k, min(k + size, n))) for k in range(0, n, size)]

    def draw(self, req: RolloutReq, samplings: Mapping[str, Any] | None = None) -> torch.Tensor:
        """[B, 3, H, W] uint8: one image after each prompt of `req` alone, with no plan (the
        evaluation's floor: the model drawing without thinking first)."""
        plan_name, image_name = self.tracks
        sampling = (samplings or {}).get(image_name, self.samplings[image_name])
        stage = self.stages[image_name]
        prompts = self.stages[plan_name].encode_prompts(req)
        empty = torch.zeros(0, dtype=torch.long)
        contexts = [stage.image_context(p, empty) for p in prompts]
        ids = [f"{sid}/0" for sid in req.sample_ids]
        return torch.cat([m for _, m in self._images(stage, contexts, ids, sampling, req.rollout_id)])

    def _images(self, stage, contexts: list, ids: list[str], sampling: Any, rollout_id: int) -> list[tuple]:
        """(segment, media) per forward batch of images after `contexts`, seeded from `ids`."""
        seeds = [child_seed(sampling.seed, rollout_id, sid) for sid in ids]
        parts = []
        was_training = stage.module.training
        stage.module.eval()
        try:
            for idx in self._chunks(len(ids)):
                parts.append(stage.generate([contexts[i] for i in idx], [seeds[i] for i in idx], sampling))
        finally:
            stage.module.train(was_training)
        return parts

    def generate(self, req: RolloutReq, samplings: Mapping[str, Any] | None = None) -> RolloutResp:
        """Plans for the root request `req` (user prompts x N, `req.sampling` the plan's), then
        one image per plan under `samplings[image]` (default: the recipe's)."""
        plan_name, image_name = self.tracks
        plan = self.plan_engine.generate(req).track(plan_name)
        stop = set(self.stages[plan_name].stop_token_ids(req.sampling))
        sampling = (samplings or {}).get(image_name, self.samplings[image_name])
        stage = self.stages[image_name]
        seg: TokenSegment = plan.segment
        truncated = [int(r[-1]) not in stop for r in seg.response_ids]
        for meta, cut in zip(plan.metadata, truncated, strict=True):
            meta["plan_truncated"] = cut
        ids = [f"{sid}/0" for sid in plan.sample_ids]
        contexts = [stage.image_context(p, r) for p, r in zip(seg.prompt_ids, seg.response_ids, strict=True)]
        parts = self._images(stage, contexts, ids, sampling, req.rollout_id)
        image_seg = concat([p[0] for p in parts])
        metadata = []
        for i, meta in enumerate(plan.metadata):
            meta = dict(meta)
            meta.setdefault(self.prompt_key, plan.prompts[i])
            meta["plan"] = plan.texts[i]
            metadata.append(meta)
        image = RolloutTrack(
            name=image_name,
            sample_ids=ids,
            group_ids=list(plan.group_ids),
            prompts=list(plan.texts),
            metadata=metadata,
            segment=image_seg,
            media=torch.cat([p[1] for p in parts]),
            parent_ids=list(plan.sample_ids),
            root_ids=list(plan.group_ids),
            rollout_id=req.rollout_id,
        )
        return RolloutResp(tracks={plan_name: plan, image_name: image})


class DedicatedUnifiedEngine(DedicatedEngine):
    """`UnifiedEngine`'s sampling in dedicated engine actors (`unirl.trainer.unified.UnifiedEngineWorker`),
    each holding its own backbone, synced from the trainer before every rollout.

    Args:
        tracks, forward_batch_size, prompt_key: as `UnifiedEngine`.
        placement, num_engines, sleep_level: as `DedicatedEngine` (read by the trainer); with
            colocate and sleep level 1 or 2 an engine releases the backbone while the trainer trains.
        max_staleness: 0 only (every rollout samples the weights of the step).
        overlap_reward: false only: an engine returns a rollout whole, its plans and their images.
        rebuild: as `DedicatedEngine` (sleep level 2).

    The engine worker `bind`s its own stages and the sampling params; weight sync, sleep and
    wake-up act on the plan stage's module, the whole backbone (both stages hold it).
    """

    def __init__(
        self,
        tracks: list[str] = ("plan", "image"),  # type: ignore[assignment]
        forward_batch_size: Annotated[int, Ge(1)] | None = None,
        placement: str = "colocate",
        num_engines: Annotated[int, Ge(1)] = 1,
        max_staleness: int = 0,
        sleep_level: int = 1,
        overlap_reward: bool = False,
        prompt_key: str = "user_prompt",
        rebuild: Any = None,
    ) -> None:
        if max_staleness != 0:
            raise ValueError(
                f"rollout.max_staleness={max_staleness}: a unified engine samples the weights of the step; set 0"
            )
        if overlap_reward:
            raise ValueError(
                "rollout.overlap_reward=true: a unified engine returns a rollout whole (plans, then their "
                "images); set it to false"
            )
        self.unified = UnifiedEngine(tracks, forward_batch_size, prompt_key)
        self.tracks = self.unified.tracks
        self._settings = (forward_batch_size, placement, num_engines, max_staleness, sleep_level, rebuild)

    def bind(self, stages: Mapping[str, Any], samplings: Mapping[str, Any]) -> DedicatedUnifiedEngine:
        """Attach the engine's own stages and the sampling params (`UnifiedEngine.bind`); returns self."""
        self.unified.bind(stages, samplings)
        forward_batch_size, placement, num_engines, max_staleness, sleep_level, rebuild = self._settings
        DedicatedEngine.__init__(
            self,
            stages[self.tracks[0]],
            forward_batch_size,
            placement,  # type: ignore[arg-type]
            num_engines,
            max_staleness,  # type: ignore[arg-type]
            sleep_level,  # type: ignore[arg-type]
            False,
            rebuild,
            track_name=self.tracks[0],
        )
        return self

    def generate(self, req: RolloutReq) -> RolloutResp:
        """`UnifiedEngine.generate` on the engine's synced backbone (both tracks)."""
        self._check_ready()
        return self.unified.generate(req)

    def generate_chunks(self, req: RolloutReq):
        """A unified rollout is returned whole (`overlap_reward` is false): the one response's tracks."""
        yield from self.generate(req).tracks.values()
