"""The shape of the code a reader follows: short functions, and no import circle inside ``dimuon.optim``.

Functions are measured from their ``def`` line to their last line (decorators aside, docstrings included): none in
``optim/`` over 60 lines, none elsewhere in ``src/dimuon`` over 100. A function that grows past its limit is split
into parts with one job each.
"""

from __future__ import annotations

import ast
from pathlib import Path

import dimuon

ROOT = Path(dimuon.__file__).parent
OPTIM_LIMIT = 60  # lines per function in optim/, the product a reader checks against the papers
SRC_LIMIT = 100  # lines per function anywhere else in the package


def _functions(path: Path) -> list[tuple[str, int]]:
    """Every function and method of one file (nested ones too), with its length in lines."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return [
        (node.name, node.end_lineno - node.lineno + 1)
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno is not None
    ]


def test_no_function_is_longer_than_its_limit() -> None:
    too_long = []
    for path in sorted(ROOT.rglob("*.py")):
        limit = OPTIM_LIMIT if "optim" in path.relative_to(ROOT).parts[:1] else SRC_LIMIT
        for name, lines in _functions(path):
            if lines > limit:
                too_long.append(f"{path.relative_to(ROOT)}:{name} has {lines} lines (at most {limit})")
    assert not too_long, "\n".join(too_long)


def _module_name(path: Path) -> str:
    """``dimuon.optim.x`` for ``optim/x.py``, the package's name for its ``__init__.py``."""
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _top_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """The imports a module runs when it is loaded: its body's, and those under a plain ``if`` or ``try`` (not
    ``if TYPE_CHECKING:``, which never runs); imports inside functions are left out."""
    found: list[ast.Import | ast.ImportFrom] = []
    pending: list[ast.stmt] = list(tree.body)
    while pending:
        node = pending.pop(0)
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
            pending += node.body + node.orelse
        elif isinstance(node, ast.Try):
            pending += node.body + [s for h in node.handlers for s in h.body] + node.orelse + node.finalbody
    return found


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The ``dimuon.optim`` modules one import statement loads: ``from P import m`` names module ``P.m`` where
    that is a module, else ``P`` itself (a parent package, run first by Python anyway, is not an edge)."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name in known}
    base = node.module or ""
    if node.level:
        package = module.split(".") if is_package else module.split(".")[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join(package + ([node.module] if node.module else []))
    submodules = {f"{base}.{alias.name}" for alias in node.names} & known
    names_only = len(submodules) < len(node.names)
    return submodules | ({base} if names_only and base in known else set())


def optim_import_graph() -> dict[str, set[str]]:
    """Module -> the ``dimuon.optim`` modules it imports when loaded (module-level imports only)."""
    paths = {_module_name(p): p for p in sorted((ROOT / "optim").rglob("*.py"))}
    known = set(paths)
    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        edges = {t for node in _top_level_imports(tree) for t in _targets(node, module, is_package, known)}
        graph[module] = edges - {module}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` (its modules in order, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state and (found := visit(target, path)) is not None:
                return found
        path.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state and (found := visit(module, [])) is not None:
            return found
    return None


def test_optim_imports_run_in_no_circle() -> None:
    """Module-level imports only: an import inside a function is lazy on purpose (it runs after every module has
    loaded), and ``if TYPE_CHECKING:`` imports never run; shared types live in ``optim/common.py``."""
    graph = optim_import_graph()
    assert "dimuon.optim.core" in graph and "dimuon.optim.distributed.sharded" in graph
    assert "dimuon.optim.distributed.engine" in graph["dimuon.optim.distributed.sharded"]
    circle = _cycle(graph)
    assert circle is None, " -> ".join(circle or [])


def test_the_circle_finder_finds_a_circle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
