"""Manifests by name: `--manifest peer_fill` finds the built-in manifest (package data, see
tray.manifest.builtin) when no such file exists."""

from __future__ import annotations

import difflib
import json
from pathlib import Path

from tray.errors import UsageError
from tray.manifest.builtin import builtin_dir


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


def resolve_manifest(arg: str) -> str:
    """The manifest file `arg` names: an existing file wins; else the built-in manifest of that name
    ("ep_moe" or "ep_moe.json"). Raises UsageError listing the built-ins (with a did-you-mean)."""
    if Path(arg).is_file():
        return arg
    known = builtin_manifests()
    stem = arg[:-5] if arg.endswith(".json") else arg
    if "/" not in stem and stem in known:
        return str(builtin_dir() / f"{stem}.json")
    close = difflib.get_close_matches(Path(stem).name, known, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    listing = ", ".join(known) or "none"
    raise UsageError(f"no manifest file {arg!r} and no built-in manifest of that name{hint} "
                     f"(built-in: {listing}; `tray inspect --list` describes them)")


def format_builtins() -> str:
    """One line per built-in manifest: name and description."""
    known = builtin_manifests()
    width = max((len(n) for n in known), default=0)
    return "\n".join(f"{name:<{width}}  {text}" for name, text in known.items())
