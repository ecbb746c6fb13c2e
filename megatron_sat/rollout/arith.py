"""Verifiable arithmetic prompts ("37+45=" -> "82") for the tiny CPU RL task.

Problems are drawn uniformly without replacement from the space of all (left operand, operator,
right operand) triples with operands in [0, 10**max_digits), so no prompt repeats inside one call
and the splits of `make_arith_splits` never share a prompt. Results may be negative ("5-13=" ->
"-8"); operands never are.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

SUPPORTED_OPS = ("+", "-", "*")


def _validate(num: int, max_digits: int, ops: Sequence[str]) -> int:
    """Checks the arguments and returns the number of distinct problems available."""
    if isinstance(num, bool) or not isinstance(num, int) or num < 0:
        raise ValueError(f"num must be an int >= 0, got {num!r}")
    if isinstance(max_digits, bool) or not isinstance(max_digits, int) or max_digits < 1:
        raise ValueError(f"max_digits must be an int >= 1, got {max_digits!r}")
    if not ops:
        raise ValueError("ops must name at least one operator")
    unknown = [op for op in ops if op not in SUPPORTED_OPS]
    if unknown:
        raise ValueError(f"ops {unknown!r} are not supported; choose from {SUPPORTED_OPS}")
    if len(set(ops)) != len(ops):
        # A repeated operator would double its share of the problems without saying so.
        raise ValueError(f"ops must not repeat an operator, got {list(ops)!r}")
    num_problems = len(ops) * (10**max_digits) ** 2
    if num > num_problems:
        raise ValueError(
            f"num={num} exceeds the {num_problems} distinct problems with max_digits="
            f"{max_digits} and ops={list(ops)!r}"
        )
    return num_problems


def _evaluate(left: int, op: str, right: int) -> int:
    """Exact integer result of `left op right`."""
    if op == "+":
        return left + right
    if op == "-":
        return left - right
    if op == "*":
        return left * right
    raise ValueError(f"unsupported operator {op!r}; choose from {SUPPORTED_OPS}")


def make_arith_rows(
    num: int, seed: int, max_digits: int = 3, ops: Sequence[str] = ("+", "-")
) -> list[dict[str, str]]:
    """Draws `num` distinct arithmetic problems.

    Args:
        num: Number of rows, 0 <= num <= len(ops) * 100**max_digits.
        seed: Seed of the private `random.Random`; equal arguments give equal rows.
        max_digits: Operands lie in [0, 10**max_digits), uniformly (so most have max_digits
            digits).
        ops: Operators, a non-repeating subset of "+", "-", "*".

    Returns:
        Rows ``{"prompt": "37+45=", "label": "82"}`` in sampling order, all prompts distinct.

    Raises:
        ValueError: A negative `num`, `max_digits` < 1, empty, unknown or repeated `ops`, or more
            rows asked for than distinct problems exist.
    """
    _validate(num, max_digits, ops)
    operand_range = 10**max_digits
    problems_per_op = operand_range**2
    rng = random.Random(seed)
    # random.sample on a range draws distinct integers without materialising the range, so a
    # problem index maps to exactly one (op, left, right) triple and duplicates cannot occur.
    indices = rng.sample(range(len(ops) * problems_per_op), num)
    rows = []
    for index in indices:
        op_index, pair_index = divmod(index, problems_per_op)
        left, right = divmod(pair_index, operand_range)
        op = ops[op_index]
        rows.append({"prompt": f"{left}{op}{right}=", "label": str(_evaluate(left, op, right))})
    return rows


def make_arith_splits(
    num_train: int,
    num_test: int,
    seed: int,
    max_digits: int = 3,
    ops: Sequence[str] = ("+", "-"),
) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """Draws disjoint train and test splits from one pool of distinct problems.

    Args:
        num_train: Number of training rows, >= 0.
        num_test: Number of test rows, >= 0.
        seed, max_digits, ops: As in `make_arith_rows`.

    Returns:
        (train_rows, test_rows); no prompt appears in both.

    Raises:
        ValueError: As in `make_arith_rows`, for num_train + num_test rows, or a negative count.
    """
    for name, value in (("num_train", num_train), ("num_test", num_test)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    rows = make_arith_rows(num_train + num_test, seed, max_digits, ops)
    return rows[:num_train], rows[num_train:]


def parse_ops(text: str) -> tuple[str, ...]:
    """Parses a comma-separated operator list ("+,-") as given on a command line.

    Raises:
        ValueError: An empty entry (e.g. "+,,-"); unknown operators are caught by
            `make_arith_rows`.
    """
    ops = tuple(part.strip() for part in text.split(","))
    if any(not op for op in ops):
        raise ValueError(f"ops {text!r} has an empty entry; write e.g. '+,-'")
    return ops
