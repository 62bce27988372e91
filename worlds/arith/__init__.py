"""The arithmetic world: integer problems with checkable answers for a tiny character-level LM.

Problems, formats and the train/eval split (`world`) and the answer scorers
(`verifier`). See README.md.
"""

from worlds.arith.verifier import ArithAnswer, ArithFormat, strip_answer
from worlds.arith.world import (
    COMBOS,
    HELD_OUT_COMBOS,
    OPS,
    RESERVED_MODULUS,
    SPLITS,
    TRAIN_COMBOS,
    ArithDataset,
    ArithDataSource,
    ArithSFTSource,
    Problem,
    combo_problems,
    combo_size,
    distinct_problems,
    eval_problems,
    holdout_of,
    is_reserved,
    is_train_problem,
    make_problem,
    random_problem,
    sample_train_problem,
    split_problems,
    to_example,
)

__all__ = [
    "COMBOS",
    "HELD_OUT_COMBOS",
    "OPS",
    "RESERVED_MODULUS",
    "SPLITS",
    "TRAIN_COMBOS",
    "ArithAnswer",
    "ArithDataSource",
    "ArithDataset",
    "ArithFormat",
    "ArithSFTSource",
    "Problem",
    "combo_problems",
    "combo_size",
    "distinct_problems",
    "eval_problems",
    "holdout_of",
    "is_reserved",
    "is_train_problem",
    "make_problem",
    "random_problem",
    "sample_train_problem",
    "split_problems",
    "strip_answer",
    "to_example",
]
