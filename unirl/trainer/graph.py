"""`RunGraph`: the driver's view of any recipe as a graph of tracks.

Every RL recipe is a chain of tracks, root first, each child's request built from its
parent's output (`unirl.types.lineage.child_request`):

- a single-track recipe (no `tracks`) is a chain of one track, named None: it is its own
  root and leaf, samples where the recipe's `rollout` says, is scored by `reward` and
  weighed by `advantage`; its partition is the step's and its checkpoint and export keep
  the flat layout. Only such a track has dynamic sampling, staleness and reward overlap
  (the validator refuses them on a chained track);
- a composed recipe (`tracks.<name>`, each with its own `model`) is a chain in the order of
  `rollout.tracks`, each track sampled where its `engine` says (trainside without one), a
  leaf scored by `rewards.<leaf>`, a parent by the `aggregate` of its children's rewards
  (plus `rewards.<name>` when set);
- a unified recipe (`tracks.<name>` sharing the recipe's one `model`) is a chain whose
  tracks share one backbone (`shared`): one engine samples them all in one call (a plan,
  then an image after it), one joint optimizer step trains them, and the plan's reward is
  the mean of its one image's.

The driver (`unirl.trainer.trainer.Trainer`) walks the graph's engine units (`units`: one per
track, or one for the shared backbone's tracks), scores leaf first, computes advantages per
trained track and trains per track (or jointly).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from unirl.trainer.engines import RolloutSettings
from unirl.trainer.worker import build, track_partition
from unirl.types.lineage import AGGREGATES
from unirl.types.rollout_resp import RolloutTrack
from unirl.types.sampling import TextSamplingParams

# what a child's request is built from (`child_request`), besides a grandparent's root ids
PARENT_FIELDS = ["sample_ids", "group_ids", "prompts", "metadata", "texts"]
LINEAGE_FIELDS = ["parent_ids", "root_ids"]
# recipe keys of a composed run that a track's engine does not read
RUN_ONLY_KEYS = ("tracks", "rollout", "rewards", "data_source", "eval")


def track_recipe(plain: dict[str, Any], name: str) -> dict[str, Any]:
    """The single-track recipe an engine of composed track `name` is built from: the run's top
    level (seed, devices, threads, transport), the track's own nodes over it (model, stage,
    sampling, train, its `weight_sync`) and its `engine` as `rollout`, producing a track named
    `name`."""
    track = plain["tracks"][name]
    view = {k: v for k, v in plain.items() if k not in RUN_ONLY_KEYS}
    view.update({k: v for k, v in track.items() if k != "engine"})
    view["rollout"] = {**track["engine"], "track_name": name}
    return view


@dataclass
class Track:
    """The driver's view of one track.

    Attributes:
        name: the track's name; None for a single-track recipe's one track.
        sampling: its sampling params (built).
        trained: whether it trains (False: `trained: false`, a frozen track).
        advantage: its advantage config (None: frozen, or a supervised track's demonstrations).
        reward: its own reward service (None: scored only through its children, or not at all).
        aggregate: a parent's: how its children's rewards become its own (mean | max | min).
        engine: where it samples.
    """

    name: str | None
    sampling: Any
    trained: bool
    advantage: Any
    reward: Any
    aggregate: str | None
    engine: RolloutSettings

    @property
    def prefix(self) -> str:
        """The prefix of its metric keys: "" for a single-track run's track, else `<name>/`."""
        return "" if self.name is None else f"{self.name}/"

    def partition(self, step_partition: str) -> str:
        """Its data-plane partition within a step's."""
        return step_partition if self.name is None else track_partition(step_partition, self.name)

    @property
    def text(self) -> bool:
        return isinstance(self.sampling, TextSamplingParams)

    def score_fields(self, reward_fields: list[str]) -> list[str]:
        """What the driver fetches of the track's samples to score them and compute their
        advantages: its modality's `reward_fields`, and a critic's per-step values for GAE."""
        if (
            self.advantage is not None
            and self.advantage.estimator == "gae"
            and "segment" not in reward_fields
        ):
            return [*reward_fields, "segment.values"]
        return list(reward_fields)


@dataclass
class EngineUnit:
    """What one engine (trainside or dedicated) samples in one call: one track, or all the
    tracks of a shared backbone. `key`: the engine's name in rows and weight sync (None: the
    run's own `rollout` engine)."""

    key: str | None
    tracks: list[str | None]
    settings: RolloutSettings

    @property
    def prefix(self) -> str:
        """The prefix of its engine's metric keys: "" for the run's own engine, else `<key>/`."""
        return "" if self.key is None else f"{self.key}/"


@dataclass
class RunGraph:
    """A recipe's tracks (root first), which of them share one backbone, and its engines."""

    tracks: dict[str | None, Track]
    shared: bool
    prompt_key: str
    units: list[EngineUnit]
    keep_graph: bool

    @property
    def order(self) -> list[str | None]:
        return list(self.tracks)

    @property
    def root(self) -> str | None:
        return self.order[0]

    @property
    def leaf(self) -> str | None:
        return self.order[-1]

    @property
    def single(self) -> bool:
        """A single-track recipe's graph: one track, its own root and leaf."""
        return self.root is None

    @property
    def per_track_models(self) -> bool:
        """Each track has its own model (a composed recipe): checkpoints and exports hold a
        directory per track."""
        return not self.single and not self.shared

    @property
    def trained(self) -> list[str | None]:
        return [n for n, t in self.tracks.items() if t.trained]

    @classmethod
    def of(cls, cfg: Any) -> RunGraph:
        """The graph of a validated recipe of any kind."""
        if "tracks" not in cfg:
            engine = RolloutSettings.of(cfg)
            track = Track(
                None, build(cfg.sampling), True, build(cfg.advantage), build(cfg.reward), None, engine
            )
            return cls(
                {None: track},
                False,
                "user_prompt",
                [EngineUnit(None, [None], engine)],
                bool(cfg.rollout.get("keep_graph", False)),
            )
        order = list(cfg.rollout.tracks)
        shared = "model" in cfg
        rewards = cfg.get("rewards") or {}
        tracks = {}
        for depth, name in enumerate(order):
            node = cfg.tracks[name]
            trained = bool(node.get("trained", True))
            aggregate = None
            if depth < len(order) - 1:  # a parent; one image per plan in a shared chain: its mean
                aggregate = "mean" if shared else str(node.get("aggregate", "mean"))
            tracks[name] = Track(
                name,
                build(node.sampling),
                trained,
                build(node.advantage) if trained else None,
                build(rewards[name]) if name in rewards else None,
                aggregate,
                RolloutSettings(dedicated=False) if shared else RolloutSettings.of_node(node.get("engine")),
            )
        if shared:  # one engine for every segment; it returns a rollout whole (one call each)
            engine = RolloutSettings.of(cfg)
            units = [EngineUnit(None, order, dataclasses.replace(engine, overlap_reward=False))]
            keep = bool(cfg.rollout.get("keep_graph", False))
        else:
            units = [EngineUnit(n, [n], tracks[n].engine) for n in order]
            keep = any(bool((cfg.tracks[n].get("engine") or {}).get("keep_graph")) for n in order)
        return cls(tracks, shared, str(cfg.rollout.get("prompt_key", "user_prompt")), units, keep)

    def pool_devices(self, num_devices: int) -> int:
        """Devices the run reserves: the training devices, plus every separate engine's own."""
        return num_devices + sum(
            u.settings.num_engines
            for u in self.units
            if u.settings.dedicated and u.settings.placement == "separate"
        )


def aggregate_children(parent: RolloutTrack, child: RolloutTrack, how: str) -> torch.Tensor:
    """[Bp] fp32: for each parent sample, the `how` ("mean" | "max" | "min") of its children's
    `rewards`.

    Raises ValueError naming the ids when a child's parent is not in `parent` (naming both),
    when a parent has no child, or when the child track has no rewards or no lineage.
    """
    if how not in AGGREGATES:
        raise ValueError(f"parent reward aggregate must be one of {AGGREGATES}, got {how!r}")
    if child.rewards is None:
        raise ValueError(f"track {child.name!r} has no rewards to propagate to track {parent.name!r}")
    if child.parent_ids is None:
        raise ValueError(f"track {child.name!r} has no parent_ids: it is not a child of {parent.name!r}")
    index = {sid: i for i, sid in enumerate(parent.sample_ids)}
    rows: list[list[int]] = [[] for _ in parent.sample_ids]
    for j, pid in enumerate(child.parent_ids):
        if pid not in index:
            raise ValueError(
                f"sample {child.sample_ids[j]!r} of track {child.name!r} names parent {pid!r}, which is not in "
                f"the batch of track {parent.name!r}"
            )
        rows[index[pid]].append(j)
    empty = [parent.sample_ids[i] for i, r in enumerate(rows) if not r]
    if empty:
        raise ValueError(
            f"sample(s) {empty[:3]}{' ...' if len(empty) > 3 else ''} of track {parent.name!r} have no child "
            f"in track {child.name!r}"
        )
    rewards = child.rewards.float().cpu()
    reduce = {"mean": torch.mean, "max": torch.amax, "min": torch.amin}[how]
    return torch.stack([reduce(rewards[torch.tensor(r)]) for r in rows]).to(child.rewards.device)
