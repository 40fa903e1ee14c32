"""Each package folder's ``__init__.py`` docstring lists its files: every ``.py`` file of the folder
is named in it (as ``name``, ``name.py`` or ``:mod:`.name```), and every entry of its lists
(a ``- ``name`` …`` line, a ``:mod:`.name``` reference) is a file or a folder that exists.

The folders are those pyproject.toml maps into ``nereus`` and every package below them.
"""

from __future__ import annotations

import ast
import os
import re

from tests.test_imports import package_folders

ENTRY = re.compile(r"^\s*- ``(\w+)(?:\.py|/)?``", re.M)
MOD = re.compile(r":mod:`\.(\w+)`")


def package_dirs() -> list[str]:
    """Every folder with an ``__init__.py`` under the mapped folders, sorted."""
    out = set()
    for folder in package_folders().values():
        for root, dirs, files in os.walk(folder):
            dirs[:] = [d for d in dirs if d.isidentifier()]
            if "__init__.py" in files:
                out.add(root)
    return sorted(out)


def docstring_gaps(folder: str) -> list[str]:
    """What the folder's ``__init__.py`` docstring leaves out or names in vain, one line each."""
    path = os.path.join(folder, "__init__.py")
    with open(path) as f:
        doc = ast.get_docstring(ast.parse(f.read(), path)) or ""
    entries = os.listdir(folder)
    modules = sorted(n[:-3] for n in entries if n.endswith(".py") and n != "__init__.py")
    named = set(ENTRY.findall(doc)) | set(MOD.findall(doc))
    mentioned = named | set(re.findall(r"``(\w+)(?:\.py|/)?``", doc))
    rel = os.path.relpath(path, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = [f"{rel}: does not name {m}.py" for m in modules if m not in mentioned]
    out += [f"{rel}: names {n}, which is not a file or a folder there"
            for n in sorted(named) if f"{n}.py" not in entries and not os.path.isdir(os.path.join(folder, n))]
    return out


def test_every_package_docstring_lists_its_files():
    folders = package_dirs()
    assert any(f.endswith(os.path.join("trainer", "rollout")) for f in folders), folders
    gaps = [g for folder in folders for g in docstring_gaps(folder)]
    assert not gaps, "package docstrings out of step with their folders:\n" + "\n".join(gaps)


def test_the_check_finds_a_missing_file_and_a_named_ghost(tmp_path):
    (tmp_path / "__init__.py").write_text('"""A room.\n\n- ``kept``  here\n- ``gone``  removed\n:mod:`.also` too\n"""\n')
    for name in ("kept.py", "new.py", "also.py"):
        (tmp_path / name).write_text("")
    (tmp_path / "sub").mkdir()
    gaps = [g.split(": ", 1)[1] for g in docstring_gaps(str(tmp_path))]
    assert gaps == ["does not name new.py", "names gone, which is not a file or a folder there"]
