"""The layers of the house, as a test (../shared/ARCHITECTURE.md):

    floor 4  edge/cli/                        the roof: the only package above quant/, tui/, edge/server/
    floor 3  quant/  tui/  edge/server/       applications of the library
    floor 2  edge/ (the rest)                 the library
    floor 1  kernels_cpu/                     numba kernels and GGML block layouts

Every import counts, at module level or inside a function (walked with ``ast``), relative ones
resolved. The rules: kernels_cpu imports nothing of the project and no third-party package but
numpy, numba, llvmlite and gguf; the library imports no application (quant, tui, edge.server,
edge.cli) and none of their frameworks (textual, starlette, uvicorn, pydantic,
prometheus_client, rich); only tui imports textual; an application imports no other, and only
the roof (edge/cli/) imports applications; and no module imports itself through others (no loop).
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kernels_cpu", "edge", "quant", "tui")
APPLICATIONS = ("quant", "tui", "edge.server")
FRAMEWORKS = ("textual", "starlette", "uvicorn", "pydantic", "prometheus_client", "rich")
KERNEL_DEPENDENCIES = ("numpy", "numba", "llvmlite", "gguf")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports (absolute names; ``from a import b`` gives a and a.b)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.add(module)
            found.update(f"{module}.{a.name}" for a in node.names if a.name != "*")
    return found


MODULES = {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}
IMPORTS = {m: _imports(p) for m, p in MODULES.items()}


def _project(names: set[str]) -> set[str]:
    """The project's modules among imported names (a.b.c -> the longest known prefix)."""
    out = set()
    for n in names:
        parts = n.split(".")
        for k in range(len(parts), 0, -1):
            if ".".join(parts[:k]) in MODULES:
                out.add(".".join(parts[:k]))
                break
    return out


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _floor(module: str) -> str:
    if _within(module, "kernels_cpu"):
        return "kernels"
    if _within(module, "edge.cli"):
        return "roof"
    if any(_within(module, a) for a in APPLICATIONS):
        return next(a for a in APPLICATIONS if _within(module, a))
    return "library"


def _third_party(names: set[str]) -> set[str]:
    tops = {n.split(".")[0] for n in names if n}
    return {t for t in tops if t not in PACKAGES and t not in sys.stdlib_module_names and t != "__future__"}


def test_the_walk_sees_the_project():
    """The rules below hold over the real tree (not over nothing)."""
    assert {"kernels_cpu.matmul", "edge.engine", "edge.cli.generate", "edge.server.app", "quant.pipeline", "tui.app"} <= set(MODULES)
    assert any("edge.engine" in _project(IMPORTS[m]) for m in MODULES if _within(m, "edge.cli"))


def test_kernels_import_nothing_of_the_project():
    bad = {m: sorted(_project(i) - {x for x in MODULES if _within(x, "kernels_cpu")}) for m, i in IMPORTS.items()
           if _floor(m) == "kernels"}
    assert not {m: b for m, b in bad.items() if b}
    foreign = {m: sorted(_third_party(i) - set(KERNEL_DEPENDENCIES)) for m, i in IMPORTS.items() if _floor(m) == "kernels"}
    assert not {m: f for m, f in foreign.items() if f}


def test_library_imports_no_application_and_no_framework():
    bad = {}
    for m, names in IMPORTS.items():
        if _floor(m) != "library":
            continue
        apps = sorted(x for x in _project(names) if _floor(x) not in ("library", "kernels"))
        frameworks = sorted(_third_party(names) & set(FRAMEWORKS))
        if apps or frameworks:
            bad[m] = apps + frameworks
    assert not bad


def test_only_tui_imports_textual():
    assert not [m for m, names in IMPORTS.items() if "textual" in _third_party(names) and not _within(m, "tui")]


def test_only_the_roof_sits_above_the_applications():
    """An application imports the library and kernels only; the roof alone imports them."""
    bad = {}
    for m, names in IMPORTS.items():
        floor = _floor(m)
        if floor in APPLICATIONS:
            others = sorted(x for x in _project(names) if _floor(x) not in (floor, "library", "kernels"))
            if others:
                bad[m] = others
    assert not bad
    importers = {m for m, names in IMPORTS.items() for x in _project(names) if _floor(x) in APPLICATIONS
                 and _floor(m) not in APPLICATIONS}
    assert importers and all(_floor(m) == "roof" for m in importers)


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import loop of the graph (modules in order, the first repeated at the end), or None."""
    state: dict[str, int] = {}   # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_import_loop():
    """A package's __init__ counts as imported by its modules only where they name it."""
    graph = {m: _project(names) - {m} for m, names in IMPORTS.items()}
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


@pytest.mark.parametrize("graph, loop", [({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
                                         ({"a": {"b"}, "b": set()}, None)])
def test_the_loop_finder_finds_loops(graph, loop):
    assert _cycle(graph) == loop
