"""Size limits, so that no file grows past what a reader takes in: a module of the package
(every ``.py`` under the folders pyproject.toml maps into ``nereus``) at most 600 lines, a file
of ``tests/`` at most 800 (docs/architecture.md's conventions: modules around 500 lines).
``tools/`` is not part of the package and has no limit. Pure file reading.
"""

from __future__ import annotations

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODULE_LINES = 600
TEST_LINES = 800


def package_folders() -> list[str]:
    """The folders pyproject.toml's ``[tool.setuptools.package-dir]`` maps into ``nereus``
    (read line by line: ``tomllib`` is Python 3.11+, the project runs on 3.10)."""
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        table = f.read().split("[tool.setuptools.package-dir]", 1)[1].split("\n[", 1)[0]
    folders = re.findall(r'^"[\w.]+"\s*=\s*"([^"]+)"', table, re.M)
    assert "trainer" in folders and "nereus" in folders, f"pyproject.toml's package-dir table not understood: {table!r}"
    return sorted(set(folders))


def python_files(folder: str) -> list[str]:
    out = []
    for parent, dirs, files in os.walk(os.path.join(ROOT, folder)):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__" and not d.startswith("."))
        out += [os.path.join(parent, name) for name in sorted(files) if name.endswith(".py")]
    return out


def too_long(files: list[str], limit: int) -> list[str]:
    """``path: N lines`` of every file in ``files`` longer than ``limit`` lines."""
    out = []
    for path in files:
        with open(path, encoding="utf-8") as f:
            lines = sum(1 for _ in f)
        if lines > limit:
            out.append(f"{os.path.relpath(path, ROOT)}: {lines} lines")
    return out


def test_no_package_module_is_longer_than_its_limit():
    files = [path for folder in package_folders() for path in python_files(folder)]
    assert len(files) > 50  # the folders were found
    offenders = too_long(files, MODULE_LINES)
    assert not offenders, f"modules over {MODULE_LINES} lines (split them): " + "; ".join(offenders)


def test_no_test_file_is_longer_than_its_limit():
    files = python_files("tests")
    assert len(files) > 20
    offenders = too_long(files, TEST_LINES)
    assert not offenders, f"test files over {TEST_LINES} lines (split them): " + "; ".join(offenders)
