"""The documentation site stays whole and true.

- `mkdocs build --strict` passes: no broken link or anchor, no page left out of the nav
  (mkdocs.yml's `validation` turns each into a warning, and `--strict` fails on warnings).
  About a second of CPU, so it runs in `make test-fast` too.
- docs/reference/cli.md is exactly what docs/gen_cli_reference.py renders from the parsers
  now, so the command-line reference cannot drift from `--help`.
- The README stays the first screen (about 200 lines), and every link in it points at a
  file of the repository that exists (it is read on the repository's pages, outside the
  site, so mkdocs does not check it).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 250


def _generator():
    spec = importlib.util.spec_from_file_location(
        "gen_cli_reference", ROOT / "docs" / "gen_cli_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli_reference_is_generated_from_the_parsers():
    generator = _generator()
    committed = (ROOT / "docs" / "reference" / "cli.md").read_text(encoding="utf-8")
    assert committed == generator.render(), (
        "docs/reference/cli.md is out of date with the pagoda parsers; regenerate it from "
        f"the repository root with:\n    {generator.REGENERATE}")


def test_cli_reference_names_every_subcommand_and_flag():
    from pagoda.cli.main import build_parser

    text = _generator().render()
    parser = build_parser()
    commands = [(["pagoda"], parser)]
    while commands:
        path, current = commands.pop()
        assert f"`{' '.join(path)}`" in text
        for action in current._actions:
            if hasattr(action, "choices") and isinstance(action.choices, dict):
                commands += [(path + [name], sub) for name, sub in action.choices.items()]
            for flag in action.option_strings:
                if flag not in ("-h", "--help"):
                    assert f"`{flag}`" in text, f"{flag} of {' '.join(path)}"


def test_mkdocs_build_strict(tmp_path):
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict",
         "--config-file", str(ROOT / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
        check=False, cwd=ROOT, capture_output=True, text=True, env=env, timeout=300,
    )
    assert result.returncode == 0, (
        "mkdocs build --strict failed (mkdocs-material comes with pip install -e '.[test]'):\n"
        + result.stdout + result.stderr)
    assert (tmp_path / "site" / "reference" / "cli" / "index.html").is_file()
    assert (tmp_path / "site" / "ARCHITECTURE" / "index.html").is_file()


def test_readme_is_the_first_screen_and_links_inside_the_repository():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= README_MAX_LINES
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    assert targets, "the README links into docs/"
    for target in targets:
        assert "://" not in target, f"the README points outside the repository: {target}"
        path = target.split("#", 1)[0]
        assert (ROOT / path).exists(), f"README links to a missing file: {target}"


# a repository path named in a page's text: `pagoda/x/y.py`, tests/..., (benchmarks/z.sh),
# deploy/...; pagoda's modules are lower case (`pagoda/PagodaEngine` is a Ray Serve name)
_REPO_PATH = re.compile(
    r"(?<![\w/.-])((?:pagoda/[a-z_]|(?:tests|benchmarks|deploy|docs)/\w)[\w./-]*[\w/])")
# a Markdown link's target: mkdocs checks the pages' links, the README test the README's
_LINK_TARGET = re.compile(r"\]\([^)]*\)")


def test_paths_named_in_the_docs_exist():
    """A page that names a file (`pagoda/entrypoints/openai/field_policy.py`,
    `benchmarks/soak.sh`) names one that exists: a move elsewhere fails here until the pages
    follow it, as tests/test_architecture_map.py does for the architecture's map."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    stale = set()
    for page in pages:
        if page.name == "ARCHITECTURE.md":
            continue  # tests/test_architecture_map.py keeps it true
        text = _LINK_TARGET.sub("]", page.read_text(encoding="utf-8"))
        for path in _REPO_PATH.findall(text):
            if not (ROOT / path.rstrip("/.")).exists():
                stale.add(f"{page.relative_to(ROOT)}: {path}")
    assert not stale, f"these pages name paths that no longer exist: {sorted(stale)}"


# a dotted name a page tells users to import or run: `from pagoda.lora.request import ...`,
# `serve run pagoda.deploy.app:build_app`, a logger's name
_DOTTED_NAME = re.compile(r"\bpagoda((?:\.[A-Za-z_]\w*)+)(?::(\w+))?")


def _names_exist(dotted: str) -> bool:
    """The longest prefix that is a module exists, and the rest is one name defined at its
    top level (read from its source: only packages are imported on the way down, never the
    module itself, since `pagoda.deploy.app` would import Ray)."""
    parts = dotted.split(".")
    spec, cut = None, 0
    while cut < len(parts):
        found = importlib.util.find_spec(".".join(parts[:cut + 1]))
        if found is None:
            break
        spec, cut = found, cut + 1
        if found.submodule_search_locations is None:
            break  # a module, not a package: what follows are names in it
    rest = parts[cut:]
    if spec is None or len(rest) > 1:
        return False
    if not rest:
        return True
    source = Path(spec.origin).read_text(encoding="utf-8")
    definition = rf"^(?:class |def |async def )?{rest[0]}\b"
    return re.search(definition, source, re.MULTILINE) is not None


def test_python_names_in_the_docs_exist():
    """Every `pagoda.x.y` a page names (an import, `serve run`'s app, a logger) exists, so
    that a module moved elsewhere fails here until the pages follow it."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    stale = set()
    for page in pages:
        if page.name == "ARCHITECTURE.md":
            continue
        for match in _DOTTED_NAME.finditer(page.read_text(encoding="utf-8")):
            dotted = "pagoda" + match.group(1)
            if dotted.endswith(".json"):
                continue  # deploy/grafana/pagoda.json, a file
            names = [dotted + "." + match.group(2)] if match.group(2) else [dotted]
            if not all(_names_exist(name) for name in names):
                stale.add(f"{page.relative_to(ROOT)}: {match.group(0)}")
    assert not stale, f"these pages name Python names that no longer exist: {sorted(stale)}"
