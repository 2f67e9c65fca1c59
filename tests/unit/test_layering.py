"""The package's imports run one way: read from the source (AST), lazy imports included.

A module may import its own package or a lower layer; packages in one layer do not import
each other; and no two modules import each other, directly or in a circle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from support.paths import ROOT

AGENT = ROOT / "agent"

LAYERS: list[set[str]] = [
    {"atomic", "errors"},
    {"log", "demo", "signals", "_vendor"},
    {"spec"},
    {"systemd"},
    {"net"},
    {"gpu", "worker", "router"},
    {"front"},
    {"metrics", "export"},
    {"cli"},
    {"__main__"},
]
RANK = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}

# Imports against the layering that are still to be removed: (importer, imported).
KNOWN: set[tuple[str, str]] = set()
# Circles still to be broken, each named by the pair that closes it.
KNOWN_CYCLES: set[tuple[str, str]] = set()


def modules() -> dict[str, Path]:
    found = {}
    for path in AGENT.rglob("*.py"):
        if "_vendor" in path.parts:
            continue
        parts = path.relative_to(AGENT.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The agent modules `name` imports (a `from pkg import module` names the module)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            targets = [
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                for a in node.names
            ]
        else:
            continue
        out |= {t for t in targets if t.split(".")[0] == "agent" and t != name}
    return out


def package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "agent"


GRAPH = {name: imports(name, path, set(modules())) for name, path in modules().items()}


def test_every_package_has_a_layer() -> None:
    unplaced = {package(m) for m in GRAPH} - set(RANK) - {"agent"}
    assert not unplaced, f"packages with no layer in {__file__}: {sorted(unplaced)}"


def test_imports_go_down_the_layers() -> None:
    wrong = set()
    for importer, targets in GRAPH.items():
        for target in targets:
            a, b = package(importer), package(target)
            if a == b or b == "agent" or a == "agent":
                continue
            if RANK[b] >= RANK[a]:
                wrong.add((importer, target))
    assert wrong <= KNOWN, "imports against the layering:\n" + "\n".join(
        f"  {a} imports {b}" for a, b in sorted(wrong - KNOWN)
    )
    stale = KNOWN - wrong
    assert not stale, f"listed in KNOWN but gone, remove them: {sorted(stale)}"


def test_no_module_imports_itself_in_a_circle() -> None:
    cycles = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(GRAPH.get(m, ())):
            if n not in GRAPH:
                continue
            if state.get(n) == 1:
                if (n, m) not in KNOWN_CYCLES and (m, n) not in KNOWN_CYCLES:
                    cycles.append([*stack[stack.index(n) :], n])
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(GRAPH):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles:\n" + "\n".join("  " + " -> ".join(c) for c in cycles)


@pytest.mark.parametrize("pkg", sorted({package(m) for m in GRAPH} - {"agent"}))
def test_a_package_init_imports_nothing(pkg: str) -> None:
    """`python3 -m agent.worker` must stay light: no package pulls in code on import."""
    init = AGENT / pkg / "__init__.py"
    if init.exists():
        assert not GRAPH.get(f"agent.{pkg}"), f"{init} imports {GRAPH[f'agent.{pkg}']}"
