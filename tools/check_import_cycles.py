"""Fail on module-level import cycles inside a package (``make lint``).

For every package of ``cacheblend_rag`` the script links its direct children (modules, subpackages and its
own ``__init__``): A -> B when a module of A imports, at module level, a module of B. A cycle among them
(two modules of ``engine/`` importing each other, say) is reported with the imports that close it, and the
script exits 1. Imports under ``if TYPE_CHECKING:`` count (two modules that name each other's types are
tied together all the same); imports inside functions (deferred on purpose) do not. Between the top-level
packages the import-linter layers contract (pyproject.toml) already forbids cycles; this check covers the
modules within each package.

:data:`KNOWN_CYCLES` lists cycles tolerated while they are untied (reported, not failed); it is empty:
the three it had (``check`` <-> ``rag``, ``corpus`` <-> ``documents``, the remote tier's ``admin`` <->
``source`` <-> ``tier``) are gone, and any cycle fails.

    python tools/check_import_cycles.py [ROOT_DIR]     # default: the cacheblend_rag package folder
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

PACKAGE = "cacheblend_rag"
# (package, its children in the cycle) of cycles tolerated while they are untied; the three it had are
# gone, and a new one is untied rather than added here
KNOWN_CYCLES: set[tuple[str, tuple[str, ...]]] = set()


def module_names(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, of every module under ``root`` (the package folder)."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def module_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """The imports at a module's level: its body's and those of top-level ``if`` (``TYPE_CHECKING``
    included), ``try`` and ``with`` blocks, not those in functions or classes."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(statements: list[ast.stmt]) -> None:
        for node in statements:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found.append(node)
            elif isinstance(node, ast.If):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                    visit(block)
            elif isinstance(node, ast.With):
                visit(node.body)

    visit(tree.body)
    return found


def imported_modules(
    name: str, is_package: bool, node: ast.Import | ast.ImportFrom, known: set[str]
) -> set[str]:
    """The package's modules that ``node`` (in module ``name``) imports."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name in known}
    if node.level:
        base = name.split(".") if is_package else name.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    targets = set()
    for alias in node.names:
        candidate = f"{source}.{alias.name}"
        targets.add(candidate if candidate in known else source)  # a submodule, else a name of `source`
    return {t for t in targets if t in known}


def import_graph(root: Path) -> dict[str, dict[str, int]]:
    """Module -> {module it imports at module level: line}, within the package at ``root``."""
    names = module_names(root)
    known = set(names)
    graph: dict[str, dict[str, int]] = {}
    for name, path in names.items():
        tree = ast.parse(path.read_text(), str(path))
        edges: dict[str, int] = {}
        for node in module_level_imports(tree):
            for target in imported_modules(name, path.name == "__init__.py", node, known):
                if target != name:
                    edges.setdefault(target, node.lineno)
        graph[name] = edges
    return graph


def child_of(package: str, module: str) -> str | None:
    """The direct child of ``package`` that holds ``module`` (``package`` itself for its __init__)."""
    if module == package:
        return package
    if not module.startswith(package + "."):
        return None
    return package + "." + module[len(package) + 1 :].split(".")[0]


def cycles(graph: dict[str, dict[str, int]]) -> list[tuple[str, list[str], list[str]]]:
    """(package, the children in a cycle, the imports between them) for every cycle among the direct
    children of a package."""
    packages = sorted({name for name in graph if any(other.startswith(name + ".") for other in graph)})
    found = []
    for package in packages:
        links: dict[str, set[str]] = defaultdict(set)
        why: dict[tuple[str, str], str] = {}
        for module, edges in graph.items():
            a = child_of(package, module)
            if a is None:
                continue
            for target, line in edges.items():
                b = child_of(package, target)
                if b is not None and b != a:
                    links[a].add(b)
                    why.setdefault((a, b), f"{module} (line {line}) imports {target}")
        for component in strongly_connected(links):
            if len(component) > 1:
                members = sorted(component)
                evidence = sorted(why[(a, b)] for a in members for b in members if (a, b) in why)
                found.append((package, members, evidence))
    return found


def strongly_connected(links: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's strongly connected components of the graph ``links`` (node -> successors)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []
    nodes = sorted(set(links) | {b for bs in links.values() for b in bs})

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(links.get(node, ())):
            if successor not in index:
                connect(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            components.append(component)

    for node in nodes:
        if node not in index:
            connect(node)
    return components


def main(argv: list[str]) -> int:
    root = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parent.parent / PACKAGE
    found = []
    for package, members, evidence in cycles(import_graph(root)):
        if (package, tuple(members)) in KNOWN_CYCLES:
            names = " <-> ".join(m.rsplit(".", 1)[-1] for m in members)
            print(f"known import cycle in {package} (to untie): {names}")
            continue
        found.append((package, members, evidence))
    for package, members, evidence in found:
        print(f"import cycle in {package}: {' <-> '.join(m.rsplit('.', 1)[-1] for m in members)}")
        for line in evidence:
            print(f"    {line}")
    if found:
        print(
            f"{len(found)} module-level import cycle(s); defer one import into the function using it, or "
            "move what both need to a module of its own"
        )
        return 1
    print(f"no module-level import cycles inside the packages of {root.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
