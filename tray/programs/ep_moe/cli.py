"""`tray bench ep-moe`: its argument parser (light: no numpy until the bench runs)."""

from __future__ import annotations

import argparse

from tray.bench.cli import add_program_args, backend_and_nprocs, ints


def add_bench_parser(benches: argparse._SubParsersAction) -> None:
    """Add `ep-moe` to the `tray bench` subcommands."""
    b = benches.add_parser("ep-moe", help="EP MoE layer: peer dispatch/combine vs NCCL all-to-all vs EP1")
    add_program_args(b)
    b.add_argument("--tokens", type=ints, default=(128, 4096), help="tokens per rank, comma-separated")
    b.add_argument("--hidden", type=int, default=7168)
    b.add_argument("--experts", type=int, default=256)
    b.add_argument("--topk", type=int, default=8)
    b.add_argument("--expert-dim", type=int, default=2048)
    b.add_argument("--cap", type=int, default=None, help="rows per expert (default: fit the routing)")
    b.add_argument("--ref-tokens", type=int, default=4, help="tokens checked against float64")
    b.add_argument("--plot", default=None, help="PNG of latency vs tokens per rank (the `plot` extra)")
    b.set_defaults(fn=cmd_bench_ep_moe)


def cmd_bench_ep_moe(args: argparse.Namespace) -> int:
    from tray.bench import require_plot
    from tray.programs.ep_moe.bench import EpBenchArgs, run_ep_bench

    backend, nprocs = backend_and_nprocs(args)
    require_plot(args.plot)
    extra = {} if args.repeats is None else {"repeats": args.repeats}
    return run_ep_bench(
        EpBenchArgs(
            nprocs=nprocs,
            backend=backend,
            tokens=args.tokens,
            hidden=args.hidden,
            experts=args.experts,
            topk=args.topk,
            expert_dim=args.expert_dim,
            seed=args.seed,
            cap=args.cap,
            ref_tokens=args.ref_tokens,
            json_path=args.json,
            plot_path=args.plot,
            log_dir=args.log_dir,
            keep=args.keep,
            **extra,
        )
    )
