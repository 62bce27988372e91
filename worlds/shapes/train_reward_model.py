"""Train the learned shapes reward (`worlds.shapes.reward_model`): one Hydra recipe, resumable.

    python -m worlds.shapes.train_reward_model --config-name=shapes_reward_model [key=value ...]

The recipe (`worlds/shapes/recipes/shapes_reward_model.yaml`) sets every field of `RewardModelRun`; it is
validated before any work (every problem named by its key, exit 2).

1. Data (cached under `work`, chunk by chunk, so a stopped run resumes where it was):
   `synth` renders and perturbed renders of training scenes (`worlds.shapes.reward_data`, each
   paired with its own, a near-miss or a random training prompt); `base_train` samples of the
   committed base (`base`) on training prompts (ODE, CFG 3, 10 or 20 steps alternately), each
   also paired with a near-miss prompt; and two held-out sets never trained on: `base_heldout`
   base samples of training prompts from other seeds, and base samples of the held-out (eval)
   prompts. Every (image, prompt) pair gets `GenEvalMini`'s verdicts (for the agreement).
2. Training: the detector (`SceneNet`) learns `GenEvalMini`'s detections of the images (cell
   classes and centre heat, `reward_data.targets`; prompts are not used), AdamW with a cosine
   learning rate, `steps` steps of `batch` images drawn with a generator seeded by (seed,
   step), small Gaussian input noise; the state is saved every `save_every` steps and a rerun
   continues from it.
3. Export to `out`: `model.safetensors`, `config.json` (widths, classes, data sizes, seed,
   wall clock), `agreement.json` (the model's verdicts vs the scorer's on both held-out sets and
   the training pool: accuracy per verdict, AUC of the differentiable score for strict, strict
   accuracy per category, exact object counts) and `heldout.npz` (the held-out images and
   prompts, for the pinned test).

Prints the agreement as JSON.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import hydra
import numpy as np
import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from unirl.types import PromptExample  # noqa: E402
from unirl.types.constraints import AtLeastOne, Positive, check_fields  # noqa: E402
from worlds.shapes import CATEGORIES, ShapesDataset, parse_prompt  # noqa: E402
from worlds.shapes.reward_data import detection_labels, label, pair_prompts, synth_batch, targets  # noqa: E402
from worlds.shapes.reward_model import (  # noqa: E402
    CLASSES,
    HEADS,
    HEAT_MAX,
    SceneNet,
    SceneNetConfig,
    predicted_detections,
    save_scene_net,
    scene_score,
)
from worlds.shapes.scorer import score_scene  # noqa: E402

SYNTH_CHUNK = 2000


def _chunk(path: str, make) -> dict[str, np.ndarray]:
    """Load the cached chunk at `path`, or make it (a dict of arrays) and save it."""
    if os.path.isfile(path):
        with np.load(path) as z:
            return dict(z)
    data = make()
    tmp = path + ".tmp.npz"
    np.savez_compressed(tmp, **data)
    os.replace(tmp, path)
    return data


def _labelled(images: np.ndarray, prompts: list[str]) -> dict[str, np.ndarray]:
    targets, mask = label(images, prompts)
    return {"images": images, "prompts": np.array(prompts), "targets": targets, "mask": mask}


def _base_prompts(n: int, rng: np.random.Generator, ds: ShapesDataset) -> list[PromptExample]:
    """n prompts of `ds`, category uniform then prompt uniform (as `sample_batch`)."""
    cats = sorted({e.metadata["category"] for e in ds.examples})
    by_cat = {c: [e for e in ds.examples if e.metadata["category"] == c] for c in cats}
    return [by_cat[c][int(rng.integers(len(by_cat[c])))] for c in rng.choice(cats, n)]


BASE_MODEL = "unirl.models.sd3.SD3ModelConfig"
"""The model config (`_target_`) of the committed shapes base (`base`)."""


class BaseSampler:
    """Deterministic ODE samples of the committed base (built on first use), a model directory
    of the family `BASE_MODEL` names."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.stage = None

    def __call__(self, examples: list[PromptExample], steps: int, seed: int) -> np.ndarray:
        from unirl.models.flow import FlowMatchingStage
        from unirl.trainer.evaluation import EvalSampling, sample_eval_images
        from unirl.trainer.worker import build, quiet_library_logs
        from unirl.types import DiffusionSamplingParams

        if self.stage is None:
            quiet_library_logs()
            model = build({"_target_": BASE_MODEL, "pretrained_path": self.path, "tiny": None})
            self.stage = FlowMatchingStage(model.build())
        sp = DiffusionSamplingParams(height=32, width=32, shift=1.0, max_sequence_length=12, eta=0.0)
        ev = EvalSampling(num_steps=steps, guidance_scale=3.0, samples_per_prompt=1, seed=seed)
        with torch.no_grad():
            images, _ = sample_eval_images(self.stage, examples, sp, ev)
        return images.permute(0, 2, 3, 1).numpy()


def build_data(args) -> tuple[dict[str, np.ndarray], dict[str, dict[str, np.ndarray]]]:
    """(training pool, {"heldout_train": ..., "heldout_eval": ...}); chunks cached in args.work."""
    os.makedirs(args.work, exist_ok=True)
    train_ds, eval_ds = ShapesDataset("train", 0), ShapesDataset("eval", 0)
    train_prompts = [e.prompt for e in train_ds.examples]
    sampler = BaseSampler(args.base)
    parts = []
    for k in range(-(-args.synth // SYNTH_CHUNK)):
        n = min(SYNTH_CHUNK, args.synth - k * SYNTH_CHUNK)
        rng = np.random.default_rng([args.seed, 1, k])
        parts.append(
            _chunk(
                os.path.join(args.work, f"synth_{k:03d}_n{n}.npz"),
                lambda n=n, rng=rng: _labelled(*synth_batch(n, rng)),
            )
        )
    c = args.chunk
    for k in range(args.base_train // c):
        rng = np.random.default_rng([args.seed, 2, k])

        def make_pair(k=k, rng=rng):
            ex = _base_prompts(c, rng, train_ds)
            images = sampler(ex, 10 if k % 2 == 0 else 20, 10_000 + k)
            own = [e.prompt for e in ex]
            miss = pair_prompts(own, rng, train_prompts, p_near=1.0, p_random=0.0)
            return _labelled(np.concatenate([images, images]), own + miss)

        parts.append(_chunk(os.path.join(args.work, f"base_c{c}_{k:03d}.npz"), make_pair))
    heldout = {}
    chunks = []
    for k in range(args.base_heldout // c):
        rng = np.random.default_rng([args.seed, 3, k])

        def make_held(k=k, rng=rng):
            ex = _base_prompts(c, rng, train_ds)
            return _labelled(sampler(ex, 10 if k % 2 == 0 else 20, 20_000 + k), [e.prompt for e in ex])

        chunks.append(_chunk(os.path.join(args.work, f"heldout_train_c{c}_{k:03d}.npz"), make_held))
    heldout["heldout_train"] = {key: np.concatenate([part[key] for part in chunks]) for key in chunks[0]}
    ex = [e for e in eval_ds.examples[: args.eval_prompts] for _ in range(args.eval_seeds)]
    heldout["heldout_eval"] = _chunk(
        os.path.join(args.work, f"heldout_eval_p{args.eval_prompts}_s{args.eval_seeds}.npz"),
        lambda: _labelled(sampler(ex, 20, 30_000), [e.prompt for e in ex]),
    )
    pool = {key: np.concatenate([p[key] for p in parts]) for key in parts[0]}
    return pool, heldout


def images_of(data: dict[str, np.ndarray]) -> torch.Tensor:
    """[n, 3, 32, 32] fp32 images in [0, 1]."""
    return torch.from_numpy(data["images"]).permute(0, 3, 1, 2).float() / 255.0


def auc(scores: np.ndarray, labels: np.ndarray) -> float | None:
    """Area under the ROC curve (ties count half); None when one class is absent."""
    pos, neg = scores[labels > 0.5], scores[labels <= 0.5]
    if len(pos) == 0 or len(neg) == 0:
        return None
    greater = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    return float(greater / (len(pos) * len(neg)))


@torch.no_grad()
def agreement(net: SceneNet, data: dict[str, np.ndarray]) -> dict[str, float]:
    """The model's verdicts (`score_scene` of its predicted detections) against the weight-free
    scorer's labels: accuracy of each verdict where it applies, with the label base rate; the AUC
    of the differentiable score for the strict verdict; strict accuracy per category; and how
    often the predicted object counts equal the scorer's detections exactly."""
    images = images_of(data)
    prompts = [str(p) for p in data["prompts"]]
    heat = torch.cat([net(images[i : i + 256])[1] for i in range(0, len(images), 256)])
    specs = [parse_prompt(p) for p in prompts]
    verdicts = [score_scene(s, d) for s, d in zip(specs, predicted_detections(heat), strict=True)]
    scores = scene_score(heat, specs).numpy()
    targets, mask = data["targets"], data["mask"]
    out: dict[str, float] = {"n": len(prompts)}
    for j, head in enumerate(HEADS):
        m = mask[:, j] > 0
        if not m.any():
            continue
        pred = np.array([float(v[head]) for v, keep in zip(verdicts, m, strict=True) if keep])
        out[f"{head}/accuracy"] = float((pred == targets[m, j]).mean())
        out[f"{head}/positive_rate"] = float(targets[m, j].mean())
        out[f"{head}/n"] = int(m.sum())
    out["strict/auc"] = auc(scores, targets[:, 0])
    cats = np.array([s.category for s in specs])
    strict_pred = np.array([v["strict"] for v in verdicts])
    for cat in CATEGORIES:
        m = cats == cat
        if m.any():
            out[f"strict_accuracy/{cat}"] = float((strict_pred[m] == targets[m, 0]).mean())
    _, objects = detection_labels(data["images"])
    true_counts = np.zeros((len(prompts), len(CLASSES)))
    for n, row in enumerate(objects):
        for k in row[row[:, 0] >= 0, 0].astype(int):
            true_counts[n, k] += 1
    pred_counts = torch.round(heat.sum(dim=(2, 3))).clamp(min=0).numpy()
    out["counts_exact"] = float((pred_counts == true_counts).all(axis=1).mean())
    return out


def train(args, pool: dict[str, np.ndarray]) -> tuple[SceneNet, float, bool]:
    """Train (or resume) the detector on `pool`'s images; returns it, the seconds spent training
    in this call and whether it reached `args.steps` (False: `args.max_seconds` stopped it after
    saving the train state, and the next call resumes from there). Loss per batch: cross-entropy of the cell classes, binary
    cross-entropy of the centre heat (as a fraction of `HEAT_MAX`, clipped at 1 where two
    objects' centres overlap; weighted 30) and the squared error of each class's total heat
    (its object count)."""
    images = images_of(pool)
    classes, objects = (torch.from_numpy(a) for a in detection_labels(pool["images"]))
    torch.manual_seed(args.seed)
    net = SceneNet(SceneNetConfig())
    opt = torch.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=1e-4)
    state_path = os.path.join(args.work, "train_state.pt")
    step = 0
    if os.path.isfile(state_path):
        state = torch.load(state_path)
        net.load_state_dict(state["net"])
        opt.load_state_dict(state["opt"])
        step = state["step"]
        print(f"resuming reward-model training at step {step}", file=sys.stderr)
    t0 = time.perf_counter()
    net.train()
    while step < args.steps:
        gen = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
        idx = torch.randint(0, len(images), (args.batch,), generator=gen)
        x = images[idx] + torch.rand(args.batch, 1, 1, 1, generator=gen) * 0.04 * torch.randn(
            images[idx].shape, generator=gen
        )
        cells, heat_target = targets(classes[idx], objects[idx])
        logits, heat = net(x.clamp(0, 1))
        loss = (
            -(cells * F.log_softmax(logits, dim=1)).sum(dim=1).mean()
            + 30 * F.binary_cross_entropy(heat / HEAT_MAX, (heat_target / HEAT_MAX).clamp(max=1.0))
            + ((heat.sum(dim=(2, 3)) - heat_target.sum(dim=(2, 3))) ** 2).mean()
        )
        opt.zero_grad()
        loss.backward()
        for group in opt.param_groups:  # cosine decay to 0 over args.steps, a function of the step
            group["lr"] = float(args.lr * 0.5 * (1 + np.cos(np.pi * step / args.steps)))
        opt.step()
        step += 1
        if step % 100 == 0:
            print(f"step {step} loss {loss.item():.4f}", file=sys.stderr)
        out_of_time = args.max_seconds is not None and time.perf_counter() - t0 >= args.max_seconds
        if step % args.save_every == 0 or step == args.steps or out_of_time:
            torch.save({"net": net.state_dict(), "opt": opt.state_dict(), "step": step}, state_path + ".tmp")
            os.replace(state_path + ".tmp", state_path)
        if out_of_time and step < args.steps:
            return net.eval(), time.perf_counter() - t0, False
    return net.eval(), time.perf_counter() - t0, True


@dataclass(kw_only=True)
class RewardModelRun:
    """The recipe of one reward-model training (`worlds/shapes/recipes/shapes_reward_model.yaml`).

    Attributes:
        out: directory for the trained model.
        work: cache of data chunks and the train state (a rerun resumes from it).
        base: the pretrained shapes model whose samples join the data.
        synth: rendered / perturbed (image, prompt) pairs.
        base_train: base samples to train on (each also with a near-miss prompt); a multiple of `chunk`.
        base_heldout: held-out base samples of training prompts; a multiple of `chunk`.
        eval_prompts: held-out (eval) prompts sampled, in order.
        eval_seeds: held-out base samples per eval prompt.
        chunk: base samples per cached chunk.
        steps, batch, lr, save_every, seed: the training (AdamW, cosine learning rate).
        max_seconds: bounds this invocation's training wall clock (checked after each step); when
            it stops the run, the train state is saved, nothing is exported, and the next run of
            the same recipe resumes where it stopped (null: no bound).
        threads: torch threads.
        hydra: Hydra's own settings.
    """

    out: str
    work: str = "outputs/shapes_reward_work"
    base: str = "checkpoints/shapes_sd3"
    synth: AtLeastOne = 24_000
    base_train: AtLeastOne = 640
    base_heldout: AtLeastOne = 256
    eval_prompts: AtLeastOne = 51
    eval_seeds: AtLeastOne = 4
    chunk: AtLeastOne = 64
    steps: AtLeastOne = 3000
    batch: AtLeastOne = 64
    lr: Positive = 2e-3
    save_every: AtLeastOne = 200
    max_seconds: Positive | None = None
    seed: int = 0
    threads: AtLeastOne = 1
    hydra: Any = None

    def __post_init__(self) -> None:
        check_fields(self)
        for key in ("base_train", "base_heldout"):
            if getattr(self, key) % self.chunk:
                raise ValueError(f"{key}={getattr(self, key)} must be a multiple of chunk={self.chunk}")
        if not os.path.isdir(self.base):
            raise ValueError(f"base={self.base!r} is not a directory (the pretrained shapes model)")


def validated(cfg: DictConfig) -> RewardModelRun:
    """The recipe as a `RewardModelRun`, or `ConfigError` listing every problem, named by its key."""
    from unirl.config.schema import check_node
    from unirl.config.tree import ConfigError

    try:
        plain = OmegaConf.to_container(cfg, resolve=True)
    except Exception as exc:  # noqa: BLE001 - an interpolation that does not resolve stops everything
        raise ConfigError([f"the recipe does not resolve: {type(exc).__name__}: {exc}"]) from exc
    run, problems = check_node("", RewardModelRun, plain)
    if problems:
        raise ConfigError(problems)
    return run


def run(cfg: DictConfig) -> int:
    """Validate the recipe (exit 2 listing every problem), then make the data, train, export and
    print the agreement; 0 when done."""
    from unirl.config.tree import ConfigError

    try:
        args = validated(cfg)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from exc
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    pool, heldout = build_data(args)
    t_data = time.perf_counter() - t0
    net, t_train, finished = train(args, pool)
    if not finished:
        step = torch.load(os.path.join(args.work, "train_state.pt"))["step"]
        print(
            f"stopped at step {step} of {args.steps} after max_seconds={args.max_seconds}; the train state is in "
            f"{args.work}: run the same recipe again to resume",
            file=sys.stderr,
        )
        return 0
    result = {name: agreement(net, data) for name, data in heldout.items()}
    result["train_pool"] = agreement(net, pool)
    extra = {
        "seed": args.seed,
        "data": {"synth": args.synth, "base_train": 2 * args.base_train, "pool": int(len(pool["prompts"]))},
        "heldout": {name: int(len(d["prompts"])) for name, d in heldout.items()},
        "steps": args.steps,
        "batch": args.batch,
        "lr": args.lr,
        "threads": args.threads,
        "seconds": {"data_this_call": round(t_data, 1), "train_this_call": round(t_train, 1)},
    }
    save_scene_net(net, args.out, extra)
    with open(os.path.join(args.out, "agreement.json"), "w") as f:
        json.dump(result, f, indent=2)
    np.savez_compressed(
        os.path.join(args.out, "heldout.npz"),
        **{f"{name}_{key}": heldout[name][key] for name in heldout for key in ("images", "prompts")},
    )
    print(json.dumps(result, indent=2))
    return 0


@hydra.main(config_path="recipes", config_name=None, version_base=None)
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
