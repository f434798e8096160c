"""The code's shape stays readable: a small top level, no import cycles, no class over 200 lines, no function
over 60 (docs/architecture.md).

``OVERSIZED`` would name an exception with its size (it may shrink, never grow); it is empty: every class and
function is within the limits.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("fedcomp", "clients", "server_app", "simulations")
MAX_CLASS, MAX_FUNCTION, MAX_TOP_MODULES = 200, 60, 8

#: (path, name) -> lines: classes and functions allowed over the limits, and their size; none may grow.
OVERSIZED: dict[tuple[str, str], int] = {}


def sources():
    for pkg in PACKAGES:
        yield from sorted((ROOT / pkg).rglob("*.py"))


def sizes():
    """(path, name, kind, lines) of every class and function."""
    for path in sources():
        rel = str(path.relative_to(ROOT))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                kind = "class" if isinstance(node, ast.ClassDef) else "function"
                yield rel, node.name, kind, node.end_lineno - node.lineno + 1


def test_no_class_or_function_grows_past_its_limit():
    over = {}
    for rel, name, kind, lines in sizes():
        if lines > (MAX_CLASS if kind == "class" else MAX_FUNCTION):
            over[(rel, name)] = lines
    new = {k: v for k, v in over.items() if k not in OVERSIZED}
    grown = {k: (OVERSIZED[k], v) for k, v in over.items() if k in OVERSIZED and v > OVERSIZED[k]}
    assert not new, f"over {MAX_CLASS} (class) / {MAX_FUNCTION} (function) lines: {new}"
    assert not grown, f"grew (then, now): {grown}"


def test_the_core_has_a_small_top_level():
    top = sorted(p.name for p in (ROOT / "fedcomp").glob("*.py"))
    assert len(top) <= MAX_TOP_MODULES, top


def imports(path: Path, package: str) -> set[str]:
    """The project modules ``path`` imports, at module level or inside functions (a deferred import that closes
    a cycle is still a cycle)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m.split(".")[0] in PACKAGES}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_import_cycles_between_modules():
    modules = {module_name(p): p for p in sources()}
    graph = {m: {i for i in imports(p, m) if i in modules and i != m} for m, p in modules.items()}
    # a package's __init__ re-exporting its modules is not a cycle with them
    graph = {m: {i for i in deps if not m.startswith(i + ".")} for m, deps in graph.items()}
    state: dict[str, int] = {}
    cycles = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                cycles.append(stack[stack.index(d):] + [d] if d in stack else [m, d])
            elif d not in state:
                visit(d, stack + [d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, cycles


def test_benchmarks_and_the_apps_never_import_the_tests():
    """Benchmarks import the package (and the harness beside them: benchmarks/flowerkit.py, compatkit.py,
    faultkit.py), never ``tests``; nor do the packages."""
    offenders = []
    for path in [*sorted((ROOT / "benchmarks").glob("*.py")), *sources()]:
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            if any(n == "tests" or n.startswith("tests.") for n in names):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, offenders
