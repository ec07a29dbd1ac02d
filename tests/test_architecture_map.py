"""docs/ARCHITECTURE.md stays a true map: every file of the package is named in it by its
path, and every package path it names exists."""

from __future__ import annotations

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE_SUFFIXES = (".py", ".c", ".h", ".js", ".css", ".html")


def package_files() -> set[str]:
    found = set()
    for folder, subfolders, names in os.walk(os.path.join(ROOT, "pagoda")):
        subfolders[:] = [name for name in subfolders if name != "__pycache__"]
        found.update(os.path.relpath(os.path.join(folder, name), ROOT) for name in names
                     if name.endswith(SOURCE_SUFFIXES))
    return found


def mapped_paths() -> set[str]:
    with open(os.path.join(ROOT, "docs", "ARCHITECTURE.md"), encoding="utf-8") as doc:
        return set(re.findall(r"`(pagoda/[^`\s]+)`", doc.read()))


def test_every_file_is_on_the_map() -> None:
    missing = sorted(package_files() - mapped_paths())
    assert not missing, f"add these to docs/ARCHITECTURE.md's file table: {missing}"


def test_the_map_names_no_file_that_is_gone() -> None:
    stale = sorted(path for path in mapped_paths()
                   if not os.path.exists(os.path.join(ROOT, path.rstrip("/"))))
    assert not stale, f"docs/ARCHITECTURE.md names paths that no longer exist: {stale}"
