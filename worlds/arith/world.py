"""The arithmetic world: integer problems with checkable answers, and a split that holds out skills.

A problem is a short expression over non-negative integer operands (an operand
of d digits is uniform in [10^(d-1), 10^d - 1]; a 1-digit operand is 0-9):

    add    a+b      operands of 1-3 digits
    sub    a-b      operands of 1-3 digits; the answer may be negative
    mul    a*b      operands of 1-2 digits
    chain  a+b-c    3 operands of 1-2 digits, each operator + or -, left to right

A combination is `(op, digits)`, `digits` naming the operand lengths in order
("3x2": a 3-digit then a 2-digit operand). `COMBOS` lists all 30.

Formats (what a character-level LM reads and writes, no chat template):
    prompt      "{expression}="                      e.g. "123+45="
    completion  the answer in ASCII digits, with a leading "-" when negative and
                no other characters, e.g. "168", "-333", "0"; the model ends it
                with EOS (the stop token is not part of the decoded response).

Split (fixed, independent of any seed):
    - `HELD_OUT_COMBOS`: four combinations that appear only in the eval split, each
      an operator on an operand layout trained under another operator (see README.md).
    - Reserved expressions: within the trained combinations, every expression whose
      BLAKE2b hash is 0 mod `RESERVED_MODULUS` (about 1 in 20) is never drawn for
      training; split "eval_trained" asks those.
    So no eval or eval_trained expression is ever a training expression.

Data: `ArithDataset` (prompts of a split), `ArithDataSource` (the same as a
resumable RL data source) and `ArithSFTSource` ((prompt, completion) pairs for
supervised pretraining).
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import math
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from unirl.data.data_source import ListDataSource
from unirl.types.rollout_req import PromptExample

OPS: tuple[str, ...] = ("add", "sub", "mul", "chain")
_SYMBOL = {"add": "+", "sub": "-", "mul": "*"}
_OP_DIGITS: dict[str, tuple[int, ...]] = {"add": (1, 2, 3), "sub": (1, 2, 3), "mul": (1, 2), "chain": (1, 2)}
_ARITY = {"add": 2, "sub": 2, "mul": 2, "chain": 3}

COMBOS: tuple[tuple[str, str], ...] = tuple(
    (op, "x".join(map(str, lengths)))
    for op in OPS
    for lengths in itertools.product(_OP_DIGITS[op], repeat=_ARITY[op])
)
"""Every (op, digits) combination: add and sub 9 each (1x1 .. 3x3), mul 4 (1x1 .. 2x2), chain 8 (1x1x1 .. 2x2x2)."""

HELD_OUT_COMBOS: tuple[tuple[str, str], ...] = (
    ("add", "3x2"),
    ("add", "1x3"),
    ("sub", "2x3"),
    ("mul", "2x1"),
)
"""Combinations only in the eval split: operator mixes. Each held-out operand-length pattern is
trained under another operator (sub 3x2, sub 1x3, add 2x3, add/sub 2x1), so what is held out
is the operator on that layout, not an unseen layout: a tiny transformer does not generalize to
operand lengths it never saw (a base trained with add 3x2, add 2x3, sub 3x2 and mul 2x1 all held
out scored about 1% on them at 32% on unseen problems of trained combinations)."""

TRAIN_COMBOS: tuple[tuple[str, str], ...] = tuple(c for c in COMBOS if c not in HELD_OUT_COMBOS)
"""The 26 combinations training draws from."""

RESERVED_MODULUS = 20
"""An expression of a trained combination is reserved for eval_trained when its hash is 0 mod this."""

SPLITS: tuple[str, ...] = ("train", "eval", "eval_trained", "eval_all")


@dataclass(frozen=True)
class Problem:
    """One arithmetic problem.

    Attributes:
        expression: e.g. "123+45", "12*3", "7+8-2" (no spaces).
        answer: its integer value (+ and - left to right).
        op: one of `OPS`.
        digits: the operand digit lengths, e.g. "3x2", "1x1x1".
    """

    expression: str
    answer: int
    op: str
    digits: str

    def __post_init__(self) -> None:
        if (self.op, self.digits) not in COMBOS:
            raise ValueError(
                f"unknown arithmetic combination ({self.op!r}, {self.digits!r}); known: {COMBOS}"
            )

    @property
    def prompt(self) -> str:
        """The model's input: "{expression}=", e.g. "123+45="."""
        return f"{self.expression}="

    @property
    def completion(self) -> str:
        """The target output: the answer in ASCII digits, "-" first when negative, e.g. "168"."""
        return str(self.answer)

    @property
    def combo(self) -> tuple[str, str]:
        """Its combination `(op, digits)`."""
        return (self.op, self.digits)


def make_problem(op: str, operands: tuple[int, ...], signs: str = "") -> Problem:
    """The problem of `op` over `operands` (non-negative ints); `signs` gives chain's two operators ("+-").

    Raises:
        ValueError: an unknown op, a wrong number of operands or signs, or a negative operand.
    """
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; known: {OPS}")
    if len(operands) != _ARITY[op] or any(x < 0 for x in operands):
        raise ValueError(f"{op} takes {_ARITY[op]} non-negative operands, got {operands}")
    if op == "chain":
        if len(signs) != 2 or set(signs) - {"+", "-"}:
            raise ValueError(f"chain takes two signs from '+-', got {signs!r}")
        answer = operands[0]
        for sign, x in zip(signs, operands[1:], strict=True):
            answer = answer + x if sign == "+" else answer - x
        expression = f"{operands[0]}{signs[0]}{operands[1]}{signs[1]}{operands[2]}"
    else:
        if signs:
            raise ValueError(f"{op} takes no signs, got {signs!r}")
        a, b = operands
        answer = {"add": a + b, "sub": a - b, "mul": a * b}[op]
        expression = f"{a}{_SYMBOL[op]}{b}"
    digits = "x".join(str(len(str(x))) for x in operands)
    return Problem(expression=expression, answer=answer, op=op, digits=digits)


def _operand_range(length: int) -> range:
    return range(0, 10) if length == 1 else range(10 ** (length - 1), 10**length)


def _lengths(digits: str) -> list[int]:
    return [int(d) for d in digits.split("x")]


def random_problem(op: str, digits: str, rng: random.Random) -> Problem:
    """A uniformly random problem of one combination (operands, and chain's signs, uniform)."""
    operands = tuple(rng.choice(_operand_range(n)) for n in _lengths(digits))
    signs = "".join(rng.choice("+-") for _ in range(2)) if op == "chain" else ""
    return make_problem(op, operands, signs)


def combo_size(op: str, digits: str) -> int:
    """How many distinct expressions the combination has."""
    return math.prod(len(_operand_range(n)) for n in _lengths(digits)) * (4 if op == "chain" else 1)


def combo_problems(op: str, digits: str) -> Iterator[Problem]:
    """Every problem of one combination, in operand order."""
    ranges = [_operand_range(n) for n in _lengths(digits)]
    signs = ["".join(s) for s in itertools.product("+-", repeat=2)] if op == "chain" else [""]
    for operands in itertools.product(*ranges):
        for s in signs:
            yield make_problem(op, operands, s)


def is_reserved(expression: str) -> bool:
    """True when an expression is kept out of training (BLAKE2b-64 of its UTF-8 bytes is 0 mod 20)."""
    digest = hashlib.blake2b(expression.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % RESERVED_MODULUS == 0


def is_train_problem(problem: Problem) -> bool:
    """The split rule: a trained combination and not a reserved expression."""
    return problem.combo not in HELD_OUT_COMBOS and not is_reserved(problem.expression)


def sample_train_problem(rng: random.Random) -> Problem:
    """A training problem: a combination uniform over `TRAIN_COMBOS`, then a uniform non-reserved problem."""
    op, digits = rng.choice(TRAIN_COMBOS)
    while True:
        problem = random_problem(op, digits, rng)
        if not is_reserved(problem.expression):
            return problem


_ENUMERATE_BELOW = 20_000  # combinations this small are listed; larger ones are sampled by rejection


def distinct_problems(
    op: str, digits: str, n: int, rng: random.Random, keep: Callable[[Problem], bool]
) -> list[Problem]:
    """Up to `n` distinct uniformly random problems of one combination that satisfy `keep`.

    Fewer than `n` only when the combination has fewer such problems.
    """
    if combo_size(op, digits) <= _ENUMERATE_BELOW:
        pool = [p for p in combo_problems(op, digits) if keep(p)]
        return rng.sample(pool, min(n, len(pool)))
    found: dict[str, Problem] = {}
    for _ in range(1000 * max(n, 1)):
        if len(found) == n:
            break
        p = random_problem(op, digits, rng)
        if keep(p):
            found.setdefault(p.expression, p)
    return list(found.values())


def eval_problems(split: str, seed: int, size: int) -> list[Problem]:
    """The fixed eval list of a split, balanced over its combinations, in `COMBOS` order.

    "eval": `size` problems over `HELD_OUT_COMBOS`; "eval_trained": reserved expressions
    of `TRAIN_COMBOS` (a small combination, e.g. mul 1x1, has only ~5 and gives all it has).
    Combination i gets `size // k + (i < size % k)` distinct problems for k combinations.
    """
    if split == "eval":
        combos, keep = HELD_OUT_COMBOS, lambda p: True
    elif split == "eval_trained":
        combos, keep = TRAIN_COMBOS, lambda p: is_reserved(p.expression)
    else:
        raise ValueError(f"eval split must be 'eval' or 'eval_trained', got {split!r}")
    combos = tuple(c for c in COMBOS if c in combos)
    rng = random.Random(f"arith/{split}/{seed}")
    k = len(combos)
    out: list[Problem] = []
    for i, (op, digits) in enumerate(combos):
        out += distinct_problems(op, digits, size // k + (i < size % k), rng, keep)
    return out


_DEFAULT_SIZE = {"train": 20_000, "eval": 200, "eval_trained": 260, "eval_all": 460}


def holdout_of(problem: Problem) -> str:
    """What a problem holds out: "combination" (a held-out combination), "expression" (a reserved
    expression of a trained combination) or "none" (a training problem)."""
    if problem.combo in HELD_OUT_COMBOS:
        return "combination"
    return "expression" if is_reserved(problem.expression) else "none"


def _split_size(split: str, size: int | None) -> int:
    """`size`, or the split's default; raises ValueError for an unknown split or a bad size."""
    if split not in SPLITS:
        raise ValueError(f"arith split must be one of {SPLITS}, got {split!r}")
    size = _DEFAULT_SIZE[split] if size is None else size
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"arith {split} size must be an int >= 1, got {size!r}")
    return size


def split_problems(split: str, seed: int = 0, size: int | None = None) -> list[Problem]:
    """The problems of a split: "train" draws `size` (default 20000) with `sample_train_problem`
    from `random.Random("arith/train/{seed}")` (repeats possible: add 1x1 has 100
    expressions); the eval splits are `eval_problems` (default size 200 and 260).

    A pure function of its arguments: each list is drawn once per process (recipe validation
    builds the same data sources many times) and every call returns a fresh copy."""
    return list(_drawn_problems(split, seed, _split_size(split, size)))


@functools.lru_cache(maxsize=8)
def _drawn_problems(split: str, seed: int, size: int) -> tuple[Problem, ...]:
    if split == "eval_all":  # both held-out kinds, told apart by the examples' "holdout" metadata
        return _drawn_problems("eval", seed, _DEFAULT_SIZE["eval"]) + _drawn_problems(
            "eval_trained", seed, _DEFAULT_SIZE["eval_trained"]
        )
    if split != "train":
        return tuple(eval_problems(split, seed, size))
    rng = random.Random(f"arith/train/{seed}")
    return tuple(sample_train_problem(rng) for _ in range(size))


def to_example(problem: Problem, prompt_id: str) -> PromptExample:
    """`PromptExample(problem.prompt, prompt_id, {"answer": completion, "op": ..., "digits": ...,
    "holdout": ...})` (`holdout_of`: what the problem holds out)."""
    metadata = {
        "answer": problem.completion,
        "op": problem.op,
        "digits": problem.digits,
        "holdout": holdout_of(problem),
    }
    return PromptExample(prompt=problem.prompt, prompt_id=prompt_id, metadata=metadata)


@functools.lru_cache(maxsize=8)
def _split_examples(split: str, seed: int, size: int) -> tuple[PromptExample, ...]:
    return tuple(
        to_example(p, f"arith/{split}/{i}") for i, p in enumerate(_drawn_problems(split, seed, size))
    )


class ArithDataset:
    """The problems of one split as prompts.

    Args:
        split: "train", "eval" (held-out combinations), "eval_trained" (reserved
            expressions of trained combinations) or "eval_all" (both at their default
            sizes; metadata "holdout" says which).
        seed: which problems are drawn (the split rule itself is fixed).
        size: number of problems; default 20000 for train, 200 for eval, 260 for eval_trained.

    Attributes:
        problems: the `Problem`s, in order.
        examples: one `PromptExample` per problem, id "arith/{split}/{i}", metadata
            {"answer": "168", "op": "add", "digits": "3x2", "holdout": "combination"}
            (each dataset holds its own examples and metadata dicts).
    """

    def __init__(self, split: str = "train", seed: int = 0, size: int | None = None) -> None:
        self.split = split
        self.seed = seed
        size = _split_size(split, size)
        self.problems: list[Problem] = list(_drawn_problems(split, seed, size))
        self.examples: list[PromptExample] = [
            PromptExample(e.prompt, e.prompt_id, dict(e.metadata)) for e in _split_examples(split, seed, size)
        ]

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> PromptExample:
        return self.examples[i]


class ArithDataSource(ListDataSource):
    """An `ArithDataset` as a resumable data source for RL (recipe: `_target_: worlds.arith.ArithDataSource`).

    Epochs, shuffling and `state_dict` / `load_state_dict` are `ListDataSource`'s, with
    `seed` seeding both the problems and the per-epoch order.
    """

    def __init__(self, split: str = "train", seed: int = 0, size: int | None = None, shuffle: bool = True):
        examples = _split_examples(split, seed, _split_size(split, size))  # shared: next_batch copies
        super().__init__(
            list(examples),
            shuffle=shuffle,
            seed=seed,
            source=f"<arith split={split} seed={seed} size={len(examples)}>",
        )


class ArithSFTSource:
    """(prompt, completion) pairs for supervised pretraining.

    Args:
        split: "train" draws fresh problems on every call (never a held-out combination
            or reserved expression); "eval" / "eval_trained" draw from that fixed
            list (for an upper-bound control only).
        seed: the eval list's seed (unused for "train", whose draws come from `rng`).
    """

    def __init__(self, split: str = "train", seed: int = 0) -> None:
        if split not in SPLITS:
            raise ValueError(f"ArithSFTSource split must be one of {SPLITS}, got {split!r}")
        self.split = split
        self.seed = seed
        self._fixed = None if split == "train" else split_problems(split, seed)

    def sample_batch(self, n: int, rng: np.random.Generator) -> list[tuple[str, str]]:
        """`n` pairs like ("123+45=", "168"); deterministic given `rng`'s state, which it advances."""
        py_rng = random.Random(int(rng.integers(2**63)))
        if self._fixed is None:
            problems = [sample_train_problem(py_rng) for _ in range(n)]
        else:
            problems = [py_rng.choice(self._fixed) for _ in range(n)]
        return [(p.prompt, p.completion) for p in problems]
