"""`tray bench tp`: its argument parser (light: no numpy until the bench runs)."""

from __future__ import annotations

import argparse

from tray.bench.cli import add_program_args, backend_and_nprocs, ints
from tray.programs.tp_mlp.defaults import DEFAULTS


def _said(key: str) -> str:
    """Each backend's default of `key`, for the help: "cuda: 8,16,..,67108864; host: 8,16,..,32768"."""
    def one(v: object) -> str:
        return f"{v[0]},{v[1]},..,{v[-1]}" if isinstance(v, tuple) and len(v) > 3 else \
            ",".join(map(str, v)) if isinstance(v, tuple) else str(v)
    return "; ".join(f"{backend}: {one(d[key])}" for backend, d in DEFAULTS.items())


def add_bench_parser(benches: argparse._SubParsersAction) -> None:
    """Add `tp` to the `tray bench` subcommands."""
    b = benches.add_parser("tp", help="TP allreduce vs NCCL, 8 B .. 64 MiB (one-shot, two-shot, low-latency), and "
                                      "a TP MLP layer")
    add_program_args(b)
    b.add_argument("--sizes", type=ints, default=None, help=f"message bytes, comma-separated ({_said('sizes')})")
    b.add_argument("--tokens", type=ints, default=None, help=f"MLP token counts ({_said('tokens')})")
    b.add_argument("--hidden", type=int, default=None, help=f"MLP hidden size ({_said('hidden')})")
    b.add_argument("--ffn", type=int, default=None, help=f"MLP ffn size, split over the ranks ({_said('ffn')})")
    b.add_argument("--ll-max-bytes", type=int, default=None, metavar="N",
                   help="largest message the tray sends through the low-latency path (default: the manifest's)")
    b.add_argument("--ll-sweep-bytes", type=int, default=None, metavar="N",
                   help="time the low-latency path up to N bytes (cuda: 4 MiB; host: 32 KiB)")
    b.add_argument("--ll-shapes", default=None, metavar="SPEC",
                   help="also time the low-latency path at these launch shapes, e.g. 'threads=256,512;lines=1,2' "
                        "and line formats (';formats=ll,ll3', default ll) (keys ar_ll[t512,l2], ar_ll3[t128,l1] per "
                        "size, each checked after its timed replays)")
    b.add_argument("--nnodes", type=int, default=1, metavar="K",
                   help="run the N-rank tray as a job of K nodes on this machine (N / K ranks each; cuda: each its "
                   "share of the GPUs and its own NCCL_HOSTID); TP runs within each node (default 1)")
    b.add_argument("--no-nccl-windows", dest="nccl_windows", action="store_false",
                   help="cuda: leave out NCCL on buffers registered as symmetric windows (ar_nccl_win), e.g. where "
                        "the registration fails (which aborts the communicator, and the run)")
    b.add_argument("--plot", default=None, metavar="PNG", help="latency vs size as a PNG (the `plot` extra)")
    b.set_defaults(fn=cmd_bench_tp)


def cmd_bench_tp(args: argparse.Namespace) -> int:
    from tray.bench import check_report_path, require_plot
    from tray.programs.tp_mlp.bench import TpBenchArgs, run_tp_bench, validate
    from tray.programs.tp_mlp.ll import parse_ll_shapes

    backend, nprocs = backend_and_nprocs(args)
    require_plot(args.plot)
    check_report_path(args.json)
    extra: dict = {"plot_path": args.plot}
    if args.ll_shapes is not None:
        extra["ll_shapes"] = parse_ll_shapes(args.ll_shapes)
    if args.repeats is not None:
        extra["repeats"] = args.repeats
    bench = TpBenchArgs(
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
        ll_max_bytes=args.ll_max_bytes,
        ll_sweep_bytes=args.ll_sweep_bytes,
        nnodes=args.nnodes,
        nccl_windows=args.nccl_windows,
        **extra,
    )
    validate(bench.resolved())  # a usage error before the defaults line, not after it
    if backend == "host" and None in (args.sizes, args.tokens, args.repeats):
        d = DEFAULTS["host"]
        print(f"tp: host backend defaults: sizes {d['sizes'][0]} .. {d['sizes'][-1]} B, tokens {list(d['tokens'])}, "
              f"hidden {d['hidden']}, ffn {d['ffn']}, {d['repeats']} repeats (--sizes, --tokens, ... to change)",
              flush=True)
    return run_tp_bench(bench)
