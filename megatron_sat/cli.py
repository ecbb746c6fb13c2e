"""``megatron-sat``: the command-line entry point.

Subcommands:
  train        RL with the config's objective (YAML + ``section.field=value`` overrides)
  warm-start   supervised warm start of a fresh model, written as an HF checkpoint
  serve        the embedded SGLang-compatible rollout server (CPU)
"""

from __future__ import annotations

import argparse
import sys


def _train(args: argparse.Namespace) -> int:
    from megatron_sat.config import load_config
    from megatron_sat.training.rl import run_rl

    cfg = load_config(args.config, args.overrides)
    if args.dry_run:
        import yaml

        print(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        return 0
    run_rl(cfg)
    return 0


def _warm_start(args: argparse.Namespace) -> int:
    from megatron_sat.training.warm_start import WarmStartConfig, warm_start

    cfg = WarmStartConfig(
        model_config=args.model_config,
        train_path=args.train_path,
        out_dir=args.out_dir,
        num_steps=args.num_steps,
        batch_size=args.batch_size,
        lr=args.lr,
        seed=args.seed,
    )
    print(f"warm start written to {warm_start(cfg)}")
    return 0


def _serve(argv: list[str]) -> int:
    from megatron_sat.rollout.embedded import server

    return server.main(argv) or 0


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run the subcommand; returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        return _serve(argv[1:])
    parser = argparse.ArgumentParser(
        prog="megatron-sat",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="RL training")
    train.add_argument("--config", help="YAML run config (see examples/configs)")
    train.add_argument("--dry-run", action="store_true", help="print the resolved config")
    train.add_argument("overrides", nargs="*", help="section.field=value overrides")
    train.set_defaults(func=_train)
    ws = sub.add_parser("warm-start", help="supervised warm start")
    ws.add_argument("--model-config", default="examples/models/qwen3_moe_tiny.json")
    ws.add_argument("--train-path", default="data/arith/train.jsonl")
    ws.add_argument("--out-dir", default="checkpoints/warm_start")
    ws.add_argument("--num-steps", type=int, default=300)
    ws.add_argument("--batch-size", type=int, default=64)
    ws.add_argument("--lr", type=float, default=3e-3)
    ws.add_argument("--seed", type=int, default=1234)
    ws.set_defaults(func=_warm_start)
    sub.add_parser("serve", help="embedded rollout server (flags as sglang.launch_server)")
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
