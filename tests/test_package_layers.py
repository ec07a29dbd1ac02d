"""The serving packages import downward only (issue 50: no cli <-> deploy cycle):

    cli/           parses `pagoda ...` flags, calls what lies below
     └ deploy/     `pagoda serve --ray-serve` and `serve run pagoda.deploy.app:build_app`
        └ entrypoints/   the server (openai/api_server.py assembles it), the offline LLM

Any import counts, at module level or inside a function: a lazy import still ties the
packages together."""

from __future__ import annotations

from tests.engine.test_layering import PACKAGE, imported_modules


def offenders(folder: str, above: tuple[str, ...]) -> list[str]:
    return [f"{path.relative_to(PACKAGE)}: {name}"
            for path in (PACKAGE / folder).rglob("*.py")
            for name in imported_modules(path)
            if any(name == a or name.startswith(a + ".") for a in above)]


def test_deploy_never_imports_the_cli() -> None:
    assert offenders("deploy", ("pagoda.cli",)) == []


def test_the_server_imports_neither_the_cli_nor_deploy() -> None:
    assert offenders("entrypoints", ("pagoda.cli", "pagoda.deploy")) == []


def test_the_check_finds_an_upward_import() -> None:
    # (the CLI does import deploy and the server: the check sees imports where they are)
    assert offenders("cli", ("pagoda.deploy",))
    assert offenders("cli", ("pagoda.entrypoints",))
