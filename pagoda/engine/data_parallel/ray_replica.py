"""A data-parallel replica as a Ray actor (`--distributed-executor-backend ray`): the same
replica body (replica_main.serve_replica) on whichever node of the running Ray cluster has
room, behind the ReplicaHandle the engine knows (launcher.py).

    server (launch_ray_replica)                     ReplicaActor (on some node)
    listen.remote(authkey)  ───────────────────>    a Listener on the node's address
    serve.remote(spec)      ───────────────────>    accept, then serve_replica (until STOP)
    Client(address, authkey): the replica's pipe, a TCP connection carrying the same
    messages as a local replica's (messages.py)

The actor's death closes its socket (the server reads EOF, as for a local process) and
fails the `serve` call (is_alive / join watch that). Replicas spread over the cluster's
nodes (Ray's SPREAD scheduling); each reserves ray_cpus_per_worker CPUs and runs that many
threads (with tensor parallelism inside a replica its workers reserve them instead).
Non-detached actors end with the server's Ray connection, so none outlives it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
from multiprocessing.connection import Client, Listener

from pagoda.engine.data_parallel.replica_spec import ReplicaSpec

logger = logging.getLogger(__name__)

LISTEN_TIMEOUT_S = 120.0
"""Seconds for the cluster to start the actor and open its listener."""


class ReplicaActor:
    """The body of a Ray replica (wrapped by ray.remote in launch_ray_replica)."""

    def listen(self, authkey: bytes) -> tuple[tuple[str, int], int]:
        """Open the replica's listener; returns (its address, this process's pid)."""
        import ray

        self._listener = Listener((ray.util.get_node_ip_address(), 0), authkey=authkey)
        return self._listener.address, os.getpid()

    def serve(self, spec: ReplicaSpec) -> int:
        """Accept the server's connection and serve it; returns the exit code."""
        from pagoda.engine.data_parallel.replica_main import serve_replica

        logging.basicConfig(level=spec.log_level,
                            format=f"%(levelname)s replica {spec.index} %(name)s: %(message)s")
        conn = self._listener.accept()
        self._listener.close()
        try:
            return serve_replica(spec, conn)
        finally:
            conn.close()


class RayReplica:
    """A ReplicaHandle over a ReplicaActor: `done` is its serve call, ready once it ended."""

    sentinel = None  # (no local process: the connection's EOF tells the engine)

    def __init__(self, ray, actor, connection, done, pid: int) -> None:
        self.ray = ray
        self.actor = actor
        self.connection = connection
        self.done = done
        self._pid = pid

    @property
    def pid(self) -> int | None:
        return self._pid

    @property
    def exitcode(self) -> int | None:
        """The replica's exit code once its serve call ended; None while it runs, or when
        the actor died without one."""
        if self.is_alive():
            return None
        try:
            return self.ray.get(self.done)
        except self.ray.exceptions.RayError:
            return None

    def is_alive(self) -> bool:
        ready, _ = self.ray.wait([self.done], timeout=0)
        return not ready

    def kill(self) -> None:
        self.ray.kill(self.actor)

    def join(self, timeout: float | None = None) -> None:
        self.ray.wait([self.done], timeout=timeout)


def launch_ray_replica(spec: ReplicaSpec) -> RayReplica:
    """Start the actor and connect to it. ValueError if the cluster cannot start it."""
    from pagoda.executor.parallel.ray_workers import connect_to_cluster

    ray = connect_to_cluster()
    parallel = spec.config.parallel
    cpus = parallel.ray_cpus_per_worker
    own_cpus = cpus if parallel.tensor_parallel_size == 1 else 0
    spec = dataclasses.replace(spec, num_threads=cpus)
    actor = ray.remote(ReplicaActor).options(
        num_cpus=own_cpus, scheduling_strategy="SPREAD", name=None,
        runtime_env={"env_vars": {"OMP_NUM_THREADS": str(cpus)}},
    ).remote()
    authkey = secrets.token_bytes(32)
    try:
        address, pid = ray.get(actor.listen.remote(authkey), timeout=LISTEN_TIMEOUT_S)
    except (ray.exceptions.GetTimeoutError, ray.exceptions.RayError) as error:
        ray.kill(actor)
        raise ValueError(f"engine replica {spec.index} could not start on the Ray cluster "
                         f"({type(error).__name__}); its free resources: "
                         f"{ray.available_resources()}") from None
    done = actor.serve.remote(spec)
    logger.info("engine replica %d: Ray actor, pid %d at %s:%d", spec.index, pid, *address)
    return RayReplica(ray, actor, Client(address, authkey=authkey), done, pid)
