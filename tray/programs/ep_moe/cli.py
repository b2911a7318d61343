"""`tray bench ep-moe`: its argument parser (light: no numpy until the bench runs)."""

from __future__ import annotations

import argparse

from tray.bench.cli import add_program_args, backend_and_nprocs, ints, words

# The layer's shape: DeepSeek-V3's on GPUs; on the host backend (numpy twins on CPU cores) one that runs in
# well under a minute on 2 cores with a few hundred MB per rank.
CUDA_SHAPE = {"tokens": (128, 4096), "hidden": 7168, "experts": 256, "topk": 8, "expert_dim": 2048}
HOST_SHAPE = {"tokens": (16, 64), "hidden": 256, "experts": 16, "topk": 4, "expert_dim": 256}


def add_bench_parser(benches: argparse._SubParsersAction) -> None:
    """Add `ep-moe` to the `tray bench` subcommands."""
    b = benches.add_parser("ep-moe", help="EP MoE layer: peer dispatch/combine vs NCCL all-to-all vs EP1")
    add_program_args(b)
    b.add_argument("--tokens", type=ints, default=None,
                   help="tokens per rank, comma-separated (default 128,4096 on cuda, 16,64 on host)")
    b.add_argument("--hidden", type=int, default=None, help="default 7168 on cuda, 256 on host")
    b.add_argument("--experts", type=int, default=None, help="default 256 on cuda, 16 on host")
    b.add_argument("--topk", type=int, default=None, help="default 8 on cuda, 4 on host")
    b.add_argument("--expert-dim", type=int, default=None, help="default 2048 on cuda, 256 on host")
    b.add_argument("--routing", type=words, default=("uniform", "zipf"),
                   help="routings, comma-separated: uniform, zipf (skew 1), zipf:S (default uniform,zipf)")
    b.add_argument("--capacity", default="4",
                   help="rows per expert: 'worst' (every token of every rank may pick it) or a factor of the mean "
                   "rows per expert (default 4; pairs beyond it are dropped and counted)")
    b.add_argument("--gemm", choices=("auto", "masked", "wgmma", "cublas"), default="auto",
                   help="expert GEMMs: 'masked' (one launch over every expert, rows from the device counts, "
                   "mma.sync), 'wgmma' (the same on Hopper's warpgroup MMA, compute capability 9.0 only), 'auto' "
                   "(default: wgmma on compute capability 9.0, else masked) or 'cublas' (a cuBLAS GEMM per expert "
                   "over all cap rows)")
    b.add_argument("--sms", type=words, default=("all", "24"),
                   help="SM budgets of the peer kernels, comma-separated (default all,24)")
    b.add_argument("--ref-tokens", type=int, default=8,
                   help="evenly spaced tokens of each run checked against float64 (plus, on the first token count "
                   "of each routing, tokens covering every expert)")
    b.add_argument("--nccl-timing", choices=("eager", "captured"), default="captured",
                   help="how the NCCL path's programs are timed: 'captured' (graph replays, as the peer path; "
                   "default) or 'eager' (launched from Python between an eager barrier and device events; the "
                   "peer path's dispatch/combine/layer are also timed so, as peer_eager)")
    b.add_argument("--nnodes", type=int, default=1,
                   help="run the EP-N tray as a job of this many nodes on this machine (-n / N ranks each; cuda: "
                   "each its share of the GPUs and its own NCCL_HOSTID); the peer path within a node, its rows for "
                   "other nodes staged and carried by an NCCL all-to-all, and the NCCL path beside it, both checked "
                   "against EP1 byte for byte (default 1)")
    b.add_argument("--dispatch", type=words, default=("bf16",),
                   help="dispatch formats, comma-separated: bf16 (the baseline, always) and fp8 (e4m3 rows with a "
                   "float32 scale per 128 values, dequantized on the receiver: timed as dispatch_fp8 and layer_fp8, "
                   "checked against EP1's FP8 path, its error against bf16 and float64 reported; default bf16)")
    b.add_argument("--ll-phases", action="store_true",
                   help="after each run's timing, time the low-latency kernels' diagnosis build (cuda, one node) and "
                   "report where their µs go, phase by phase per rank (runs[].ll_phases; "
                   "tray/programs/ep_moe/ll_phases.py)")
    b.add_argument("--plot", default=None, help="PNG of latency vs tokens per rank (the `plot` extra)")
    b.set_defaults(fn=cmd_bench_ep_moe)


def cmd_bench_ep_moe(args: argparse.Namespace) -> int:
    from tray.bench import check_report_path, require_plot
    from tray.programs.ep_moe.bench import EpBenchArgs, run_ep_bench, validate

    backend, nprocs = backend_and_nprocs(args)
    require_plot(args.plot)
    check_report_path(args.json)
    extra = {} if args.repeats is None else {"repeats": args.repeats}
    if backend != "cuda" and args.repeats is None:
        extra["repeats"] = 3  # NOTE: numpy twins: three samples per figure keep the host run short
    shape = dict(CUDA_SHAPE if backend == "cuda" else HOST_SHAPE)
    given = {k: getattr(args, k) for k in shape if getattr(args, k) is not None}
    defaults = {k: v for k, v in shape.items() if k not in given}
    shape.update(given)
    bench = EpBenchArgs(
        nprocs=nprocs,
        backend=backend,
        tokens=shape["tokens"],
        hidden=shape["hidden"],
        experts=shape["experts"],
        topk=shape["topk"],
        expert_dim=shape["expert_dim"],
        routings=args.routing,
        capacity=args.capacity,
        gemm=args.gemm,
        budgets=args.sms,
        seed=args.seed,
        ref_tokens=args.ref_tokens,
        json_path=args.json,
        plot_path=args.plot,
        log_dir=args.log_dir,
        keep=args.keep,
        nccl_timing=args.nccl_timing,
        nnodes=args.nnodes,
        dispatch=args.dispatch,
        ll_phases=args.ll_phases,
        **extra,
    )
    validate(bench)  # a usage error before the defaults line, not after it
    if backend == "host" and defaults:
        print("ep-moe: host backend defaults: " + ", ".join(f"{k.replace('_', '-')} {v}" for k, v in defaults.items())
              + " (a DeepSeek-sized layer takes > 10 GB per rank and minutes in numpy)", flush=True)
    return run_ep_bench(bench)
