"""The package's shape : no module of ``lightning_mics/`` or ``triton_kernels/`` over 450 lines, no class
over 400, no function over 80, and no import cycle among the package's modules (imports under TYPE_CHECKING
and imports inside functions count), and the package's folders by layer import only downward (``LAYERS``); the tests
sit in folders by area, each rank script beside a test that names it. Read from the source: nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set, Tuple

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = {"lightning_mics": "lightning_mics", "lightning_mics_kernels": "triton_kernels"}  # import name: folder
MAX_MODULE, MAX_CLASS, MAX_FUNCTION = 450, 400, 80

# (kind, name) -> why it may still be over; every entry must still be needed (see the last test)
ALLOWED: Dict[Tuple[str, str], str] = {}


def _modules() -> Dict[str, Path]:
    out = {}
    for pkg, folder in PACKAGES.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            parts = [pkg, *path.relative_to(REPO / folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


MODULES = _modules()
TREES = {name: ast.parse(path.read_text(), str(path)) for name, path in MODULES.items()}


def _span(node: ast.AST) -> int:
    start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    return node.end_lineno - start + 1


def _violations() -> Dict[Tuple[str, str], str]:
    found = {}
    for name, tree in TREES.items():
        lines = len(MODULES[name].read_text().splitlines())
        if lines > MAX_MODULE:
            found[("module", name)] = f"{lines} lines > {MAX_MODULE}"

        def visit(node: ast.AST, prefix: str) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.ClassDef):
                    qual = f"{prefix}.{child.name}"
                    if _span(child) > MAX_CLASS:
                        found[("class", qual)] = f"{_span(child)} lines > {MAX_CLASS}"
                    visit(child, qual)
                elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    qual = f"{prefix}.{child.name}"
                    if _span(child) > MAX_FUNCTION:
                        found[("function", qual)] = f"{_span(child)} lines > {MAX_FUNCTION}"
                    visit(child, qual)
                else:
                    visit(child, prefix)

        visit(tree, name)
    return found


def _imports(name: str) -> Set[str]:
    """The package modules ``name`` imports, anywhere in its source."""
    is_pkg = MODULES[name].name == "__init__.py"
    out: Set[str] = set()

    def add(target: str) -> None:
        while target and target not in MODULES:  # a name inside a module: the module
            target = target.rpartition(".")[0]
        if target and target != name:
            out.add(target)

    for node in ast.walk(TREES[name]):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[: len(base) - node.level + (1 if is_pkg else 0)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for alias in node.names:  # ``from pkg import module``: the module itself
                sub = f"{module}.{alias.name}"
                add(sub if sub in MODULES else module)
    return out


def _cycles() -> List[List[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    graph = {n: sorted(_imports(n)) for n in MODULES}
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on: Set[str] = set()
    out: List[List[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                strong(w)
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

    for v in graph:
        if v not in index:
            strong(v)
    return out


def test_the_modules_are_found():
    assert {"lightning_mics.engine.engine", "lightning_mics.engine.unit", "lightning_mics_kernels._checks"} <= set(MODULES)


@pytest.mark.parametrize("kind", ["module", "class", "function"])
def test_nothing_over_the_limits(kind):
    over = {k[1]: why for k, why in _violations().items() if k[0] == kind and k not in ALLOWED}
    assert not over, over


def test_no_import_cycle():
    assert _cycles() == []


def test_the_import_reader_sees_the_edges():
    assert "lightning_mics.engine.unit" in _imports("lightning_mics.engine.schedule")
    assert "lightning_mics.comm.collectives" in _imports("lightning_mics.engine.unit")  # ``from lightning_mics import ...``


def test_every_allowance_is_still_needed():
    stale = sorted(set(ALLOWED) - set(_violations()))
    assert not stale, f"remove these from ALLOWED: {stale}"


# The package's layers, lowest first: a module may import its own layer's modules and those of the layers below.
LAYERS = ["lightning_mics_kernels", "lightning_mics.options", "lightning_mics.comm", "lightning_mics.layout",
          "lightning_mics.engine", "lightning_mics.checkpoint", "lightning_mics.frontends", "lightning_mics.fabric",
          "lightning_mics.plan", "lightning_mics.app", "lightning_mics"]


def _layer(module: str) -> int:
    return max(i for i, layer in enumerate(LAYERS) if module == layer or module.startswith(layer + "."))


def test_every_module_has_a_layer_and_imports_only_downward():
    upward = {}
    for name in MODULES:
        for target in _imports(name):
            if _layer(target) > _layer(name):
                upward.setdefault(name, []).append(target)
    assert not upward, upward
    top = {n for n in MODULES if n.count(".") == 1 and n.startswith("lightning_mics.")}
    assert top <= {"lightning_mics.options", "lightning_mics.fabric", "lightning_mics.comm", "lightning_mics.layout",
                   "lightning_mics.engine", "lightning_mics.checkpoint", "lightning_mics.frontends",
                   "lightning_mics.plan", "lightning_mics.app"}, top  # the package's top level holds only these


# -- the tests' own shape: by area, each rank script beside a test that runs it ------------------------------------
TESTS = REPO / "tests"
SHARED = {"helpers", "stress"}  # what several areas use; the long runs CI deselects


def test_tests_are_by_area_with_each_rank_script_beside_its_test():
    assert sorted(p.name for p in TESTS.glob("*.py")) == ["__init__.py", "conftest.py"], "tests go in an area folder"
    areas = sorted(p for p in TESTS.iterdir() if p.is_dir() and p.name not in SHARED | {"__pycache__"})
    assert len(areas) >= 10, areas
    lonely = []
    for area in areas:
        assert (area / "__init__.py").exists(), f"{area.name}/ is not a package"
        tests = " ".join(p.read_text() for p in area.glob("test_*.py"))
        assert tests, f"{area.name}/ holds no test"
        for script in area.glob("*.py"):
            name = script.stem
            if name.startswith("test_") or name == "__init__":
                continue
            if f"{name}.py" not in tests and f"tests.{area.name}.{name}" not in tests:
                lonely.append(f"{area.name}/{script.name}")
    assert not lonely, f"rank scripts no test beside them names (move them beside their test, or to helpers/): {lonely}"
