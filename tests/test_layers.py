"""The tree's layering holds: the low packages stand on the shared base of `cachetier` alone, and
no import cycle exists, between rooms or between modules.

The low packages (the index, the pool and its agent, the kernels, eviction, the tiny model) may
use `cachetier.config`, `cachetier.errors`, `cachetier.private_files` (the agent's handle file)
and the wire (`cachetier.wire.*`: the agent speaks it) and each other; never the service, the
events, the engine, the runners, the replay, the benchmarks, the client or the CLI. Inside `cachetier` each subpackage and each top-level module is
a room of its own, so a cycle between, say, the replay and the runners fails here even when it
goes through lazy imports inside functions.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.import_graph import (cycles, describe, forbidden_imports, graph, imports_of, modules_of,
                                room_of)

ROOT = Path(__file__).resolve().parent.parent
LOW = ("index", "gpu_pool", "kernels", "eviction", "tinymodel")
SHIPPED = ("cachetier", *LOW)
SHARED_BASE = ("cachetier.config", "cachetier.errors", "cachetier.private_files",
               "cachetier.wire")
ROOMS = room_of(["cachetier"])


@pytest.fixture(scope="module")
def shipped():
    modules = modules_of(ROOT, SHIPPED)
    return modules, imports_of(modules)


def test_the_checker_reads_every_shipped_module(shipped):
    modules, imports = shipped
    assert {"cachetier.cli", "cachetier.wire.protocol", "gpu_pool.agent", "tinymodel.chunk",
            "kernels.page_copy", "eviction.policy", "index.store"} <= modules.keys()
    importers = {i.module for i in imports}
    assert "gpu_pool.agent" in importers and "cachetier.cli" in importers


def test_low_packages_import_only_the_shared_base_of_cachetier(shipped):
    _, imports = shipped
    bad = forbidden_imports(imports, LOW, "cachetier", SHARED_BASE)
    assert not bad, "a low package imports above the shared base:\n" + "\n".join(map(str, bad))


def test_no_cycle_between_rooms(shipped):
    modules, imports = shipped
    edges = graph(imports, modules, ROOMS)
    found = cycles(edges)
    assert not found, "import cycles between rooms:\n" + "\n".join(
        describe(c, edges) for c in found)


def test_no_cycle_between_modules(shipped):
    modules, imports = shipped
    edges = graph(imports, modules)
    found = cycles(edges)
    assert not found, "import cycles between modules:\n" + "\n".join(
        describe(c, edges) for c in found)


def test_no_test_module_imports_another():
    """Fixtures live in conftest.py and helpers in modules that pytest does not collect, so a
    test module never runs another's tests or shares its module-level state."""
    modules = modules_of(ROOT, ["tests"])
    imports = imports_of(modules)

    def is_test(module: str) -> bool:
        return module.rpartition(".")[2].startswith("test_")

    bad = [i for i in imports if is_test(i.module) and is_test(i.target)]
    assert not bad, "a test module imports another:\n" + "\n".join(map(str, bad))


# -- the checker itself, on a tree made for it ---------------------------------------------------

def write_tree(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


TREE = {
    "top/__init__.py": "",
    "top/config.py": "",
    "top/wire/__init__.py": "",
    "top/wire/frames.py": "from .. import config\n",
    "top/service/__init__.py": "",
    "top/service/server.py": "from top.run import nodes\n",
    "top/run/__init__.py": "",
    # lazy, and a relative import of a submodule: run -> service.server, the room cycle's return
    "top/run/nodes.py": "def go():\n    from ..service import server\n",
    "low/__init__.py": "from .a import A\n",
    # a forbidden import under TYPE_CHECKING, an allowed one, and one inside a method
    "low/a.py": ("from typing import TYPE_CHECKING\n"
                 "import top.wire.frames\n"
                 "if TYPE_CHECKING:\n"
                 "    from top.service.server import Server\n"
                 "class A:\n"
                 "    def f(self):\n"
                 "        from . import b\n"),
    "low/b.py": "import json\nfrom low.a import A\n",
}


@pytest.fixture
def tree(tmp_path):
    write_tree(tmp_path, TREE)
    modules = modules_of(tmp_path, ["top", "low"])
    return modules, imports_of(modules)


def test_the_checker_resolves_relative_lazy_and_submodule_imports(tree):
    modules, imports = tree
    made = {(i.module, i.target, i.line) for i in imports}
    assert ("top.wire.frames", "top.config", 1) in made           # from .. import config
    assert ("top.run.nodes", "top.service.server", 2) in made     # lazy, relative, submodule
    assert ("low.a", "top.service.server", 4) in made             # under TYPE_CHECKING
    assert ("low.a", "low.b", 7) in made                          # inside a method
    assert ("low", "low.a", 1) in made
    assert not any(i.target == "json" for i in imports)           # third party is not followed


def test_the_checker_names_a_forbidden_import(tree):
    _, imports = tree
    bad = forbidden_imports(imports, ["low"], "top", ["top.config", "top.wire"])
    assert [str(i).split("/")[-1] for i in bad] == ["a.py:4: low.a imports top.service.server"]


def test_the_checker_reports_cycles_between_modules_and_between_rooms(tree):
    modules, imports = tree
    module_edges = graph(imports, modules)
    assert cycles(module_edges) == [["low.a", "low.b", "low.a"],
                                    ["top.run.nodes", "top.service.server", "top.run.nodes"]]
    rooms = room_of(["top"])
    room_edges = graph(imports, modules, rooms)
    assert cycles(room_edges) == [["top.run", "top.service", "top.run"]]
    text = describe(["top.run", "top.service", "top.run"], room_edges)
    assert "nodes.py:2: top.run.nodes imports top.service.server" in text


def test_the_checker_finds_a_cycle_only_rooms_see(tmp_path):
    write_tree(tmp_path, {"top/__init__.py": "", "top/x/__init__.py": "", "top/y/__init__.py": "",
                          "top/x/one.py": "import top.y.two\n", "top/y/two.py": "",
                          "top/y/three.py": "from top.x import one\n",
                          "top/x/five.py": "from ..y import three\n"})
    modules = modules_of(tmp_path, ["top"])
    imports = imports_of(modules)
    assert cycles(graph(imports, modules)) == []
    assert cycles(graph(imports, modules, room_of(["top"]))) == [["top.x", "top.y", "top.x"]]


def test_a_missing_package_is_an_error_not_a_pass(tmp_path):
    with pytest.raises(FileNotFoundError):
        modules_of(tmp_path, ["nowhere"])
