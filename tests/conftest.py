"""Shared fixtures: the bundled model's path, one engine on it reused across tests, one
`pagoda serve` on it shared by the server test modules, a two-node Ray cluster, and the
check that no process the tests start outlives them. (The per-test time budget's report:
tests/budget.py.)"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import tempfile
import time

import gguf
import pytest

from pagoda.executor.loader.model_files import bundled_model_path
from tests.budget import pytest_runtest_logreport, pytest_terminal_summary  # noqa: F401 (hooks)

_TOKENIZER_CACHE = tempfile.mkdtemp(prefix="pagoda-tokenizers-")
"""This session's GGUF tokenizer cache (pagoda/executor/loader/tokenizer.py), shared by every
engine and server process the tests start (they inherit the environment), gone at the end:
the suite never writes into the user's ~/.cache."""
os.environ.setdefault("PAGODA_TOKENIZER_CACHE", _TOKENIZER_CACHE)
atexit.register(shutil.rmtree, _TOKENIZER_CACHE, True)

gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map)
"""transformers' GGUF reader (the oracle) builds gguf's TensorNameMap anew for each module of
the model it fills: 397 times, ~5.7 s, for the bundled model. The map is a pure function of
(architecture, layers) that no caller changes, so the suite builds each one once."""


@pytest.fixture(scope="session")
def bundled_gguf() -> str:
    return bundled_model_path()


@pytest.fixture(scope="session")
def bundled_tokenizer(bundled_gguf):
    """The bundled model's tokenizer (loading it from the GGUF takes seconds: load once)."""
    from pagoda.executor.loader.model_files import resolve_model_files
    from pagoda.executor.loader.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model_files(bundled_gguf))


@pytest.fixture(scope="session")
def bundled_grammar_compiler(bundled_tokenizer):
    """A structured-output grammar compiler on the bundled tokenizer."""
    from pagoda.engine.core.grammar import GrammarCompiler

    return GrammarCompiler(bundled_tokenizer, len(bundled_tokenizer),
                           [bundled_tokenizer.eos_token_id])


@pytest.fixture(scope="session")
def bundled_llm():
    """One float32 engine on the bundled model, shared by the engine tests (loading is slow).

    Tests must leave it idle: every request they add has finished or been aborted."""
    from pagoda import LLM

    return LLM(dtype="float32", kv_cache_memory=256 * 1024 * 1024, max_model_len=2048)


@pytest.fixture(scope="session")
def shared_server():
    """One `pagoda serve` on the bundled model with the default engine settings
    (server_helpers.ENGINE_ARGS), --tool-call-parser auto (on the bundled model it picks
    hermes, the default: the same server for every other module) and an API key from
    PAGODA_API_KEY (SHARED_API_KEY), shared by every test module whose server needs no flags
    of its own.

    Tests must leave it as they found it: every request finished or aborted, and its
    counters read as differences (other modules' traffic comes before)."""
    from tests.entrypoints.server_helpers import SHARED_API_KEY, RemoteServer

    with RemoteServer(["--tool-call-parser", "auto"],
                      env={"PAGODA_API_KEY": SHARED_API_KEY}) as server:
        yield server
        assert server.proc.poll() is None, "the shared server died:\n" + server.log_text()


ENDS_WITH_PYTEST = (b"compile_worker", b"multiprocessing.resource_tracker")
"""Command-line parts of helper processes that end with the test process itself: PyTorch's
compile workers, multiprocessing's resource tracker (started by spawn)."""


@pytest.fixture(scope="session", autouse=True)
def no_process_outlives_the_tests():
    """Every process the tests start (servers, tensor-parallel workers, data-parallel
    replicas, Ray's) must be gone at the end, orphans included: they carry this session's
    tag in their environment. (Helpers that end with this process are not ours to stop.)"""
    import uuid

    from tests.process_tree import SESSION_TAG, tagged_pids

    tag = os.environ[SESSION_TAG] = uuid.uuid4().hex
    yield
    deadline = time.monotonic() + 30
    while (left := {pid: command for pid, command in tagged_pids(tag).items()
                    if not any(part in command for part in ENDS_WITH_PYTEST)}
           ) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"processes outlived the tests: {left}"


@pytest.fixture(scope="session", autouse=True)
def ahead_of_time_builds(request, tmp_path_factory, no_process_outlives_the_tests):
    """Where the session holds the kernel tests, their builds compile in the background from
    the start, on otherwise idle CPU (tests/background_builds.py); stopped at the end if
    still going (it is ours: it must not outlive the tests). Every test that compiles a build
    other than the native one is marked slow (pyproject.toml's marker), so make test-fast
    starts none."""
    import signal
    import subprocess
    import sys

    from tests.background_builds import AHEAD_OF
    from tests.executor.test_cpu_kernels import isa_build_cache

    modules = list(dict.fromkeys(item.path.name for item in request.session.items
                                 if item.path.name in AHEAD_OF and item.get_closest_marker("slow")))
    if not modules:
        yield
        return
    cache = isa_build_cache(tmp_path_factory)
    cache.mkdir(exist_ok=True)
    with open(cache / "background_builds.log", "w") as log:  # (what it said, if it failed)
        builder = subprocess.Popen(
            [sys.executable, "-m", "tests.background_builds", str(cache), *modules],
            start_new_session=True, stdout=log, stderr=log)  # (see lowest_priority)
    yield
    if builder.poll() is None:
        os.killpg(builder.pid, signal.SIGKILL)
    builder.wait()


@pytest.fixture(scope="module")
def two_node_cluster():
    """A two-node Ray cluster on this machine (ray.cluster_utils.Cluster: a head and one
    added node, one CPU each), for the Ray backend's tests; nothing of it outlives the
    module that asked for it."""
    from tests.process_tree import wait_until_gone

    ray = pytest.importorskip("ray", reason="make test installs Ray (the [ray] extra)")
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address)
    yield cluster
    ray.shutdown()
    cluster.shutdown()
    assert wait_until_gone(b"ray") == set()
