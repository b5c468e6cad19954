"""The import rules of docs/architecture.md, read from the source with ``ast``: no module
of a part imports a part it must not know, and no import cycle between modules."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

# part -> parts it must not import
FORBIDDEN = {
    "atom.worker": ["atom.engine", "atom.entrypoints", "atom.benchmarks"],
    "atom.engine": ["atom.entrypoints", "atom.benchmarks"],
    "atom.entrypoints": ["atom.worker", "atom.benchmarks"],
    "atom.models": ["atom.engine", "atom.worker", "atom.entrypoints", "atom.plugin"],
    "atom.layers": ["atom.engine", "atom.worker", "atom.entrypoints", "atom.plugin", "atom.models"],
    "atom.ops": ["atom.engine", "atom.worker", "atom.entrypoints", "atom.layers", "atom.models"],
    "atom.core_types": ["atom.engine", "atom.worker", "atom.entrypoints"],
    # the engine (scheduling, statistics) and the worker (proposers, verification) both use it
    "atom.spec_decode": ["atom.engine", "atom.worker", "atom.entrypoints", "atom.benchmarks"],
}


def import_graph() -> dict[str, set[str]]:
    paths = {}
    for p in (ROOT / "atom").rglob("*.py"):
        parts = p.relative_to(ROOT).with_suffix("").parts
        paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    graph = {}
    for name, path in paths.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # ``from atom import ops`` imports the module atom.ops, not atom/__init__'s names
                edges |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in paths else node.module
                          for a in node.names}
            elif isinstance(node, ast.Import):
                edges |= {a.name for a in node.names}
        graph[name] = {e for e in edges if e in paths and e != name}
    return graph


def within(module: str, part: str) -> bool:
    return module == part or module.startswith(part + ".")


@pytest.mark.parametrize("part", list(FORBIDDEN))
def test_part_imports_only_what_it_may(part):
    bad = [(m, e) for m, edges in import_graph().items() if within(m, part)
           for e in edges if any(within(e, f) for f in FORBIDDEN[part])]
    assert bad == []


def test_no_import_cycle():
    graph = import_graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for e in sorted(graph[m]):
            assert state.get(e) != 1, f"import cycle: {' -> '.join(path[path.index(e):] + [e])}"
            if e not in state:
                visit(e, path + [e])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
