"""Rules of what a recipe refers to by name or path: the thing named must exist.

A path the run will read (a model directory) must be there before Ray starts, and a name that
selects something (a metadata key of the prompts, a stop token of the tokenizer) must select
it; otherwise the run would fail late inside a worker, or silently do nothing. Each problem
names the full key, the value, and what does exist. (Names checked by their own component:
LoRA target modules and FSDP block classes in `unirl.config.distributed`, reward weights in
`LocalRewardBackend`, data files in their data source.)
"""

from __future__ import annotations

import re
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from unirl.tracking.trackers import tracker_problems

# the attributes by which a scorer names the metadata key of the prompts it reads
# (`ArithAnswer` / `ExactAnswer`: answer_key, `GenEvalMini`: intent_key, `RewriteMatchesScene`: canonical_key)
SCORER_METADATA_KEYS = ("answer_key", "intent_key", "canonical_key")
_COMPONENT = re.compile(r"(?:^|\.)backend\.components\.[^.]+$")


def check_tracking(cfg: DictConfig, problems: list[str]) -> None:
    """`tracking`: a list whose entries name known trackers (`unirl.tracking.trackers.TRACKERS`)
    with options their classes take."""
    node = cfg.get("tracking")
    if isinstance(node, (DictConfig, ListConfig)):
        node = OmegaConf.to_container(node, resolve=True)
    problems.extend(tracker_problems(node))


def check_model_path(model: Any, problems: list[str]) -> None:
    """`model.pretrained_path`, when set, is a directory of the model's family: the model
    config's own `directory_problems()`."""
    check = getattr(model, "directory_problems", None)
    if check is not None:
        problems.extend(check())


def examples_of(source: Any) -> list | None:
    """The `PromptExample`s of a built data source or dataset (its `.examples`, or itself when a
    list); None when it holds none that can be read before the run."""
    examples = getattr(source, "examples", source)
    return list(examples) if isinstance(examples, list | tuple) else None


def check_conditions(passed: dict[str, Any], problems: list[str]) -> None:
    """A model conditioned on more than the prompt (an edit family: its config's
    `condition_problems`) against every prompt file it samples before the run starts: the
    training prompts (`data_source`) and the held-out ones (`eval.examples`), each problem naming
    the key and the row; the sampling is passed for a family whose prompt reads its conditions
    (the prompt's length with them)."""
    check = getattr(passed.get("model"), "condition_problems", None)
    if check is None:
        return
    for key in ("data_source", "eval.examples"):
        examples = examples_of(passed.get(key))
        if examples:
            problems.extend(check(examples, key, passed.get("sampling")))


def check_metadata_key(key: str, name: str, examples: list | None, where: str, problems: list[str]) -> None:
    """The recipe value `key`=`name` names a metadata key that every one of `examples` (the
    prompts of recipe key `where`) carries."""
    if not examples:
        return
    missing = [ex.prompt_id for ex in examples if name not in ex.metadata]
    if missing:
        present = sorted({k for ex in examples for k in ex.metadata})
        problems.append(
            f"{key}={name!r}: {len(missing)} of the {len(examples)} examples of {where} have no metadata key "
            f"{name!r} (e.g. {missing[0]!r}); their metadata keys are {present}: name one of them, or give "
            "every prompt that key"
        )


def check_scorer_keys(
    passed: dict[str, Any], scorers: str, examples: list | None, where: str, problems: list[str]
) -> None:
    """Every reward component under recipe key `scorers` (e.g. "reward", "algorithm.reward",
    "rewards.diffusion"), or the scorer at `scorers` itself, reads metadata keys the prompts of
    `where` carry (`SCORER_METADATA_KEYS`)."""
    for path, scorer in passed.items():
        if path == scorers or (path.startswith(scorers + ".") and _COMPONENT.search(path[len(scorers) :])):
            for attr in SCORER_METADATA_KEYS:
                name = getattr(scorer, attr, None)
                if isinstance(name, str):
                    check_metadata_key(f"{path}.{attr}", name, examples, where, problems)


def check_stop_tokens(key: str, stop_tokens: list[str], tokenizer: Any, problems: list[str]) -> None:
    """Each of `stop_tokens` (recipe key `key`) is exactly one token of the model's tokenizer, as
    the text stage requires when it starts sampling."""
    for token in stop_tokens:
        ids = tokenizer.encode(token, add_special_tokens=False)
        if len(ids) != 1:
            problems.append(
                f"{key}: {token!r} is {len(ids)} tokens ({ids}) for the model's tokenizer, but a stop token must "
                f"be exactly one; its special tokens are {list(tokenizer.all_special_tokens)}"
            )


def check_prompt_keys(passed: dict[str, Any], problems: list[str]) -> None:
    """A single-track recipe's metadata keys: the reward components' (and a reward-backprop
    algorithm's own reward's) vs the training prompts (`data_source`); the eval scorer's and
    `eval.sampling.group_by` vs the eval prompts (`eval.examples`)."""
    train = examples_of(passed.get("data_source"))
    for scorers in ("reward", "algorithm.reward"):
        check_scorer_keys(passed, scorers, train, "data_source", problems)
    held_out = examples_of(passed.get("eval.examples"))
    check_scorer_keys(passed, "eval.scorer", held_out, "eval.examples", problems)
    for name in getattr(passed.get("eval.sampling"), "group_by", None) or []:
        check_metadata_key("eval.sampling.group_by", name, held_out, "eval.examples", problems)
