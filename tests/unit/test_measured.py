"""README.md's measured figures against the result files they cite (bench/results/): every row of a measurement
table whose last column names its files ("file, commit") must cite files that exist, name the commit each JSON
records (with "-dirty" where the JSON's does), a commit that is in the repository's history (or say that it is
not), and, for a GPU result (bench/results/h200*/), a file that records its GPU, driver and NCCL version (or a row
that says which it does not), the driver and NCCL the README states. The figures in the tray and baseline columns
that carry three or more significant digits must be values of the cited JSONs after the rounding shown (in s, ms
or µs), and a sum written out (a + b = c) must add up; ratios and figures derived in other ways (TFLOP/s, "0.52x")
are left to the reader. A citation in the prose, "`path.json`, <commit>" or "`path.json` at <commit>", must name
the commit its file records."""

from __future__ import annotations

import bisect
import functools
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO

RESULTS = REPO / "bench" / "results"
README = (REPO / "README.md").read_text()
DOCS = {"README.md": README} | {f"docs/{p.name}": p.read_text() for p in sorted((REPO / "docs").glob("*.md"))}

# a commit as a row names it: 7 to 40 hex digits with at least one digit, "-dirty" when the tree had changes
_COMMIT = re.compile(r"(?<![\w/.`*-])(?=[0-9a-f]*\d)([0-9a-f]{7,40})(-dirty)?(?![\w/.*])")
NOT_IN_HISTORY = "not in this repository's history"
_MISSING_LABEL = {"commit": "commit", "gpu": "GPU", "driver": "driver", "nccl": "NCCL"}


def _cells(line: str) -> list[str]:
    return [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]


def _tables(text: str) -> list[tuple[list[str], list[tuple[int, list[str]]]]]:
    """Every markdown table: its header and its rows with their line numbers."""
    lines = text.splitlines()
    out, i = [], 0
    while i < len(lines):
        if lines[i].startswith("|") and i + 1 < len(lines) and re.match(r"^\|\s*-{3,}", lines[i + 1]):
            header, rows, j = _cells(lines[i]), [], i + 2
            while j < len(lines) and lines[j].startswith("|"):
                rows.append((j + 1, _cells(lines[j])))
                j += 1
            out.append((header, rows))
            i = j
        else:
            i += 1
    return out


def _is_path(span: str) -> bool:
    return " " not in span and not span.startswith("-") and ("/" in span or span.endswith((".json", ".log"))
                                                             or "*" in span)


class Row:
    """One table row that cites result files: its files, each with the commit the row names for it."""

    def __init__(self, line: int, cells: list[str], file_cell: str):
        self.line, self.cells, self.cell = line, cells, file_cell
        spans = [(m.start(), m.end(), m.group(1)) for m in re.finditer(r"`([^`]+)`", file_cell)]
        outside = file_cell
        for s, e, _ in spans:
            outside = outside[:s] + " " * (e - s) + outside[e:]
        self.commits = [(m.start(), m.group(1), bool(m.group(2))) for m in _COMMIT.finditer(outside)]
        explicit: dict[int, tuple[str, bool]] = {}   # a span's start -> the commit named for it alone
        for s, e, _ in spans:
            at = re.match(r"\s+at\s+", file_cell[e:])   # `ab_new_*` at 93015d6
            if at:
                for pos, c, dirty in self.commits:
                    if pos == e + at.end():
                        explicit[s] = (c, dirty)
            run = re.search(r"([0-9a-f]{7,40})'s run:\s*$", file_cell[:s])   # 7e1aa8a's run: `file`
            if run:
                explicit[s] = (run.group(1), False)
        used = {c for c, _ in explicit.values()}
        # the commit of every file not named with its own: the first other one in the cell
        self.main = next(((c, d) for _, c, d in self.commits if c not in used), None)
        self.paths: list[tuple[Path, str, tuple[str, bool] | None]] = []   # path or glob, as written, commit
        base = RESULTS   # a bare name (`ab.log`, `ab_new_*`) is in the directory cited before it
        for s, _, span in spans:
            if not _is_path(span):
                continue
            path = RESULTS / span if "/" in span else base / span
            if span.endswith("/"):
                base = path
            self.paths.append((path, span, explicit.get(s, self.main)))

    def where(self) -> str:
        return f"README.md:{self.line}"

    def jsons(self) -> list[tuple[Path, tuple[str, bool] | None]]:
        """Every JSON the row cites, a glob or a directory opened, with the commit the row names for it."""
        out = []
        cited_in_dirs = {p.parent for p, span, _ in self.paths if "*" in span}
        for path, span, commit in self.paths:
            if "*" in span:
                out += [(p, commit) for p in sorted(path.parent.glob(path.name)) if p.suffix == ".json"]
            elif span.endswith("/") and path.is_dir() and path not in cited_in_dirs:
                out += [(p, commit) for p in sorted(path.glob("*.json"))]
            elif path.suffix == ".json" and path.is_file():   # a missing one: test_every_cited_file_exists
                out.append((path, commit))
        return out


def _rows() -> list[Row]:
    rows = []
    for header, body in _tables(README):
        if not header[-1].lower().startswith("file"):
            continue
        previous = ""
        for line, cells in body:
            cell = previous if cells[-1] == "same" else cells[-1]
            previous = cell
            rows.append(Row(line, cells, cell))
    return rows


ROWS = _rows()


@functools.cache
def _load(path: Path) -> Any:
    return json.loads(path.read_text())


def _facts(doc: Any) -> dict[str, str | None]:
    """The commit, GPU, driver and NCCL version a result file records: under "environment" (the benches, through
    tray.envinfo) or "env" (the GPU test stages: "gpus" as "name, driver")."""
    env = (doc.get("environment") or doc.get("env") or {}) if isinstance(doc, dict) else {}
    gpus = env.get("gpus") or []
    first = str(gpus[0]).split(",") if gpus else []
    return {"commit": env.get("commit"),
            "gpu": env.get("gpu") or (first[0].strip() if first else None),
            "driver": env.get("driver") or (first[1].strip() if len(first) > 1 else None),
            "nccl": env.get("nccl")}


def _says_missing(cell: str, what: str) -> bool:
    return re.search(rf"records no\b[^)]*\b{_MISSING_LABEL[what]}\b", cell) is not None


def _stated_versions() -> tuple[str, str]:
    m = re.search(r"driver\s*\(([\d.]+)\)\s*and\s+NCCL\s*\(([\d.]+)\)", README)
    assert m, "README.md's Measured section no longer states the driver and NCCL version as 'driver (X) and NCCL (Y)'"
    return m.group(1), m.group(2)


def test_the_readme_has_measurement_rows_that_cite_files():
    assert len(ROWS) >= 30 and all(r.paths for r in ROWS), [r.where() for r in ROWS if not r.paths]


def test_every_cited_file_exists():
    problems = []
    for row in ROWS:
        for path, span, _ in row.paths:
            if "*" in span:
                if not list(path.parent.glob(path.name)):
                    problems.append(f"{row.where()}: nothing matches `{span}` in {path.parent.relative_to(REPO)}")
            elif not path.exists() or (span.endswith("/") and not path.is_dir()):
                problems.append(f"{row.where()}: `{span}` ({path.relative_to(REPO)}) does not exist")
    assert not problems, "\n".join(problems)


def test_every_row_names_the_commit_its_files_record():
    problems = []
    for row in ROWS:
        for path, commit in row.jsons():
            recorded = _facts(_load(path))["commit"]
            name = path.relative_to(RESULTS)
            if commit is None:
                problems.append(f"{row.where()}: no commit named for {name}")
            elif recorded is None:
                if not _says_missing(row.cell, "commit"):
                    problems.append(f"{row.where()}: {name} records no commit and the row does not say so")
            else:
                sha, dirty = recorded.removesuffix("-dirty"), recorded.endswith("-dirty")
                want = commit[0] + ("-dirty" if commit[1] else "")
                if not sha.startswith(commit[0]) or dirty != commit[1]:
                    problems.append(f"{row.where()}: the row names {want} for {name}, which records {recorded}")
    assert not problems, "\n".join(problems)


def test_every_gpu_result_records_its_gpu_driver_and_nccl():
    driver, nccl = _stated_versions()
    problems = []
    for row in ROWS:
        for path, _ in row.jsons():
            name = path.relative_to(RESULTS)
            if not name.parts[0].startswith("h200"):
                continue
            facts = _facts(_load(path))
            for key in ("gpu", "driver", "nccl"):
                if not facts[key] and not _says_missing(row.cell, key):
                    problems.append(f"{row.where()}: {name} records no {key} and the row does not say so")
            for key, stated in (("driver", driver), ("nccl", nccl)):
                if facts[key] and facts[key] != stated:
                    problems.append(f"{row.where()}: {name} records {key} {facts[key]}, the README states {stated}")
    assert not problems, "\n".join(problems)


def _git(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", "-C", str(REPO), *args], input=stdin, capture_output=True, text=True, timeout=20)


def test_every_commit_a_row_names_is_in_the_history():
    if shutil.which("git") is None:
        pytest.skip("git is not available")
    shallow = _git("rev-parse", "--is-shallow-repository")
    if shallow.returncode != 0:
        pytest.skip(f"not a git work tree: {shallow.stderr.strip()}")
    if shallow.stdout.strip() == "true":
        pytest.skip("a shallow clone: older commits do not resolve here (a full clone checks them)")
    prose = _prose_citations()
    named = sorted({c for row in ROWS for _, c, _ in row.commits} | {c for _, _, c, _ in prose})
    out = _git("cat-file", "--batch-check", stdin="".join(f"{c}^{{commit}}\n" for c in named))
    assert out.returncode == 0, out.stderr
    missing = {c for c, line in zip(named, out.stdout.splitlines(), strict=True) if line.endswith(" missing")}
    flagged = {row.main[0] for row in ROWS if NOT_IN_HISTORY in row.cell and row.main}
    problems = []
    for row in ROWS:
        for _, c, _ in row.commits:
            if c in missing and not (NOT_IN_HISTORY in row.cell and row.main and c == row.main[0]):
                problems.append(f"{row.where()}: {c} is not a commit of this repository")
        if NOT_IN_HISTORY in row.cell and row.main and row.main[0] not in missing:
            problems.append(f"{row.where()}: says {row.main[0]} is {NOT_IN_HISTORY}, but it is")
    for doc, rel, c, _ in prose:
        if c in missing and c not in flagged:
            problems.append(f"{doc}: `{rel}` cited at {c}, not a commit of this repository")
    assert not problems, "\n".join(problems)


# -- the figures ----------------------------------------------------------------------------------------------------

_NUM = r"\d+(?:\.\d+)?(?:e-?\d+)?"
_FIGURE = re.compile(rf"(?<![\w.`/-])({_NUM})(?![\w.]|-\d)")
_SUM = re.compile(rf"(?<![\w.])((?:{_NUM}\s*\+\s*)+{_NUM})\s*=\s*({_NUM})(?![\w.])")
# figures derived from the file's values rather than held in it: a group of them, then their unit
_DERIVED = re.compile(rf"{_NUM}(?:\s*/\s*{_NUM})*\s*(?:TFLOP/s|x\b)")
_SCALES = (1.0, 1e3, 1e-3, 1e6)


def _tolerance(shown: str) -> float:
    mantissa, _, exp = shown.partition("e")
    decimals = len(mantissa.partition(".")[2])
    return 0.5 * 10.0 ** (int(exp or 0) - decimals) * (1 + 1e-9) + 1e-12


def _significant(shown: str) -> int:
    return len(shown.partition("e")[0].replace(".", "").lstrip("0"))


def _numbers(doc: Any, out: list[float]) -> list[float]:
    if isinstance(doc, bool):
        return out
    if isinstance(doc, int | float):
        out.append(float(doc))
    elif isinstance(doc, dict):
        for v in doc.values():
            _numbers(v, out)
    elif isinstance(doc, list):
        for v in doc:
            _numbers(v, out)
    return out


class Values:
    """The numbers of some result files, sorted, at each scale a figure may be quoted in."""

    def __init__(self, paths: list[Path], extra: tuple[float, ...] | list[float] = ()):
        found: list[float] = list(extra)
        for p in paths:
            _numbers(_load(p), found)
        self.scaled = [sorted(v * s for v in found if v == v) for s in _SCALES]

    def hold(self, shown: str) -> bool:
        x, tol = float(shown), _tolerance(shown)
        for values in self.scaled:
            i = bisect.bisect_left(values, x - tol)
            if i < len(values) and values[i] <= x + tol:
                return True
        return False


def _figure_problems(cell: str, values: Values) -> list[str]:
    problems = []
    text = re.sub(r"`[^`]*`", " ", cell)
    text = _DERIVED.sub(" ", text)
    for m in _SUM.finditer(text):
        parts = re.split(r"\s*\+\s*", m.group(1))
        total = float(m.group(2))
        slack = _tolerance(m.group(2)) + sum(_tolerance(p) for p in parts)
        if abs(sum(float(p) for p in parts) - total) > slack:
            problems.append(f"{m.group(0)!r} does not add up")
    # a sum's total is checked above; its parts, like every other figure, must be in the files
    text = _SUM.sub(lambda m: m.group(1) + " " * (len(m.group(0)) - len(m.group(1))), text)
    for m in _FIGURE.finditer(text):
        shown = m.group(1)
        if _significant(shown) >= 3 and not values.hold(shown):
            problems.append(f"{shown} is in none of the cited files (in s, ms or µs, after the rounding shown)")
    return problems


def test_every_figure_of_a_row_is_in_the_files_it_cites():
    """A figure may also be a sum's total written out in another row citing the same files ("NCCL 719 µs" for
    "269.1 + 361.1 + 88.9 = 719 µs")."""
    totals: dict[tuple[Path, ...], list[float]] = {}
    for row in ROWS:
        files = tuple(p for p, _ in row.jsons())
        for column in (1, 2):
            totals.setdefault(files, []).extend(float(m.group(2)) for m in _SUM.finditer(row.cells[column]))
    problems = []
    for row in ROWS:
        files = tuple(p for p, _ in row.jsons())
        values = Values(list(files), extra=totals[files])
        for column in (1, 2):   # tray (or host backend), baseline
            problems += [f"{row.where()}: {p}" for p in _figure_problems(row.cells[column], values)]
    assert not problems, "\n".join(problems)


def test_the_figure_check_catches_a_wrong_figure_and_a_wrong_sum():
    values = Values([RESULTS / "h200x2" / "peer_barrier.json"])
    assert _figure_problems("2.35 µs (host 1.60 µs per call)", values) == []
    assert _figure_problems("2.36 µs", values) and _figure_problems("2.35 + 4.17 = 6.60 µs", values)
    assert _figure_problems("4.17 µs; 0.52x of bf16, 473 / 434 TFLOP/s, `python bench/x.py --iters 1000`", values) == []


# -- citations in the prose ----------------------------------------------------------------------------------------

_PROSE = re.compile(r"`((?:bench/results/)?[\w./-]+\.json)`(?:,|\s+at)\s+(?:at\s+)?([0-9a-f]{7,40})(-dirty)?\b")


def _prose_citations() -> list[tuple[str, str, str, bool]]:
    """Every "`file.json`, <commit>" or "`file.json` at <commit>" of README.md and docs/*.md: document, file as
    written, commit, "-dirty"."""
    return [(doc, m.group(1), m.group(2), bool(m.group(3)))
            for doc, text in DOCS.items() for m in _PROSE.finditer(re.sub(r"\s+", " ", text))]


def test_every_file_cited_with_a_commit_in_the_prose_records_that_commit():
    problems = []
    for doc, rel, commit, dirty in _prose_citations():
        path = REPO / rel if rel.startswith("bench/") else RESULTS / rel
        if not path.is_file():
            problems.append(f"{doc}: `{rel}` does not exist")
            continue
        recorded = _facts(_load(path))["commit"]
        if recorded is None:   # the table rows say so where they cite such a file
            continue
        if not recorded.removesuffix("-dirty").startswith(commit) or recorded.endswith("-dirty") != dirty:
            problems.append(f"{doc}: `{rel}` cited at {commit}{'-dirty' if dirty else ''}, records {recorded}")
    assert not problems, "\n".join(problems)
