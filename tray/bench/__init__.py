"""The bench harness every figure uses: launch a rank program, environment, medians, same-run ratios, an
nccl-tests-shaped table, JSON, an optional plot.

A bench (`tray.programs.<name>.bench`) checks correctness first, warms up, times (on ranks: with
`tray.bench.timing.Sampler`, device events on cuda), then builds a report dict whose figures sit next to
their baseline measured in the same run (`ratio`), prints `format_table` rows, and hands the report to
`write_report` (JSON with `environment()`) and, when asked, `plot_lines` (matplotlib, the `plot` extra).
"""

from __future__ import annotations

import json
import math
import os
import shlex
import stat
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tray.envinfo import environment
from tray.envvars import own_python, share_gpus
from tray.errors import SetupError, UsageError

__all__ = ["Row", "TrayFailed", "buffers_nbytes", "busbw_factor", "environment", "format_gbps", "format_table",
           "invoked_command",
           "median", "plot_bars", "plot_lines", "ratio", "require_plot", "run_rank_program", "stage", "write_report"]

PLOT_EXTRA = "plot"


class TrayFailed(RuntimeError):
    """A tray run by `run_rank_program` exited non-zero; the message carries its root cause."""


def run_rank_program(name: str, module: str, cfg: dict[str, Any], work: Path, *, nprocs: int, backend: str,
                     manifest: str, vars: dict[str, int], log_dir: str | None = None,
                     progress: bool = True, env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Launch `python -m module CFG.json` on `nprocs` ranks (with `env` added to their environment); each
    rank writes `result_*.json` into `cfg["out_dir"]` (set here to work/name). Returns those results in
    file-name order. With `progress`, rank 0's output (its progress lines) shows on the terminal as
    `[rank 0] ...`; else no rank's does.

    Raises TrayFailed naming the root cause when the tray fails."""
    from tray.launch import TraySpec, run_tray

    out = work / name
    out.mkdir()
    cfg_path = work / f"{name}.json"
    cfg_path.write_text(json.dumps({**cfg, "out_dir": str(out)}))
    python, path = own_python()
    spec = TraySpec(nprocs=nprocs, cmd=(*python, "-m", module, str(cfg_path)), backend=backend,
                    manifest=manifest, vars=tuple(sorted(vars.items())), log_dir=log_dir, quiet=not progress,
                    timeline=False, local_ranks_filter=(0,),
                    extra_env=tuple(sorted({"PYTHONPATH": path, **(env or {})}.items())))
    result = run_tray(spec)
    if result.exit_code != 0:
        cause = result.root_cause
        detail = f"{cause.summary}\n{cause.report}" if cause else "no root cause reported"
        raise TrayFailed(f"the {name} tray failed (exit {result.exit_code}): {detail}")
    return [json.loads(f.read_text()) for f in sorted(out.glob("result_*.json"))]


def buffers_nbytes(manifest: str, nprocs: int, vars: dict[str, int], local_world_size: int | None = None) -> int:
    """Bytes of device buffers one rank of `manifest` allocates at `nprocs` ranks (`local_world_size` per node;
    None: one node) with `vars` (states and the tray's own barrier flags and group buffers aside): what a bench
    states as its memory per rank."""
    from tray.manifest import load_manifest

    resolved = load_manifest(manifest).resolve(nprocs, vars, local_world_size)
    return sum(b.nbytes for b in resolved.buffers)


def stage(bench: str, index: int, total: int, what: str) -> float:
    """Print a progress line `bench: [index/total] what` now (flushed); returns time.monotonic() for the
    caller's elapsed time."""
    print(f"{bench}: [{index}/{total}] {what}", flush=True)
    return time.monotonic()


def format_gbps(value: float) -> str:
    """A bandwidth in GB/s: 0.00176, 1.76, 176.0 (three significant digits below 1, never a bare 0.00);
    n/a for NaN."""
    if math.isnan(value):
        return "n/a"
    if value >= 100:
        return f"{value:.1f}"
    if value >= 1:
        return f"{value:.2f}"
    return f"{value:.3g}"


def median(values: Sequence[float]) -> float:
    """The median of `values`, ignoring NaN (a figure a rank could not take); NaN when none is left."""
    kept = [v for v in values if not math.isnan(v)]
    return statistics.median(kept) if kept else float("nan")


def ratio(value: float, baseline: float) -> float:
    """value / baseline of the same run; NaN when the baseline is zero or missing."""
    if not baseline or math.isnan(baseline) or math.isnan(value):
        return float("nan")
    return value / baseline


def busbw_factor(op: str, nranks: int) -> float:
    """nccl-tests' bus-bandwidth factor: busbw = algbw * factor (allreduce 2(n-1)/n, alltoall and
    allgather (n-1)/n, anything else 1)."""
    if nranks < 1:
        raise UsageError(f"nranks must be at least 1, got {nranks}")
    if op == "allreduce":
        return 2 * (nranks - 1) / nranks
    if op in ("alltoall", "allgather", "reducescatter"):
        return (nranks - 1) / nranks
    return 1.0


@dataclass(frozen=True)
class Row:
    """One line of an nccl-tests-shaped table: `nbytes` per rank moved by `name` in `time_us`.

    count: elements of `dtype`; wrong: elements (or rows) that failed the check, -1 when not checked."""

    name: str
    nbytes: int
    count: int
    dtype: str
    time_us: float
    wrong: int = 0
    op: str = ""
    nranks: int = 1

    @property
    def algbw_gbps(self) -> float:
        return self.nbytes / (self.time_us * 1e3) if self.time_us > 0 else float("nan")

    @property
    def busbw_gbps(self) -> float:
        return self.algbw_gbps * busbw_factor(self.op, self.nranks)


def format_table(rows: Sequence[Row]) -> str:
    """The rows as nccl-tests prints them: size (B), count, type, time (us), algbw, busbw (GB/s), #wrong."""
    width = max([len("name"), *(len(r.name) for r in rows)])
    lines = [f"  {'name':<{width}} {'size':>10} {'count':>10} {'type':>6} {'time':>9} {'algbw':>8} "
             f"{'busbw':>8} {'#wrong':>7}",
             f"  {'':<{width}} {'(B)':>10} {'(elements)':>10} {'':>6} {'(us)':>9} {'(GB/s)':>8} "
             f"{'(GB/s)':>8} {'':>7}"]
    for r in rows:
        wrong = "N/A" if r.wrong < 0 else str(r.wrong)
        lines.append(f"  {r.name:<{width}} {r.nbytes:>10} {r.count:>10} {r.dtype:>6} {r.time_us:>9.2f} "
                     f"{format_gbps(r.algbw_gbps):>8} {format_gbps(r.busbw_gbps):>8} {wrong:>7}")
    return "\n".join(lines)


def invoked_command(argv: Sequence[str] | None = None) -> str:
    """The command line that made a report, as a reader would type it: `tray bench tp -n 2 ...` for the
    `tray` command (or `python -m tray`), `python bench/startup.py ...` for a bench script."""
    argv = list(sys.argv if argv is None else argv)
    head = Path(argv[0]) if argv else Path("?")
    if head.name in ("tray", "__main__.py"):
        return shlex.join(["tray", *argv[1:]])
    if head.suffix == ".py":
        return shlex.join(["python", os.path.relpath(head) if head.is_absolute() else str(head), *argv[1:]])
    return shlex.join([head.name, *argv[1:]])


def write_report(report: dict[str, Any], path: str | None, extra_env: dict[str, Any] | None = None) -> None:
    """Add `environment` (GPU, driver, NCCL, commit, ...), `command` (the command line that made it) and, when ranks
    shared GPUs, `shared_gpus` to `report` unless present; write it as JSON to `path` (parents created) when one is
    given."""
    report.setdefault("command", invoked_command())
    report.setdefault("environment", environment(extra_env))
    if share_gpus(None, os.environ.get("TRAY_SHARE_GPUS")):
        report.setdefault(
            "shared_gpus", "ranks shared GPUs (TRAY_SHARE_GPUS=1): the checks hold, the timings mean nothing")
    if path:
        try:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(json.dumps(report, indent=2) + "\n")
        except OSError as exc:
            raise SetupError(f"--json {path}: cannot write the report ({exc.strerror}); the results above stand: give "
                             "a path where it can be written") from None


def check_report_path(path: str | None, flag: str = "--json") -> None:
    """Raise UsageError, before a bench or gate runs, when its report could not be written at `path` (None: no
    report): an empty path, a directory, or a parent that is not a directory. The run's results would otherwise be
    printed, then the report lost."""
    if path is None:
        return
    if not path:
        raise UsageError(f"{flag} needs a file path to write the report to, got an empty one (an unset variable?)")
    target = Path(path)
    try:
        st = os.stat(target)
    except FileNotFoundError:
        st = None
    except OSError as exc:
        raise UsageError(f"{flag} {path}: cannot be used for the report ({exc.strerror})") from None
    if st is not None and stat.S_ISDIR(st.st_mode):  # a FIFO or a device (/dev/stdout, >(jq .)) is written to
        raise UsageError(f"{flag} {path} is a directory; give the path of a file to write the report to")
    parent = next((p for p in target.absolute().parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise UsageError(f"{flag} {path}: {parent} is not a directory; give the path of a file to write the report to")


def require_plot(path: str | None) -> None:
    """Raise UsageError naming the `plot` extra when `path` asks for a plot and matplotlib is missing.
    Call before the bench runs, so a missing extra costs nothing."""
    if path is None:
        return
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError(f"--plot {path} needs matplotlib: pip install 'tray[{PLOT_EXTRA}]'") from None


def plot_lines(path: str, series: dict[str, tuple[Sequence[float], Sequence[float]]], *, title: str,
               xlabel: str, ylabel: str, log_x: bool = True, log_y: bool = True) -> None:
    """A PNG at `path`: one line per series name -> (xs, ys). Needs matplotlib (see `require_plot`)."""
    require_plot(path)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for label, (xs, ys) in series.items():
        ax.plot(list(xs), list(ys), marker="o", label=label)
    if log_x:
        ax.set_xscale("log", base=2)
    if log_y:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_bars(path: str, categories: Sequence[str], series: dict[str, Sequence[float]], *, title: str,
              ylabel: str, stacked: bool = False, log_y: bool = False) -> None:
    """A PNG at `path`: one bar per (category, series name) side by side, or with `stacked` one bar per
    category with the series piled in order. series: name -> one value per category (NaN: no bar, as for a
    figure a run did not take). Needs matplotlib (see `require_plot`); raises ValueError when a series does
    not have one value per category."""
    require_plot(path)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.0, 4.2))
    # NOTE: tab10 repeats after ten series (a startup's phases are eleven); tab20 keeps every one apart
    colors = plt.get_cmap("tab10" if len(series) <= 10 else "tab20").colors
    xs = list(range(len(categories)))
    width = 0.6 if stacked else 0.8 / max(1, len(series))
    bottoms = [0.0] * len(categories)
    for i, (label, values) in enumerate(series.items()):
        heights = [float(v) for v in values]
        if len(heights) != len(categories):
            raise ValueError(f"series {label!r} has {len(heights)} values for {len(categories)} categories")
        if stacked:
            kept = [0.0 if math.isnan(h) else h for h in heights]
            ax.bar(xs, kept, width, bottom=bottoms, label=label, color=colors[i % len(colors)])
            bottoms = [b + h for b, h in zip(bottoms, kept, strict=True)]
        else:
            offset = (i - (len(series) - 1) / 2) * width
            ax.bar([x + offset for x in xs], heights, width, label=label, color=colors[i % len(colors)])
    ax.set_xticks(xs, list(categories))
    if log_y:
        ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, axis="y", which="both", alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if stacked:  # the legend top-down as the pile
        handles, labels = handles[::-1], labels[::-1]
    ax.legend(handles, labels, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
