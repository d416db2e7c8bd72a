"""The import graph of a source tree, read with `ast` (nothing is imported), and the two things the
layering test asks of it: imports a package may not make, and cycles.

Every import statement counts, wherever it is: at module level, inside a function (a lazy import
is still a dependency, only a later one) and under `if TYPE_CHECKING:` (the annotation still names
the other module). An import's target is the module it names: `import a.b` and `from a import b`,
where `b` is a module of the tree, both target `a.b`; `from a.b import name`, where `name` is not a
module, targets `a.b`. Relative imports are resolved against the importing module's package.
Importing `a.b` also runs `a/__init__.py`, but that is no edge here: a package whose `__init__`
re-exports its modules would otherwise sit in a cycle with each of them.

Cycles are looked for at two scales: between modules, and between rooms (groups of modules that
form one layer, see `room_of`), where two modules each importing the other's room is a cycle even
when no module imports its own importer.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Import:
    """One import of a first-party module, where it is written."""

    module: str   # the importing module
    target: str   # the dotted name it imports, resolved, possibly not a module of the tree
    path: Path
    line: int

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.module} imports {self.target}"


def modules_of(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    """Every module of `packages` (directories under `root`) by dotted name; a package is its
    `__init__.py`."""
    found: dict[str, Path] = {}
    for package in packages:
        base = root / package
        if not (base / "__init__.py").is_file():
            raise FileNotFoundError(f"{base} is not a package")
        for path in sorted(base.rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _package_of(module: str, path: Path) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _resolve_base(node: ast.ImportFrom, module: str, path: Path) -> str:
    """The absolute name of `from <base> import ...`."""
    if node.level == 0:
        return node.module or ""
    parts = _package_of(module, path).split(".")
    if node.level - 1 >= len(parts):
        raise ValueError(f"{path}:{node.lineno}: relative import beyond the top-level package")
    anchor = parts[:len(parts) - (node.level - 1)]
    return ".".join([*anchor, node.module] if node.module else anchor)


def _is_first_party(name: str, packages: set[str]) -> bool:
    return name.partition(".")[0] in packages


def imports_of(modules: dict[str, Path]) -> list[Import]:
    """Every import of a first-party name (one whose top-level package is in `modules`) made by
    the modules of `modules`, in file and line order."""
    packages = {name.partition(".")[0] for name in modules}
    found: list[Import] = []
    for module, path in sorted(modules.items()):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve_base(node, module, path)
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                           for alias in node.names]
            else:
                continue
            found += [Import(module, target, path, node.lineno) for target in dict.fromkeys(targets)
                      if _is_first_party(target, packages)]
    return sorted(found, key=lambda i: (str(i.path), i.line, i.target))


def known_module(name: str, modules: dict[str, Path]) -> str | None:
    """The module of the tree that importing `name` runs last: `name` itself, or the deepest
    package above it when `name` is not a module (a name the import would fail on)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def forbidden_imports(imports: Iterable[Import], importers: Iterable[str], guarded: str,
                      allowed: Iterable[str]) -> list[Import]:
    """The imports by modules of the `importers` packages of a name inside `guarded` that is
    neither one of `allowed` nor below one of them."""
    low = tuple(importers)
    base = tuple(allowed)

    def inside(name: str, prefix: str) -> bool:
        return name == prefix or name.startswith(prefix + ".")

    return [i for i in imports
            if any(inside(i.module, p) for p in low) and inside(i.target, guarded)
            and not any(inside(i.target, p) for p in base)]


def room_of(split: Iterable[str]) -> Callable[[str], str]:
    """Rooms: each top-level package is one room, except the `split` ones, whose subpackages and
    top-level modules are each a room (`cachetier.wire`, `cachetier.cli`, ...)."""
    split_set = set(split)

    def room(module: str) -> str:
        parts = module.split(".")
        return ".".join(parts[:2]) if parts[0] in split_set else parts[0]

    return room


Graph = dict[str, dict[str, list[Import]]]   # importer -> imported -> the imports making the edge


def graph(imports: Iterable[Import], modules: dict[str, Path],
          node_of: Callable[[str], str] = lambda m: m) -> Graph:
    """The edges between nodes (modules, or rooms with `node_of`), each with its imports; an
    import within one node is no edge."""
    edges: Graph = {}
    for i in imports:
        target = known_module(i.target, modules)
        if target is None:
            continue
        src, dst = node_of(i.module), node_of(target)
        if src != dst:
            edges.setdefault(src, {}).setdefault(dst, []).append(i)
    return edges


def cycles(edges: Graph) -> list[list[str]]:
    """One cycle per strongly connected component of more than one node, as [a, b, ..., a]: a
    shortest path back to the component's first node (in sorted order), so each is reported once
    and reads the same on every run."""
    found = []
    for component in _components(edges):
        if len(component) < 2:
            continue
        start = min(component)
        found.append(_shortest_loop(edges, start, component))
    return sorted(found)


def _components(edges: Graph) -> list[set[str]]:
    """Tarjan's strongly connected components, iteratively (no recursion limit on a big tree)."""
    nodes = sorted(set(edges) | {dst for out in edges.values() for dst in out})
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    result: list[set[str]] = []
    for root in nodes:
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, {}))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            advanced = False
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = len(index)
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(edges.get(succ, {})))))
                    advanced = True
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                result.append(component)
    return result


def _shortest_loop(edges: Graph, start: str, within: set[str]) -> list[str]:
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for succ in sorted(edges.get(node, {})):
                if succ not in within:
                    continue
                if succ == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if succ not in previous:
                    previous[succ] = node
                    following.append(succ)
        frontier = following
    raise AssertionError(f"{start} is in a component it cannot get back to")


def describe(cycle: list[str], edges: Graph) -> str:
    """A cycle with, for each step, the first import that makes it."""
    steps = [f"  {a} -> {b}  ({edges[a][b][0]})" for a, b in zip(cycle, cycle[1:])]
    return " -> ".join(cycle) + "\n" + "\n".join(steps)
