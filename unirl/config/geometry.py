"""Rules of batch geometry: how the samples of a step split over devices and micro-batches, and
how an image's size fits the model's latent patch grid (the model config's own rule,
`FlowModelConfig.size_problems`); with them, whether the model takes the recipe's guidance
scales (`FlowModelConfig.guidance_problems`)."""

from __future__ import annotations

from typing import Any

from unirl.types.sampling import DiffusionSamplingParams


def check_geometry(run: Any, sampling: Any, stack: Any, model: Any, problems: list[str], sp: int = 1) -> None:
    """Batch geometry vs devices and micro-batches; image size vs the model's patch grid (as the
    model config states it). With sequence parallelism (`sp` > 1) the samples split over the
    num_devices / sp groups of ranks, each group's ranks holding the same samples."""
    if run is not None and sampling is not None:
        world = max(1, run.num_devices // sp)
        shards = "num_devices" if sp == 1 else "num_devices / train.parallel.sp"  # sample shards
        total = run.prompts_per_rollout * sampling.samples_per_prompt
        if total % world:
            problems.append(
                f"batch geometry: prompts_per_rollout ({run.prompts_per_rollout}) x sampling.samples_per_prompt "
                f"({sampling.samples_per_prompt}) = {total} samples do not split evenly over {shards}={world}"
            )
        elif stack is not None and (total // world) % stack.micro_batch_size:
            problems.append(
                f"batch geometry: train.stack.micro_batch_size={stack.micro_batch_size} does not divide the "
                f"per-rank batch of {total // world} samples (prompts_per_rollout x samples_per_prompt / {shards})"
            )
    sizes = getattr(model, "size_problems", None)
    if sizes is not None and isinstance(sampling, DiffusionSamplingParams):
        problems.extend(sizes(sampling.height, sampling.width))


def check_eval_size(model: Any, sampling: Any, eval_sampling: Any, problems: list[str]) -> None:
    """Decoupled resolution: an evaluation size (`eval.sampling.height` / `width`, each defaulting
    to the rollouts') vs the model's patch grid, as the model config states it."""
    sizes = getattr(model, "size_problems", None)
    height, width = (getattr(eval_sampling, k, None) for k in ("height", "width"))
    if (
        sizes is None
        or not isinstance(sampling, DiffusionSamplingParams)
        or (height is None and width is None)
    ):
        return
    h, w = height or sampling.height, width or sampling.width
    try:
        found = sizes(h, w, key="eval.sampling")
    except TypeError:  # a family whose size_problems names only `sampling.*`
        found = [p.replace("sampling.", "eval.sampling.", 1) for p in sizes(h, w)]
    problems.extend(p for p in found if (height and ".height=" in p) or (width and ".width=" in p))


def check_training_guidance(model: Any, algorithm: Any, problems: list[str]) -> None:
    """The guidance scale a supervised diffusion loss trains at (`algorithm.config.guidance_scale`:
    FlowSFT's) vs the guidance the model takes (a FLUX model without a guidance embedding takes
    none); a family that trains unguided refuses a scale other than 1.0 when the loss is built
    (`unirl.models.flow.family.training_guidance`)."""
    ask = getattr(model, "guidance_problems", None)
    scale = getattr(getattr(algorithm, "config", None), "guidance_scale", None)
    if ask is not None and scale is not None and getattr(algorithm, "learns_from_demonstrations", False):
        problems.extend(ask(scale, "algorithm.config.guidance_scale"))


def check_guidance(model: Any, sampling: Any, eval_sampling: Any, problems: list[str]) -> None:
    """`sampling.guidance_scale` and `eval.sampling.guidance_scale` vs the guidance the model takes
    (as the model config states it: a guidance-distilled model without true CFG, say)."""
    ask = getattr(model, "guidance_problems", None)
    if ask is None or not isinstance(sampling, DiffusionSamplingParams):
        return
    found = ask(sampling.guidance_scale, "sampling.guidance_scale")
    if eval_sampling is not None and hasattr(eval_sampling, "guidance_scale"):
        found += ask(eval_sampling.guidance_scale, "eval.sampling.guidance_scale")
    problems.extend(dict.fromkeys(found))  # a model-level problem (not the key's) is said once
