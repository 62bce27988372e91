"""The arithmetic world: problems, formats, the held-out split, determinism and the data sources."""

from __future__ import annotations

import random
import re

import numpy as np
import pytest

from worlds.arith import (
    COMBOS,
    HELD_OUT_COMBOS,
    TRAIN_COMBOS,
    ArithDataset,
    ArithDataSource,
    ArithSFTSource,
    Problem,
    combo_problems,
    combo_size,
    is_reserved,
    is_train_problem,
    make_problem,
    random_problem,
    sample_train_problem,
)

_EXPRESSION = re.compile(r"(0|[1-9][0-9]*)([-+*](0|[1-9][0-9]*))+")


def _operand_digits(expression: str) -> str:
    return "x".join(str(len(x)) for x in re.split(r"[-+*]", expression))


def _check(problem: Problem) -> None:
    """Recompute everything independently from the expression string."""
    assert _EXPRESSION.fullmatch(problem.expression), problem
    assert eval(problem.expression) == problem.answer, problem  # noqa: S307 (digits and +-* only, checked above)
    assert _operand_digits(problem.expression) == problem.digits
    symbols = re.sub(r"[0-9]", "", problem.expression)
    expected_op = {"+": "add", "-": "sub", "*": "mul"}.get(symbols, "chain")
    assert problem.op == expected_op and (problem.op != "chain" or set(symbols) <= {"+", "-"})
    assert problem.prompt == problem.expression + "="
    assert (
        re.fullmatch(r"-?(0|[1-9][0-9]*)", problem.completion) and int(problem.completion) == problem.answer
    )


def test_combos() -> None:
    assert len(COMBOS) == 30 and len(set(COMBOS)) == 30
    counts = {op: sum(c[0] == op for c in COMBOS) for op in ("add", "sub", "mul", "chain")}
    assert counts == {"add": 9, "sub": 9, "mul": 4, "chain": 8}
    assert set(HELD_OUT_COMBOS) <= set(COMBOS)
    assert set(TRAIN_COMBOS) == set(COMBOS) - set(HELD_OUT_COMBOS) and len(TRAIN_COMBOS) == 26
    assert {("add", "3x2"), ("sub", "2x3"), ("mul", "2x1")} <= set(HELD_OUT_COMBOS)
    # operator mixes: every held-out operand layout is trained under another operator
    assert all(any(d == digits for _, d in TRAIN_COMBOS) for _, digits in HELD_OUT_COMBOS)
    # every held-out combination's op keeps trained combinations (it composes trained skills)
    assert {op for op, _ in HELD_OUT_COMBOS} <= {op for op, _ in TRAIN_COMBOS}


@pytest.mark.parametrize(("op", "digits"), COMBOS)
def test_random_problems_are_right(op: str, digits: str) -> None:
    rng = random.Random(0)
    for _ in range(200):
        p = random_problem(op, digits, rng)
        assert (p.op, p.digits) == (op, digits)
        _check(p)


def test_formats_and_edge_values() -> None:
    p = make_problem("add", (123, 45))
    assert (p.expression, p.answer, p.digits, p.prompt, p.completion) == (
        "123+45",
        168,
        "3x2",
        "123+45=",
        "168",
    )
    p = make_problem("sub", (12, 345))
    assert (p.prompt, p.completion) == ("12-345=", "-333")
    assert make_problem("sub", (5, 5)).completion == "0"
    assert make_problem("mul", (0, 7)).completion == "0"
    p = make_problem("chain", (7, 8, 20), "+-")
    assert (p.prompt, p.completion, p.digits) == ("7+8-20=", "-5", "1x1x2")
    assert make_problem("chain", (10, 9, 9), "--").completion == "-8"
    for bad in [
        ("add", (1, 2, 3), ""),
        ("chain", (1, 2, 3), "*+"),
        ("mul", (1000, 2), ""),
        ("div", (1, 2), ""),
    ]:
        with pytest.raises(ValueError):
            make_problem(*bad)


def test_small_combos_enumerate_exactly() -> None:
    for op, digits in [("add", "1x1"), ("mul", "2x1"), ("chain", "1x1x1")]:
        problems = list(combo_problems(op, digits))
        assert len(problems) == len({p.expression for p in problems}) == combo_size(op, digits)
        for p in problems[::37]:
            _check(p)


def test_train_sample_holds_out_what_it_claims() -> None:
    train = ArithDataset("train", seed=0, size=20_000).problems
    held_out_exprs = {
        p.expression for s in ("eval", "eval_trained") for p in ArithDataset(s, seed=0).problems
    }
    assert not {p.combo for p in train} & set(HELD_OUT_COMBOS)
    assert {p.combo for p in train} == set(TRAIN_COMBOS)  # every trained combination is drawn
    assert not any(is_reserved(p.expression) for p in train)
    assert not {p.expression for p in train} & held_out_exprs
    for p in train[:2000]:
        _check(p)
    fresh = ArithSFTSource("train").sample_batch(5000, np.random.default_rng(1))
    assert not {prompt[:-1] for prompt, _ in fresh} & held_out_exprs


def test_eval_split_covers_held_out_combos() -> None:
    ev = ArithDataset("eval", seed=0)
    assert len(ev) == 200
    assert len({p.expression for p in ev.problems}) == 200
    by_combo = {c: sum(p.combo == c for p in ev.problems) for c in HELD_OUT_COMBOS}
    assert by_combo == {c: 50 for c in HELD_OUT_COMBOS}
    assert not any(is_train_problem(p) for p in ev.problems)
    for p in ev.problems:
        _check(p)
    ex = ev.examples[0]
    p = ev.problems[0]
    assert ex.prompt == p.prompt and ex.prompt_id == "arith/eval/0"
    assert ex.metadata == {"answer": p.completion, "op": p.op, "digits": p.digits, "holdout": "combination"}
    assert len({e.prompt_id for e in ev.examples}) == len(ev)


def test_eval_trained_split() -> None:
    ev = ArithDataset("eval_trained", seed=0)
    assert {p.combo for p in ev.problems} == set(TRAIN_COMBOS)
    assert all(is_reserved(p.expression) and not is_train_problem(p) for p in ev.problems)
    assert len({p.expression for p in ev.problems}) == len(ev) == 241
    assert max(sum(p.combo == c for p in ev.problems) for c in TRAIN_COMBOS) == 10


def test_determinism_by_seed() -> None:
    for split in ("train", "eval", "eval_trained"):
        a = ArithDataset(split, seed=3, size=300).examples
        assert a == ArithDataset(split, seed=3, size=300).examples
        assert a != ArithDataset(split, seed=4, size=300).examples
    src = ArithSFTSource()
    assert src.sample_batch(64, np.random.default_rng(7)) == src.sample_batch(64, np.random.default_rng(7))
    assert src.sample_batch(64, np.random.default_rng(7)) != src.sample_batch(64, np.random.default_rng(8))
    a, b = random.Random(5), random.Random(5)
    assert [sample_train_problem(a) for _ in range(50)] == [sample_train_problem(b) for _ in range(50)]


def test_sft_source_pairs() -> None:
    pairs = ArithSFTSource().sample_batch(500, np.random.default_rng(0))
    assert len(pairs) == 500
    for prompt, completion in pairs:
        assert prompt.endswith("=") and str(eval(prompt[:-1])) == completion  # noqa: S307
    fixed = {p.prompt for p in ArithDataset("eval").problems}
    assert {p for p, _ in ArithSFTSource("eval").sample_batch(100, np.random.default_rng(0))} <= fixed
    with pytest.raises(ValueError, match="split"):
        ArithSFTSource("test")


def test_data_source_resumes_identically() -> None:
    src = ArithDataSource(split="train", seed=1, size=100, shuffle=True)
    for _ in range(7):  # into the third epoch
        src.next_batch(16)
    state = src.state_dict()
    expected = [[e.prompt_id for e in src.next_batch(16)] for _ in range(10)]
    resumed = ArithDataSource(split="train", seed=1, size=100, shuffle=True)
    resumed.load_state_dict(state)
    assert [[e.prompt_id for e in resumed.next_batch(16)] for _ in range(10)] == expected
    with pytest.raises(ValueError, match="does not match"):
        ArithDataSource(split="train", seed=1, size=99).load_state_dict(state)


def test_data_source_from_recipe_args() -> None:
    from hydra.utils import instantiate

    src = instantiate({"_target_": "worlds.arith.ArithDataSource", "split": "eval", "seed": 0})
    assert len(src) == 200
    assert src.next_batch(4)[0].metadata.keys() == {"answer", "op", "digits", "holdout"}
    assert len(ArithDataSource()) == 20_000


@pytest.mark.parametrize("bad", [{"split": "test"}, {"size": 0}, {"size": True}])
def test_bad_arguments_raise(bad: dict) -> None:
    with pytest.raises(ValueError):
        ArithDataset(**bad)


def test_eval_all_holds_both_kinds_apart() -> None:
    """split eval_all: the held-out combinations and the reserved expressions, told apart by
    metadata "holdout"; training problems are "none"."""
    both = ArithDataset("eval_all", seed=0)
    kinds = [ex.metadata["holdout"] for ex in both.examples]
    assert kinds.count("combination") == 200 and kinds.count("expression") == 241
    assert [p.expression for p in both.problems] == [
        p.expression for p in ArithDataset("eval").problems + ArithDataset("eval_trained").problems
    ]
    assert {ex.metadata["holdout"] for ex in ArithDataset("train", size=500).examples} == {"none"}
