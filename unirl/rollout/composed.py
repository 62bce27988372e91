"""`ComposedEngine`: a chain of stages, each sampling from the previous stage's outputs.

The prompt enhancer: stage 1 (a causal LM) writes N rewrites of every user
prompt, stage 2 (a diffusion model) renders M images of every rewrite. The
rewrite is the diffusion prompt; the user prompt and its metadata stay
attached to every image for scoring (`unirl.types.lineage.child_request`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

from annotated_types import Ge

from unirl.models.stage import DiffusionStage, TextStage
from unirl.rollout.trainside import TrainsideEngine
from unirl.sde.schedules import schedule_tokens, sigmas_for
from unirl.types.lineage import child_request
from unirl.types.rollout_req import RolloutReq
from unirl.types.rollout_resp import RolloutResp
from unirl.types.sampling import DiffusionSamplingParams, TextSamplingParams


class ComposedEngine:
    """Trainside composed sampling: every stage samples through the worker's own module.

    Args:
        tracks: track names in chain order, root first (e.g. [ar, diffusion]); each names a
            `tracks.<name>` node of the recipe.
        forward_batch_size: samples per forward of every stage (None: a stage's whole request).
        prompt_key: metadata key under which a child keeps its root prompt (the user prompt).

    The worker then `bind`s each track's stage and sampling params.

    `generate(req)`: `req` is the root stage's request (user prompts x N); returns one track
    per stage, children linked to their parents (`parent_ids`, `root_ids`). A root stage must
    be a text stage (its texts prompt the next stage); a later text stage would prompt with its
    parent's texts too.
    """

    def __init__(
        self,
        tracks: list[str],
        forward_batch_size: Annotated[int, Ge(1)] | None = None,  # Ge: checked before stages exist
        prompt_key: str = "user_prompt",
    ) -> None:
        if len(tracks) < 2 or len(set(tracks)) != len(tracks):
            raise ValueError(f"rollout.tracks must name two or more distinct tracks, root first, got {tracks}")
        self.tracks = list(tracks)
        self.prompt_key = prompt_key
        self.forward_batch_size = forward_batch_size

    def bind(
        self,
        stages: Mapping[str, DiffusionStage | TextStage],
        samplings: Mapping[str, DiffusionSamplingParams | TextSamplingParams],
    ) -> ComposedEngine:
        """Attach the worker's stage and the recipe's sampling params of every track; returns self."""
        missing = [t for t in self.tracks if t not in stages or t not in samplings]
        if missing:
            raise ValueError(f"rollout.tracks names {missing}, which have no tracks.<name> node")
        self.samplings = dict(samplings)
        self.stages = dict(stages)
        self.engines = {t: TrainsideEngine(stages[t], self.forward_batch_size, track_name=t) for t in self.tracks}
        for t in self.tracks[:-1]:
            if not self.engines[t].text:
                child = self.tracks[self.tracks.index(t) + 1]
                raise ValueError(
                    f"rollout.tracks: track {t!r} feeds track {child!r}, so it must be a text stage "
                    "(its texts are the next stage's prompts)"
                )
        return self

    def sigmas(self, name: str, sampling: DiffusionSamplingParams | TextSamplingParams) -> Any:
        """The pinned sigma schedule of track `name` under `sampling` (None for a text track)."""
        if self.engines[name].text:
            return None
        return sigmas_for(sampling, schedule_tokens(sampling, self.stages[name].model_info()))

    def generate(
        self,
        req: RolloutReq,
        samplings: Mapping[str, DiffusionSamplingParams | TextSamplingParams] | None = None,
        texts_override: Mapping[str, list[str]] | None = None,
    ) -> RolloutResp:
        """Sample the chain from the root request `req`.

        Args:
            samplings: per child track, sampling params to use instead of the recipe's
                (evaluation samples deterministically).
            texts_override: per parent track, the prompts to feed its child instead of its
                sampled texts, one per parent sample (evaluation's floor and ceiling feed the
                user prompt or the canonical prompt straight to the image model).
        """
        tracks = {}
        parent = None
        for name in self.tracks:
            engine = self.engines[name]
            if parent is None:
                track = engine.generate(req).track(name)
            else:
                texts = (texts_override or {}).get(parent.name, parent.texts)
                sampling = (samplings or {}).get(name, self.samplings[name])
                child_req = child_request(
                    parent, texts, sampling, self.sigmas(name, sampling), req.rollout_id, self.prompt_key
                )
                track = engine.generate(child_req).track(name)
            tracks[name] = track
            parent = track
        return RolloutResp(tracks=tracks)
