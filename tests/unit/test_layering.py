"""The layout as rules, read from the source with `ast`: no import cycle among tray's modules, the
infrastructure never imports a program, and nothing in tray/ touches sys.path."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO

TRAY = REPO / "tray"
INFRASTRUCTURE = ("backend", "collectives", "handshake", "launch", "rank", "park", "manifest", "numa")
# Imports inside functions that close a cycle today: the one edge of each cycle to delete. When the
# modules are split so that the edge is gone, the test says so: delete the entry.
KNOWN_CYCLE_EDGES: set[tuple[str, str]] = {
    ("tray.manifest.schema", "tray.manifest.resolve"),  # the schema's resolve() helper
    ("tray.park.session", "tray.park.parking"),  # a session reaches back to its parking
}


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def tray_sources() -> dict[str, Path]:
    return {module_name(p): p for p in TRAY.rglob("*.py") if "_builtin" not in p.relative_to(TRAY).parts}


def imports(path: Path, modules: set[str], module_level_only: bool) -> set[str]:
    """The tray modules `path` imports (`from a import b` counts as a.b when that is a module)."""
    tree = ast.parse(path.read_text(), str(path))
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    nodes = tree.body if module_level_only else list(ast.walk(tree))
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.If) and module_level_only:  # `if TYPE_CHECKING:` imports are not run
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                head = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(head + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in modules:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def graph(module_level_only: bool) -> dict[str, set[str]]:
    sources = tray_sources()
    names = set(sources)
    return {m: imports(p, names, module_level_only) for m, p in sources.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_among_tray_modules_at_module_level():
    assert cycles(graph(module_level_only=True)) == []


def test_no_import_cycle_among_tray_modules_counting_imports_in_functions():
    edges = graph(module_level_only=False)
    for a, b in KNOWN_CYCLE_EDGES:
        assert b in edges.get(a, set()), f"known cycle edge {a} -> {b} is gone: delete it from KNOWN_CYCLE_EDGES"
        edges[a] = edges[a] - {b}
    assert cycles(edges) == []


def test_the_infrastructure_never_imports_a_program():
    bad = []
    for m, targets in graph(module_level_only=False).items():
        if m.split(".")[1:2] and m.split(".")[1] in INFRASTRUCTURE:
            bad += [f"{m} -> {t}" for t in targets if t == "tray.programs" or t.startswith("tray.programs.")]
    assert bad == []


def test_rank_the_head_and_the_backends_never_reach_a_collectives_implementation():
    """DESIGN §12: Rank -> collectives -> backend, never back, and Rank and the head never say NCCL: they use the
    collectives through tray.collectives (base, the joiner a backend names, early's StartJoin), never their NCCL
    module or its id process; a backend imports no collectives at all."""
    implementations = ("tray.collectives.nccl", "tray.collectives.idmaker")
    bad = []
    for m, targets in graph(module_level_only=False).items():
        layer = m.split(".")[1] if m.count(".") else ""
        if layer in ("rank", "launch", "handshake"):
            bad += [f"{m} -> {t}" for t in targets if t in implementations]
        elif layer == "backend":
            bad += [f"{m} -> {t}" for t in targets if t.startswith("tray.collectives")]
    assert bad == []


def test_nothing_in_tray_touches_sys_path():
    offenders = []
    for m, path in tray_sources().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "path" and getattr(node.value, "id", "") == "sys":
                offenders.append(m)
    assert offenders == []


def test_the_rules_see_an_import_cycle_and_a_program_import(tmp_path):
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    edges = graph(module_level_only=False)
    assert "tray.twins" in edges["tray.backend.host"] or "tray.twins" in edges["tray.backend.host.twins"]
    assert "tray.programs.ep_moe.twins" in edges["tray.programs.tp_mlp.twins"]
