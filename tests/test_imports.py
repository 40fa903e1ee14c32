"""The import rules of docs/architecture.md ("Dependency rules") that import-linter cannot state, and its contracts.

- no import circle: strongly connected components of grimp's module graph of ``nereus``
  (function-level imports count), a package dropped from its own children's circle, as the
  maintainers' own check outside the repository does (an ``__init__`` that re-exports its children);
- no ``_private`` name taken across files of the package, by ``from X import _private`` or as
  ``alias._private`` on an imported module (an AST walk of every file);
- no ``torch.distributed`` in ``trainer/controller/`` and ``trainer/simulate/``, nor in any module
  they reach (``reshard/plan.py`` aside: it builds on DCP's planner classes; what it imports is
  checked): neither imported nor reached as ``torch.distributed…`` from a plain ``import torch``;
- the ``.importlinter`` contracts, run in-process (``.ci/run`` runs them as a command too).

grimp sees the folders that pyproject.toml maps into ``nereus`` because ``nereus`` is imported
first: its ``__init__`` adds the repository root to ``__path__`` in a source checkout, and grimp
walks ``__path__`` (``.importlinter`` explains). That walk also names tests/ and tools/
``nereus.tests``/``nereus.tools``; only modules of the mapped folders are checked here.
"""

from __future__ import annotations

import ast
import os
import re
from collections import deque
from collections.abc import Iterable, Mapping

import grimp
import pytest

import nereus  # noqa: F401 - before grimp: the mapped folders join nereus.__path__

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def package_folders() -> dict[str, str]:
    """Package name → folder, as pyproject.toml's ``[tool.setuptools.package-dir]`` maps them
    (read line by line: ``tomllib`` is Python 3.11+, the project runs on 3.10)."""
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        table = f.read().split("[tool.setuptools.package-dir]", 1)[1].split("\n[", 1)[0]
    mapping = dict(re.findall(r'^"([\w.]+)"\s*=\s*"([^"]+)"', table, re.M))
    assert "nereus.trainer" in mapping, f"pyproject.toml's package-dir table not understood: {table!r}"
    return {name: os.path.join(ROOT, folder) for name, folder in mapping.items()}


def module_files() -> dict[str, str]:
    """Dotted module name → file of every ``.py`` under the mapped folders (a package as its ``__init__``)."""
    out = {}
    for package, folder in package_folders().items():
        for root, dirs, files in os.walk(folder):
            dirs[:] = sorted(d for d in dirs if d.isidentifier())
            rel = os.path.relpath(root, folder)
            base = package if rel == "." else f"{package}.{rel.replace(os.sep, '.')}"
            for name in sorted(files):
                if name.endswith(".py"):
                    out[base if name == "__init__.py" else f"{base}.{name[:-3]}"] = os.path.join(root, name)
    return out


def strongly_connected(edges: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The components of more than one module (Tarjan, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def circles(edges: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """Import circles: components with a package dropped where its own children are in it
    (its ``__init__`` re-exporting them is not a circle of design), those still of 2 or more."""
    out = []
    for comp in strongly_connected(edges):
        trimmed = [m for m in comp if not any(o.startswith(m + ".") for o in comp)]
        if len(trimmed) > 1:
            out.append(trimmed)
    return out


def cycle_through(edges: Mapping[str, Iterable[str]], members: list[str]) -> list[str]:
    """One shortest cycle inside ``members`` that starts and ends at the first of them."""
    inside, start = set(members), members[0]
    parent: dict[str, str] = {}
    queue = deque([start])
    while queue:
        v = queue.popleft()
        for w in sorted(edges.get(v, ())):
            if w == start:
                path = [v]
                while path[-1] != start:
                    path.append(parent[path[-1]])
                return [start, *reversed(path[:-1]), start] if len(path) > 1 else [start, v, start]
            if w in inside and w not in parent:
                parent[w] = v
                queue.append(w)
    return members


def resolve_from(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module of a ``from … import`` in ``module``."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def dotted(node: ast.expr) -> str:
    """``a.b.c`` for a chain of attributes on a name, else ``""``."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else ""


def private_crossings(files: Mapping[str, str]) -> list[str]:
    """``file:line: …`` for every private name a file takes from another module of ``files``:
    ``from X import _name``, and ``alias._name`` where ``alias`` is bound by an import to such a
    module (``import nereus.x as m; m._name``, ``from nereus import x; x._name``,
    ``import nereus.x; nereus.x._name``)."""

    def private(name: str) -> bool:
        return name.startswith("_") and not name.startswith("__")

    out = []
    for module, path in sorted(files.items()):
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        where = os.path.relpath(path, ROOT)
        bound: dict[str, str] = {}  # a name an import binds → the module it names
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    bound[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else alias.name.split(".")[0]
            elif isinstance(node, ast.ImportFrom):
                source = resolve_from(module, path.endswith("__init__.py"), node)
                for alias in node.names:
                    if f"{source}.{alias.name}" in files:
                        bound[alias.asname or alias.name] = f"{source}.{alias.name}"
                    if private(alias.name) and source in files and source != module:
                        out.append(f"{where}:{node.lineno}: from {source} import {alias.name}")
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and private(node.attr)):
                continue
            head, _, rest = dotted(node.value).partition(".")
            target = ".".join(filter(None, [bound.get(head, ""), rest])) if head in bound else ""
            if target in files and target != module:
                out.append(f"{where}:{node.lineno}: {ast.unparse(node)} ({target}.{node.attr})")
    return out


def distributed_uses(files: Mapping[str, str]) -> list[str]:
    """``file:line: …`` for every import of ``torch.distributed`` in ``files``, and every attribute
    chain that reaches it from the name ``torch`` (``torch.distributed.get_rank()`` after a plain
    ``import torch``), each chain once."""
    out = []
    for _, path in sorted(files.items()):
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Attribute):
                names = [dotted(node)]
            if any(n == "torch.distributed" or n.startswith("torch.distributed.") for n in names):
                if isinstance(node, ast.Attribute) and names != ["torch.distributed"]:
                    continue  # a longer chain: its inner torch.distributed node is the one reported
                out.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}: {ast.unparse(node)}")
    return out


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph("nereus", include_external_packages=False, cache_dir=None)


@pytest.fixture(scope="module")
def edges(graph) -> dict[str, set[str]]:
    """Module → the modules of the mapped folders it imports (function-level imports too)."""
    real = set(module_files()) & set(graph.modules)
    return {m: graph.find_modules_directly_imported_by(m) & real for m in real}


def test_grimp_sees_the_folders_pyproject_maps_into_nereus(graph):
    files = module_files()
    for name in ("nereus.trainer.config.schema", "nereus.reshard.layout", "nereus.store", "nereus.cli.app", "nereus.launch"):
        assert name in graph.modules, f"{name} is not in grimp's graph of nereus (is nereus imported before it is built?)"
    missing = sorted(m for m in files if m not in graph.modules)
    assert not missing, f"modules grimp does not see (a folder without __init__.py?): {', '.join(missing)}"


def test_no_module_imports_itself_through_others(graph, edges):
    found = circles(edges)

    def shown(members: list[str]) -> str:
        path = cycle_through(edges, members)
        hops = []
        for a, b in zip(path, path[1:]):
            lines = sorted({d["line_number"] for d in graph.get_import_details(importer=a, imported=b)})
            hops.append(f"{a} -> {b} (l.{', l.'.join(map(str, lines))})")
        return f"circle of {len(members)} modules: " + "; ".join(hops)

    assert not found, "import circle(s):\n" + "\n".join(shown(c) for c in found)


def test_no_private_name_crosses_files():
    crossings = private_crossings(module_files())
    assert not crossings, "private names imported from another module:\n" + "\n".join(crossings)


def test_controller_and_simulate_import_no_torch_distributed():
    files = {m: p for m, p in module_files().items() if m.startswith(("nereus.trainer.controller", "nereus.trainer.simulate"))}
    assert "nereus.trainer.controller.search" in files and "nereus.trainer.simulate.replay" in files
    found = distributed_uses(files)
    assert not found, "torch.distributed in controller/ or simulate/ (pure rooms: no process group):\n" + "\n".join(found)


REACHED_EXEMPT = {"nereus.reshard.plan"}
"""Reached from controller/ and simulate/ and allowed its own torch.distributed: the overlap plan
builds on torch.distributed.checkpoint's planner classes (metadata only, no process group). Only
its file is spared: the modules it imports are walked and checked like any other."""


def test_nothing_controller_and_simulate_reach_imports_torch_distributed(edges):
    """The same rule for every module they reach, through any chain of imports (a pure room
    that imports a module that imports torch.distributed is not pure)."""
    files = module_files()
    start = [m for m in edges if m.startswith(("nereus.trainer.controller", "nereus.trainer.simulate"))]
    seen, todo = set(start), deque(start)
    while todo:
        for nxt in edges.get(todo.popleft(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    assert REACHED_EXEMPT <= seen, f"{REACHED_EXEMPT - seen} is no longer reached: drop it from REACHED_EXEMPT"
    found = distributed_uses({m: files[m] for m in seen - REACHED_EXEMPT if m in files})
    assert not found, "torch.distributed reached from controller/ or simulate/:\n" + "\n".join(found)


def test_the_import_linter_contracts_hold(capsys):
    from importlinter import configuration
    from importlinter.application.use_cases import lint_imports

    configuration.configure()
    kept = lint_imports(config_filename=os.path.join(ROOT, ".importlinter"), cache_dir=None, no_logo=True)
    assert kept, capsys.readouterr().out


# The checks themselves, on made-up input: each finds what it is for.


def test_the_circle_check_names_a_circle_and_spares_a_re_exporting_init():
    edges = {"p": {"p.a"}, "p.a": {"p"}, "x.a": {"x.b"}, "x.b": {"x.c"}, "x.c": {"x.a"}, "y": set()}
    assert circles(edges) == [["x.a", "x.b", "x.c"]]
    assert cycle_through(edges, ["x.a", "x.b", "x.c"]) == ["x.a", "x.b", "x.c", "x.a"]
    assert circles({"p": {"p.a"}, "p.a": {"p"}, "p.b": {"p.a"}}) == []


def test_the_private_and_distributed_checks_find_their_imports(tmp_path):
    (tmp_path / "a.py").write_text(
        "def f():\n    from .b import _hidden, shown\nimport pkg.b\nimport pkg.b as bee\nfrom pkg import b\nimport torch\n"
        "def g():\n    return bee._one, b._two, pkg.b._three, b.shown, bee.__doc__, torch._C, bee.x._four\n"
    )
    (tmp_path / "b.py").write_text(
        "from torch import distributed\nimport torch.distributed as dist\nfrom .b import _self\nimport torch\n"
        "def g():\n    return torch.distributed.get_rank() + torch.distributions.Normal + torch.distributed\n"
    )
    files = {"pkg.a": str(tmp_path / "a.py"), "pkg.b": str(tmp_path / "b.py")}
    assert [c.split(": ", 1)[1] for c in private_crossings(files)] == [
        "from pkg.b import _hidden",
        "bee._one (pkg.b._one)",
        "b._two (pkg.b._two)",
        "pkg.b._three (pkg.b._three)",
    ]
    assert [c.split(":", 1)[1] for c in distributed_uses(files)] == [
        "1: from torch import distributed",
        "2: import torch.distributed as dist",
        "6: torch.distributed",
        "6: torch.distributed",
    ]
