"""The layers' import rules: the scheduling layer is pure Python (no torch), nothing in
the execution layer reaches up into the engine, and the engine's subfolders import only
downward (core <- stats <- loop)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).parents[2] / "pagoda"


def test_the_scheduler_imports_without_torch():
    code = (
        "import sys\n"
        "import pagoda.engine.core.scheduler, pagoda.engine.core.block_manager\n"
        "import pagoda.engine.stats.snapshot\n"
        "import pagoda.step_data, pagoda.engine.core.input_processor, pagoda.engine.core.stop_rules\n"
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
        PACKAGE / "engine" / "loop" / "builder.py"))


def test_the_kernels_import_nothing_above_them():
    """pagoda/executor/kernels is the execution layer's floor: the C library, its ABI and
    the types its wrappers take (kernels/kv_cache_types.py). The attention backends, layers
    and runner build on it; it imports nothing of pagoda outside itself (the attention
    package above all: the KV-cache types sit below both)."""
    kernels = PACKAGE / "executor" / "kernels"
    offenders = [
        f"{path.relative_to(PACKAGE)}: {name}"
        for path in kernels.rglob("*.py")
        for name in imported_modules(path)
        if name.startswith("pagoda") and not name.startswith("pagoda.executor.kernels")
    ]
    assert offenders == []
    # (the check itself works: the attention backends do import the kernels)
    assert any(n.startswith("pagoda.executor.kernels") for n in imported_modules(
        PACKAGE / "executor" / "attention" / "cpu_backend.py"))


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the pagoda modules it imports anywhere in its file (top level or inside a
    function: a lazy import still ties the two modules together). Every code import names
    absolute modules (the tree has no relative imports); `from pagoda.x import name` counts
    as importing pagoda.x.name where that is a module, else pagoda.x."""
    modules = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert node.level == 0, f"{name}: relative import"
                candidates = [f"{node.module}.{alias.name}" for alias in node.names]
                edges |= {c for c in candidates if c in modules} or {node.module}
            elif isinstance(node, ast.Import):
                edges |= {alias.name for alias in node.names}
        graph[name] = {edge for edge in edges if edge in modules and edge != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycle_in_the_tree():
    graph = import_graph()
    assert len(graph) > 150
    assert "pagoda.executor.loader.model_loader" in graph["pagoda.executor.runner_builder"]
    assert cycles(graph) == []
    # the check itself finds one
    assert cycles({**graph, "pagoda.config": graph["pagoda.config"] | {"pagoda.engine.loop.builder"}})


ENGINE_LEVELS = ["core", "stats", "loop"]
"""pagoda/engine/'s subfolders, lowest first: each imports only the ones before it."""


def test_the_engine_subfolders_import_only_downward():
    graph = import_graph()
    offenders = []
    for low, level in enumerate(ENGINE_LEVELS):
        higher = tuple(f"pagoda.engine.{name}." for name in ENGINE_LEVELS[low + 1:])
        offenders += [f"{module} -> {edge}" for module, edges in graph.items()
                      if module.startswith(f"pagoda.engine.{level}.")
                      for edge in edges if edge.startswith(higher)]
    assert offenders == []
    # the check itself sees the levels: stats reads core, loop reads both
    assert "pagoda.engine.core.scheduler" in graph["pagoda.engine.stats.engine_accounting"]
    assert "pagoda.engine.stats.engine_accounting" in graph["pagoda.engine.loop.llm_engine"]
