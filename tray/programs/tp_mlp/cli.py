"""`tray bench tp`: its argument parser (light: no numpy until the bench runs)."""

from __future__ import annotations

import argparse

from tray.bench.cli import add_program_args, backend_and_nprocs, ints


def add_bench_parser(benches: argparse._SubParsersAction) -> None:
    """Add `tp` to the `tray bench` subcommands."""
    b = benches.add_parser("tp", help="TP MLP: one-shot peer allreduce vs NCCL allreduce, 512 B .. 4 MiB")
    add_program_args(b)
    b.add_argument("--sizes", type=ints, default=None,
                   help="message bytes, comma-separated (default 512..4194304 on cuda, 512..65536 on host)")
    b.add_argument("--hidden", type=int, default=256, help="MLP hidden size (default 256)")
    b.add_argument("--ffn", type=int, default=1024, help="MLP ffn size, split over the ranks (default 1024)")
    b.add_argument("--plot", default=None, metavar="PNG", help="latency vs size as a PNG (the `plot` extra)")
    b.set_defaults(fn=cmd_bench_tp)


def cmd_bench_tp(args: argparse.Namespace) -> int:
    from tray.bench import require_plot
    from tray.programs.tp_mlp.bench import HOST_REPEATS, HOST_SIZES, TpBenchArgs, run_tp_bench

    backend, nprocs = backend_and_nprocs(args)
    require_plot(args.plot)
    extra: dict = {"plot_path": args.plot}
    if backend == "host":  # sized to finish within a minute on a 2-core machine
        extra.update(sizes=HOST_SIZES, repeats=HOST_REPEATS)
        if args.sizes is None or args.repeats is None:
            print(f"tp: host backend defaults: sizes {HOST_SIZES[0]} .. {HOST_SIZES[-1]} B, {HOST_REPEATS} repeats "
                  "(--sizes, --repeats to change)", flush=True)
    if args.repeats is not None:
        extra["repeats"] = args.repeats
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
