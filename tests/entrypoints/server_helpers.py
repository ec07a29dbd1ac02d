"""A real `pagoda serve` process on a free loopback port, for the server tests. A module
whose server needs no flags of its own uses the session's shared one (tests/conftest.py's
`shared_server`: ENGINE_ARGS, --tool-call-parser auto, API key
SHARED_API_KEY) instead of starting another: each
start loads the model again, seconds of the suite's time."""

from __future__ import annotations

import os
import signal
import ssl
import subprocess
import sys
import tempfile
import time

import httpx

from tests.helpers.ports import free_port

# Small engine settings shared by the server tests and the offline reference LLM.
ENGINE_ARGS = ["--dtype", "float32", "--kv-cache-memory", str(256 * 1024 * 1024),
               "--max-model-len", "2048"]
MODEL_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The shared server's key, given through PAGODA_API_KEY (the --api-key flag is what the
# modules with servers of their own use).
SHARED_API_KEY = "env-key-123"
SHARED_AUTH = {"Authorization": f"Bearer {SHARED_API_KEY}"}


class RemoteServer:
    def __init__(self, args: list[str], env: dict[str, str] | None = None,
                 startup_timeout: float = 300.0, https_ca: str | None = None,
                 module: str = "pagoda") -> None:
        """`https_ca`: the server runs HTTPS (its --ssl-* flags in `args`) with a
        certificate this file verifies. `module`: run as `python -m module serve ...`."""
        self.port = free_port()
        self.verify = ssl.create_default_context(cafile=https_ca) if https_ca else True
        self.url = f"{'https' if https_ca else 'http'}://127.0.0.1:{self.port}"
        # Open for the server's lifetime; closed in stop().
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115
            "w+", prefix="pagoda-serve-", suffix=".log", delete=False
        )
        command = [sys.executable, "-m", module, "serve",
                   "--port", str(self.port), *ENGINE_ARGS, *args]
        self.proc = subprocess.Popen(
            command, stdout=self.log, stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )
        self._wait_ready(startup_timeout)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_text()}")
            try:
                if httpx.get(self.url + "/health", timeout=2, verify=self.verify).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"server not ready after {timeout}s:\n{self.log_text()}")

    def log_text(self) -> str:
        with open(self.log.name) as f:
            return f.read()

    def metric(self, name: str, labels: str = "") -> float:
        """One sample of /metrics, e.g. metric("num_requests_running")."""
        prefix = f"pagoda:{name}{{"
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line.startswith(prefix) and labels in line:
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
        os.unlink(self.log.name)
