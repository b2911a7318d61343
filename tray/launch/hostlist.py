"""Slurm's compressed host lists (`gpu[01-04,07]`, `a,b[1-2]`, `n[001-003]-ib`) expanded in Python.

Slurm hands every task `SLURM_JOB_NODELIST` in this form; `scontrol show hostnames` expands it, but a
launcher must not depend on a Slurm binary being on PATH inside the job, so the grammar lives here:

    list    := entry ("," entry)*          commas inside brackets do not split entries
    entry   := (text | "[" ranges "]")+    several bracket groups multiply (n[1-2]-ib[0-1]: 4 names)
    ranges  := range ("," range)*
    range   := NUM | NUM "-" NUM           zero padding: the width of the lower bound ("001-003")
"""

from __future__ import annotations

import itertools

from tray.errors import UsageError
from tray.text import is_digits

__all__ = ["expand_hostlist", "first_host"]

# NOTE: a typo like `n[1-1000000]` must fail fast instead of building a million names.
MAX_HOSTS = 65_536


def _error(hostlist: str, why: str) -> UsageError:
    return UsageError(f"host list {hostlist!r}: {why}; expected Slurm's form, e.g. 'gpu[01-04,07]' or "
                      "'a,b[1-2]'")


def _split_top(hostlist: str) -> list[str]:
    """Split at commas outside brackets; raises on unbalanced brackets."""
    entries, depth, start = [], 0, 0
    for i, ch in enumerate(hostlist):
        if ch == "[":
            if depth:
                raise _error(hostlist, f"nested '[' at offset {i}")
            depth = 1
        elif ch == "]":
            if not depth:
                raise _error(hostlist, f"']' without '[' at offset {i}")
            depth = 0
        elif ch == "," and not depth:
            entries.append(hostlist[start:i])
            start = i + 1
    if depth:
        raise _error(hostlist, "'[' is never closed")
    entries.append(hostlist[start:])
    return entries


def _expand_ranges(hostlist: str, body: str) -> list[str]:
    out: list[str] = []
    for part in body.split(","):
        lo_text, dash, hi_text = part.strip().partition("-")
        if not is_digits(lo_text) or (dash and not is_digits(hi_text)):
            raise _error(hostlist, f"range {part!r} in [{body}] is not NUM or NUM-NUM")
        lo, hi = int(lo_text), int(hi_text) if dash else int(lo_text)
        if hi < lo:
            raise _error(hostlist, f"range {part!r} runs backwards")
        if len(out) + hi - lo + 1 > MAX_HOSTS:
            raise _error(hostlist, f"more than {MAX_HOSTS} hosts")
        width = len(lo_text)
        out.extend(f"{n:0{width}d}" for n in range(lo, hi + 1))
    return out


def _expand_entry(hostlist: str, entry: str) -> list[str]:
    if not entry:
        raise _error(hostlist, "an empty name (two commas in a row, or a comma at an end)")
    pieces: list[list[str]] = []
    rest = entry
    while rest:
        open_at = rest.find("[")
        if open_at < 0:
            pieces.append([rest])
            break
        if open_at:
            pieces.append([rest[:open_at]])
        close_at = rest.index("]", open_at)  # balanced: checked by _split_top
        body = rest[open_at + 1:close_at]
        if not body:
            raise _error(hostlist, "empty brackets '[]'")
        pieces.append(_expand_ranges(hostlist, body))
        rest = rest[close_at + 1:]
    return ["".join(combo) for combo in itertools.product(*pieces)]


def expand_hostlist(hostlist: str) -> list[str]:
    """Every host name of `hostlist`, in Slurm's order (entries left to right, ranges ascending).

    Raises UsageError naming the list and the fault (unbalanced or nested brackets, an empty name,
    a range that is not NUM or NUM-NUM or runs backwards, more than MAX_HOSTS names)."""
    text = hostlist.strip()
    if not text:
        raise _error(hostlist, "it is empty")
    hosts: list[str] = []
    for entry in _split_top(text):
        hosts.extend(_expand_entry(hostlist, entry.strip()))
        if len(hosts) > MAX_HOSTS:
            raise _error(hostlist, f"more than {MAX_HOSTS} hosts")
    return hosts


def first_host(hostlist: str) -> str:
    """The first name of `hostlist` (the job's root under Slurm), with the whole list checked."""
    return expand_hostlist(hostlist)[0]
