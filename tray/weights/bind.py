"""A buffer's `bind`: which safetensors tensors fill it on each rank (manifest schema, resolution).

    {"name": "w13", "dtype": "bf16", "shape": ["experts // world_size", "2 * ffn", "hidden"],
     "bind": {"file": "ckpt/layer0.safetensors",
              "tensors": ["experts.{e}.w1", "experts.{e}.w3"],
              "range": {"e": ["experts // world_size * rank", "experts // world_size"]}}}

- `file`: a path relative to the manifest's directory, or absolute. No placeholders.
- `tensors`: tensor names; `{name}` is replaced by a `range` variable's value (or by `rank`, `index`,
  `world_size` or a manifest var).
- `range` (optional): name -> [start, count], both integer expressions over the manifest vars,
  `world_size`, `rank` (this rank) and `index` (this rank's member index in the buffer's group). With
  several names, the first varies slowest.
- The buffer receives, in order, for every range value (outer) and every template (inner), the named
  tensor's bytes: a concatenation along dim 0. Each tensor must have the buffer's dtype and trailing
  dims equal to the buffer's last ones; together they must hold exactly the buffer's elements.
"""

from __future__ import annotations

import itertools
import os
import re
from dataclasses import dataclass
from typing import Any

from tray.errors import ManifestError
from tray.manifest.expr import ExprError, did_you_mean, eval_expr

BIND_KEYS = ("file", "tensors", "range")
_PLACEHOLDER = re.compile(r"\{([^{}]*)\}")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


@dataclass(frozen=True)
class ResolvedBind:
    """A bind for one rank: the absolute file and the tensor names in concatenation order."""

    file: str
    tensors: tuple[str, ...]


def resolve_bind(
    bind: dict[str, Any], env: dict[str, int], manifest_path: str, json_path: str, group: str = "world"
) -> ResolvedBind:
    """Expand `bind` for one rank. `env` holds the manifest vars, world_size, rank and index (absent when the rank
    is in no instance of the buffer's `group`).

    Raises ManifestError at `json_path` (e.g. `$.buffers[3].bind`) for any schema violation.
    """

    def fail(where: str, message: str) -> ManifestError:
        return ManifestError(manifest_path, f"{json_path}{where}", message)

    unknown = sorted(set(bind) - set(BIND_KEYS))
    if unknown:
        raise fail("", f"unknown key(s) {', '.join(unknown)}; a bind has: {', '.join(BIND_KEYS)}"
                       f"{did_you_mean(unknown[0], BIND_KEYS)}")
    file = bind.get("file")
    if not isinstance(file, str) or not file:
        raise fail(".file", f"expected a path (relative to the manifest or absolute), got {file!r}")
    tensors = bind.get("tensors")
    if not isinstance(tensors, list) or not tensors or not all(isinstance(t, str) and t for t in tensors):
        raise fail(".tensors", f"expected a non-empty list of tensor names, got {tensors!r:.80}")
    ranges = bind.get("range", {})
    if not isinstance(ranges, dict):
        raise fail(".range", f"expected an object name -> [start, count], got {ranges!r:.80}")
    values: list[list[tuple[str, int]]] = []
    for name, spec in ranges.items():
        where = f".range.{name}"
        if not _NAME.match(name):
            raise fail(where, f"range names must be identifiers, got {name!r}")
        if name in env:
            raise fail(where, f"range name {name!r} shadows a var or rank/index/world_size; pick another")
        if not isinstance(spec, list) or len(spec) != 2:
            raise fail(where, f"expected [start, count] (ints or expressions), got {spec!r:.80}")
        try:
            start, count = (eval_expr(v, env) for v in spec)
        except ExprError as exc:
            raise fail(where, str(exc)) from None
        if count < 0 or start < 0:
            raise fail(where, f"start and count must be >= 0, got start {start}, count {count}")
        values.append([(name, v) for v in range(start, start + count)])
    names: list[str] = []
    for combo in itertools.product(*values):
        scope = {**env, **dict(combo)}
        for i, template in enumerate(tensors):
            names.append(_expand(template, scope, lambda msg, i=i: fail(f".tensors[{i}]", msg), group))
    base = os.path.dirname(os.path.abspath(manifest_path))
    return ResolvedBind(os.path.normpath(os.path.join(base, file)), tuple(names))


def _expand(template: str, scope: dict[str, int], fail: Any, group: str = "world") -> str:
    def sub(m: re.Match[str]) -> str:
        key = m.group(1)
        if key == "index" and key not in scope and "rank" in scope:
            raise fail(f"{{index}} in {template!r}: rank {scope['rank']} is in no instance of the buffer's group "
                       f"{group!r}, so it has no member index there; name its tensors by rank, or give the buffer a "
                       "group every rank is in")
        if key not in scope:
            raise fail(f"{{{key}}} in {template!r} names no range variable, var, rank, index or world_size")
        return str(scope[key])

    return _PLACEHOLDER.sub(sub, template)
