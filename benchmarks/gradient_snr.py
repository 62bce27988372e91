"""Signal-to-noise ratio of a recipe's policy gradient: how alike are two independent estimates?

Builds the recipe's worker in this process (its model, stage, LoRA backend,
algorithm, train stack and rollout engine, exactly as a run does, with the inband data
plane and no Ray), fixes one batch of `prompts_per_rollout` training prompts,
and `--repeats` times: samples a fresh rollout of them (new seeds), scores it
with the recipe's reward, computes the recipe's advantages and the
algorithm's loss gradient on the trainable weights, without an optimizer step.
The weights never change, so every estimate has the same expectation g.

For two independent estimates of g from N samples each, E[cos] ~= |g|^2 /
(|g|^2 + tr(Sigma)/N): the mean pairwise cosine is the fraction of an update
that is signal, and N / mean_cos is about the number of samples an update
needs for a cosine of 0.5 with the true gradient.

    python benchmarks/gradient_snr.py --recipe diffusion/shapes_flowgrpo [--repeats 4] [key=value ...]
    python benchmarks/gradient_snr.py --recipe diffusion/shapes_draft sampling.samples_per_prompt=8

The same construction serves the reward-backprop losses (DRaFT, AlignProp, ReFL): their
gradient is the differentiable reward's, taken through the re-run sampling steps (the
advantages are computed and unused), so the cosine compares a pathwise estimator with the
policy-gradient rows at the same sample count.

Prints one JSON line (and appends it to `--out`): the recipe, overrides,
samples per estimate, mean / min / max pairwise cosine, each estimate's
gradient norm and mean reward, `samples_for_cos_0.5`, and seconds per estimate.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from unirl.algorithms.advantages import track_advantages
from unirl.config.validate import validate_recipe  # noqa: E402
from unirl.distributed.group import RankInfo  # noqa: E402
from unirl.evaluate import EXAMPLES  # noqa: E402
from unirl.sde.schedules import sigmas_for  # noqa: E402
from unirl.trainer.worker import RLWorker, build  # noqa: E402
from unirl.types import RolloutReq  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "gradient_snr.jsonl")


def gradient_estimates(cfg, repeats: int) -> tuple[list[torch.Tensor], list[float], float]:
    """`repeats` flattened gradients of the recipe's loss on independent rollouts of one prompt batch."""
    plain = OmegaConf.to_container(cfg, resolve=True)
    plain.pop("hydra", None)
    worker = RLWorker(RankInfo(rank=0, world_size=1, dp_rank=0, dp_size=1), plain, total_optimizer_steps=1)
    backend, engine, stack = worker.backend, worker.engine, worker.stack
    sampling, reward, advantage = build(cfg.sampling), build(cfg.reward), build(cfg.advantage)
    examples = build(cfg.data_source).next_batch(int(cfg.prompts_per_rollout))
    sigmas = sigmas_for(sampling, worker.bundle.image_seq_len(sampling.height, sampling.width))
    grads, rewards, t0 = [], [], time.perf_counter()
    for rep in range(repeats):
        req = RolloutReq.from_prompts(examples, sampling, sigmas, rollout_id=10_000 + rep)
        track = engine.generate(req).track(engine.track_name)
        reward.score_and_attach(track)
        track_advantages(track, advantage)
        micro, ctx = stack.prepare(track, progress=0.0)
        backend.zero_grad()
        stack.backward(micro, ctx)
        grads.append(torch.cat([p.grad.detach().flatten() for p in backend.params]))
        rewards.append(float(track.rewards.mean()))
    worker.transport.close()
    return grads, rewards, (time.perf_counter() - t0) / repeats


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="diffusion/shapes_flowgrpo")
    parser.add_argument("--repeats", type=int, default=4, help="independent estimates (>= 2)")
    parser.add_argument("--out", default=RESULTS)
    parser.add_argument("overrides", nargs="*", help="Hydra key=value overrides of the recipe")
    args = parser.parse_args(argv)
    if args.repeats < 2:
        parser.error("--repeats must be >= 2 (cosines are between pairs of estimates)")
    with initialize_config_dir(config_dir=EXAMPLES, version_base=None):
        cfg = compose(args.recipe, overrides=[*args.overrides, "transport=inband"])
    validate_recipe(cfg)
    grads, rewards, seconds = gradient_estimates(cfg, args.repeats)
    cos = [
        float(torch.nn.functional.cosine_similarity(grads[i], grads[j], dim=0))
        for i, j in itertools.combinations(range(len(grads)), 2)
    ]
    n = int(cfg.prompts_per_rollout) * int(cfg.sampling.samples_per_prompt)
    mean_cos = sum(cos) / len(cos)
    row = {
        "recipe": args.recipe,
        "overrides": args.overrides,
        "algorithm": cfg.algorithm._target_.rsplit(".", 1)[-1],
        "samples_per_estimate": n,
        "repeats": args.repeats,
        "mean_cos": round(mean_cos, 4),
        "min_cos": round(min(cos), 4),
        "max_cos": round(max(cos), 4),
        "samples_for_cos_0.5": round(n / mean_cos) if mean_cos > 0 else None,
        "grad_norms": [round(float(g.norm()), 6) for g in grads],
        "mean_rewards": [round(r, 4) for r in rewards],
        "seconds_per_estimate": round(seconds, 1),
        "threads": torch.get_num_threads(),
    }
    line = json.dumps(row)
    print(line)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "a") as f:
        f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
