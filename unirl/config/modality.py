"""Rules of a recipe's modality: one modality across its components, and that modality's own checks.

The sampling node's class sets the modality (`SAMPLING_MODALITY`); the model, the algorithm,
the eval block and the entry point must agree with it. A text recipe's token budget must fit
the model's context, and a pretrained LM directory's tokenizer its embedding. (An image
recipe's size vs the model's patch grid is batch geometry: `unirl.config.geometry`.)
"""

from __future__ import annotations

import os
from typing import Any

from omegaconf import DictConfig

from unirl.config.references import check_stop_tokens
from unirl.types.sampling import DiffusionSamplingParams, TextSamplingParams

SAMPLING_MODALITY = {DiffusionSamplingParams: "diffusion", TextSamplingParams: "text"}
ENTRY_POINTS = {"diffusion": "unirl.train_diffusion", "text": "unirl.train_vlm"}
EVAL_SAMPLING = {
    "diffusion": "unirl.trainer.evaluation.EvalSampling",
    "text": "unirl.trainer.text_eval.TextEvalSampling",
}


def modality_of(sampling: Any) -> str | None:
    """ "diffusion" or "text" for a built sampling node (`SAMPLING_MODALITY`); None otherwise."""
    return next((m for kind, m in SAMPLING_MODALITY.items() if isinstance(sampling, kind)), None)


def check_modality(
    cfg: DictConfig, sampling: Any, model: Any, algorithm: type | None, problems: list[str]
) -> str | None:
    """One modality across sampling, model and algorithm; returns it."""
    modality = modality_of(sampling)
    if modality is None:
        return None
    parts = {"model": getattr(model, "modality", None), "algorithm": getattr(algorithm, "modality", None)}
    for key, other in parts.items():
        if other is not None and other != modality:
            target = cfg[key]["_target_"] if key in cfg else "?"
            problems.append(
                f"{key}: {target} is a {other} component but sampling ({type(sampling).__name__}) makes this a "
                f"{modality} recipe; use a {modality} {key}"
            )
    return modality


def check_entry_point(sampling: Any, expect: str, problems: list[str]) -> None:
    """A single-track recipe run by the entry point of its modality (`expect`: "diffusion" for
    `unirl.train_diffusion`, "text" for `unirl.train_vlm`)."""
    modality = modality_of(sampling)
    if modality is not None and modality != expect:
        problems.append(
            f"sampling: this is a {modality} recipe ({type(sampling).__name__}); run it with "
            f"`python -m {ENTRY_POINTS[modality]}`, not {ENTRY_POINTS[expect]}"
        )


def check_text(
    cfg: DictConfig, sampling: TextSamplingParams, model: Any, problems: list[str], eval_sampling: Any = None
) -> None:
    """Text recipes: the token budget fits the model's context, a pretrained directory's tokenizer
    fits its embedding, and every stop token (`sampling.stop_tokens`, and `eval.sampling.stop_tokens`
    of a built `eval_sampling`) is one token of the model's tokenizer. A model that states its own
    text rules (`text_problems`: a unified model's language head) is asked instead."""
    if hasattr(model, "text_problems"):
        problems.extend(model.text_problems(sampling))
        return
    tiny = getattr(model, "tiny", None) if model is not None else None
    context = getattr(tiny, "max_position_embeddings", None)
    if context is not None and sampling.max_prompt_length + sampling.max_new_tokens > context:
        problems.append(
            f"sampling.max_prompt_length ({sampling.max_prompt_length}) + sampling.max_new_tokens "
            f"({sampling.max_new_tokens}) exceeds model.tiny.max_position_embeddings={context}, the model's context"
        )
    tokenizer = None
    path = getattr(model, "pretrained_path", None)
    if path and os.path.isfile(os.path.join(path, "config.json")):
        try:
            from transformers import AutoConfig, AutoTokenizer

            config = AutoConfig.from_pretrained(path, local_files_only=True)
            tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
            tokens = len(tokenizer)
        except Exception as exc:  # noqa: BLE001 - an unreadable directory is reported, not raised
            problems.append(f"model.pretrained_path {path!r}: cannot read its config or tokenizer ({exc})")
            tokenizer = None
        else:
            rows = getattr(config, "vocab_size", None)
            if rows is not None and tokens > rows:
                problems.append(
                    f"model.pretrained_path {path!r}: the tokenizer has {tokens} tokens but config.json's "
                    f"vocab_size is {rows}; ids >= {rows} would index past the embedding. Use the tokenizer "
                    "saved with this model"
                )
            context = getattr(config, "max_position_embeddings", None)
            if context is not None and sampling.max_prompt_length + sampling.max_new_tokens > context:
                problems.append(
                    f"sampling.max_prompt_length ({sampling.max_prompt_length}) + sampling.max_new_tokens "
                    f"({sampling.max_new_tokens}) exceeds the model's max_position_embeddings={context} ({path})"
                )
    elif not path and tiny is not None and getattr(model, "modality", None) == "text":
        from unirl.models.causal_lm.tiny import tiny_tokenizer

        tokenizer = tiny_tokenizer()
    if tokenizer is not None:
        check_stop_tokens("sampling.stop_tokens", sampling.stop_tokens, tokenizer, problems)
        eval_stops = getattr(eval_sampling, "stop_tokens", None)  # an image EvalSampling has none
        if eval_stops:
            check_stop_tokens("eval.sampling.stop_tokens", eval_stops, tokenizer, problems)


def check_eval_sampling(cfg: DictConfig, modality: str | None, problems: list[str]) -> None:
    """The eval block samples as its modality does (images: EvalSampling; text: TextEvalSampling)."""
    ev = cfg.get("eval")
    if modality is None or ev is None or not isinstance(ev.get("sampling"), DictConfig):
        return
    target, want = ev.sampling.get("_target_"), EVAL_SAMPLING[modality]
    if target != want:
        problems.append(f"eval.sampling: a {modality} recipe evaluates with {want}, got {target}")
