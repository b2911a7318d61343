"""`tray` / `python -m tray`: launch, gate, bench, inspect, doctor."""

from __future__ import annotations

import argparse
import contextlib
import difflib
import errno
import json
import os
import re
import shutil
import signal
import stat
import sys
from collections.abc import Sequence
from typing import NoReturn

from tray.envvars import stop_signals
from tray.errors import TrayError, UsageError
from tray.lazy import DEPENDENCIES
from tray.text import is_digits

EXIT_USAGE = 2


def _backend_and_n(backend: str | None, nprocs: int | None, share: bool | None = None) -> tuple[str, int]:
    """The tray's backend and size, checked against the visible GPUs before anything is spawned (`share`: ranks
    may share them; None: TRAY_SHARE_GPUS). The caller warns when the ranks outnumber the cores, once every
    option has been checked (pick.warn_if_oversubscribed)."""
    from tray.launch.pick import backend_and_nprocs

    return backend_and_nprocs(backend, nprocs, share)


def _parse_vars(items: Sequence[str]) -> tuple[tuple[str, int], ...]:
    out = []
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise UsageError(f"--var expects NAME=INT, got {item!r}")
        try:
            out.append((name, int(value)))
        except ValueError:
            raise UsageError(f"--var {name}: expected an integer, got {value!r}") from None
    return tuple(out)


def _job_of(args: argparse.Namespace):  # -> JobSpec | None

    from tray.launch.job import HEARTBEAT_INTERVAL_S, JobArgs, resolve_job

    least = 2 * HEARTBEAT_INTERVAL_S
    if not least <= args.node_heartbeat_timeout_s < float("inf"):
        raise UsageError(f"--node-heartbeat-timeout-s must be a number of seconds of at least {least:g} (heads and "
                         f"the root heartbeat every {HEARTBEAT_INTERVAL_S:g} s), got {args.node_heartbeat_timeout_s}")
    return resolve_job(JobArgs(
        nnodes=args.nnodes, node_rank=args.node_rank, rdzv_endpoint=args.rdzv_endpoint, rdzv_id=args.rdzv_id,
        master_addr=args.master_addr, master_port=args.master_port, nproc_per_node=args.nprocs, slurm=args.slurm,
        node_heartbeat_timeout_s=args.node_heartbeat_timeout_s, standalone=args.standalone), os.environ)


def _note_options_after_the_program(cmd: Sequence[str], launch: argparse.ArgumentParser) -> None:
    """`tray launch prog.py -n 2`: as under torchrun, what follows the program is the program's; when that looks
    like one of tray's options, a note says so (the command runs as given). Not with `--`: the split is explicit."""
    if not cmd or cmd[0] == "--":
        return
    ours = [a for a in cmd[1:] if a.partition("=")[0] in launch._option_string_actions and a not in ("-h", "--help")]
    if ours:
        print(f"tray: note: {' '.join(ours)} after the program {cmd[0]!r} go to the program, not to tray launch; put "
              "tray's options before the program", file=sys.stderr, flush=True)


def _check_program(cmd: Sequence[str], dashed: bool) -> None:
    """A program named without `--` that is no file: one line saying so, before anything starts."""
    if not dashed and cmd[0].endswith(".py") and os.path.isdir(cmd[0]):
        raise UsageError(f"{cmd[0]}: a directory without a __main__.py, not a program (the program to run: a path to "
                         "a .py file, or -- CMD ARGS...)")
    if not dashed and cmd[0].endswith(".py") and not os.path.isfile(cmd[0]) and not shutil.which(cmd[0]):
        raise UsageError(f"{cmd[0]}: no such file here or on PATH (the program to run: a path to a .py file, or "
                         "-- CMD ARGS...)")


def _nprocs_of(args: argparse.Namespace) -> int | None:
    """-n as a number (None: the default), torchrun's words resolved: gpu needs a visible GPU, cpu counts cores."""
    n = args.nprocs
    if n == "cpu":  # torchrun's: one process per core, which here are host ranks
        if args.backend == "cuda":
            raise UsageError("--nproc-per-node cpu is one host rank per core; with --backend cuda give a number")
        args.backend = "host"
        return len(os.sched_getaffinity(0))
    if n == "gpu":
        from tray.backend import detect_backend

        if (args.backend or detect_backend()) != "cuda":
            raise UsageError("--nproc-per-node gpu: no GPU is visible (or --backend host was given); give a number "
                             "of ranks: the host backend runs them without a GPU")
        return None
    return None if n == "auto" else n


def cmd_launch(args: argparse.Namespace) -> int:
    from tray.launch import TraySpec, placements_for, run_tray
    from tray.launch.pick import warn_if_oversubscribed
    from tray.launch.spawn import process_started_at
    from tray.manifest.names import resolve_manifest

    cmd = list(args.cmd)
    dashed = bool(cmd) and cmd[0] == "--"
    if dashed:
        cmd = cmd[1:]
    ways = [flag for flag, on in (("-m/--module", args.module), ("--no-python", args.no_python),
                                  ("--run-path", args.run_path)) if on]
    if len(ways) > 1:
        raise UsageError(f"{' and '.join(ways)} say {len(ways)} ways of starting the program; give one")
    if not cmd:
        what = "a module: tray launch -n 4 -m package.module" if args.module else \
            "tray launch -n 4 program.py, or tray launch -n 4 -- CMD ARGS..."
        raise UsageError(f"tray launch needs a command: {what}")
    if args.module:
        cmd = [sys.executable, "-m", *cmd]  # torchrun's -m: `python -m MODULE ARGS`
    elif args.run_path or (not args.no_python and not dashed and cmd[0].endswith(".py")
                           and (os.path.isfile(cmd[0]) or os.path.isfile(os.path.join(cmd[0], "__main__.py")))):
        cmd = [sys.executable, *cmd]  # `tray launch -n 4 prog.py`: as torchrun, with this Python (a directory too)
    else:
        _check_program(cmd, dashed)
    _note_torchrun_flags(args)
    if args.nprocs is None:  # torchrun's default for it: a PyTorchJob's nprocPerNode, one pod or several
        from tray.launch.job import pytorchjob_nprocs

        args.nprocs = pytorchjob_nprocs(os.environ)
    args.nprocs = _nprocs_of(args)
    if args.max_restarts < 0:
        raise UsageError(f"--max-restarts must be 0 or more, got {args.max_restarts}")
    for flag, seconds in (("--barrier-timeout-s", args.barrier_timeout_s), ("--timeout-s", args.timeout_s),
                          ("--heartbeat-timeout-s", args.heartbeat_timeout_s)):
        if seconds is not None and not 0 < seconds < float("inf"):
            raise UsageError(f"{flag} must be a number of seconds > 0, got {seconds}")
    from tray.handshake import HEARTBEAT_INTERVAL_S

    if args.heartbeat_timeout_s < 4 * HEARTBEAT_INTERVAL_S:
        raise UsageError(f"--heartbeat-timeout-s must be at least {4 * HEARTBEAT_INTERVAL_S:g} s: ranks heartbeat "
                         f"every {HEARTBEAT_INTERVAL_S:g} s, and a silent rank's CPU use is measured over the last "
                         f"half second before it is judged frozen; got {args.heartbeat_timeout_s:g}")
    from tray.launch.output import Routing, parse_ranks_filter, parse_streams

    if args.standalone and args.nnodes not in (None, 1):
        raise UsageError(f"--standalone is one host; --nnodes {args.nnodes} is several: drop one of them")
    job = _job_of(args)
    master_port = None
    if job is None and args.master_port is not None:  # one host: torchrun's --master-port is MASTER_PORT there
        if not 1 <= args.master_port <= 65535:
            raise UsageError(f"--master-port must be a TCP port, 1..65535, got {args.master_port}")
        master_port = args.master_port
    if job is not None and args.max_restarts:
        raise UsageError("--max-restarts restarts one tray; a job of several nodes restarts as a whole, under its "
                         "scheduler (e.g. sbatch --requeue), so drop --max-restarts with --nnodes")
    backend, nprocs = _backend_and_n(args.backend, job.nproc_per_node if job else args.nprocs, args.share_gpus)
    tee, redirects = parse_streams("--tee", args.tee, nprocs), parse_streams("--redirects", args.redirects, nprocs)
    ranks = parse_ranks_filter(args.local_ranks_filter, nprocs)
    Routing(log_dir=args.log_dir, tee=tee, redirects=redirects)  # refuses --tee/--redirects without --log-dir
    from tray.envvars import barrier_timeout, join_collectives

    barrier_timeout(os.environ.get("TRAY_BARRIER_TIMEOUT_S"))  # a bad value fails here, not in every rank
    program = next((c for c in cmd if c.endswith(".py")), None)  # the program file: `prog.py`, `-- python prog.py`
    manifest = resolve_manifest(args.manifest, program) if args.manifest is not None else None
    warn_if_oversubscribed(nprocs, timeout_flag="--barrier-timeout-s (or TRAY_BARRIER_TIMEOUT_S)")
    spec = TraySpec(nprocs=nprocs, cmd=tuple(cmd), backend=backend, manifest=manifest,
                    vars=_parse_vars(args.var), log_dir=args.log_dir, handshake_timeout_s=args.timeout_s,
                    heartbeat_timeout_s=args.heartbeat_timeout_s, grace_s=args.stop_grace_s,
                    timeline=not args.quiet, tee=tee,
                    redirects=redirects, local_ranks_filter=ranks, barrier_timeout_s=args.barrier_timeout_s,
                    max_restarts=args.max_restarts, launched_at=process_started_at(), share_gpus=args.share_gpus,
                    run_id=args.rdzv_id if job is None else None, master_port=master_port,
                    join_collectives=join_collectives(args.join_collectives, os.environ.get("TRAY_JOIN_COLLECTIVES")))
    if job is None:
        code = run_tray(spec).exit_code
    else:
        from tray.launch.node import NodeHead

        code = NodeHead(spec, job, placements_for(backend, nprocs, args.share_gpus)).run().exit_code
    global _launched
    _launched = True  # the tray is down and cleaned up: `program` may end this process at once
    return code


def cmd_gate(args: argparse.Namespace) -> int:
    from tray.programs import GATES

    if args.gate not in GATES:
        close = difflib.get_close_matches(args.gate, GATES, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else f"; known gates: {', '.join(GATES)}"
        raise UsageError(f"unknown gate {args.gate!r}{hint}")
    from tray.bench import check_report_path
    from tray.launch.pick import warn_if_oversubscribed
    from tray.programs.peer_barrier.gate import GateArgs, run_gate

    backend, nprocs = _backend_and_n(args.backend, args.nprocs)
    if not args.stress:
        given = [f for f, v in (("--replays", args.replays), ("--skew-ns", args.skew_ns)) if v is not None]
        if given:
            raise UsageError(f"{' and '.join(given)} set the rounds of --stress: give --stress, or leave them out")
    elif args.drop is not None:
        raise UsageError("--drop and --stress are two gates: --stress checks the barrier's ordering with every rank "
                         "in it, --drop that a rank that never comes is named; run them one at a time")
    check_report_path(args.json)
    stress = {k: v for k, v in (("replays", args.replays), ("skew_ns", args.skew_ns)) if v is not None}
    return run_gate(GateArgs(nprocs=nprocs, backend=backend, iters=args.iters, drop=args.drop,
                             timeout_s=args.timeout_s, json_path=args.json, log_dir=args.log_dir,
                             stress=args.stress, **stress, corrupt=args.corrupt,
                             warn=lambda: warn_if_oversubscribed(nprocs, timeout_flag="--timeout-s")))


def cmd_inspect(args: argparse.Namespace) -> int:
    from tray.manifest import load_manifest
    from tray.manifest.inspect import format_inspect
    from tray.manifest.names import format_builtins, resolve_manifest

    if args.list:
        print(format_builtins())
        return 0
    if not args.manifest:
        raise UsageError("tray inspect needs a manifest (a file or a built-in name), or --list")
    from tray.manifest.resolve import MAX_WORLD_SIZE
    from tray.weights.loader import check_bind
    from tray.weights.safetensors import SafetensorsHeader

    if args.nprocs is not None and not 1 <= args.nprocs <= MAX_WORLD_SIZE:
        raise UsageError(f"tray inspect -n {args.nprocs}: the number of ranks to resolve the manifest for is 1 to "
                         f"{MAX_WORLD_SIZE}")
    manifest = load_manifest(resolve_manifest(args.manifest))
    headers: dict[str, SafetensorsHeader] = {}  # each file's header read once for every rank and buffer
    print(format_inspect(manifest, args.nprocs, dict(_parse_vars(args.var)),
                         check_bind=lambda b, env, jp, path: check_bind(b, env, jp, path, headers)))
    return 0


def _nccl_version() -> str | None:
    try:
        from tray.collectives import nccl

        return str(nccl.version())
    except Exception:  # NOTE: no NCCL in this Python: the report says "not found"
        return None


def cmd_doctor(args: argparse.Namespace) -> int:
    from tray.backend.cuda import visible_gpu_count

    if visible_gpu_count() == 0:
        report = {"gpus": [], "note": "no GPU visible: the host backend runs every tray"}
        print(json.dumps(report, indent=2) if args.json else "tray doctor: no GPU visible; "
              "`tray launch` and the gates use the host backend (memfd + numpy)")
        return 0
    from tray.backend.cuda.doctor import doctor_report, format_doctor

    report = doctor_report(_nccl_version())
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_doctor(report))
    return 0


LAUNCH_EPILOG = """\
examples:
  tray launch -n 4 prog.py                                one rank per GPU (host backend without GPUs)
  tray launch -n 2 --backend host --manifest m.json -- python prog.py
  tray launch --manifest peer_fill prog.py                a built-in manifest (tray inspect --list)
  tray launch -n 8 -q --log-dir logs --tee 3 --local-ranks-filter 0 -- python serve.py
                                                          rank 0 on the terminal, every rank's lines in logs/
  tray launch --nnodes 2 --node-rank 0 --rdzv-endpoint node0:29400 -n 4 --manifest m.json prog.py
                                                          node 0 of a job of two trays (node1: --node-rank 1);
                                                          both with the same TRAY_JOB_TOKEN in the environment
  srun -N 2 --ntasks-per-node=1 tray launch -n 4 prog.py  the same under Slurm (launch/slurm/tray.sbatch)

output: every line a rank writes is printed as "[rank R] line". With --log-dir D, D/rank-R.log gets
every line, stamped (ISO 8601, ms), and the error report of a rank that failed. --tee/--redirects take
torchrun's numbers: 0 none, 1 stdout, 2 stderr, 3 both; --tee S: streams S go to the file and the
terminal; --redirects S: streams S go to the file only. S for every rank, or per local rank: --redirects
0:3,1:2 (ranks not listed: 0). A rank given 0 by both flags gets --tee 3: --log-dir alone is --tee 3.

exit codes: 0 every rank exited 0; 1 a rank failed (the root cause is printed first); 2 usage, setup or
manifest error; 3 the handshake failed (offers disagree, a rank never offered); 130 interrupted.
env: TRAY_JOBS_ROOT (job directories), TRAY_BARRIER_TIMEOUT_S (as --barrier-timeout-s), TRAY_JOB_TOKEN
(a job of several nodes: the secret every node shares; never read from the command line), SLURM_*, PET_*
(PyTorchJob), LWS_* (LeaderWorkerSet): the job's shape where --nnodes and friends are not given.
ranks get TRAY_RESTART_COUNT (and TORCHELASTIC_RESTART_COUNT): the attempts before theirs.
torchrun's --rdzv-backend, --rdzv-conf, --monitor-interval, --start-method, --role, --local-addr,
--logs-specs and --event-log-handler are accepted and change nothing (a note says so where torchrun would
act on the value given); -m, --no-python and --run-path run the program as torchrun's do.
"""


COMMANDS = ("launch", "gate", "inspect", "bench", "doctor")


_INVALID_CHOICE = re.compile(r"invalid choice: '([^']*)' \(choose from (.*)\)")


class _Parser(argparse.ArgumentParser):
    """argparse's parser, its errors one line as every other usage error: what was wrong, and where the options
    are listed (argparse would print the whole usage block first)."""

    def _get_option_tuples(self, option_string: str) -> list:
        """The options a prefix could stand for, one per option: `tray launch` takes each option in two spellings
        (`--barrier-timeout-s`, `--barrier_timeout_s`), so argparse took every prefix of a two-word option for
        ambiguous and refused it even after the program (`tray launch prog.py --bar`, `--time`, `--share`),
        which torchrun passes to the program as they are; a prefix of one option is that option."""
        seen: set[int] = set()
        out = []
        for t in super()._get_option_tuples(option_string):
            if id(t[0]) not in seen:
                seen.add(id(t[0]))
                out.append(t)
        return out

    def error(self, message: str) -> NoReturn:
        hint = f"`{self.prog} --help` lists the options"
        if (wrong := _INVALID_CHOICE.search(message)) is not None:  # `tray lanch`: argparse lists, not suggests
            listed = re.findall(r"'([^']*)'", wrong.group(2)) or [c.strip() for c in wrong.group(2).split(",")]
            close = difflib.get_close_matches(wrong.group(1), listed, n=1)
            if close:
                message += f"; did you mean {close[0]!r}?"
        print(f"tray: UsageError: {self.prog}: {message} ({hint})", file=sys.stderr)
        sys.exit(EXIT_USAGE)


def _command_parser(ap: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.ArgumentParser:
    """The (sub-)command's parser that parsed `argv`."""
    for word in (a for a in argv if not a.startswith("-")):
        sub = next((a for a in ap._actions if isinstance(a, argparse._SubParsersAction)), None)
        if sub is None or word not in sub.choices:
            break
        ap = sub.choices[word]
    return ap


def _unknown_options(ap: argparse.ArgumentParser, argv: Sequence[str], extra: Sequence[str]) -> NoReturn:
    """`extra`: what no option of the command took; each flag among them with the nearest real one."""
    ap = _command_parser(ap, argv)
    known = [o for o in ap._option_string_actions if o.startswith("--")]
    hints = []
    for arg in extra:
        close = difflib.get_close_matches(arg.split("=")[0], known, n=1) if arg.startswith("--") else []
        hints.append(f"{arg} (did you mean {close[0]}?)" if close else arg)
    ap.error(f"unrecognized arguments: {' '.join(hints)}")


NPROCS_WORDS = ("gpu", "auto", "cpu")  # torchrun's --nproc-per-node words


def _nprocs_arg(text: str) -> int | str:
    """-n/--nproc-per-node: a number of ranks, or torchrun's words: gpu (every visible GPU), auto (the default:
    the visible GPUs, else HOST_DEFAULT_NPROCS host ranks), cpu (one host rank per CPU core)."""
    if text in NPROCS_WORDS:
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of ranks (or {', '.join(NPROCS_WORDS)}), got "
                                         f"{text!r}") from None


def _grace_arg(text: str) -> float:
    """--stop-grace-s: seconds >= 0, at most an hour (a stop must end)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not 0 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"expected 0 to 3600 s, got {text}")
    return value


def _nnodes_arg(text: str) -> int:
    """--nnodes N, or torchrun's MIN:MAX when MIN == MAX (an elastic range is refused: tray's jobs are fixed)."""
    low, sep, high = text.partition(":")
    try:
        n, m = int(low), int(high if sep else low)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of nodes, got {text!r}") from None
    if n != m:
        raise argparse.ArgumentTypeError(f"{text!r} is an elastic range (torchrun's MIN:MAX); a job of trays has a "
                                         "fixed number of nodes: give one number")
    return n


# torchrun's flags that change nothing here: (what tray does instead, the values that mean just that; None: any)
TORCHRUN_NO_EFFECT: dict[str, tuple[str, tuple[str, ...] | None]] = {
    "--rdzv-backend": ("the nodes of a job meet at the root's --rdzv-endpoint (tray's own rendezvous)",
                       ("c10d", "static")),
    "--rdzv-conf": ("tray's waits are --timeout-s and --node-heartbeat-timeout-s", ()),
    "--monitor-interval": ("the head watches its ranks all the time", None),
    "--start-method": ("every rank is a fresh process, as torchrun's spawn", ("spawn",)),
    "--role": ("ROLE_NAME is 'default'", ("default",)),
    "--local-addr": ("ranks reach each other over this host's loopback and the root over --rdzv-endpoint", ()),
    "--logs-specs": ("rank logs are --log-dir, --tee and --redirects", ()),
    "--event-log-handler": ("tray logs no torchelastic events", ("null",)),
}


def _note_torchrun_flags(args: argparse.Namespace) -> None:
    """One note per torchrun flag given that changes nothing here, unless its value means what tray does."""
    for flag, (instead, fine) in TORCHRUN_NO_EFFECT.items():
        value = getattr(args, "torchrun_" + flag[2:].replace("-", "_"), None)
        if value is None or fine is None or value in fine:
            continue
        print(f"tray: note: {flag} {value} is torchrun's and has no effect under tray launch: {instead}",
              file=sys.stderr, flush=True)


def _accept_underscores(p: argparse.ArgumentParser) -> None:
    """torchrun takes --nproc_per_node as well as --nproc-per-node: so does `tray launch`, for every option. The
    underscore spelling is only parsed: the help and the messages name each option as tray spells it."""
    for action in list(p._actions):
        for opt in list(action.option_strings):
            alias = "--" + opt[2:].replace("-", "_")
            if opt.startswith("--") and alias != opt and alias not in p._option_string_actions:
                p._option_string_actions[alias] = action


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole command line; with `command` one of the others, `bench`'s sub-commands are left out (their
    parsers import every program: time a `tray launch` would spend before its first rank starts)."""
    from tray import __version__

    ap = _Parser(prog="tray", description="Run one SPMD program across the GPUs of a host.",
                                 epilog="`tray CMD --help` for each command; `tray inspect --list` for the built-in "
                                        "manifests; in tray's source tree: docs/cli.md (commands), docs/api.md, "
                                        "docs/manifest.md, docs/design.md")
    ap.add_argument("--version", action="version", version=f"tray {__version__} (Python {sys.version.split()[0]})")
    sub = ap.add_subparsers(dest="command", required=True, metavar="{" + ",".join(COMMANDS) + "}")

    p = sub.add_parser("launch", help="spawn N ranks of CMD and supervise them",
                       description="Spawn N ranks of CMD, form the tray (handshake, peer mappings, groups),\n"
                                   "supervise them, and stop all of them at the first failure.",
                       epilog=LAUNCH_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", "--nprocs", "--nproc-per-node", type=_nprocs_arg, default=None,
                   help="ranks (default: the visible GPUs; host backend: 4); checked against the visible GPUs "
                        "and CUDA_VISIBLE_DEVICES before anything starts; torchrun's gpu, auto (the default) and "
                        "cpu (one host rank per core) too")
    p.add_argument("--backend", choices=("host", "cuda"), default=None, help="default: cuda if a GPU is visible")
    p.add_argument("--manifest", default=None,
                   help="manifest JSON file or built-in name (tray inspect --list); default: the world group")
    p.add_argument("--share-gpus", action="store_true", default=None,
                   help="more ranks than GPUs: rank r on GPU r mod G, taking turns there, NCCL over sockets; for "
                        "checking correctness on fewer GPUs, never for timings (default: $TRAY_SHARE_GPUS)")
    job = p.add_argument_group("a job of several nodes (one `tray launch` per node; secret in $TRAY_JOB_TOKEN)")
    job.add_argument("--nnodes", type=_nnodes_arg, default=None, help="nodes in the job (torchrun's N:N too)")
    job.add_argument("--node-rank", type=int, default=None, help="this node's rank, 0..nnodes-1 (0 hosts the root)")
    job.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT", help="where node 0's root listens")
    job.add_argument("--rdzv-id", default=None, help="a name of the job (the same on every node)")
    job.add_argument("--master-addr", default=None, help="the root's host (torchrun's spelling)")
    job.add_argument("--master-port", type=int, default=None, help="the root's port (torchrun's spelling)")
    job.add_argument("--standalone", action="store_true",
                     help="torchrun's: one host, rendezvous on it (what tray launch does without --nnodes)")
    job.add_argument("--slurm", action="store_true",
                     help="read the job from Slurm (automatic inside `srun --ntasks-per-node=1`)")
    job.add_argument("--node-heartbeat-timeout-s", type=float, default=5.0,
                     help="a node or the root silent this long is lost (default 5)")
    p.add_argument("--var", action="append", default=[], metavar="NAME=INT",
                   help="override a manifest var (repeatable)")
    p.add_argument("-q", "--quiet", action="store_true", help="no startup timeline (rank output and errors stay)")
    p.add_argument("--log-dir", default=None, metavar="DIR", help="keep one log file per rank here (rank-R.log)")
    p.add_argument("-t", "--tee", default="0", metavar="S|R:S,...",
                   help="streams to the log file AND the terminal: 0 none, 1 stdout, 2 stderr, 3 both; for every "
                        "rank, or per local rank as 0:3,1:2 (ranks not listed: 0)")
    p.add_argument("-r", "--redirects", default="0", metavar="S|R:S,...",
                   help="streams to the log file ONLY: 0 none, 1 stdout, 2 stderr, 3 both; for every rank, or per "
                        "local rank as 0:3,1:2 (ranks not listed: 0)")
    p.add_argument("--local-ranks-filter", default=None, metavar="R[,R...]",
                   help="show only these ranks' output on the terminal (log files keep every rank's)")
    p.add_argument("--barrier-timeout-s", type=float, default=None, metavar="S",
                   help="how long programs' barriers wait (default: the manifest's barrier_timeout_s, or 2); "
                        "sets TRAY_BARRIER_TIMEOUT_S for every rank")
    p.add_argument("--timeout-s", type=float, default=30.0, metavar="S",
                   help="once a rank called tray.init(), every rank must offer and report ready within S of it "
                        "(default 30)")
    p.add_argument("--heartbeat-timeout-s", type=float, default=10.0, metavar="S",
                   help="a rank silent this long is stopped or frozen: the tray fails (default 10)")
    p.add_argument("--stop-grace-s", type=_grace_arg, default=3.0, metavar="S",
                   help="a stop (a failure elsewhere, Ctrl-C, SIGTERM) gives each rank S after its SIGTERM before "
                        "SIGKILL: time for a SIGTERM handler to save state (default 3; torchrun's is 30)")
    p.add_argument("--max-restarts", type=int, default=0, metavar="K",
                   help="after a failure, tear down and start the tray again up to K times (default 0)")
    p.add_argument("--join-collectives", choices=("auto", "early", "lazy"), default=None,
                   help="cuda, one node: when ranks join their NCCL groups: early (while they start, ids made by "
                        "the head), lazy (at the first collective), auto (early when a manifest program has a "
                        "collective op); default: $TRAY_JOIN_COLLECTIVES, else auto")
    p.add_argument("-m", "--module", action="store_true",
                   help="torchrun's: the program is a module, run as `python -m MODULE ARGS...` with this Python")
    p.add_argument("--no-python", action="store_true",
                   help="torchrun's: run the program as the command it is, a .py file too (no Python put before it)")
    p.add_argument("--run-path", action="store_true",
                   help="torchrun's: run the program with this Python whatever its name (a .py file is anyway)")
    for flag in TORCHRUN_NO_EFFECT:  # accepted, a note when they would change something under torchrun
        p.add_argument(flag, dest="torchrun_" + flag[2:].replace("-", "_"), default=None, help=argparse.SUPPRESS)
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="PROGRAM.py ARGS... (run with this Python), or -- CMD ARGS...")
    _accept_underscores(p)
    p.set_defaults(fn=cmd_launch)

    p = sub.add_parser("gate", help="qualification runs: peer-barrier",
                       description="µs per barrier (eager, eager-sync, captured, eager graph launches), per rank; "
                                   "with --drop R, passes only if every other rank names R missing within the "
                                   "timeout + 0.5 s; with --stress, passes only if no rank received a wrong word.")
    p.add_argument("gate", metavar="GATE", help="which gate: peer-barrier")
    p.add_argument("-n", "--nprocs", type=int, default=None, help="ranks (default: the visible GPUs; host: 4)")
    p.add_argument("--backend", choices=("host", "cuda"), default=None, help="default: cuda if a GPU is visible")
    p.add_argument("--iters", type=int, default=1000,
                   help="barriers per timed repeat (--stress: rounds per graph; default 1000)")
    p.add_argument("--drop", type=int, default=None, help="this rank never enters the barrier")
    p.add_argument("--timeout-s", type=float, default=2.0, help="barrier timeout, s (default 2)")
    p.add_argument("--json", default=None, help="write the report here (with the environment and the command)")
    p.add_argument("--log-dir", default=None, help="keep one log file per rank here")
    p.add_argument("--stress", action="store_true",
                   help="check the barrier's ordering: --iters rounds of write peers -> barrier -> check on the "
                        "device, eagerly and in a replayed graph; fails on any wrong word")
    p.add_argument("--replays", type=int, default=None, help="--stress: graph replays (default 5)")
    p.add_argument("--skew-ns", type=int, default=None, help="--stress: each round one rank starts this much later "
                   "per step (default 2000)")
    p.add_argument("--corrupt", type=int, default=None, metavar="RANK",
                   help="--stress: RANK sends one wrong word (the gate must fail)")
    p.set_defaults(fn=cmd_gate)

    p = sub.add_parser("inspect", help="print a manifest's groups, buffers, kernels, programs, digest")
    p.add_argument("manifest", nargs="?", help="a manifest file or a built-in name (see --list)")
    p.add_argument("--list", action="store_true", help="list the built-in manifests")
    p.add_argument("-n", "--nprocs", type=int, default=4, help="world size to resolve shapes for (default 4)")
    p.add_argument("--var", action="append", default=[], metavar="NAME=INT",
                   help="override a manifest var (repeatable)")
    p.set_defaults(fn=cmd_inspect)

    p = sub.add_parser("bench", help="benchmarks, each against its baseline measured in the same run")
    benches = p.add_subparsers(dest="bench", required=True)
    if command not in COMMANDS or command == "bench":
        from tray.programs import bench_parsers

        for add_bench_parser in bench_parsers():
            add_bench_parser(benches)
        benches.metavar = "{" + ",".join(benches.choices) + "}"  # a missing one is named by the benches there are

    p = sub.add_parser("doctor", help="what this machine's GPUs can do")
    p.add_argument("--json", action="store_true", help="the report as JSON")
    p.set_defaults(fn=cmd_doctor)
    return ap


_interrupt_said = False  # main said the interruption (program says it where a second signal cut main short)


def _say_interrupted(exc: KeyboardInterrupt) -> None:
    global _interrupt_said
    print(f"tray: interrupted{_which_signal(exc)}; the tray was stopped", file=sys.stderr, flush=True)
    _interrupt_said = True


def _which_signal(exc: KeyboardInterrupt) -> str:
    """` (SIGTERM: ...)` for an interruption the head raised for a signal it got; `""` for a plain Ctrl-C."""
    words = str(exc).split()
    if len(words) != 2 or words[0] != "signal" or not is_digits(words[1]):
        return ""
    name = signal.Signals(int(words[1])).name
    if name == "SIGTERM" and os.environ.get("SLURM_JOB_ID"):
        return f" ({name}: under Slurm, scancel, the job's time limit, or its preemption or requeue)"
    if name == "SIGHUP":
        return f" ({name}: its terminal closed; nohup tray launch ... keeps a tray running past its terminal)"
    return f" ({name})"


# decided once, at import: whether SIGHUP stops the tray depends on whether the process was started ignoring it
_STOP_SIGNALS = stop_signals()


def _terminate_as_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


_terminate_as_interrupt.stops_tray = True  # type: ignore[attr-defined]  # (envvars.stop_signals)


# SIGUSR1/SIGUSR2 are the program's: Slurm's --signal warning and scancel --signal reach every process of the step,
# the ranks included, and a head dead of one took the ranks with it, saying nothing. A handler that does nothing, not
# SIG_IGN: an ignored signal would stay ignored in the ranks the head starts, a handled one is the default there again.
_USER_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)


def _leave_to_the_ranks(signum: int, frame: object) -> None:
    pass


def _ignore_late_signals() -> None:
    """The command is over (its tray stopped): a SIGINT/SIGTERM now would only change how the process ends.
    Ignored, not defaulted: CPython puts its handled signals back to the default while it shuts down, so a
    second SIGTERM during the exit would otherwise kill the process (-15) instead of the exit status
    saying what happened."""
    for sig in _STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command in this process; returns its exit status. SIGTERM is a Ctrl-C while it runs; the
    caller's SIGTERM handler is put back afterwards (`program` is the entry point that exits instead)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = build_parser(argv[0] if argv else None)
    args, extra = ap.parse_known_args(argv)
    if extra:
        _unknown_options(ap, argv, extra)
    if args.command == "launch":
        _note_options_after_the_program(args.cmd, _command_parser(ap, argv))
    # SIGTERM (and SIGHUP) to the head tears the tray down like Ctrl-C does (the ranks die with it anyway).
    previous = {sig: signal.signal(sig, _terminate_as_interrupt) for sig in _STOP_SIGNALS if sig != signal.SIGINT}
    previous.update({sig: signal.signal(sig, _leave_to_the_ranks) for sig in _USER_SIGNALS})
    try:
        code = int(args.fn(args))
        # NOTE: flushed here, not at the interpreter's exit, where a reader gone or a full disk is only "Exception
        # ignored" and exit 120 (stdout is block-buffered to a pipe or a file: a short output is all still there); a
        # launch keeps its tray's status (its lines to a stream without a reader are dropped, said once)
        return code if _launched else _flushed(code)
    except TrayError as exc:
        print(f"tray: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except ImportError as exc:
        shadow = _shadowed_dependency()
        if shadow:
            print(f"tray: SetupError: {shadow}", file=sys.stderr)
            return EXIT_USAGE
        if (exc.name or "").partition(".")[0] not in DEPENDENCIES:
            raise
        print(f"tray: SetupError: this Python ({sys.executable}) has tray but not {exc.name!r}, one of its "
              "dependencies: install tray with them (pip install tray, or `make` in a checkout, then use "
              ".venv/bin/tray)", file=sys.stderr)
        return EXIT_USAGE
    except AttributeError:  # a lazily imported dependency (zmq, psutil) that a lone module of its name hides
        shadow = _shadowed_dependency()
        if not shadow:
            raise
        print(f"tray: SetupError: {shadow}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as exc:
        code = _output_lost(exc)
        if code is None:
            raise
        return code
    except KeyboardInterrupt as exc:
        # a second signal now is held until the line is out (then raised, as any signal would be)
        held = signal.pthread_sigmask(signal.SIG_BLOCK, set(_STOP_SIGNALS))
        try:
            _say_interrupted(exc)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
        return 130
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def program() -> NoReturn:
    """The `tray` command: main(), then exit with its status, signals that come after the command ended
    ignored (see _ignore_late_signals); one that lands between main's own handling and that is an
    interruption too (130)."""
    _open_closed_stdio()
    for sig in _STOP_SIGNALS:  # what main puts back when it ends
        if sig != signal.SIGINT:
            signal.signal(sig, _terminate_as_interrupt)
    code = 130
    try:
        try:
            code = main()
        finally:
            _ignore_late_signals()
    except KeyboardInterrupt as exc:
        _ignore_late_signals()
        # NOTE: a second signal can land in main's own handling of the first, before it holds signals: said here
        if not _interrupt_said:
            with contextlib.suppress(OSError):
                _say_interrupted(exc)
        code = 130
    except SystemExit as exc:  # argparse: --help and --version (0) printed, a usage error (2) said
        if not isinstance(exc.code, int):
            raise
        code = _flushed(exc.code)
    if _launched:
        _exit_now(code)
    sys.exit(code)


def _flushed(code: int) -> int:
    """`code` once stdout's buffer is written, or what _output_lost makes of the error that writing met."""
    try:
        sys.stdout.flush()
    except OSError as exc:
        lost = _output_lost(exc)
        if lost is None:
            raise
        return lost
    return code


def _output_lost(exc: OSError) -> int | None:
    """The exit status for an error writing the command's output, said as such, or None when `exc` is not one. The
    reader of stdout went away (`tray inspect ... | head`): 141, quietly, as a shell tool ends on SIGPIPE. The output
    met a full disk (`tray inspect M > /dev/full`): one line instead of a traceback, exit 2. Either way stdout then
    points at /dev/null, so the interpreter's last flush does not raise again."""
    if isinstance(exc, BrokenPipeError):
        code = 128 + signal.SIGPIPE
    elif exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) and exc.filename is None and _stdout_full(exc):
        code = EXIT_USAGE
    else:
        return None
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    if code == EXIT_USAGE:
        print(f"tray: SetupError: cannot write the command's output ({exc.strerror}): what it printed to stdout is "
              "lost; free space there, or send it elsewhere", file=sys.stderr)
    return code


def _open_closed_stdio() -> None:
    """Started with stdin, stdout or stderr closed (`tray launch ... >&-`): /dev/null takes that descriptor, so
    nothing tray opens later (a socket, a rank's pipe) lands on 0, 1 or 2 and gets written to as output, and
    Python's sys.stdout/sys.stderr (None then) become writable; tray's lines to a closed stream are dropped."""
    for fd, name in ((0, "stdin"), (1, "stdout"), (2, "stderr")):
        try:
            os.fstat(fd)
            continue
        except OSError:
            pass
        null = os.open(os.devnull, os.O_RDWR)
        if null != fd:
            os.dup2(null, fd)
            os.close(null)
        if getattr(sys, name) is None:
            setattr(sys, name, open(fd, "r" if fd == 0 else "w", closefd=False))


def _stdout_full(exc: OSError) -> bool:
    """Whether stdout is what `exc` (no room: ENOSPC, EDQUOT, EFBIG, no file named) could have come from: /dev/full,
    or a file that takes no more (its file system full, a quota, the file size limit); not a pipe or a terminal, nor a
    file with room (another file the command wrote, a bench's work dir on a full disk, say)."""
    import resource

    try:
        fd = sys.stdout.fileno()
        st = os.fstat(fd)
        if stat.S_ISCHR(st.st_mode):
            return st.st_rdev == os.makedev(1, 7)  # /dev/full
        if not stat.S_ISREG(st.st_mode):
            return False
        if exc.errno == errno.ENOSPC:
            return os.fstatvfs(fd).f_bavail == 0
        if exc.errno == errno.EFBIG:
            limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
            return limit != resource.RLIM_INFINITY and st.st_size >= limit
    except (OSError, ValueError):
        return False
    return True


def _shadowed_dependency() -> str:
    """Which of tray's dependencies (each a package) a lone module of its name hides, a zmq.py on PYTHONPATH or in
    the current directory, said with what to do; "" when none does."""
    import importlib.util

    for name in sorted(DEPENDENCIES):
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        if spec is not None and spec.submodule_search_locations is None and spec.origin:
            return (f"{spec.origin} hides the package {name!r} that tray needs (Python finds it first: it is on "
                    "PYTHONPATH or in the current directory); rename it, or take its directory off the path")
    return ""


# `tray launch` ran to its end (its tray torn down, job dir removed, every child reaped)
_launched = False


def _exit_now(code: int) -> NoReturn:
    """End the head's process right away: its output flushed, without the interpreter's finalization and the
    libraries' exit handlers (the CUDA driver's among them: the head initialised it for its ranks). Measured with
    bench/teardown.py: the head's exit took 103 ms on one H200 and 23 ms on the host backend ending normally
    (f784566), 67 and 2 ms ending at once (133eb4d, 3a73068); the rest on cuda is the kernel closing the driver's
    files."""
    def flush() -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                if stream is not None:
                    stream.flush()
            except (OSError, ValueError):  # a closed pipe or stream: nothing more can be said there
                pass

    # NOTE: on a thread, waited for a while only: a stream whose reader takes nothing (`| (sleep 60; cat)`) holds
    # the flush, and the output pump's write held the stream's lock, so the head never exited
    import threading

    t = threading.Thread(target=flush, name="tray-exit-flush", daemon=True)
    t.start()
    t.join(_EXIT_FLUSH_S)
    os._exit(code)


_EXIT_FLUSH_S = 5.0  # how long the head's exit waits for its own output to be taken
