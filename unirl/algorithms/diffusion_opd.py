"""DiffusionOPD: on-policy distillation of per-source LoRA teachers into one student (Li et al.,
arXiv 2605.15055).

The student samples (the rollout); at states x_t the student itself visited, the teacher of the
sample's data source (`metadata[source_key]` of its prompt) and the student both predict, and
the student is pulled onto the teacher's prediction. No reward enters the loss: the recipe's
reward components only monitor (weight 0), evaluation scores the result.

Per row (sample b, visited step i, noise level s = sigma_i, dt = sigma_{i+1} - sigma_i) with
the guided velocities v_S (student, with the graph) and v_T (teacher, frozen), at the rollout's
CFG scale, the targets y(v):
    v     y = v
    x0    y = x_t - s v                          (the clean-latent prediction)
    xt    y = x_t + dt v                         (the ODE step's next latent, eta 0)
          y = mu(x_t, v) / std_t                 (an SDE step's mean in units of its std, eta > 0)
d = y(v_S) - y(v_T) and
    L = mean_rows mean(d^2)                      (self_normalize false)
    L = mean_rows mean(d^2) / sg(mean|d|)        (self_normalize true)
Every y is affine in v, so d = c (v_S - v_T) with c = 1, -s, dt, or c_t / std_t (the SDE
mean's velocity coefficient over the transition std): under the ODE mean(d_xt^2) = dt^2
mean(d_v^2) and mean(d_x0^2) = s^2 mean(d_v^2), and under an SDE mean(d_xt^2) is twice the
per-step Gaussian KL between the two transitions (`kl_control.step_kl`), the paper's per-step
objective. `v` and `x0` are not a transition's mean, so they need ODE rollouts (eta 0).

Visited states: with eta 0 every step's input latent (the stage stores the whole trajectory,
`stage.store_trajectory: true`); with eta > 0 the SDE steps'. `steps_per_sample` of them per
sample (drawn once per rollout, seeded by (`seed`, sample id)), or all. The teacher targets are
frozen in `prepare_segment` (one forward per teacher per micro-batch), so several updates per
rollout reuse them.

Teachers are LoRA exports of runs on the same base model (a UniRL checkpoint directory's
`pytorch_lora_weights.safetensors`, as `TrainBackend.save_weights` writes it) with the
student's LoRA layout: the same adapted modules, rank and alpha (`layout_problems`, checked
before Ray). A teacher's forward swaps its adapter weights into the student's LoRA parameters
and back (the live values return bit-exactly). One rank only: the swap does not shard.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch

from unirl.algorithms.base import StageAlgorithm
from unirl.algorithms.kl_control import transition_std, velocity_scale
from unirl.models.stage import DiffusionStage
from unirl.models.weights import swapped_weights
from unirl.types.constraints import AtLeastOne, check_fields
from unirl.types.rollout_resp import RolloutTrack
from unirl.types.segments import LatentSegment

OPD_PREFIX = "opd/"
STEPS_KEY = OPD_PREFIX + "steps"
TEACHER_V_KEY = OPD_PREFIX + "teacher_v"
Target = Literal["xt", "v", "x0"]
ODE_ONLY_TARGETS = ("v", "x0")
LORA_FILE = "pytorch_lora_weights.safetensors"
NORM_EPS = 1e-8  # floor of the self-normalising mean |d| (d = 0 gives loss 0, gradient 0)
_WRAPPER = "_checkpoint_wrapped_module."


@dataclass
class DiffusionOPDConfig:
    """DiffusionOPD settings.

    Attributes:
        teachers: data source name -> teacher directory (holding `pytorch_lora_weights.safetensors`,
            a LoRA with the student's layout); at least one.
        source_key: the prompt metadata key naming a sample's data source (prompt files:
            `{"prompt": ..., "source": "redness"}`).
        target: "xt", "v" or "x0" (module docstring); "v" and "x0" need eta 0.
        self_normalize: divide each row's mean(d^2) by stop-grad mean|d|.
        steps_per_sample: visited states trained per sample and update (null: all of them).
        seed: with the sample id, seeds the choice of visited states.
    """

    teachers: dict[str, str] = field(default_factory=dict)
    source_key: str = "source"
    target: Target = "xt"
    self_normalize: bool = False
    steps_per_sample: AtLeastOne | None = None  # null: every visited state
    seed: int = 0

    def __post_init__(self) -> None:
        self.teachers = {str(k): str(v) for k, v in dict(self.teachers).items()}
        if not self.teachers:
            raise ValueError(
                "algorithm.config.teachers must map at least one data source to a teacher LoRA directory"
            )
        check_fields(self, "algorithm.config.")
        if not self.source_key:
            raise ValueError("algorithm.config.source_key must name a prompt metadata key")


# ---- teachers: their LoRA files and layouts --------------------------------------------------


@dataclass
class LoRALayout:
    """Which modules a LoRA adapts, with what rank, and its alpha (None when unknown)."""

    ranks: dict[str, int]
    alpha: float | None


def read_teacher(path: str) -> tuple[dict[str, torch.Tensor], LoRALayout]:
    """(tensors by `<module>.lora_A|lora_B.weight`, layout) of the LoRA file in teacher
    directory `path`; the library's leading component (`transformer.`) is dropped."""
    from safetensors import safe_open

    file = os.path.join(path, LORA_FILE)
    if not os.path.isfile(file):
        raise FileNotFoundError(f"{path!r} holds no {LORA_FILE} (a UniRL LoRA export)")
    tensors, alpha = {}, None
    with safe_open(file, "pt") as f:
        meta = f.metadata() or {}
        for key in f.keys():
            tensors[key.split(".", 1)[1]] = f.get_tensor(key)
    if "lora_adapter_metadata" in meta:
        adapter = json.loads(meta["lora_adapter_metadata"])
        alpha = next((float(v) for k, v in adapter.items() if k.split(".")[-1] == "lora_alpha"), None)
    ranks = {
        k[: -len(".lora_A.weight")]: int(v.shape[0])
        for k, v in tensors.items()
        if k.endswith(".lora_A.weight")
    }
    if not ranks:
        raise ValueError(f"{file} holds no LoRA A matrices (keys like `<module>.lora_A.weight`)")
    return tensors, LoRALayout(ranks, alpha)


def student_layout(module: torch.nn.Module, targets: list[str], rank: int, alpha: float) -> LoRALayout:
    """The layout `train.lora` (`targets` name suffixes, `rank`, `alpha`) gives `module`: every
    linear layer whose name is or ends with a target (peft's matching). Works on a meta-device tree."""
    ranks = {
        name: rank
        for name, m in module.named_modules()
        if isinstance(m, torch.nn.Linear) and any(name == t or name.endswith("." + t) for t in targets)
    }
    return LoRALayout(ranks, float(alpha))


def layout_problems(source: str, path: str, teacher: LoRALayout, student: LoRALayout) -> list[str]:
    """Why teacher `source` (at `path`) cannot stand in for the student's LoRA, naming the key and
    the modules that differ; [] when the layouts match."""
    key = f"algorithm.config.teachers.{source}"
    problems = []
    only_t = sorted(set(teacher.ranks) - set(student.ranks))
    only_s = sorted(set(student.ranks) - set(teacher.ranks))
    if only_t or only_s:
        problems.append(
            f"{key}={path}: the teacher's LoRA layout differs from the student's (train.lora): modules adapted "
            f"only by the teacher {only_t[:8]}{' ...' if len(only_t) > 8 else ''}, only by the student "
            f"{only_s[:8]}{' ...' if len(only_s) > 8 else ''}; train the teacher with the same "
            "train.lora.target_modules"
        )
    ranks = sorted(
        {
            (m, teacher.ranks[m], student.ranks[m])
            for m in set(teacher.ranks) & set(student.ranks)
            if teacher.ranks[m] != student.ranks[m]
        }
    )
    if ranks:
        m, rt, rs = ranks[0]
        problems.append(
            f"{key}={path}: the teacher's LoRA rank differs from train.lora.rank={rs} on {len(ranks)} modules "
            f"(e.g. {m}: rank {rt}); train the teacher with the same rank"
        )
    if teacher.alpha is not None and student.alpha is not None and teacher.alpha != student.alpha:
        problems.append(
            f"{key}={path}: the teacher's LoRA alpha {teacher.alpha:g} differs from train.lora.alpha="
            f"{student.alpha:g}; train the teacher with the same alpha"
        )
    return problems


def _lora_params(module: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The student's trainable LoRA parameters by teacher-file name (`<module>.lora_A.weight`):
    peft's adapter segment (`.default`) and activation-checkpoint wrappers dropped."""
    out = {}
    for name, p in module.named_parameters():
        if p.requires_grad and (".lora_A." in name or ".lora_B." in name):
            out[name.replace(_WRAPPER, "").replace(".default.", ".")] = p
    return out


# ---- the loss -----------------------------------------------------------------------------


def opd_row_loss(d: torch.Tensor, self_normalize: bool) -> torch.Tensor:
    """[N] per-row loss of target differences d [N, ...]: mean(d^2), or mean(d^2) / sg(mean|d|)."""
    dims = tuple(range(1, d.dim()))
    sq = (d**2).mean(dim=dims)
    if not self_normalize:
        return sq
    return sq / d.detach().abs().mean(dim=dims).clamp_min(NORM_EPS)


def visited_steps(segment: LatentSegment) -> list[int]:
    """The steps whose input state the loss may train on: the SDE steps when the rollout was
    stochastic (eta > 0), else every step (its input latent must be stored)."""
    if segment.eta > 0:
        return list(segment.sde_indices)
    return [i for i in range(segment.num_steps) if i in segment.positions]


class DiffusionOPD(StageAlgorithm):
    """On-policy distillation from per-source LoRA teachers on a diffusion track (module docstring)."""

    modality: ClassVar[str] = "diffusion"
    supports_multi_update: ClassVar[bool] = True
    uses_reward: ClassVar[bool] = False

    def __init__(self, config: DiffusionOPDConfig) -> None:
        self.config = config
        self._teachers: dict[str, list[torch.Tensor]] | None = None
        self._params: list[torch.Tensor] | None = None

    def check_sampling(self, sampling) -> None:
        """Before Ray: `v` / `x0` targets need ODE rollouts; `steps_per_sample` fits the steps."""
        cfg = self.config
        if cfg.target in ODE_ONLY_TARGETS and sampling.eta > 0:
            raise ValueError(
                f"algorithm.config.target={cfg.target} matches predictions that are not a transition's mean, "
                f"which is the per-step KL only under ODE dynamics, but sampling.eta={sampling.eta}; set "
                "sampling.eta: 0, or algorithm.config.target: xt (the SDE step's mean)"
            )
        if cfg.steps_per_sample is not None and cfg.steps_per_sample > sampling.num_steps:
            raise ValueError(
                f"algorithm.config.steps_per_sample={cfg.steps_per_sample} exceeds sampling.num_steps="
                f"{sampling.num_steps} (the visited states per sample); lower it or set it to null"
            )

    # -- teachers
    def _load_teachers(self, stage: DiffusionStage) -> None:
        """Map every teacher's tensors onto the student's LoRA parameters (once, on their device)."""
        if self._teachers is not None:
            return
        params = _lora_params(stage.module)
        if not params:
            raise ValueError("DiffusionOPD needs a LoRA student: set train.lora in the recipe")
        names = sorted(params)
        self._params = [params[n] for n in names]
        self._teachers = {}
        for source, path in self.config.teachers.items():
            tensors, _ = read_teacher(path)
            missing = sorted({n.rsplit(".lora_", 1)[0] for n in names if n not in tensors})
            extra = sorted({n.rsplit(".lora_", 1)[0] for n in tensors if n not in params})
            if missing or extra:
                raise ValueError(
                    f"algorithm.config.teachers.{source}={path}: the teacher's LoRA layout differs from the "
                    f"student's: modules only in the student {missing[:8]}, only in the teacher {extra[:8]}"
                )
            bad = [n for n in names if tensors[n].shape != params[n].shape]
            if bad:
                raise ValueError(
                    f"algorithm.config.teachers.{source}={path}: LoRA shapes differ from the student's on {bad[:4]} "
                    f"(teacher {list(tensors[bad[0]].shape)}, student {list(params[bad[0]].shape)}): same rank needed"
                )
            self._teachers[source] = [
                tensors[n].to(device=params[n].device, dtype=params[n].dtype) for n in names
            ]

    @contextlib.contextmanager
    def teacher(self, stage: DiffusionStage, source: str) -> Iterator[None]:
        """The student's module running as the teacher of `source` for the body."""
        self._load_teachers(stage)
        if source not in self._teachers:
            raise ValueError(
                f"a sample's data source {source!r} (prompt metadata `{self.config.source_key}`) has no teacher; "
                f"algorithm.config.teachers names {sorted(self._teachers)}"
            )
        with swapped_weights(self._params, self._teachers[source]):
            yield

    # -- rows
    def draw_steps(self, track: RolloutTrack) -> torch.Tensor:
        """[B, k] visited step indices per sample (`steps_per_sample` of them, seeded by the sample
        id, without replacement; all, in order, when null)."""
        steps = visited_steps(track.segment)
        if not steps:
            raise ValueError(
                "DiffusionOPD found no visited state to train on: with sampling.eta 0 set "
                "stage.store_trajectory: true (every step's input latent is kept)"
            )
        k = self.config.steps_per_sample
        if k is None:
            return torch.tensor([steps] * len(track), dtype=torch.long)
        if k > len(steps):
            raise ValueError(
                f"algorithm.config.steps_per_sample={k} exceeds the {len(steps)} visited states per sample"
            )
        rows = []
        for sid in track.sample_ids:
            gen = torch.Generator().manual_seed(zlib.crc32(f"{self.config.seed}:{sid}".encode()))
            rows.append(torch.tensor(steps)[torch.randperm(len(steps), generator=gen)[:k]].sort().values)
        return torch.stack(rows)

    def rows(self, track: RolloutTrack, steps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """(x [B k, ...] the visited states, sigma [B k], cond repeated) for `steps` [B, k]."""
        seg = track.segment
        k = steps.shape[1]
        pos = torch.tensor([[seg.positions.index(int(i)) for i in row] for row in steps])
        x = torch.stack([seg.latents[b, pos[b]] for b in range(len(track))]).flatten(0, 1).float()
        sigma = seg.sigmas[steps.to(seg.sigmas.device)].reshape(-1).float()
        cond = {
            key: v.repeat_interleave(k, dim=0)
            for key, v in track.conditions.items()
            if not key.startswith(OPD_PREFIX)
        }
        return x, sigma, cond

    def coefficient(self, stage: DiffusionStage, segment: LatentSegment, steps: torch.Tensor) -> torch.Tensor:
        """[B k] c of d = c (v_S - v_T) for the target (module docstring)."""
        sig = segment.sigmas.float()
        flat = steps.reshape(-1).to(sig.device)
        if self.config.target == "v":
            return torch.ones_like(sig[flat])
        if self.config.target == "x0":
            return -sig[flat]
        if segment.eta == 0:
            return sig[flat + 1] - sig[flat]
        uniq = sorted(set(flat.tolist()))
        scale = velocity_scale(stage, segment, uniq) / transition_std(stage, segment, uniq)
        lookup = {i: scale[j] for j, i in enumerate(uniq)}
        return torch.stack([lookup[int(i)] for i in flat])

    @torch.no_grad()
    def prepare_segment(self, stage: DiffusionStage, track: RolloutTrack) -> RolloutTrack:
        """Choose the visited states and freeze each row's teacher velocity (one forward per
        teacher present in the micro-batch)."""
        steps = self.draw_steps(track)
        x, sigma, cond = self.rows(track, steps)
        k = steps.shape[1]
        sources = [str(m.get(self.config.source_key)) if m else "None" for m in track.metadata]
        if len(sources) != len(track):
            raise ValueError(f"track {track.name!r} carries no prompt metadata: its data sources are unknown")
        v_t = torch.empty_like(x)
        for source in dict.fromkeys(sources):
            idx = torch.tensor([b * k + j for b, s in enumerate(sources) if s == source for j in range(k)])
            sub = {key: v[idx.to(v.device)] for key, v in cond.items()}
            with self.teacher(stage, source):
                v_t[idx.to(x.device)] = stage.velocity(
                    x[idx.to(x.device)], sigma[idx.to(sigma.device)], sub, track.segment.guidance_scale
                )
        conditions = {
            **track.conditions,
            STEPS_KEY: steps,
            TEACHER_V_KEY: v_t.view(len(track), k, *x.shape[1:]),
        }
        return _with_conditions(track, conditions)

    def compute_loss_and_backward(
        self, stage: DiffusionStage, track: RolloutTrack, ctx: dict[str, Any]
    ) -> dict[str, float]:
        """ctx: `loss_scale`. Needs `prepare_segment` on `track`."""
        if TEACHER_V_KEY not in track.conditions:
            raise ValueError(f"track {track.name!r} was not prepared: call prepare_segment before the loss")
        steps = track.conditions[STEPS_KEY]
        x, sigma, cond = self.rows(track, steps)
        v_t = track.conditions[TEACHER_V_KEY].flatten(0, 1)
        v_s = stage.velocity(x, sigma, cond, track.segment.guidance_scale)
        c = self.coefficient(stage, track.segment, steps).to(v_s.device)
        d = c.view(-1, *([1] * (v_s.dim() - 1))) * (v_s - v_t)
        rows = opd_row_loss(d, self.config.self_normalize)
        loss = rows.mean()
        (loss * ctx["loss_scale"]).backward()
        dv = (v_s.detach() - v_t) ** 2
        return {
            "loss": float(loss.detach()),
            "opd/target_mse": float((d.detach() ** 2).mean()),
            "opd/velocity_mse": float(dv.mean()),
            "opd/sigma_mean": float(sigma.mean()),
        }


def _with_conditions(track: RolloutTrack, conditions: dict[str, torch.Tensor]) -> RolloutTrack:
    return dataclasses.replace(track, conditions=conditions)
