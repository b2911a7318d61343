"""`tray bench tp`: its argument parser (light: no numpy until the bench runs)."""

from __future__ import annotations

import argparse

from tray.bench.cli import add_program_args, backend_and_nprocs, ints


def add_bench_parser(benches: argparse._SubParsersAction) -> None:
    """Add `tp` to the `tray bench` subcommands."""
    b = benches.add_parser("tp", help="TP MLP: one-shot peer allreduce vs NCCL allreduce, 512 B .. 4 MiB")
    add_program_args(b)
    b.add_argument("--sizes", type=ints, default=None, help="message bytes, comma-separated (512..4194304)")
    b.add_argument("--hidden", type=int, default=256)
    b.add_argument("--ffn", type=int, default=1024)
    b.set_defaults(fn=cmd_bench_tp)


def cmd_bench_tp(args: argparse.Namespace) -> int:
    from tray.programs.tp_mlp.bench import TpBenchArgs, run_tp_bench

    backend, nprocs = backend_and_nprocs(args)
    extra: dict = {} if args.repeats is None else {"repeats": args.repeats}
    if args.sizes is not None:
        extra["sizes"] = args.sizes
    return run_tp_bench(
        TpBenchArgs(
            nprocs=nprocs,
            backend=backend,
            hidden=args.hidden,
            ffn=args.ffn,
            seed=args.seed,
            json_path=args.json,
            log_dir=args.log_dir,
            keep=args.keep,
            **extra,
        )
    )
