"""The layers' import rules: the scheduling layer is pure Python (no torch), and nothing in
the execution layer reaches up into the engine."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).parents[2] / "pagoda"


def test_the_scheduler_imports_without_torch():
    code = (
        "import sys\n"
        "import pagoda.engine.scheduler, pagoda.engine.block_manager, pagoda.engine.snapshot\n"
        "import pagoda.step_data, pagoda.engine.input_processor, pagoda.engine.stop_rules\n"
        # the data-parallel router, and what a replica process imports before it sets
        # OMP_NUM_THREADS (replica_main.py)
        "import pagoda.engine.data_parallel.router, pagoda.engine.data_parallel.replica_main\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stderr


def imported_modules(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
    return names


def test_nothing_in_the_executor_imports_the_engine():
    offenders = [
        f"{path.relative_to(PACKAGE)}: {name}"
        for path in (PACKAGE / "executor").rglob("*.py")
        for name in imported_modules(path)
        if name.startswith(("pagoda.engine", "pagoda.entrypoints"))
    ]
    assert offenders == []
    # (the check itself works: the engine does import the executor's builder pieces)
    assert any(n.startswith("pagoda.executor") for n in imported_modules(
        PACKAGE / "engine" / "builder.py"))
