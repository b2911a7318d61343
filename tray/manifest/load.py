"""JSON -> Manifest: every rule of manifest format 1, each violation a ManifestError at its JSON path."""

from __future__ import annotations

import json
import keyword
import math
import os
import re
import stat
from collections.abc import Sequence
from typing import Any, NoReturn

from tray.errors import ManifestError
from tray.manifest.digest import compute_digest
from tray.manifest.expr import (
    EXPR_HELP,
    INT_LIMIT,
    PEERS_PREFIX,
    ExprError,
    check_expr,
    did_you_mean,
    eval_expr,
    expr_names,
    known_list,
    split_ref,
)
from tray.manifest.schema import (
    ACROSS,
    COLLECTIVES,
    DTYPE_ITEMSIZE,
    FORMAT_VERSION,
    INDEX_PREFIX,
    LOCAL_WORLD_SIZE_VAR,
    NODE_RANKS,
    OP_TYPES,
    RANK_ARG,
    RESERVED_VARS,
    WORLD,
    WORLD_SIZE_VAR,
    BarrierSpec,
    BufferSpec,
    CollectiveSpec,
    CopySpec,
    Dim3,
    GemmSpec,
    GroupSpec,
    IntOrExpr,
    KernelSpec,
    LaunchSpec,
    Manifest,
    OpSpec,
    ProgramSpec,
    Ranks,
    StageSpec,
    StateSpec,
)

NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*\Z")
MANIFEST_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*\Z")
IDENT_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
# NOTE: real manifests nest four levels; the bound keeps the validator's recursion far from the
# interpreter's limit whatever an in-memory document holds.
MAX_DEPTH = 64
MAX_MANIFEST_NBYTES = 256 << 20  # a manifest names weights, it does not hold them
# NOTE: JSON has no integer bound; 2**64 admits every u64 a bind table could carry while keeping
# json.dumps (the digest) clear of Python's int-to-str digit limit.
JSON_INT_LIMIT = 2**64
# NOTE: keys and values quoted in messages are cut to this many characters.
SHOW_CHARS = 60

TOP_KEYS = ("format", "name", "description", "barrier_timeout_s", "vars", "groups", "buffers", "states",
            "kernels", "programs")
GROUP_KEYS = ("name", "ranks", "size")
BUFFER_KEYS = ("name", "dtype", "shape", "export", "group", "bind")
STATE_KEYS = ("name", "page_nbytes", "pages", "host_pages")
STATE_REQUIRED = ("name", "page_nbytes", "pages")
KERNEL_KEYS = ("name", "source", "entry", "options", "peers", "programmatic")
PROGRAM_KEYS = ("name", "graph", "ops")
# op type -> (allowed keys, required keys)
OP_KEYS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "launch": (("op", "kernel", "grid", "block", "shmem", "args", "stage"), ("kernel", "grid", "block")),
    "nccl": (
        ("op", "collective", "group", "send", "recv", "count", "dtype", "peer", "across"),
        ("collective", "group", "send", "recv", "count", "dtype"),
    ),
    "gemm": (
        ("op", "a", "b", "c", "m", "n", "k", "dtype", "accumulate"),
        ("a", "b", "c", "m", "n", "k", "dtype"),
    ),
    "barrier": (("op", "group"), ("group",)),
    "copy": (("op", "src", "dst", "bytes"), ("src", "dst", "bytes")),
}
# op type -> its integer fields and their lower bounds (checked on literals here, on all at resolve)
OP_INT_FIELDS: dict[str, dict[str, int]] = {
    "launch": {"shmem": 0},
    "nccl": {"count": 0, "peer": 0},
    "gemm": {"m": 1, "n": 1, "k": 1},
    "barrier": {},
    "copy": {"bytes": 0},
}
OP_BUFFER_FIELDS: dict[str, tuple[str, ...]] = {
    "launch": (),
    "nccl": ("send", "recv"),
    "gemm": ("a", "b", "c"),
    "barrier": (),
    "copy": ("src", "dst"),
}


def child(json_path: str, key: str | int) -> str:
    """`$.a` + key -> `$.a.key`, `$.a[3]`, or `$.a["odd key"]` for keys that are not identifiers;
    keys longer than SHOW_CHARS are cut (with an ellipsis) so a message stays readable."""
    if isinstance(key, int):
        return f"{json_path}[{key}]"
    if len(key) <= SHOW_CHARS and IDENT_RE.match(key):
        return f"{json_path}.{key}"
    return f"{json_path}[{json.dumps(cut(key))}]"


def cut(text: str, limit: int | None = None) -> str:
    """`text`, or its first characters and an ellipsis when longer than `limit` (SHOW_CHARS)."""
    limit = SHOW_CHARS if limit is None else limit
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _render(trail: tuple[Any, ...]) -> str:
    """The JSON path of a node from its trail `(parent trail, key)` (root: `()` is `$`). Trails cost
    O(1) per node; a path is rendered only for an error, so the loader stays linear in file size."""
    keys = []
    while trail:
        trail, key = trail
        keys.append(key)
    jp = "$"
    for key in reversed(keys):
        jp = child(jp, key)
    return jp


def show(value: object) -> str:
    """A JSON value for a message, cut to SHOW_CHARS characters."""
    if isinstance(value, str) and len(value) > 4 * SHOW_CHARS:
        value = value[: 4 * SHOW_CHARS]  # no need to encode megabytes to show sixty characters
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return cut(text)


class _DuplicateKeys(dict[str, Any]):
    """A JSON object in which `duplicate` appeared twice; the validator reports it with its path."""

    duplicate: str = ""


def _pairs_hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            dup = _DuplicateKeys(pairs)
            dup.duplicate = key
            return dup
        obj[key] = value
    return obj


def load_manifest(path: str | os.PathLike[str]) -> Manifest:
    """Read, parse and validate the manifest file at `path`; kernel sources resolve from its directory.

    Raises ManifestError for an unreadable file, a JSON syntax error (json_path `line L column C`),
    or any rule of format 1 (json_path `$.…`).
    """
    where = os.fspath(path)
    try:
        # NOTE: opened without blocking and judged by what was opened: a FIFO at the path (planted, or put there
        # after a check of the name) would block the reader, the head's loop with it, until someone wrote to it
        fd = os.open(where, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                what = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file (a FIFO, a device...)"
                raise ManifestError(where, "$", f"the manifest is {what}; give a manifest file")
            if st.st_size > MAX_MANIFEST_NBYTES:
                raise ManifestError(where, "$", f"the manifest takes {st.st_size} bytes, more than any manifest may "
                                    f"({MAX_MANIFEST_NBYTES}); is it the right file?")
            with open(fd, "rb", closefd=False) as f:
                raw = f.read(MAX_MANIFEST_NBYTES + 1)
        finally:
            os.close(fd)
    except OSError as exc:
        raise ManifestError(where, "$", f"cannot read the manifest: {exc.strerror or exc}") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ManifestError(where, f"byte {exc.start}", "the manifest is not UTF-8 text") from None
    try:
        doc = json.loads(text, object_pairs_hook=_pairs_hook)
    except json.JSONDecodeError as exc:
        raise ManifestError(where, f"line {exc.lineno} column {exc.colno}", _json_error(exc)) from None
    except RecursionError:
        raise ManifestError(where, "$", f"JSON nested too deeply (at most {MAX_DEPTH} levels)") from None
    except ValueError as exc:  # e.g. an integer literal past Python's digit limit
        raise ManifestError(where, "$", f"invalid JSON: {exc}") from None
    return parse_manifest(doc, where, os.path.dirname(os.path.abspath(where)))


def _json_error(exc: json.JSONDecodeError) -> str:
    """json's message, the line it points into (with a caret), and the usual cause where it is recognisable."""
    lines = exc.doc.splitlines()
    line = lines[exc.lineno - 1] if 0 < exc.lineno <= len(lines) else ""
    before = exc.doc[:exc.pos].rstrip()
    hint = ""
    at = exc.doc[exc.pos] if exc.pos < len(exc.doc) else ""
    if exc.msg.startswith(("Expecting property name", "Expecting value")) and at == "'":
        hint = " (JSON strings take double quotes)"
    elif exc.msg.startswith(("Expecting property name", "Expecting value")) and before.endswith(",") \
            and at in ("]", "}"):
        hint = " (a comma before a closing bracket or brace? JSON allows no trailing comma)"
    elif exc.msg.startswith("Expecting ',' delimiter"):
        hint = " (a missing comma between two items?)"
    shown = line.strip()
    if len(shown) > 100 or not shown:
        return exc.msg + hint
    caret = " " * (exc.colno - 1 - (len(line) - len(line.lstrip()))) + "^"
    return f"{exc.msg}{hint}:\n    {shown}\n    {caret}"


def parse_manifest(doc: dict[str, Any], path: str, base_dir: str) -> Manifest:
    """Validate an in-memory document. `path` names it in errors; kernel sources resolve from `base_dir`.

    Raises ManifestError only, whatever `doc` holds.
    """
    return _Parser(path, base_dir).parse(doc)


class _Parser:
    def __init__(self, path: str, base_dir: str) -> None:
        self.path = path
        self.base_dir = base_dir
        self.vars: dict[str, int] = {}
        self.groups: dict[str, GroupSpec] = {}
        self.buffers: dict[str, BufferSpec] = {}
        self.kernels: dict[str, KernelSpec] = {}
        self.sources: dict[str, bytes] = {}
        # name -> JSON path of its declaration, per namespace, for "also at ..." messages
        self.declared: dict[str, dict[str, str]] = {}

    def fail(self, json_path: str, message: str) -> NoReturn:
        raise ManifestError(self.path, json_path, message)

    # -- generic shapes ------------------------------------------------------------------------

    def plain(self, value: object, trail: tuple[Any, ...] = (), depth: int = 0) -> Any:
        """A copy of `value` as plain JSON (dict/list/str/int/float/bool/None); tuples become lists.
        `trail` is the node's place (see _render), turned into a JSON path only for an error."""
        if depth > MAX_DEPTH:
            self.fail(_render(trail), f"nested too deeply (at most {MAX_DEPTH} levels)")
        if isinstance(value, _DuplicateKeys):
            self.fail(_render((trail, value.duplicate)), f"duplicate key '{cut(value.duplicate)}'")
        if isinstance(value, dict):
            out: dict[str, Any] = {}
            for key, item in value.items():
                if not isinstance(key, str):
                    self.fail(f"{_render(trail)}[{key!r}]", f"object keys must be strings, got {type(key).__name__}")
                out[str(key)] = self.plain(item, (trail, key), depth + 1)
            return out
        if isinstance(value, (list, tuple)):
            items: list[Any] = []
            for i, item in enumerate(value):
                # NOTE: scalars inline (no call per element): a 5 MB list of numbers loads in well under 1 s.
                kind = type(item)
                if (kind is int and -JSON_INT_LIMIT < item < JSON_INT_LIMIT) or kind is str or kind is bool \
                        or item is None or (kind is float and math.isfinite(item)):
                    items.append(item)
                else:
                    items.append(self.plain(item, (trail, i), depth + 1))
            return items
        if value is None or isinstance(value, bool):
            return value
        if isinstance(value, str):
            return str(value)
        if isinstance(value, int):
            if abs(value) >= JSON_INT_LIMIT:
                self.fail(_render(trail), "integer out of range (|value| must be < 2**64)")
            return int(value)
        if isinstance(value, float):
            if not math.isfinite(value):
                self.fail(_render(trail), f"expected a finite number, got {value!r}")
            return float(value)
        self.fail(_render(trail), f"expected a JSON value, got {type(value).__name__}")

    def obj(
        self, value: object, jp: str, what: str, allowed: Sequence[str], required: Sequence[str]
    ) -> dict[str, Any]:
        if not isinstance(value, dict):
            self.fail(jp, f"expected an object ({what}), got {show(value)}")
        for key in value:
            if key not in allowed:
                self.fail(
                    child(jp, key),
                    f"unknown key '{cut(key)}' in {what}; allowed: {', '.join(allowed)}"
                    f"{did_you_mean(key, allowed)}",
                )
        for key in required:
            if key not in value:
                self.fail(jp, f"missing key '{key}' in {what}; required: {', '.join(required)}")
        return value

    def list_(self, value: object, jp: str, what: str) -> list[Any]:
        if not isinstance(value, list):
            self.fail(jp, f"expected a list ({what}), got {show(value)}")
        return value

    def str_(self, value: object, jp: str, what: str) -> str:
        if not isinstance(value, str):
            self.fail(jp, f"expected a string ({what}), got {show(value)}")
        return value

    def bool_(self, value: object, jp: str) -> bool:
        if not isinstance(value, bool):
            self.fail(jp, f"expected true or false, got {show(value)}")
        return value

    def int_(self, value: object, jp: str, minimum: int | None = None) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(jp, f"expected an int, got {show(value)}")
        if abs(value) >= INT_LIMIT:
            self.fail(jp, "integer out of range (|value| must be < 2**63)")
        if minimum is not None and value < minimum:
            self.fail(jp, f"must be >= {minimum}, got {value}")
        return value

    def seconds(self, value: object, jp: str) -> float:
        """A duration in seconds: a number > 0."""
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            self.fail(jp, f"expected a number of seconds > 0, got {show(value)}")
        return float(value)

    def expr(self, value: object, jp: str, minimum: int | None) -> IntOrExpr:
        """An int (checked against `minimum` now) or an expression over vars (checked at resolve)."""
        if isinstance(value, str):
            try:
                check_expr(value, [*self.vars, *RESERVED_VARS])
                # a constant ("-4", "64*1024") can be judged now, as a literal int is
                constant = None if expr_names(value) else eval_expr(value, {})
            except ExprError as exc:
                self.fail(jp, str(exc))
            if constant is not None and minimum is not None and constant < minimum:
                self.fail(jp, f"must be >= {minimum}, got {constant} from {value!r}")
            return value
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(jp, f"expected {EXPR_HELP}, got {show(value)}")
        return self.int_(value, jp, minimum)

    def name(self, value: object, jp: str, namespace: str, pattern: re.Pattern[str] = NAME_RE) -> str:
        """A new name in `namespace`: matches `pattern` and is not declared there yet."""
        text = self.str_(value, jp, f"{namespace} name")
        if not pattern.match(text):
            rule = pattern.pattern.removesuffix("\\Z")
            self.fail(jp, f"invalid {namespace} name {show(text)}; names must match {rule}")
        seen = self.declared.setdefault(namespace, {})
        if text in seen:
            self.fail(jp, f"duplicate {namespace} name '{cut(text)}' (also at {seen[text]})")
        seen[text] = jp
        return text

    def ref(self, value: object, jp: str, kind: str, known: Sequence[str]) -> str:
        """A reference to a declared `kind`; unknown names list the known ones."""
        text = self.str_(value, jp, f"{kind} name")
        if text not in known:
            self.fail(jp, f"unknown {kind} '{cut(text)}'; known: {known_list(known)}{did_you_mean(text, known)}")
        return text

    def dtype(self, value: object, jp: str) -> str:
        return self.ref(value, jp, "dtype", list(DTYPE_ITEMSIZE))

    # -- sections ------------------------------------------------------------------------------

    def parse(self, raw: object) -> Manifest:
        doc = self.plain(raw)
        top = self.obj(doc, "$", "manifest", TOP_KEYS, ("format", "name"))
        fmt = top["format"]
        if type(fmt) is not int or fmt != FORMAT_VERSION:  # 1.0 too: ints are never floats like 4.0 here
            self.fail("$.format", f"unsupported format {show(fmt)}; this tray reads format {FORMAT_VERSION}")
        name = self.name(top["name"], "$.name", "manifest", MANIFEST_NAME_RE)
        description = self.str_(top.get("description", ""), "$.description", "description")
        if any(c < " " or "\x7f" <= c <= "\x9f" for c in description):  # printed by tray inspect: a newline, an escape
            self.fail("$.description", f"the description is one line of text, without control characters; got "
                      f"{show(description)}")
        barrier_timeout_s = self.seconds(top["barrier_timeout_s"], "$.barrier_timeout_s") \
            if "barrier_timeout_s" in top else None
        self.parse_vars(top.get("vars", {}))
        groups = self.parse_groups(top.get("groups", []))
        buffers = self.parse_buffers(top.get("buffers", []))
        states = self.parse_states(top.get("states", []))
        kernels = self.parse_kernels(top.get("kernels", []))
        programs = self.parse_programs(top.get("programs", []))
        return Manifest(
            path=self.path,
            name=name,
            description=description,
            format=FORMAT_VERSION,
            vars=dict(self.vars),
            groups=groups,
            buffers=buffers,
            states=states,
            kernels=kernels,
            programs=programs,
            digest=compute_digest(doc, self.sources),
            doc=doc,
            barrier_timeout_s=barrier_timeout_s,
        )

    def parse_vars(self, raw: object) -> None:
        if not isinstance(raw, dict):
            self.fail("$.vars", f"expected an object (var name -> int default), got {show(raw)}")
        for key, value in raw.items():
            jp = child("$.vars", key)
            if not IDENT_RE.match(key) or keyword.iskeyword(key):
                self.fail(
                    jp, f"invalid var name {show(key)}: use letters, digits and _ (not a Python keyword)"
                )
            if key in RESERVED_VARS:
                self.fail(
                    jp, f"'{key}' is reserved: the tray sets it ({WORLD_SIZE_VAR}: the number of ranks, "
                    f"{LOCAL_WORLD_SIZE_VAR}: the ranks per node); rename the var"
                )
            if key in (RANK_ARG, "index"):
                self.fail(
                    jp, f"'{key}' is reserved: a launch argument \"{RANK_ARG}\" and a bind's {{{RANK_ARG}}} are the "
                    "running rank, a bind's {index} its index in the buffer's group, whatever a var of that name "
                    "says; rename the var"
                )
            self.vars[key] = self.int_(value, jp)

    def parse_groups(self, raw: object) -> tuple[GroupSpec, ...]:
        out: list[GroupSpec] = []
        for i, item in enumerate(self.list_(raw, "$.groups", "groups")):
            jp = child("$.groups", i)
            spec = self.obj(item, jp, "group", GROUP_KEYS, ("name",))
            name = self.name(spec["name"], child(jp, "name"), "group")
            if ("ranks" in spec) == ("size" in spec):
                self.fail(jp, f"group '{name}' needs exactly one of 'ranks' or 'size'")
            ranks: Ranks | None = None
            size: IntOrExpr | None = None
            if "size" in spec:
                size = self.expr(spec["size"], child(jp, "size"), 1)
            else:
                ranks = self.parse_ranks(spec["ranks"], child(jp, "ranks"))
            if name == WORLD and ranks != "all":
                self.fail(
                    jp, 'the world group is always every rank: declare it with "ranks": "all" or omit it'
                )
            out.append(GroupSpec(name, ranks, size, jp))
        if WORLD not in self.declared.get("group", {}):
            out.insert(0, GroupSpec(WORLD, "all", None))
        self.groups = {g.name: g for g in out}
        return tuple(out)

    def parse_ranks(self, raw: object, jp: str) -> Ranks:
        if raw == "all":
            return "all"
        if raw == NODE_RANKS:
            return NODE_RANKS
        if not isinstance(raw, list) or not raw:
            self.fail(
                jp,
                f'expected "all" (every rank), "{NODE_RANKS}" (the ranks of each node of the job) or a non-empty '
                f"list of rank lists like [[0,1],[2,3]], got {show(raw)}",
            )
        seen: dict[int, str] = {}
        instances: list[tuple[int, ...]] = []
        for j, inst in enumerate(raw):
            ijp = child(jp, j)
            if not isinstance(inst, list) or not inst:
                self.fail(ijp, f"expected a non-empty list of ranks, got {show(inst)}")
            for k, rank in enumerate(inst):
                rjp = child(ijp, k)
                self.int_(rank, rjp, 0)
                if rank in seen:
                    self.fail(
                        rjp, f"rank {rank} appears twice (also at {seen[rank]}); instances must be disjoint"
                    )
                seen[rank] = rjp
            instances.append(tuple(inst))
        return tuple(instances)

    def parse_buffers(self, raw: object) -> tuple[BufferSpec, ...]:
        out: list[BufferSpec] = []
        for i, item in enumerate(self.list_(raw, "$.buffers", "buffers")):
            jp = child("$.buffers", i)
            spec = self.obj(item, jp, "buffer", BUFFER_KEYS, ("name", "dtype", "shape"))
            name = self.name(spec["name"], child(jp, "name"), "buffer or state")
            if name in self.vars:
                self.fail(
                    child(jp, "name"),
                    f"buffer '{name}' has the name of a var; launch args could not tell them apart",
                )
            if name in RESERVED_VARS or name == RANK_ARG:
                self.fail(
                    child(jp, "name"),
                    f"buffer '{name}' has the name of a launch argument (\"{name}\" passes "
                    f"{'this rank' if name == RANK_ARG else 'the var'}, not a buffer's address); rename the buffer",
                )
            dtype = self.dtype(spec["dtype"], child(jp, "dtype"))
            sjp = child(jp, "shape")
            shape = tuple(
                self.expr(d, child(sjp, k), 1) for k, d in enumerate(self.list_(spec["shape"], sjp, "shape"))
            )
            export = self.bool_(spec.get("export", False), child(jp, "export"))
            group = self.ref(spec.get("group", WORLD), child(jp, "group"), "group", list(self.groups))
            bind = spec.get("bind")
            if bind is not None and not isinstance(bind, dict):
                self.fail(child(jp, "bind"), f"expected an object, got {show(bind)}")
            out.append(BufferSpec(name, dtype, shape, export, group, bind))
        self.buffers = {b.name: b for b in out}
        return tuple(out)

    def parse_states(self, raw: object) -> tuple[StateSpec, ...]:
        out: list[StateSpec] = []
        for i, item in enumerate(self.list_(raw, "$.states", "states")):
            jp = child("$.states", i)
            spec = self.obj(item, jp, "state", STATE_KEYS, STATE_REQUIRED)
            name = self.name(spec["name"], child(jp, "name"), "buffer or state")
            page_nbytes = self.expr(spec["page_nbytes"], child(jp, "page_nbytes"), 1)
            pages = self.expr(spec["pages"], child(jp, "pages"), 1)
            # host_pages 0 is legal: a state that never parks needs no pinned host memory
            host_pages = None
            if "host_pages" in spec:
                host_pages = self.expr(spec["host_pages"], child(jp, "host_pages"), 0)
            out.append(StateSpec(name, page_nbytes, pages, host_pages))
        return tuple(out)

    def parse_kernels(self, raw: object) -> tuple[KernelSpec, ...]:
        out: list[KernelSpec] = []
        for i, item in enumerate(self.list_(raw, "$.kernels", "kernels")):
            jp = child("$.kernels", i)
            spec = self.obj(item, jp, "kernel", KERNEL_KEYS, ("name", "source"))
            name = self.name(spec["name"], child(jp, "name"), "kernel")
            source = self.str_(spec["source"], child(jp, "source"), "path relative to the manifest")
            full = os.path.abspath(os.path.join(self.base_dir, source))
            try:
                # NOTE: isfile first: open() on a FIFO named by mistake would block the loader.
                if not os.path.isfile(full):
                    raise FileNotFoundError(2, "no such regular file")
                with open(full, "rb") as f:
                    self.sources[name] = f.read()
            except (OSError, ValueError) as exc:  # ValueError: a NUL in the path
                reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
                self.fail(child(jp, "source"), f"cannot read kernel source {full}: {reason}")
            entry = self.str_(spec.get("entry", name), child(jp, "entry"), "entry function name")
            if not IDENT_RE.match(entry):
                where = child(jp, "entry") if "entry" in spec else jp
                self.fail(
                    where,
                    f'entry {show(entry)} is not a C identifier; give "entry" the kernel\'s function name',
                )
            self.check_entry_in_source(entry, self.sources[name], full, child(jp, "entry") if "entry" in spec else jp)
            ojp = child(jp, "options")
            options = tuple(
                self.str_(o, child(ojp, k), "compiler option")
                for k, o in enumerate(self.list_(spec.get("options", []), ojp, "compiler options"))
            )
            peers = self.bool_(spec.get("peers", False), child(jp, "peers"))
            programmatic = self.bool_(spec.get("programmatic", False), child(jp, "programmatic"))
            out.append(KernelSpec(name, full, entry, options, peers, self.sources[name], programmatic))
        self.kernels = {k.name: k for k in out}
        return tuple(out)

    def check_entry_in_source(self, entry: str, code: bytes, path: str, jp: str) -> None:
        """An entry that its source never names (a typo) would surface on a GPU only, as a symbol the compiled
        module lacks; the host backend runs twins and never looks. Sources that include files or paste tokens
        (#include, ##) may define it out of sight, so they are not judged."""
        text = code.decode("utf-8", "replace")
        if re.search(rf"\b{re.escape(entry)}\b", text) or "#include" in text or "##" in text:
            return
        bounds = r"(?:__launch_bounds__\([^)]*\)\s*)?"
        kernels = re.findall(rf"__global__\s+{bounds}void\s+{bounds}(\w+)", text)
        found = f"; it defines {known_list(kernels)}{did_you_mean(entry, kernels)}" if kernels else ""
        self.fail(jp, f"entry {show(entry)} is not in its source {path}{found}")

    def parse_programs(self, raw: object) -> tuple[ProgramSpec, ...]:
        out: list[ProgramSpec] = []
        for i, item in enumerate(self.list_(raw, "$.programs", "programs")):
            jp = child("$.programs", i)
            spec = self.obj(item, jp, "program", PROGRAM_KEYS, ("name", "ops"))
            name = self.name(spec["name"], child(jp, "name"), "program")
            graph = self.bool_(spec.get("graph", False), child(jp, "graph"))
            ojp = child(jp, "ops")
            ops = tuple(
                self.parse_op(op, child(ojp, k)) for k, op in enumerate(self.list_(spec["ops"], ojp, "ops"))
            )
            out.append(ProgramSpec(name, graph, ops))
        return tuple(out)

    # -- ops -----------------------------------------------------------------------------------

    def parse_op(self, raw: object, jp: str) -> OpSpec:
        if not isinstance(raw, dict):
            self.fail(jp, f"expected an object (op), got {show(raw)}")
        if "op" not in raw:
            self.fail(jp, f"missing key 'op'; one of: {', '.join(OP_TYPES)}")
        kind = self.ref(raw["op"], child(jp, "op"), "op", OP_TYPES)
        allowed, required = OP_KEYS[kind]
        spec = self.obj(raw, jp, f"{kind} op", allowed, required)
        ints: dict[str, IntOrExpr] = {}
        for key, minimum in OP_INT_FIELDS[kind].items():
            if key in spec:
                ints[key] = self.expr(spec[key], child(jp, key), minimum)
        refs = {key: self.buffer_ref(spec[key], child(jp, key)) for key in OP_BUFFER_FIELDS[kind]}
        group = self.ref(spec["group"], child(jp, "group"), "group", list(self.groups)) if "group" in spec else ""
        dtype = self.dtype(spec["dtype"], child(jp, "dtype")) if "dtype" in spec else ""
        match kind:
            case "launch":
                kernel = self.ref(spec["kernel"], child(jp, "kernel"), "kernel", list(self.kernels))
                grid, grid_paths = self.dim3(spec["grid"], child(jp, "grid"))
                block, block_paths = self.dim3(spec["block"], child(jp, "block"))
                ajp = child(jp, "args")
                args = self.list_(spec.get("args", []), ajp, "kernel arguments")
                parsed = tuple(self.launch_arg(a, child(ajp, k)) for k, a in enumerate(args))
                stage = self.stage(spec["stage"], child(jp, "stage"), parsed) if "stage" in spec else ()
                return LaunchSpec(
                    kernel, grid, block, ints.get("shmem", 0), parsed, jp, grid_paths + block_paths, stage,
                )  # fmt: skip
            case "nccl":
                collective = self.ref(spec["collective"], child(jp, "collective"), "collective", COLLECTIVES)
                if (collective == "sendrecv") != ("peer" in spec):
                    self.fail(jp, "'peer' is required for collective sendrecv and allowed only there")
                across = ""
                if "across" in spec:
                    across = self.ref(spec["across"], child(jp, "across"), "across", ACROSS)
                    if collective != "alltoall":
                        self.fail(child(jp, "across"), f"'across' is for collective alltoall only, got {collective}")
                return CollectiveSpec(
                    collective, group, refs["send"], refs["recv"], ints["count"], dtype, ints.get("peer"), jp, across
                )
            case "gemm":
                accumulate = self.bool_(spec.get("accumulate", False), child(jp, "accumulate"))
                return GemmSpec(
                    refs["a"], refs["b"], refs["c"], ints["m"], ints["n"], ints["k"], dtype, accumulate, jp
                )
            case "barrier":
                return BarrierSpec(group, jp)
            case _:
                return CopySpec(refs["src"], refs["dst"], ints["bytes"], jp)

    def dim3(self, raw: object, jp: str) -> tuple[Dim3, tuple[str, str, str]]:
        """grid/block: one int|expr, or a list of 1 to 3 of them; missing trailing dims are 1.

        Returns the dims and the JSON path of each (resolve reports a bad expression there).
        """
        if isinstance(raw, list):
            if not 1 <= len(raw) <= 3:
                self.fail(jp, f"expected 1 to 3 dimensions, got {len(raw)}")
            dims = [self.expr(d, child(jp, k), 1) for k, d in enumerate(raw)] + [1] * (3 - len(raw))
            return (dims[0], dims[1], dims[2]), (child(jp, 0), child(jp, 1), child(jp, 2))
        return (self.expr(raw, jp, 1), 1, 1), (jp, jp, jp)

    def stage(self, raw: object, jp: str, args: tuple[str | int | float, ...]) -> tuple[StageSpec, ...]:
        """`{"<buffer>": {"buffer": "<buffer ref>", "block": <bytes>}, ...}`: each key a `peers:<buffer>`
        argument of the launch (StageSpec says what it means)."""
        if not isinstance(raw, dict):
            self.fail(jp, f"expected an object (peer table -> staging), got {show(raw)}")
        tables = [a[len(PEERS_PREFIX):] for a in args if isinstance(a, str) and a.startswith(PEERS_PREFIX)]
        out = []
        for name, item in raw.items():
            sjp = child(jp, name)
            if name not in tables:
                self.fail(sjp, f"'{cut(name)}' is not a peer table of this launch; its peers: arguments: "
                          f"{', '.join(tables) or 'none'}")
            spec = self.obj(item, sjp, "staging", ("buffer", "block"), ("buffer", "block"))
            out.append(StageSpec(name, self.buffer_ref(spec["buffer"], child(sjp, "buffer")),
                                 self.expr(spec["block"], child(sjp, "block"), 1), sjp))
        return tuple(out)

    def buffer_ref(self, raw: object, jp: str) -> str:
        """`"buf"` or `"buf@offset_expr"` (bytes); the buffer must be declared."""
        text = self.str_(raw, jp, "buffer reference")
        name, offset = split_ref(text)
        self.ref(name, jp, "buffer", list(self.buffers))
        if offset is not None:
            self.expr(offset, jp, 0)
        return text

    def launch_arg(self, raw: object, jp: str) -> str | int | float:
        """`buffer[@offset]`, `peers:<exported buffer>`, a var name, or an int or float literal."""
        if isinstance(raw, bool) or not isinstance(raw, (str, int, float)):
            self.fail(jp, f"expected a buffer, peers:<buffer>, var name or number, got {show(raw)}")
        if isinstance(raw, int):
            return self.int_(raw, jp)
        if isinstance(raw, float):
            return raw
        if raw.startswith(PEERS_PREFIX):
            name = self.ref(raw[len(PEERS_PREFIX) :], jp, "buffer", list(self.buffers))
            if not self.buffers[name].export:
                self.fail(jp, f"'{raw}' needs buffer '{name}' to be exported: add \"export\": true to it")
            return raw
        if raw in self.vars or raw in RESERVED_VARS or raw == RANK_ARG:
            return raw
        if raw.startswith(INDEX_PREFIX):
            self.ref(raw[len(INDEX_PREFIX) :], jp, "group", list(dict.fromkeys([*self.groups, "world"])))
            return raw
        name, _ = split_ref(raw)
        if name in self.buffers:
            return self.buffer_ref(raw, jp)
        names = [*self.buffers, *(PEERS_PREFIX + b.name for b in self.buffers.values() if b.export)]
        names += [*self.vars, *RESERVED_VARS, RANK_ARG, INDEX_PREFIX + "<group>"]
        self.fail(
            jp,
            f"'{raw}' names no buffer, peers:<exported buffer> or var; known: {known_list(names)}"
            f"{did_you_mean(name, names)}",
        )
