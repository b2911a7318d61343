"""Manifests by name: `--manifest peer_fill` finds the built-in manifest (package data, see
tray.manifest.builtin) when no such file exists."""

from __future__ import annotations

import difflib
import json
import os
import stat
from pathlib import Path

from tray.errors import UsageError
from tray.manifest.builtin import builtin_dir

# a listed description's length at most (a terminal's line, less the name)
_LISTED_CHARS = 100
# how many .json files of a folder a name not found is compared with
_FILES_COMPARED = 1000


def builtin_manifests() -> dict[str, str]:
    """Built-in manifest name (file stem) -> its one-line description, sorted by name."""
    out = {}
    for path in sorted(builtin_dir().glob("*.json")):
        try:
            description = str(json.loads(path.read_text()).get("description", ""))
        except (OSError, ValueError):
            description = "(unreadable)"
        out[path.stem] = description.splitlines()[0] if description else ""
    return out


def resolve_manifest(arg: str, program: str | None = None) -> str:
    """The manifest file `arg` names: an existing file wins; else the built-in manifest of that name
    ("ep_moe" or "ep_moe.json"). Raises UsageError listing the built-ins (with a did-you-mean), saying where a relative
    path was looked for, and naming the file of that path beside `program` (the rank's program file) if there is one:
    a relative path is taken from the working directory, not from the program's."""
    if not arg:  # `--manifest "$M"` with M unset: not the default manifest, which leaving the flag out gives
        raise UsageError("the manifest's name is empty (--manifest ''); give a manifest file or a built-in name "
                         "(`tray inspect --list`), or leave --manifest out for the default (the world group)")
    if Path(arg).is_file():
        return arg
    kind = _not_a_file(arg)
    if kind:
        raise UsageError(f"manifest {arg!r} is {kind}, not a regular file: every rank reads the manifest by its path "
                         "(a pipe gives its text once, to one reader); save it to a file and pass that")
    known = builtin_manifests()
    stem = arg[:-5] if arg.endswith(".json") else arg
    if "/" not in stem and stem in known:
        return str(builtin_dir() / f"{stem}.json")
    if os.path.isdir(arg):  # it exists: "no manifest file" would deny what the user sees
        try:
            inside = sorted(p.name for p in Path(arg).iterdir() if p.suffix == ".json" and p.is_file())
        except OSError:
            inside = []
        listed = f" (in it: {', '.join(inside[:5])}{', ...' if len(inside) > 5 else ''})" if inside else ""
        raise UsageError(f"manifest {arg!r} is a directory, not a manifest file; give the manifest's JSON "
                         f"file{listed}")
    close = difflib.get_close_matches(Path(stem).name, known, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    folder = Path(arg).parent
    try:  # a file of a close name where it was looked for ("my.jsn" beside "my.json")
        files = sorted(p.name for p in folder.iterdir() if p.suffix == ".json" and p.is_file())[:_FILES_COMPARED]
    except OSError:
        files = []
    name = Path(arg).name
    # NOTE: the stems must be close too: "m.json" and "x.json" differ in all that names them
    near = [f for f in difflib.get_close_matches(name, files, n=3, cutoff=0.75)
            if difflib.SequenceMatcher(None, Path(name).stem, Path(f).stem).ratio() >= 0.6]
    if near:
        hint = f"; did you mean the file {str(folder / near[0])!r}?"
    where = ""
    if not os.path.isabs(arg):
        try:
            where = f" in {os.getcwd()} (the working directory: a relative path is taken from there)"
        except OSError:
            where = " (a relative path is taken from the working directory)"
        beside = Path(program).resolve().parent / arg if program else None
        if beside is not None and beside.is_file():
            hint = f"; the program's directory has {str(beside)!r}: give that path"
    listing = ", ".join(known) or "none"
    raise UsageError(f"no manifest file {arg!r}{where} and no built-in manifest of that name{hint} "
                     f"(built-in: {listing}; `tray inspect --list` describes them)")


def _not_a_file(arg: str) -> str:
    """What `arg` names when it is a pipe, socket or device ("a FIFO (a pipe)", ...); "" otherwise (a directory
    of a built-in's name does not hide the built-in)."""
    try:
        mode = os.stat(arg).st_mode
    except (OSError, ValueError):
        return ""
    if stat.S_ISFIFO(mode):
        return "a FIFO (a pipe)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return ""


def format_builtins() -> str:
    """One line per built-in manifest: name and description, cut at a word within _LISTED_CHARS (`tray inspect
    NAME` prints it whole)."""
    known = builtin_manifests()
    width = max((len(n) for n in known), default=0)

    def cut(text: str) -> str:
        if len(text) <= _LISTED_CHARS:
            return text
        return text[:_LISTED_CHARS].rsplit(" ", 1)[0].rstrip(",;:(") + " ..."

    return "\n".join(f"{name:<{width}}  {cut(text)}" for name, text in known.items())
