"""``megatron-sat``: the command-line entry point.

Subcommands:
  train        RL with the config's objective (YAML + ``section.field=value`` overrides)
  warm-start   supervised warm start of a fresh model, written as an HF checkpoint
  serve        the embedded SGLang-compatible rollout server (CPU)
  launch       validate the cluster plan (--dry-run) or render the torchrun / sbatch / mpirun
               script of a config
  eval         avg@n and pass@k of a checkpoint on a held-out set through rollout servers
  convert      checkpoint conversion (arguments of megatron_sat.checkpoint.convert)
  plot         a PNG of the curves of one or more runs, side by side
  sweep        a grid of runs (methods x lags x seeds) one at a time, resumable, or its SLURM
               job array (--slurm); ``sweep report`` writes its table.md and figures
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys


def _load_config(command: str, path: str | None, overrides: list[str]):
    """The run config, or exit 2 with the offending field named (no traceback: a user error)."""
    import yaml

    from megatron_sat.config import load_config

    try:
        return load_config(path, overrides)
    except (ValueError, TypeError, OSError, yaml.YAMLError) as e:
        print(f"megatron-sat {command}: config error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def _train(args: argparse.Namespace) -> int:
    from megatron_sat.launch.env import resolve_rank_env

    source = resolve_rank_env(os.environ)  # mpirun: OMPI_COMM_WORLD_* -> RANK, WORLD_SIZE, ...
    if source != "single":
        rank, world = os.environ["RANK"], os.environ["WORLD_SIZE"]
        print(f"megatron-sat train: rank {rank} of {world} (from {source})", file=sys.stderr)
    from megatron_sat.training.rl import run_rl, validate_run

    cfg = _load_config("train", args.config, args.overrides)
    try:  # before anything is built: a wrong layout or an over-long row fails here, named
        validate_run(cfg)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"megatron-sat train: {e}", file=sys.stderr)
        return 1
    if args.dry_run:
        import yaml

        print(yaml.safe_dump(cfg.to_dict(resolved=True), sort_keys=False))
        print("dry run: the configuration is valid", file=sys.stderr)
        return 0
    _install_crash_hook(os.environ.get(CRASH_AT_ENV))
    _install_stop_hook(os.environ.get(STOP_AT_ENV))
    run_rl(cfg)
    return 0


CRASH_AT_ENV = "MEGATRON_SAT_CRASH_AT"


def _install_crash_hook(spec: str | None) -> None:
    """Crash tests only: ``MEGATRON_SAT_CRASH_AT=<phase>:<step>`` SIGKILLs this process at
    that phase of the run checkpoint commit of that step (phases ``writing``, ``written``,
    ``renamed``, ``committed``; see ``checkpoint.run_state``). Unset: nothing is installed.

    Raises:
        SystemExit: (2) for a malformed value, naming the variable.
    """
    if not spec:
        return
    import signal

    from megatron_sat.checkpoint.run_state import COMMIT_PHASES, set_commit_hook

    phase, _, step = spec.partition(":")
    if phase not in COMMIT_PHASES or not step.isdigit():
        print(
            f"megatron-sat train: {CRASH_AT_ENV}={spec!r}: want <phase>:<step>, phase one "
            f"of {COMMIT_PHASES}",
            file=sys.stderr,
        )
        raise SystemExit(2)

    def hook(at: str, at_step: int) -> None:
        if at == phase and at_step == int(step):
            os.kill(os.getpid(), signal.SIGKILL)

    set_commit_hook(hook)


STOP_AT_ENV = "MEGATRON_SAT_STOP_AT"


def _install_stop_hook(spec: str | None) -> None:
    """Stop tests only: ``MEGATRON_SAT_STOP_AT=<step>:<mini_step>`` raises SIGUSR1 in this
    process (the run's stop handler, ``training.stop``) right after optimizer step
    ``<mini_step>`` of rollout batch ``<step>`` (the one trained at trainer version
    ``<step> - 1``), a deterministic stand-in for a signal that arrives then. Unset: nothing
    is installed.

    Raises:
        SystemExit: (2) for a malformed value, naming the variable.
    """
    if not spec:
        return
    import signal

    from megatron_sat.training.mini_batches import set_step_hook

    step, _, mini = spec.partition(":")
    if not (step.isdigit() and mini.isdigit() and int(step) > 0 and int(mini) > 0):
        print(
            f"megatron-sat train: {STOP_AT_ENV}={spec!r}: want <step>:<mini_step>, both >= 1",
            file=sys.stderr,
        )
        raise SystemExit(2)

    def hook(version: int | None, done: int) -> None:
        if version == int(step) - 1 and done == int(mini):
            signal.raise_signal(signal.SIGUSR1)

    set_step_hook(hook)


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


def _convert(argv: list[str]) -> int:
    from megatron_sat.checkpoint import convert

    return convert.main(argv) or 0


def _launch(args: argparse.Namespace) -> int:
    from megatron_sat.config import load_config
    from megatron_sat.launch.plan import format_plan, resolve_plan
    from megatron_sat.launch.prepare import prepare_launch

    overrides = list(args.overrides)
    if args.launcher:
        overrides.append(f"launch.launcher={args.launcher}")
    try:
        cfg = load_config(args.config, overrides)
        if args.dry_run:
            print(format_plan(resolve_plan(cfg)))
            print("dry run: the configuration is valid", file=sys.stderr)
            return 0
        prepared = prepare_launch(cfg, args.out_dir)
    except ValueError as e:
        print(f"megatron-sat launch: {e}", file=sys.stderr)
        return 1
    print(format_plan(prepared.plan), file=sys.stderr)
    run = "sbatch" if cfg.launch.launcher == "slurm" else "bash"
    print(
        f"wrote {prepared.script_path}; run it with: {run} {prepared.script_path}", file=sys.stderr
    )
    print(prepared.script_path)
    return 0


def _plot(args: argparse.Namespace) -> int:
    from megatron_sat.experiments.plots import plot_runs

    try:
        panels = plot_runs(args.run_dirs, args.out)
    except (OSError, ValueError) as e:
        print(f"megatron-sat plot: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}: {', '.join(panels)}")
    return 0


def _sweep(args: argparse.Namespace) -> int:
    from megatron_sat.experiments.sweep import (
        load_grid,
        render_slurm_array,
        run_sweep,
        sweep_report,
    )

    try:
        grid = load_grid(args.grid, output_dir=args.output_dir)
    except (OSError, ValueError) as e:
        print(f"megatron-sat sweep: {e}", file=sys.stderr)
        return 2
    if args.action == "report":
        out = args.out or str(grid.output_dir / "report")
        # the sweep's own command is what the table quotes; by default this report's
        command = args.command_line or shlex.join(["megatron-sat", *args.argv])
        try:
            table = sweep_report(grid, out, command=command)
        except (OSError, ValueError) as e:
            print(f"megatron-sat sweep report: {e}", file=sys.stderr)
            return 2
        print(table)
        return 0
    if args.slurm:
        print(render_slurm_array(grid, args.slurm, args.sbatch_option))
        return 0
    if args.dry_run:
        for cell in grid.cells:
            state = "finished" if cell.finished else "todo"
            print(f"{cell.index}\t{state}\t{cell.row.id}\tlag {cell.lag}\tseed {cell.seed}")
        return 0
    try:
        result = run_sweep(grid, cells=args.cell or None, jobs=args.jobs)
    except ValueError as e:
        print(f"megatron-sat sweep: {e}", file=sys.stderr)
        return 2
    print(", ".join(f"{k} {len(v)}" for k, v in result.items()))
    return 1 if result["failed"] else 0


def _eval(args: argparse.Namespace) -> int:
    from megatron_sat.launch.eval_job import EvalOptions, run_eval

    cfg = _load_config("eval", args.config, args.overrides)
    opts = EvalOptions(
        data_path=args.data or cfg.data.eval_path,
        name=args.name,
        checkpoint=args.checkpoint,
        num_samples=args.num_samples,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_new_tokens=args.max_new_tokens,
        pass_ks=tuple(args.pass_k),
        step=args.step,
        num_prompts=args.num_prompts,
        prompt_key=args.prompt_key,
        label_key=args.label_key,
    )
    metrics = run_eval(cfg, opts)
    for key, value in metrics.items():
        print(f"{key}: {value:.4f}")
    return 0


def _parser() -> argparse.ArgumentParser:
    """The subcommands and their flags (``serve`` and ``convert`` parse their own)."""
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
    sub.add_parser("convert", help="checkpoint conversion (see its own --help)")
    la = sub.add_parser("launch", help="dry-run or render the launch script of a config")
    la.add_argument("--config", required=True, help="YAML run config with a launch section")
    la.add_argument("--launcher", choices=["torchrun", "slurm", "mpirun"], help="override")
    la.add_argument("--dry-run", action="store_true", help="validate and print the topology")
    la.add_argument("--out-dir", help="launch directory (default <run_dir>/launch)")
    la.add_argument("overrides", nargs="*", help="section.field=value overrides")
    la.set_defaults(func=_launch)
    _add_eval(sub)
    _add_plot_and_sweep(sub)
    return parser


def _add_eval(sub: argparse._SubParsersAction) -> None:
    """``eval``: avg@n / pass@k of a checkpoint served by the run config's engine."""
    ev = sub.add_parser("eval", help="avg@n / pass@k on a held-out set")
    ev.add_argument("--config", help="YAML run config (servers, checkpoint, run_dir)")
    ev.add_argument("--data", help="held-out jsonl/parquet (default data.eval_path)")
    ev.add_argument("--name", help="metric prefix (default: the data file's stem)")
    ev.add_argument("--checkpoint", help="HF checkpoint to serve (default init_checkpoint)")
    ev.add_argument("--num-samples", type=int, default=16, help="samples per problem (n)")
    ev.add_argument("--temperature", type=float, default=1.0)
    ev.add_argument("--top-p", type=float, default=1.0)
    ev.add_argument("--top-k", type=int, default=-1, help="-1 = off")
    ev.add_argument("--max-new-tokens", type=int, help="default rollout.max_new_tokens")
    ev.add_argument("--pass-k", type=int, nargs="*", default=[], help="k of pass@k")
    ev.add_argument("--step", type=int, default=0, help="TensorBoard step / weight version")
    ev.add_argument("--num-prompts", type=int, help="first N problems only")
    ev.add_argument("--prompt-key", help="dataset key of the prompt (e.g. problem)")
    ev.add_argument("--label-key", help="dataset key of the answer (e.g. answer)")
    ev.add_argument("overrides", nargs="*", help="section.field=value overrides")
    ev.set_defaults(func=_eval)


def _add_plot_and_sweep(sub: argparse._SubParsersAction) -> None:
    """``plot`` (curves of runs) and ``sweep`` (a grid of runs, its report or its job array)."""
    pl = sub.add_parser("plot", help="PNG of the curves of one or more runs (metrics.jsonl)")
    pl.add_argument("run_dirs", nargs="+", help="run directories to compare")
    pl.add_argument("--out", default="runs/plot.png", help="PNG to write")
    pl.set_defaults(func=_plot)
    sw = sub.add_parser("sweep", help="run a grid of runs one at a time, or report it")
    sw.add_argument("action", nargs="?", choices=["run", "report"], default="run")
    sw.add_argument("--grid", required=True, help="grid YAML (see examples/sweeps)")
    sw.add_argument("--output-dir", help="cells' parent directory (default: the grid's)")
    sw.add_argument("--cell", type=int, nargs="*", default=[], help="only these cell indices")
    sw.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="cells at once (each cell's processes get 1/jobs of the cores' threads)",
    )
    sw.add_argument("--dry-run", action="store_true", help="list the cells and their state")
    sw.add_argument("--slurm", help="write an sbatch job array (one task per cell) here")
    sw.add_argument("--sbatch-option", action="append", default=[], help="extra #SBATCH option")
    sw.add_argument("--out", help="report: directory of table.md and the PNGs")
    sw.add_argument("--command-line", help="report: the command to quote at the table's top")
    sw.set_defaults(func=_sweep)


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run the subcommand; returns the exit status.

    Run as the program (``argv`` None: the console script, ``python -m megatron_sat.cli``),
    it first applies ``platform.threads.configure_threads``, before anything imports torch (the
    OpenMP runtime reads its wait policy once, at load); a user's ``OMP_NUM_THREADS`` is kept.
    """
    if argv is None:
        from megatron_sat.platform.threads import configure_threads

        configure_threads()
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        return _serve(argv[1:])
    if argv[:1] == ["convert"]:
        return _convert(argv[1:])
    parser = _parser()
    args = parser.parse_args(argv)
    args.argv = argv
    try:
        return args.func(args)
    except KeyboardInterrupt:  # Ctrl-C outside the run's own handler (training.stop)
        print(f"megatron-sat {args.command}: interrupted (Ctrl-C)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
