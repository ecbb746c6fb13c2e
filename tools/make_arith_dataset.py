"""Writes the arithmetic RL dataset as train.jsonl and test.jsonl.

Example:
    python tools/make_arith_dataset.py --out-dir data/arith --seed 0 --num-train 20000 \\
        --num-test 500 --max-digits 3 --ops=+,-

Each line is ``{"prompt": "37+45=", "label": "82"}``; the splits share no prompt and the files
are identical for identical arguments. Write ``--ops=-,+`` (with "=") when the list starts with
"-", or argparse takes it for an option.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from megatron_sat.rollout.arith import make_arith_splits, parse_ops


def write_jsonl(path: Path, rows: list[dict[str, str]]) -> None:
    """Writes one compact JSON object per line (UTF-8, newline-terminated)."""
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def main(argv: list[str] | None = None) -> int:
    """Parses arguments, generates both splits and writes them; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, required=True, help="folder for the two files")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-train", type=int, required=True)
    parser.add_argument("--num-test", type=int, required=True)
    parser.add_argument("--max-digits", type=int, default=3, help="operands in [0, 10**N)")
    parser.add_argument("--ops", type=str, default="+,-", help='comma-separated, e.g. "+,-,*"')
    args = parser.parse_args(argv)

    try:
        train_rows, test_rows = make_arith_splits(
            args.num_train, args.num_test, args.seed, args.max_digits, parse_ops(args.ops)
        )
    except ValueError as e:
        # Bad arguments: argparse's usage line plus the reason, exit status 2.
        parser.error(str(e))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    write_jsonl(args.out_dir / "train.jsonl", train_rows)
    write_jsonl(args.out_dir / "test.jsonl", test_rows)
    print(
        f"wrote {len(train_rows)} train and {len(test_rows)} test rows to {args.out_dir}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
