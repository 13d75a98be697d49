"""The project's import graph read from source (every `import`, function-level ones too; imports under
`if TYPE_CHECKING:` are left out, since they never run): which module imports which, and its cycles."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ROOMS = (
    "common",
    "serving",
    "reports",
    "drafter",
    "engines",
    "registry",
    "tuning",
    "evaluation",
    "pipeline",
    "cli",
    "steps",
    "miniworld",
)


def modules(rooms: tuple[str, ...] = ROOMS) -> dict[str, Path]:
    out = {}
    for room in rooms:
        for path in (ROOT / room).rglob("*.py"):
            if "vllm_site" in path.parts:  # put on a vLLM server's path, never imported by the project
                continue
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            out[name] = path
    return out


def _runtime_nodes(tree: ast.AST):
    """Every node except what sits under `if TYPE_CHECKING:`."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            continue
        yield node
        yield from _runtime_nodes(node)


def imported_names(path: Path) -> set[str]:
    names = set()
    for node in _runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def graph(rooms: tuple[str, ...] = ROOMS) -> dict[str, set[str]]:
    mods = modules(rooms)
    edges: dict[str, set[str]] = defaultdict(set)
    for name, path in mods.items():
        edges[name] = {t for t in imported_names(path) if t in mods and t != name}
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
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
                found.append(sorted(comp))

    for v in list(edges):
        if v not in index:
            visit(v)
    return found


def room_edges(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    """Which room imports which (a room's imports of itself left out)."""
    out: dict[str, set[str]] = {r: set() for r in ROOMS}
    for a, bs in edges.items():
        for b in bs:
            if a.split(".")[0] != b.split(".")[0]:
                out[a.split(".")[0]].add(b.split(".")[0])
    return out


if __name__ == "__main__":  # python -m tests.helpers.import_graph: the figures quoted in docs/design.md
    g = graph()
    print("cycles:", cycles(g) or "none")
    for room, targets in room_edges(g).items():
        print(f"{room} -> {', '.join(sorted(targets)) or 'nothing of the project'}")
