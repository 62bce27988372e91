"""Recipe composition and every validator error, before any Ray work."""

from __future__ import annotations

import copy
import functools
import json
import os
import re
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from tests.conftest import EXAMPLES, run_module
from unirl.config.validate import ConfigError, validate_recipe

RECIPES = ["diffusion/tiny_sd3_flowgrpo", "diffusion/sd3_flowgrpo"]


def recipe(name: str = "diffusion/tiny_sd3_flowgrpo", overrides: list[str] | None = None):
    with initialize_config_dir(config_dir=EXAMPLES, version_base=None):
        return compose(config_name=name, overrides=overrides or [])


def problems_of(overrides: list[str], name: str = "diffusion/tiny_sd3_flowgrpo") -> str:
    with pytest.raises(ConfigError) as info:
        validate_recipe(recipe(name, overrides))
    return str(info.value)


def test_tiny_recipe_composes_and_validates():
    cfg = recipe()
    validate_recipe(cfg)
    assert cfg.num_devices == 1 and cfg.num_steps == 30
    assert cfg.sampling.samples_per_prompt * cfg.prompts_per_rollout == 32


def test_real_recipe_composes_and_names_missing_model(monkeypatch):
    monkeypatch.setenv("PRETRAINED_MODEL", "/nonexistent/sd3.5-medium")
    msg = problems_of([], name="diffusion/sd3_flowgrpo")
    assert "model.pretrained_path" in msg and "/nonexistent/sd3.5-medium" in msg


def test_batch_geometry_not_divisible_by_devices():
    msg = problems_of(["num_devices=3"])
    assert "prompts_per_rollout (4) x sampling.samples_per_prompt (8) = 32" in msg and "num_devices=3" in msg


def test_micro_batch_must_divide_per_rank_batch():
    msg = problems_of(["train.stack.micro_batch_size=5"])
    assert "train.stack.micro_batch_size=5" in msg and "per-rank batch of 32" in msg


def test_multi_update_with_algorithm_that_forbids_it():
    msg = problems_of(
        [
            "algorithm._target_=unirl.algorithms.base.StageAlgorithm",
            "~algorithm.config",
            "train.stack.num_updates_per_batch=2",
        ]
    )
    assert "train.stack.num_updates_per_batch=2" in msg and "StageAlgorithm" in msg


def test_unknown_target_names_the_key():
    msg = problems_of(["reward.backend.components.redness._target_=unirl.reward.local.color.NoSuchScorer"])
    assert "reward.backend.components.redness._target_" in msg and "NoSuchScorer" in msg


def test_missing_model_path():
    msg = problems_of(["model.pretrained_path=/does/not/exist"])
    assert "model.pretrained_path" in msg and "/does/not/exist" in msg


def test_component_errors_name_their_key():
    msg = problems_of(["sampling.sde_num_steps=50", "train.optim.lr_schedule=zigzag"])
    assert "sampling" in msg and "sde_num_steps=50" in msg
    assert "train.optim" in msg and "zigzag" in msg


def test_eta_zero_with_flow_grpo():
    msg = problems_of(["sampling.eta=0.0"])
    assert "sampling.eta=0" in msg and "FlowGRPO" in msg


def test_missing_top_level_key():
    msg = problems_of(["~prompts_per_rollout"])
    assert "prompts_per_rollout" in msg


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return run_module("unirl.train_diffusion", *args, timeout=120, env=env)


def test_cli_rejects_bad_recipe_with_exit_code_and_message(tmp_path):
    res = run_cli("--config-name=diffusion/tiny_sd3_flowgrpo", "num_devices=3", f"output_dir={tmp_path}")
    assert res.returncode == 2
    assert "num_devices=3" in res.stderr
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.parametrize("name", RECIPES)
def test_cli_cfg_job_resolve_works_offline(name):
    res = run_cli(f"--config-name={name}", "--cfg", "job", "--resolve", env={"PRETRAINED_MODEL": "/some/dir"})
    assert res.returncode == 0, res.stderr
    assert "num_devices:" in res.stdout and "_target_: unirl.algorithms.flow_grpo.FlowGRPO" in res.stdout


@pytest.mark.parametrize("name", ["llm/tiny_lm_grpo", "llm/qwen3_grpo"])
def test_vlm_cli_cfg_job_resolve_works_offline(name):
    res = run_module(
        "unirl.train_vlm",
        f"--config-name={name}",
        "--cfg",
        "job",
        "--resolve",
        env={"PRETRAINED_MODEL": "/some/dir"},
    )
    assert res.returncode == 0, res.stderr
    assert "_target_: unirl.algorithms.grpo.GRPO" in res.stdout and "TextSamplingParams" in res.stdout


@pytest.mark.parametrize("name", ["inband", "ray", "tq_simple", "tq_mooncake"])
def test_every_transport_composes_and_validates(name):
    cfg = recipe(overrides=[f"transport={name}"])
    validate_recipe(cfg)
    assert cfg.transport.name == name


def test_unknown_transport_name_lists_the_choices():
    msg = problems_of(["transport.name=carrier_pigeon"])
    assert "transport.name: unknown transport 'carrier_pigeon'" in msg and "tq_mooncake" in msg


def test_missing_transport_extra_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "transfer_queue", None)  # as if the extra were not installed
    msg = problems_of(["transport=tq_simple"])
    assert "transport=tq_simple" in msg and 'pip install -e ".[transferqueue]"' in msg


def test_bad_transport_option_fails_before_ray():
    from unirl.dataplane import DataPlaneError, make_transport

    with pytest.raises(ValueError, match="num_storage_units must be >= 1"):
        make_transport({"name": "tq_simple", "num_storage_units": 0})
    with pytest.raises(ValueError, match="master_address and transport.metadata_server go together"):
        make_transport({"name": "tq_mooncake", "master_address": "127.0.0.1:1"})
    with pytest.raises(TypeError, match="unexpected keyword argument 'num_storage_units'"):
        make_transport({"name": "ray", "num_storage_units": 1})
    with pytest.raises(DataPlaneError, match="unknown transport"):
        make_transport({"name": "nope"})


def test_bad_transport_options_are_config_errors():
    msg = problems_of(["transport=tq_simple", "transport.num_storage_units=0"])
    assert "transport (tq_simple): transport.num_storage_units must be >= 1, got 0" in msg
    msg = problems_of(["+transport.bogus=1"])
    assert "transport.bogus: unknown key; RayObjectStoreTransport takes []" in msg


# ---- every leaf of every recipe is type- and range-checked ----------------------------------

RL_RECIPES = sorted(
    f"{domain}/{os.path.splitext(f)[0]}"
    for domain in ("diffusion", "llm", "vlm")
    for f in os.listdir(os.path.join(EXAMPLES, domain))
)
# a real model directory (own tests)
NEEDS_MODEL_DIR = (
    "diffusion/sd3_flowgrpo",
    "diffusion/flux_flowgrpo",
    "diffusion/kontext_flowgrpo",
    "diffusion/qwen_edit_flowgrpo",
    "diffusion/wan22_i2v_flowgrpo",
    "diffusion/zimage_flowgrpo",
    "diffusion/flux2_flowgrpo",
    "diffusion/flux2_klein_flowgrpo",
    "diffusion/hunyuanvideo15_flowgrpo",
    "diffusion/ltx2_flowgrpo",
    "diffusion/wan_flowgrpo",
    "diffusion/qwenimage_flowgrpo",
    "llm/qwen3_grpo",
    "llm/qwen3_grpo_vllm",
    "vlm/qwen25vl_grpo",
)
# a negative weight flips a reward on purpose (the reward-backprop recipes hand theirs to the algorithm too)
SIGNED_FLOATS = (
    "reward.backend.weights.",
    "algorithm.reward.backend.weights.",
    "sampling.base_shift",  # a dynamic shift's mu at the base / max token count: a log-shift, any sign
    "sampling.max_shift",
)


def leaves(node, path=""):
    """(key, container, index, value) of every scalar leaf of a plain config tree."""
    items = node.items() if isinstance(node, dict) else enumerate(node)
    for k, v in items:
        key = f"{path}[{k}]" if isinstance(node, list) else (f"{path}.{k}" if path else k)
        if k in ("_target_", "hydra"):
            continue
        if isinstance(v, dict | list):
            yield from leaves(v, key)
        elif v is not None:
            yield key, node, k, v


def mutations(value, key):
    """The bad values a leaf must reject: wrong types always, -1 where the key has a range."""
    if isinstance(value, bool):
        return ["maybe", 3]
    if isinstance(value, int):
        return ["abc"] + ([] if key.endswith("seed") else [-1])
    if isinstance(value, float):
        return ["abc"] + ([] if key.startswith(SIGNED_FLOATS) else [-1.0])
    return [123]


def rejection(tree, key, value) -> str:
    with pytest.raises(ConfigError) as info:
        validate_recipe(OmegaConf.create(tree))
    return str(info.value)


def leaf_signature(name: str, tree: dict, key: str, value) -> tuple[str, ...]:
    """What decides how a leaf's bad values are refused: the recipe's domain (its top-level
    schema), the leaf's key and type (its mutations), and the `_target_` of the mapping that holds
    it (the class that checks it; none for a plain section, whose schema its key names). Two
    recipes whose leaf has the same signature check it the same way, so one mutates it for both."""
    path = re.sub(r"(\[\d+\])+$", "", key).rpartition(".")[0]
    node = tree
    for part in re.findall(r"[^.\[\]]+|\[\d+\]", path):
        node = node[int(part[1:-1])] if part.startswith("[") else node[part]
    return name.split("/")[0], key, type(value).__name__, str(node.get("_target_"))


@functools.cache
def resolved_tree(name: str) -> dict:
    """The recipe `name` resolved to a plain tree, with `PRETRAINED_MODEL` pointing nowhere
    (real-model recipes: only the path fails). Shared: copy before changing it."""
    old = os.environ.get("PRETRAINED_MODEL")
    os.environ["PRETRAINED_MODEL"] = "/nonexistent/model"
    try:
        return OmegaConf.to_container(recipe(name), resolve=True)
    finally:
        if old is None:
            del os.environ["PRETRAINED_MODEL"]
        else:
            os.environ["PRETRAINED_MODEL"] = old


@functools.cache
def mutation_plan() -> dict[str, frozenset[str]]:
    """{recipe: the leaf keys to mutate in it}: every leaf of every RL recipe whose signature
    (`leaf_signature`) no recipe before it in `RL_RECIPES` order had. Variants (the arithmetic
    algorithms, the shapes algorithms, the real-size random models) thus add only what they
    change; a recipe that changes nothing adds nothing."""
    seen: set[tuple[str, ...]] = set()
    plan = {}
    for name in RL_RECIPES:
        tree = resolved_tree(name)
        keys = set()
        for key, _, _, value in leaves(tree):
            signature = leaf_signature(name, tree, key, value)
            if signature not in seen:
                seen.add(signature)
                keys.add(key)
        plan[name] = frozenset(keys)
    return plan


@pytest.mark.parametrize("name", RL_RECIPES)
def test_every_leaf_rejects_bad_values_with_its_full_key(name, monkeypatch):
    """Every leaf of every recipe, each signature once over the recipes (`mutation_plan`): a bad
    value is refused naming its full key."""
    keys = mutation_plan()[name]
    monkeypatch.setenv("PRETRAINED_MODEL", "/nonexistent/model")  # validation checks the path
    assert leaves_rejected(copy.deepcopy(resolved_tree(name)), keys) >= len(keys)


def leaves_rejected(tree, keys: frozenset[str]) -> int:
    """Mutate the leaves `keys` of `tree` (`mutations`); each bad value must be refused naming its
    full key. Returns the number of mutations checked."""
    checked = 0
    for key, container, index, good in list(leaves(tree)):
        if key not in keys:
            continue
        node_path, _, leaf = key.rpartition(".")
        list_key = key.split("[")[0]
        for bad in mutations(good, key):
            container[index] = bad
            msg = rejection(tree, key, bad)
            container[index] = good
            lines = [line for line in msg.splitlines() if repr(bad) in line or str(bad) in line]
            assert any(
                key in line or list_key in line or (node_path in line and leaf.split("[")[0] in line)
                for line in lines
            ), f"{key}={bad!r} not named:\n{msg}"
            checked += 1
    return checked


def test_unmodified_recipes_validate():
    for name in RL_RECIPES:
        if name not in NEEDS_MODEL_DIR:
            validate_recipe(recipe(name))
    stage_two = ["model.pretrained_path=checkpoints/shapes_sd3", "~model.tiny", "seed=1", "train.optim.lr=5e-4"]
    validate_recipe(recipe("diffusion/shapes_sft", stage_two))  # the committed base's second stage


@pytest.mark.parametrize(
    "override, expected",
    [
        ("sampling.eta=abc", "sampling.eta: expected a valid number, got 'abc'"),
        (
            "train.stack.micro_batch_size=abc",
            "train.stack.micro_batch_size: expected a valid integer, got 'abc'",
        ),
        ("sampling.shift=-3.0", "sampling.shift must be > 0, got -3.0"),
        ("train.lora.rank=-1", "train.lora.rank must be >= 1, got -1"),
        ("train.optim.weight_decay=-0.1", "train.optim.weight_decay must be >= 0, got -0.1"),
        ("sampling.height=-32", "sampling.height must be >= 1, got -32"),
        ("num_steps=-1", "num_steps must be >= 1, got -1"),
        ("sampling.height=30", "sampling.height=30 must be a multiple of 4"),
        ("sampling.width=64", "sampling.width=64 exceeds model.tiny.resolution=32"),
        (
            "stage.replay_steps_per_forward=0",
            "stage.replay_steps_per_forward must be >= 1, got 0",
        ),
        (
            "+stage.replay_token_budget=0",
            "stage.replay_token_budget must be >= 1, got 0",
        ),
        (
            "rollout.forward_batch_size=0",
            "rollout.forward_batch_size must be >= 1, got 0",
        ),
        ("+num_step=3", "num_step: unknown key; RunConfig takes"),
        ("+train.loar=1", "train.loar: unknown key; TrainConfig takes"),
        ("+sampling.etaa=1", "sampling.etaa: unknown key; DiffusionSamplingParams takes"),
        (
            "+reward.backend.components.redness.colour=1",
            "redness.colour: unknown key; ColorTarget takes ['target']",
        ),
        ("model.tiny.patch_size=2.5", "model.tiny.patch_size: expected a valid integer, got 2.5"),
        ("logging.progress=maybe", "logging.progress: expected a valid boolean, got 'maybe'"),
        ("checkpoint.every_n_steps=-1", "checkpoint.every_n_steps must be >= 0, got -1"),
        ("+train.ema.decay=0.9", "train.ema must be a _target_ node naming its class, got {'decay': 0.9}"),
        ("launcher=slurm", "launcher must be one of ('ray', 'in_process'), got 'slurm'"),
        (
            "train.lora.target_modules=[to_q,nope]",
            "train.lora.target_modules ['nope'] match no module of SD3Transformer2DModel; its linear layers "
            "are named [",
        ),
        ("train.lora.target_modules=[]", "train.lora.target_modules must name at least one module suffix"),
    ],
)
def test_specific_bad_values(override, expected):
    assert expected in problems_of([override])


def test_all_problems_are_listed_together():
    overrides = [
        "sampling.eta=abc",
        "train.lora.rank=-1",
        "train.optim.weight_decay=-1.0",
        "num_steps=-1",
        "+train.ema._target_=unirl.train.ema.EMAConfig",
        "+train.ema.decay=2.0",
        "transport.name=carrier_pigeon",
        "reward.backend.components.redness._target_=unirl.reward.local.color.NoSuchScorer",
        "train.stack.num_updates_per_batch=0",
    ]
    msg = problems_of(overrides)
    for part in (
        "sampling.eta: expected a valid number, got 'abc'",
        "train.lora.rank must be >= 1, got -1",
        "train.optim.weight_decay must be >= 0, got -1.0",
        "num_steps must be >= 1, got -1",
        "train.ema.decay must be in (0, 1), got 2.0",
        "transport.name: unknown transport 'carrier_pigeon'",
        "NoSuchScorer",
        "train.stack.num_updates_per_batch must be >= 1, got 0",
    ):
        assert part in msg, part
    assert msg.count("\n  - ") >= len(overrides) - 1


def test_checks_after_a_failed_component_still_run():
    # a bad sampling leaf does not hide the batch geometry of the parts that built
    msg = problems_of(["sampling.eta=abc", "train.stack.micro_batch_size=5", "num_devices=3"])
    assert "sampling.eta" in msg and "train.stack.micro_batch_size" not in msg  # needs sampling: skipped
    msg = problems_of(["train.lora.rank=-1", "train.stack.micro_batch_size=5"])
    assert "train.lora.rank" in msg and "train.stack.micro_batch_size=5 does not divide" in msg


def test_eval_from_ema_needs_train_ema():
    msg = problems_of(["eval.use_ema=true"], name="diffusion/shapes_flowgrpo_smoke")
    assert "eval.use_ema=true" in msg and "train.ema is null" in msg
    validate_recipe(
        recipe(
            "diffusion/shapes_flowgrpo_smoke",
            ["eval.use_ema=true", "+train.ema._target_=unirl.train.ema.EMAConfig"],
        )
    )


def test_algorithm_with_ema_rollouts_needs_train_ema(monkeypatch):
    from unirl.algorithms.diffusion_nft import DiffusionNFT

    monkeypatch.setattr(DiffusionNFT, "requires_ema_rollout", True)
    msg = problems_of([], name="diffusion/shapes_nft")
    assert "algorithm: DiffusionNFT samples rollouts from EMA weights, but train.ema is null" in msg


def test_supervised_recipe_leaves_are_checked():
    with pytest.raises(ConfigError) as info:
        validate_recipe(
            recipe(
                "diffusion/shapes_sft",
                ["train.optim.lr=abc", "algorithm.config.cond_dropout=1.5", "eval.sampling.num_steps=0"],
            )
        )
    msg = str(info.value)
    assert "train.optim.lr: expected a valid number, got 'abc'" in msg
    assert "algorithm.config.cond_dropout" in msg
    assert "eval.sampling.num_steps must be >= 1, got 0" in msg


def test_cli_reports_type_and_range_problems_with_exit_code_2(tmp_path):
    res = run_cli(
        "--config-name=diffusion/tiny_sd3_flowgrpo",
        "sampling.eta=abc",
        "train.lora.rank=-1",
        f"output_dir={tmp_path}",
    )
    assert res.returncode == 2, res.stderr
    assert "sampling.eta: expected a valid number, got 'abc'" in res.stderr
    assert "train.lora.rank must be >= 1, got -1" in res.stderr
    assert "Traceback" not in res.stderr


def test_parameter_offload_needs_sharding_ranks():
    """FSDP2 shards (and so offloads) the module over two or more ranks only."""
    msg = problems_of(["+train.fsdp.offload_params=true"])
    assert "train.fsdp.offload_params=true with num_devices=1" in msg and "raise num_devices" in msg
    validate_recipe(recipe(overrides=["+train.fsdp.offload_params=true", "num_devices=2", "launcher=ray"]))


def test_one_rank_bf16_fsdp_policy_without_autocast_and_in_process_geometry_are_rejected():
    """FSDP2's bf16 policy does nothing on one rank: a recipe asking for it must also ask for autocast;
    launcher=in_process has one worker and no Ray, so it needs num_devices=1 and the inband transport."""
    msg = problems_of(["train.fsdp.param_dtype=bfloat16"])
    assert "train.fsdp.param_dtype=bfloat16" in msg and "stage.autocast_dtype" in msg
    validate_recipe(
        recipe(overrides=["train.fsdp.param_dtype=bfloat16", "+stage.autocast_dtype=bfloat16"])
    )
    msg = problems_of(["launcher=in_process", "num_devices=2", "prompts_per_rollout=4"])
    assert "launcher=in_process" in msg and "num_devices=2" in msg
    validate_recipe(recipe(overrides=["launcher=in_process", "transport=inband"]))


# ---- text recipes ---------------------------------------------------------------------------

LM = "llm/tiny_lm_grpo"


@pytest.mark.parametrize("override", ["+advantage.estimator=reinforce_pp", "+advantage.kl_coef=0.1"])
def test_token_level_advantages_are_refused_on_diffusion(override):
    assert "needs per-token data that diffusion tracks do not have" in problems_of([override])


def test_one_modality_per_recipe_and_the_right_entry_point():
    """A text algorithm in a diffusion recipe (and the reverse) names the component; a recipe run
    through the other modality's entry point names the right one."""
    msg = problems_of(
        [
            "algorithm._target_=unirl.algorithms.grpo.GRPO",
            "algorithm.config._target_=unirl.algorithms.grpo.GRPOConfig",
        ]
    )
    assert "algorithm: unirl.algorithms.grpo.GRPO is a text component" in msg and "diffusion recipe" in msg
    with pytest.raises(
        ConfigError, match="run it with `python -m unirl.train_vlm`, not unirl.train_diffusion"
    ):
        validate_recipe(recipe(LM), expect="diffusion")
    with pytest.raises(
        ConfigError, match="run it with `python -m unirl.train_diffusion`, not unirl.train_vlm"
    ):
        validate_recipe(recipe(), expect="text")
    res = run_module("unirl.train_vlm", "--config-name=diffusion/tiny_sd3_flowgrpo", timeout=120)
    assert res.returncode == 2 and "python -m unirl.train_diffusion" in res.stderr


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (
            ["sampling.max_new_tokens=250"],
            "sampling.max_prompt_length (64) + sampling.max_new_tokens (250) exceeds model.tiny.max_position_embeddings=256",
        ),
        (
            ["advantage.estimator=rloo", "sampling.samples_per_prompt=1", "prompts_per_rollout=16"],
            "must be >= 2, got 1",
        ),
        (["sampling.temperature=-1.0"], "sampling.temperature must be >= 0 (0: greedy), got -1.0"),
        (["sampling.top_p=1.5"], "sampling.top_p must be in (0, 1], got 1.5"),
        (["sampling.stop_tokens=im_end"], "sampling.stop_tokens"),
        (["algorithm.config.loss_agg_mode=seq-sum"], "algorithm.config.loss_agg_mode must be one of"),
        (["advantage.estimator=ppo"], "advantage.estimator"),
        (
            [
                "+eval={examples: {_target_: unirl.data.DefaultDataSource}, "
                "scorer: {_target_: unirl.reward.local.FormatCheck, pattern: x}, "
                "sampling: {_target_: unirl.trainer.evaluation.EvalSampling}}"
            ],
            "eval.sampling: a text recipe evaluates with unirl.trainer.text_eval.TextEvalSampling, "
            "got unirl.trainer.evaluation.EvalSampling",
        ),
        (
            [
                "algorithm._target_=unirl.algorithms.dr_grpo.DrGRPO",
                "algorithm.config._target_=unirl.algorithms.dr_grpo.DrGRPOConfig",
                "+algorithm.config.norm_constant=16",
            ],
            "advantage.norm_by_std",
        ),
    ],
)
def test_text_recipe_errors_name_their_keys(overrides, expected):
    assert expected in problems_of(overrides, name=LM)


@pytest.mark.parametrize(
    "content, expected",
    [("", "no prompts"), ('{"prompt": "ok"}\n{"prompt": \n', "line 2")],
)
def test_bad_prompt_file_is_named_before_ray(tmp_path, content, expected):
    path = tmp_path / "prompts.jsonl"
    path.write_text(content)
    msg = problems_of([f"data_source.data_path={path}"], name=LM)
    assert str(path) in msg and expected in msg


def test_pretrained_lm_directory_checks(tmp_path, monkeypatch):
    """A real Qwen3 directory validates; one whose tokenizer outgrows the model's vocabulary, or
    whose context the token budget exceeds, is named with both sizes before Ray starts."""
    from unirl.models.causal_lm import TinyLMConfig
    from unirl.models.qwen import QwenBundle

    good = tmp_path / "qwen3"
    QwenBundle.tiny(TinyLMConfig(max_position_embeddings=2048)).save_pretrained(str(good))
    monkeypatch.setenv("PRETRAINED_MODEL", str(good))
    validate_recipe(recipe("llm/qwen3_grpo"), expect="text")
    msg = problems_of(["sampling.max_new_tokens=4000"], name="llm/qwen3_grpo")
    assert "exceeds the model's max_position_embeddings=2048" in msg
    # the vLLM variant reads the directory's head size (16 here: no CPU kernel for it)
    import torch

    msg = problems_of([], name="llm/qwen3_grpo_vllm")
    assert (f"model.pretrained_path '{good}': head size 16" in msg) != torch.cuda.is_available()
    config = json.loads((good / "config.json").read_text())
    (good / "config.json").write_text(json.dumps({**config, "architectures": ["MistralForCausalLM"]}))
    msg = problems_of([], name="llm/qwen3_grpo_vllm")
    assert "holds a ['MistralForCausalLM']" in msg and "serves ['Qwen3ForCausalLM'" in msg

    from transformers import AutoTokenizer

    bad = tmp_path / "mismatch"
    QwenBundle.tiny(TinyLMConfig()).save_pretrained(str(bad))
    tok = AutoTokenizer.from_pretrained(str(bad))
    tok.add_tokens([f"<extra_{i}>" for i in range(10)])
    tok.save_pretrained(str(bad))
    monkeypatch.setenv("PRETRAINED_MODEL", str(bad))
    msg = problems_of([], name="llm/qwen3_grpo")
    assert "the tokenizer has 269 tokens but config.json's vocab_size is 259" in msg and str(bad) in msg


# ---- reward backpropagation (DRaFT, AlignProp, ReFL) ------------------------------------------


@pytest.mark.parametrize(
    "name, override, expected",
    [
        (
            "diffusion/shapes_draft",
            "stage.store_trajectory=false",
            "stage.store_trajectory: DRaFT restarts the sampler",
        ),
        ("diffusion/shapes_draft", "sampling.eta=0.7", "sampling.eta=0.7: DRaFT re-runs ODE rollouts"),
        (
            "diffusion/shapes_draft",
            "algorithm.config.steps=11",
            "algorithm.config.steps=11 exceeds sampling.num_steps=10",
        ),
        (
            "diffusion/shapes_alignprop",
            "algorithm.config.max_steps=12",
            "algorithm.config.max_steps=12 exceeds",
        ),
        (
            "diffusion/shapes_refl",
            "reward.backend.weights.strict=1.0",
            "reward component 'strict' (GenEvalMini) has weight 1.0 but is not differentiable",
        ),
        (
            "diffusion/shapes_refl",
            "train.stack.num_updates_per_batch=2",
            "ReFL does not support several updates",
        ),
    ],
)
def test_reward_backprop_recipes_refuse_what_the_loss_cannot_do(name, override, expected):
    assert expected in problems_of([override], name=name)


# ---- names and paths a recipe refers to ------------------------------------------------------

ARITH = "llm/arith_grpo_smoke"


@pytest.mark.parametrize(
    "name, override, key, value",
    [
        (LM, "sampling.stop_tokens=[nope_tok]", "sampling.stop_tokens", "'nope_tok' is 8 tokens"),
        (ARITH, "eval.sampling.stop_tokens=[xx]", "eval.sampling.stop_tokens", "'xx' is 2 tokens"),
        (ARITH, "eval.sampling.group_by=[op,nope]", "eval.sampling.group_by", "'nope'"),
        (
            ARITH,
            "+reward.backend.components.answer.answer_key=nope",
            "reward.backend.components.answer.answer_key",
            "'nope'",
        ),
        (ARITH, "+eval.scorer.answer_key=nope", "eval.scorer.answer_key", "'nope'"),
    ],
)
def test_names_that_select_nothing_are_rejected_before_ray(name, override, key, value):
    """A stop token that is not one token of the model's tokenizer, and a metadata key that the
    prompts do not carry (eval grouping, a scorer's reference), fail inside a worker: the validator
    names the key, the value and what exists instead."""
    (problem,) = [p for p in problems_of([override], name=name).splitlines() if key in p]
    assert value in problem
    assert (
        "special tokens are ['<|endoftext|>'" in problem
        or "their metadata keys are ['answer', 'digits'" in problem
    )


def test_supervised_model_path_must_exist():
    with pytest.raises(ConfigError) as info:
        validate_recipe(recipe("diffusion/shapes_sft", ["model.pretrained_path=/no/such/model", "~model.tiny"]))
    assert "model.pretrained_path: '/no/such/model' is not a directory" in str(info.value)


def _same_build(a, b, depth: int = 0) -> bool:
    """`a` and `b` were built from one node alike: the same types all the way down (four levels
    of attributes), equal values where they are plain data or tensors."""
    import torch

    if type(a) is not type(b):
        return False
    if isinstance(a, (int, float, str, bool, type(None))):
        return a == b
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same_build(x, y, depth) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_build(a[k], b[k], depth) for k in a)
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if hasattr(a, "__dict__") and depth < 4:
        return _same_build(vars(a), vars(b), depth + 1)
    return True  # an opaque object (a function, a generator): its type is what the node decides


@pytest.mark.parametrize(
    "name",
    ["diffusion/tiny_sd3_flowgrpo", "llm/tiny_lm_grpo", "llm/shapes_pe_sft", "pe/tiny_pe_smoke", "vlm/tiny_vqa_smoke"],
)
def test_the_validators_builder_builds_what_hydra_builds(name):
    """`build_resolved` (the validator's builder, children reused) builds every `_target_` node of a
    recipe into what `hydra.utils.instantiate(node, _convert_="all")` builds from it alone."""
    from hydra.utils import instantiate

    from unirl.config.tree import build_resolved, target_nodes

    tree = resolved_tree(name)
    built, compared = {}, 0
    for path, node in target_nodes(tree):
        try:
            theirs = instantiate(node, _convert_="all")
        except Exception:  # noqa: BLE001 - a node that needs the trainer's arguments (a stage's bundle)
            with pytest.raises(Exception):  # noqa: B017 - ours refuses it too
                build_resolved(node, path, dict(built))
            continue
        built[path] = build_resolved(node, path, built)
        assert _same_build(built[path], theirs), path
        compared += 1
    assert compared >= 5


REWARD_GROUP = {  # examples/scorer/<name>.yaml (package `reward`): the component it builds and the paths it reads
    "pickscore": ("PickScore", ["PRETRAINED_PICKSCORE", "PRETRAINED_CLIP_H"]),
    "clipscore": ("CLIPScore", ["PRETRAINED_CLIP"]),
    "hpsv2": ("HPSv2", ["PRETRAINED_HPS", "PRETRAINED_CLIP_H"]),
    "hpsv3": ("HPSv3", ["PRETRAINED_HPSV3", "PRETRAINED_QWEN2VL"]),
    "imagereward": ("ImageReward", ["PRETRAINED_IMAGEREWARD", "PRETRAINED_BERT"]),
    "aesthetic": ("AestheticScore", ["PRETRAINED_CLIP", "PRETRAINED_AESTHETIC"]),
}


def test_every_reward_group_file_is_listed_here():
    names = {os.path.splitext(f)[0] for f in os.listdir(os.path.join(EXAMPLES, "scorer"))}
    assert names == set(REWARD_GROUP) | {"jpeg_incompressibility", "ocr"}


@pytest.mark.parametrize("name", sorted(REWARD_GROUP))
def test_a_pretrained_scorer_is_one_override_and_its_missing_files_are_named_before_ray(name, monkeypatch):
    cls, variables = REWARD_GROUP[name]
    monkeypatch.setenv("PRETRAINED_MODEL", "/nonexistent/sd3.5-medium")
    for var in variables:
        monkeypatch.setenv(var, f"/nonexistent/{var.lower()}")
    cfg = recipe("diffusion/sd3_flowgrpo", [f"scorer={name}"])
    (component,) = cfg.reward.backend.components.values()
    assert component._target_ == f"unirl.reward.local.{cls}"
    msg = problems_of([f"scorer={name}"], name="diffusion/sd3_flowgrpo")
    assert f"/nonexistent/{variables[0].lower()}" in msg and cls in msg, msg
    monkeypatch.delenv(variables[0])  # an unset path names its variable
    msg = problems_of([f"scorer={name}"], name="diffusion/sd3_flowgrpo")
    assert variables[0] in msg, msg


@pytest.mark.parametrize("name", ["jpeg_incompressibility", "ocr"])
def test_weight_free_reward_groups_validate(name, monkeypatch):
    monkeypatch.setenv("PRETRAINED_MODEL", "/nonexistent/sd3.5-medium")
    msg = problems_of([f"scorer={name}"], name="diffusion/sd3_flowgrpo")
    assert "reward" not in msg.replace("model.pretrained_path", ""), msg  # only the model is missing
