"""`tray bench tp`: its argument parser (light: no numpy until the bench runs)."""

from __future__ import annotations

import argparse

from tray.bench.cli import add_program_args, backend_and_nprocs, ints


def add_bench_parser(benches: argparse._SubParsersAction) -> None:
    """Add `tp` to the `tray bench` subcommands."""
    b = benches.add_parser("tp", help="peer allreduce (one-shot, two-shot) vs NCCL, 8 B .. 64 MiB, and a TP MLP layer")
    add_program_args(b)
    b.add_argument("--sizes", type=ints, default=None, help="message bytes, comma-separated (cuda: 8 .. 67108864)")
    b.add_argument("--tokens", type=ints, default=None, help="MLP token counts (cuda: 1,4,..,4096)")
    b.add_argument("--hidden", type=int, default=None, help="MLP hidden size (cuda: 8192; host: 256)")
    b.add_argument("--ffn", type=int, default=None, help="MLP ffn size, split over the ranks (cuda: 28672)")
    b.set_defaults(fn=cmd_bench_tp)


def cmd_bench_tp(args: argparse.Namespace) -> int:
    from tray.programs.tp_mlp.bench import TpBenchArgs, run_tp_bench

    backend, nprocs = backend_and_nprocs(args)
    extra: dict = {} if args.repeats is None else {"repeats": args.repeats}
    return run_tp_bench(
        TpBenchArgs(
            nprocs=nprocs,
            backend=backend,
            sizes=args.sizes,
            tokens=args.tokens,
            hidden=args.hidden,
            ffn=args.ffn,
            seed=args.seed,
            json_path=args.json,
            log_dir=args.log_dir,
            keep=args.keep,
            **extra,
        )
    )
