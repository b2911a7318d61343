"""`tray bench ep-moe` and `tray bench tp`: their argument parsers (light: no numpy until a bench runs)."""

from __future__ import annotations

import argparse

from tray.errors import UsageError


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one integer")
    return values


def _common(b: argparse.ArgumentParser) -> None:
    b.add_argument("-n", "--nprocs", type=int, default=None, help="ranks (default: visible GPUs, or 4)")
    b.add_argument("--backend", choices=("host", "cuda"), default=None)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--repeats", type=int, default=None, help="timed replays per figure (median)")
    b.add_argument("--json", default=None, help="write the report here")
    b.add_argument("--log-dir", default=None, help="keep one log file per rank here")
    b.add_argument("--keep", action="store_true", help="keep the work directory (plans, outputs)")


def add_bench_parsers(benches: argparse._SubParsersAction) -> None:
    """Add `ep-moe` and `tp` to the `tray bench` subcommands."""
    b = benches.add_parser("ep-moe", help="EP MoE layer: peer dispatch/combine vs NCCL all-to-all vs EP1")
    _common(b)
    b.add_argument("--tokens", type=_ints, default=(128, 4096), help="tokens per rank, comma-separated")
    b.add_argument("--hidden", type=int, default=7168)
    b.add_argument("--experts", type=int, default=256)
    b.add_argument("--topk", type=int, default=8)
    b.add_argument("--expert-dim", type=int, default=2048)
    b.add_argument("--cap", type=int, default=None, help="rows per expert (default: fit the routing)")
    b.add_argument("--ref-tokens", type=int, default=4, help="tokens checked against float64")
    b.add_argument("--plot", default=None, help="PNG of latency vs tokens per rank (needs matplotlib)")
    b.set_defaults(fn=cmd_bench_ep_moe)

    b = benches.add_parser("tp", help="TP MLP: one-shot peer allreduce vs NCCL allreduce, 512 B .. 4 MiB")
    _common(b)
    b.add_argument("--sizes", type=_ints, default=None, help="message bytes, comma-separated (512..4194304)")
    b.add_argument("--hidden", type=int, default=256)
    b.add_argument("--ffn", type=int, default=1024)
    b.set_defaults(fn=cmd_bench_tp)


def _backend_and_n(args: argparse.Namespace) -> tuple[str, int]:
    from tray.cli import _backend_and_n as pick

    backend, nprocs = pick(args.backend, args.nprocs)
    if args.repeats is not None and args.repeats < 1:
        raise UsageError(f"--repeats must be at least 1, got {args.repeats}")
    return backend, nprocs


def cmd_bench_ep_moe(args: argparse.Namespace) -> int:
    from tray.moe.bench import EpBenchArgs, run_ep_bench

    backend, nprocs = _backend_and_n(args)
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


def cmd_bench_tp(args: argparse.Namespace) -> int:
    from tray.tp.bench import TpBenchArgs, run_tp_bench

    backend, nprocs = _backend_and_n(args)
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
