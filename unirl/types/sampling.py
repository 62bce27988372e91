"""Sampling parameters of a diffusion stage and the choice of SDE steps.

`DiffusionSamplingParams` travels on every `RolloutReq`. It is pure data: the
sigma schedule itself is computed by `unirl.sde.schedules` and pinned onto the
request, so every engine and the train-side replay read the same fp32 sigmas.
"""

from __future__ import annotations

import math
import random
import typing
from dataclasses import dataclass, field
from typing import Annotated, Literal

from annotated_types import Ge, Interval, doc

from unirl.types.constraints import AtLeastOne, NonNegative, OpenUnit, Positive, check_fields

SdeScheduler = Literal["all", "fixed", "random", "sliding"]
WindowOrder = Literal["progressive", "random"]
OdeSolver = Literal["euler", "dpmpp_2m"]  # implemented in unirl.sde.solvers
MuRule = Literal["linear", "empirical"]  # implemented in unirl.sde.schedules.sigmas_for
SigmaGrid = Literal["scheduler", "steps"]  # implemented in unirl.sde.schedules.sigmas_for
ODE_SOLVERS = typing.get_args(OdeSolver)
Guidance = Annotated[float, Ge(1), doc("1 disables CFG")]
Temperature = Annotated[float, Ge(0), doc("0: greedy")]
TopP = Annotated[float, Interval(gt=0, le=1)]
TopK = Annotated[int, Ge(0), doc("0: off")]


@dataclass
class DiffusionSamplingParams:
    """How one diffusion rollout samples.

    Attributes:
        num_steps: denoising steps T; the sigma schedule has T+1 entries.
        samples_per_prompt: group size; siblings of a prompt share a group id.
        height, width: output size in pixels.
        guidance_scale: classifier-free guidance; 1.0 disables the uncond branch.
        eta: SDE noise level on SDE steps; eta=0 makes every step an Euler step.
        shift: static sigma shift (SD3 uses 3.0). Ignored when `dynamic_shift`.
        dynamic_shift: compute the shift from the image sequence length (mu), as
            SD3.5 at high resolution and FLUX do.
        base_seq_len, max_seq_len, base_shift, max_shift: the (seq_len, mu)
            line of the dynamic shift.
        mu_rule: how the dynamic shift's mu follows the token count: "linear", the line above
            (SD3.5, FLUX.1, Qwen-Image), or "empirical", FLUX.2's rule, which also reads the
            step count (`unirl.sde.schedules.empirical_mu`; the line keys are then unused).
        sigma_grid: the unshifted grid the shift is applied to: "scheduler", the grid of
            the scheduler's own `set_timesteps(T)` (StableDiffusion3Pipeline), or "steps",
            `linspace(1, 1/T, T)` (the grid FluxPipeline and QwenImagePipeline pass it).
        shift_terminal: stretch the shifted "steps" grid so its last sigma before the final 0
            is this value (the scheduler's `shift_terminal`: Qwen-Image's 0.02); None: no stretch.
        max_sequence_length: T5 token budget of the prompt encoder.
        sde_scheduler: which steps are SDE steps (stochastic, with a log-prob):
            "all", "fixed" (the list `sde_steps`), "random" (`sde_num_steps`
            steps drawn within the fraction window `sde_window`, seeded by the
            rollout id so replay and every rank agree), or "sliding"
            (MixGRPO: `sde_num_steps` consecutive steps whose start moves
            through `sde_window` with the rollout id; see `window_start`).
        sde_steps: step indices for "fixed".
        sde_num_steps: k for "random"; the window size for "sliding".
        sde_window: (lo, hi) fractions of T that bound the "random" draw and
            the range the "sliding" window moves through.
        sde_stride: "sliding": steps between consecutive window positions.
        sde_iters_per_window: "sliding": consecutive rollouts at one position
            (MixGRPO's iters_per_group).
        sde_window_order: "sliding": "progressive" (positions in order, from
            the noisiest) or "random" (a position drawn from (seed, window
            index) every `sde_iters_per_window` rollouts).
        sde_window_roll_back: "progressive": after the last position start
            again from the first (else stay at the last).
        ode_solver: how the non-SDE steps are integrated: "euler", or
            "dpmpp_2m" (DPM-Solver++(2M), second order, MixGRPO-Flash). SDE
            steps always take the stage's SDE step.
        noise_all_steps: every step draws SDE noise, also the steps outside
            `sde_indices`, which record no log-prob and are not trained
            (DanceGRPO samples the whole chain stochastically and trains on a
            random subset of its steps). Needs `ode_solver: euler` (no ODE step is left).
        seed: base seed; rollout noise derives from (seed, rollout_id, sample).
        same_initial_noise: siblings of a group start from one x_T (their first
            sample's); each keeps its own SDE-step noise. The group then differs
            only by the noise the SDE log-probs credit (DanceGRPO; Flow-GRPO's
            `same_latent`). Evaluation always draws one x_T per sample.
    """

    num_steps: AtLeastOne = 10
    samples_per_prompt: AtLeastOne = 4
    height: AtLeastOne = 32
    width: AtLeastOne = 32
    guidance_scale: Guidance = 4.5
    eta: NonNegative = 0.7
    shift: Positive = 3.0
    dynamic_shift: bool = False
    base_seq_len: AtLeastOne = 256
    max_seq_len: int = 4096
    base_shift: float = 0.5
    max_shift: float = 1.15
    mu_rule: MuRule = "linear"
    sigma_grid: SigmaGrid = "scheduler"
    shift_terminal: OpenUnit | None = None
    max_sequence_length: AtLeastOne = 77
    sde_scheduler: SdeScheduler = "all"
    sde_steps: list[int] = field(default_factory=list)
    sde_num_steps: int = 1
    sde_window: tuple[float, float] = (0.0, 0.99)
    sde_stride: AtLeastOne = 1
    sde_iters_per_window: AtLeastOne = 1
    sde_window_order: WindowOrder = "progressive"
    sde_window_roll_back: bool = True
    ode_solver: OdeSolver = "euler"
    noise_all_steps: bool = False
    seed: int = 0
    same_initial_noise: bool = False

    def __post_init__(self) -> None:
        self.sde_window = tuple(self.sde_window)
        self.sde_steps = list(self.sde_steps)
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the offending `sampling.*` key: the ranges the fields' types
        declare, then the rules across fields."""
        check_fields(self, "sampling.")
        if self.max_seq_len <= self.base_seq_len:
            raise ValueError(
                f"sampling.max_seq_len ({self.max_seq_len}) must be > sampling.base_seq_len ({self.base_seq_len})"
            )
        if self.max_shift < self.base_shift:
            raise ValueError(
                f"sampling.max_shift ({self.max_shift}) must be >= sampling.base_shift ({self.base_shift}): "
                "the dynamic shift grows with the image's token count"
            )
        if self.sde_scheduler == "fixed":
            bad = [i for i in self.sde_steps if not 0 <= i < self.num_steps]
            if not self.sde_steps or bad:
                raise ValueError(
                    f"sampling.sde_steps must be a non-empty list of step indices in [0, {self.num_steps}) "
                    f"for sde_scheduler=fixed, got {self.sde_steps}"
                )
        if self.sde_scheduler in ("random", "sliding"):
            lo, hi = self.window_bounds()
            if not 1 <= self.sde_num_steps <= hi - lo:
                what = "the window size" if self.sde_scheduler == "sliding" else "the number of SDE steps"
                raise ValueError(
                    f"sampling.sde_num_steps={self.sde_num_steps} ({what} of sde_scheduler={self.sde_scheduler}) "
                    f"must be in [1, {hi - lo}]: the window sampling.sde_window={list(self.sde_window)} covers "
                    f"steps [{lo}, {hi}) of {self.num_steps}"
                )
        if self.shift_terminal is not None and self.sigma_grid != "steps":
            raise ValueError(
                f"sampling.shift_terminal={self.shift_terminal} stretches the 'steps' grid; set "
                f"sampling.sigma_grid: steps (got {self.sigma_grid!r}) or shift_terminal: null"
            )
        if self.mu_rule != "linear" and not self.dynamic_shift:
            raise ValueError(
                f"sampling.mu_rule={self.mu_rule!r} picks the dynamic shift's mu, but "
                "sampling.dynamic_shift is false (a static shift reads no mu); set dynamic_shift: true "
                "or mu_rule: linear"
            )
        if self.noise_all_steps and self.ode_solver != "euler":
            raise ValueError(
                f"sampling.noise_all_steps=true makes every step stochastic, leaving no ODE step for "
                f"sampling.ode_solver={self.ode_solver!r}; set ode_solver: euler or noise_all_steps: false"
            )

    def window_bounds(self) -> tuple[int, int]:
        """Step range [lo, hi) covered by `sde_window` fractions of `num_steps`."""
        lo_f, hi_f = self.sde_window
        if not 0.0 <= lo_f < hi_f <= 1.0:
            raise ValueError(
                f"sampling.sde_window must satisfy 0 <= lo < hi <= 1, got {list(self.sde_window)}"
            )
        # floor with a tolerance: 0.29 * 100 is 28.999999999999996 in floats
        lo = math.floor(lo_f * self.num_steps + 1e-9)
        hi = max(lo + 1, math.floor(hi_f * self.num_steps + 1e-9))
        return lo, hi

    def resolve_sde_indices(self, rollout_id: int) -> list[int]:
        """Sorted step indices that run as SDE steps for this rollout.

        Deterministic in (`sde_scheduler`, `seed`, `rollout_id`), so the
        rollout, every data-parallel rank and the train-side replay agree.
        With eta=0 there are no SDE steps at all.
        """
        if self.eta == 0:
            return []
        if self.sde_scheduler == "all":
            return list(range(self.num_steps))
        if self.sde_scheduler == "fixed":
            return sorted(set(self.sde_steps))
        if self.sde_scheduler == "sliding":
            start = self.window_start(rollout_id)
            return list(range(start, start + self.sde_num_steps))
        lo, hi = self.window_bounds()
        rng = random.Random(self.seed * 1_000_003 + rollout_id)
        return sorted(rng.sample(range(lo, hi), self.sde_num_steps))

    def window_starts(self) -> list[int]:
        """The first step of each position of the "sliding" window: `lo, lo + stride, ...`,
        every window of `sde_num_steps` steps inside `sde_window`'s steps [lo, hi)."""
        lo, hi = self.window_bounds()
        return list(range(lo, hi - self.sde_num_steps + 1, self.sde_stride))

    def window_start(self, rollout_id: int) -> int:
        """The "sliding" window's first step for this rollout, a function of
        (rollout_id, seed) only (the trainer's rollout id is the training step,
        so a resumed run slides the same way).

        With w = rollout_id // sde_iters_per_window and n positions: progressive
        takes position w % n (roll back) or min(w, n - 1); random takes a
        position drawn from (seed, w).
        """
        starts = self.window_starts()
        w = rollout_id // self.sde_iters_per_window
        if self.sde_window_order == "random":
            return starts[random.Random(f"sde-window:{self.seed}:{w}").randrange(len(starts))]
        return starts[w % len(starts) if self.sde_window_roll_back else min(w, len(starts) - 1)]

    def possible_sde_steps(self) -> list[int]:
        """Every step that some rollout may take as an SDE step (eta > 0)."""
        if self.sde_scheduler == "all":
            return list(range(self.num_steps))
        if self.sde_scheduler == "fixed":
            return sorted(set(self.sde_steps))
        lo, hi = self.window_bounds()
        return list(range(lo, hi))

    @property
    def do_cfg(self) -> bool:
        return self.guidance_scale > 1.0


class _TokenTemperature:
    """What a token sampler reads of its `temperature` (0: greedy)."""

    temperature: float

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def logit_temperature(self) -> float:
        """The divisor of the logits (an image-token rollout's guided logits) in sampling and
        replay (1 when greedy)."""
        return self.temperature or 1.0


@dataclass
class TextSamplingParams(_TokenTemperature):
    """How one autoregressive rollout samples.

    Attributes:
        samples_per_prompt: group size; siblings of a prompt share a group id.
        max_new_tokens: response budget; a response that reaches it without a
            stop token is truncated there (DAPO's overlong shaping reads this).
        temperature: logits are divided by it before sampling; replay computes
            `log_softmax(logits / temperature)` so old and new log-probs share
            one geometry. 0 means greedy (argmax; log-probs at temperature 1).
        top_p: nucleus sampling mass (1.0 disables).
        top_k: keep the k most likely tokens (0 disables).
        stop_tokens: token strings that end a response (the tokenizer's EOS
            always does); each must be one token of the tokenizer.
        max_prompt_length: longest prompt in tokens (chat template applied); a
            longer prompt is an error naming the sample, never truncated.
        seed: base seed; a sample's draws derive from (seed, rollout_id, sample),
            so its tokens do not depend on how the batch is split.
        chat_template: apply the tokenizer's chat template to the prompt (as a
            single user turn, with the generation prompt) before tokenizing.
    """

    samples_per_prompt: AtLeastOne = 4
    max_new_tokens: AtLeastOne = 16
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = 0
    stop_tokens: list[str] = field(default_factory=list)
    max_prompt_length: AtLeastOne = 64
    seed: int = 0
    chat_template: bool = True

    def __post_init__(self) -> None:
        self.stop_tokens = list(self.stop_tokens)
        check_fields(self, "sampling.")


@dataclass
class ImageTokenSamplingParams(_TokenTemperature):
    """How an autoregressive image-token rollout samples (a unified model's `image` track).

    Attributes:
        samples_per_prompt: images per context; 1 in a unified run (each plan is drawn once,
            so the prompt's group is its plans' group).
        temperature: guided logits are divided by it before sampling; the recorded and
            replayed log-prob is `log_softmax(guided / temperature)`. 0 means greedy (argmax;
            log-probs at temperature 1).
        top_k, top_p: restrict the choice as for text (0 / 1.0 disable); the recorded
            log-prob stays the full softmax's.
        guidance_scale: classifier-free guidance s as Janus does it: guided = u + s (c - u) of
            the conditional (prompt + plan) and unconditional (padded context) logits; 1 runs
            the conditional rows only.
        seed: base seed; a sample's draws derive from its id, not its batch.
    """

    samples_per_prompt: AtLeastOne = 1
    temperature: Temperature = 1.0
    top_k: TopK = 0
    top_p: TopP = 1.0
    guidance_scale: Guidance = 5.0
    seed: int = 0

    def __post_init__(self) -> None:
        check_fields(self, "sampling.")
