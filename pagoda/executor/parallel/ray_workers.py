"""Tensor-parallel workers as Ray actors (`--distributed-executor-backend ray`), placed on
the running Ray cluster (`ray start --head` on one machine, `ray start --address=HEAD:6379`
on the others; or RAY_ADDRESS) by a placement group: one bundle per rank, {"CPU":
ray_cpus_per_worker} (plus {"GPU": 1} on CUDA), under ray_placement_strategy (PACK keeps a
group on as few nodes as hold it; STRICT_SPREAD puts each rank on its own node).

The rendezvous is rank 0's node address and a free port there, found by a task placed on
rank 0's bundle. Each actor is a TensorParallelWorker (worker.py); a step goes to all of
them as one object in Ray's store. A dead actor or a failed call: EngineFatalError.
"""

from __future__ import annotations

import logging
import socket

from pagoda.config import EngineConfig
from pagoda.errors import EngineFatalError

logger = logging.getLogger(__name__)

PLACEMENT_TIMEOUT = 30.0
"""Seconds to wait for the cluster to find room for the group before refusing."""


def import_ray():
    """Ray, or a ValueError that says how to get it."""
    try:
        import ray
    except ImportError:
        raise ValueError("distributed_executor_backend ray needs Ray: "
                         "pip install 'pagoda-llm[ray]'") from None
    return ray


def connect_to_cluster():
    """Join the running Ray cluster (unless this process already has); ValueError if none."""
    ray = import_ray()
    if not ray.is_initialized():
        try:
            ray.init(address="auto", logging_level=logging.WARNING)
        except ConnectionError as error:
            raise ValueError(f"no Ray cluster to join ({error}); start one with "
                             "`ray start --head`, or set RAY_ADDRESS") from None
    return ray


def start_ray_workers(config: EngineConfig) -> tuple[RayWorkers, list]:
    """Place and start the actors; wait for each one's BuiltRunner (rank order). ValueError
    when the cluster cannot hold the group, or a worker fails to start."""
    ray = connect_to_cluster()
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from pagoda.executor.loader.model_loader import resolve_device
    from pagoda.executor.parallel.worker import TensorParallelWorker

    parallel = config.parallel
    world_size, cpus = parallel.tensor_parallel_size, parallel.ray_cpus_per_worker
    on_gpu = resolve_device(config.device).type == "cuda"
    bundle = {"CPU": cpus, **({"GPU": 1} if on_gpu else {})}
    group = placement_group([bundle] * world_size, strategy=parallel.ray_placement_strategy)
    if not _wait_ready(ray, group.ready(), timeout=PLACEMENT_TIMEOUT):
        remove_placement_group(group)
        raise ValueError(
            f"the Ray cluster cannot place {world_size} workers of {bundle} "
            f"({parallel.ray_placement_strategy}); its free resources: "
            f"{ray.available_resources()}")

    def on_bundle(rank: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank)

    address = ray.get(ray.remote(num_cpus=0)(_rendezvous_address).options(
        scheduling_strategy=on_bundle(0)).remote())
    actor_class = ray.remote(TensorParallelWorker)
    actors = [
        actor_class.options(
            num_cpus=cpus, num_gpus=1 if on_gpu else 0, scheduling_strategy=on_bundle(rank),
            runtime_env={"env_vars": {"OMP_NUM_THREADS": str(cpus)}},
        ).remote(config, rank, world_size, f"tcp://{address}", 0 if on_gpu else None)
        for rank in range(world_size)
    ]
    workers = RayWorkers(ray, actors, group)
    try:
        built = workers.gather([actor.describe.remote() for actor in actors])
    except EngineFatalError as error:
        workers.stop()
        raise ValueError(f"tensor-parallel start-up on Ray failed: {error}") from None
    logger.info("tensor parallelism on Ray: %d actors of %s, %s, on nodes %s", world_size,
                bundle, parallel.ray_placement_strategy, workers.node_ids)
    return workers, built


class RayWorkers:
    """The actors of one tensor-parallel group (a WorkerGroup, tp_runner.py)."""

    def __init__(self, ray, actors: list, placement_group) -> None:
        self.ray, self.actors, self.placement_group = ray, actors, placement_group
        from ray.util import placement_group_table

        bundles = placement_group_table(placement_group)["bundles_to_node_id"]
        self.node_ids = [bundles[rank] for rank in range(len(actors))]
        """The Ray node of each rank."""
        self._stopped = False

    def call_all(self, method: str, args: tuple) -> list:
        shared = self.ray.put(args)  # (one copy in the object store for all ranks)
        return self.gather([actor.run.remote(method, shared) for actor in self.actors])

    def gather(self, calls: list) -> list:
        """The results of the actors' `calls`, or EngineFatalError."""
        ray = self.ray
        try:
            return ray.get(calls)
        except ray.exceptions.RayActorError as error:
            raise EngineFatalError(f"a tensor-parallel Ray actor died: {error}") from None
        except ray.exceptions.RayTaskError as error:
            raise EngineFatalError(f"a tensor-parallel Ray actor failed: "
                                   f"{error.cause!r}") from None

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        from ray.util.placement_group import remove_placement_group

        for actor in self.actors:
            self.ray.kill(actor)
        remove_placement_group(self.placement_group)


def _wait_ready(ray, ready_ref, timeout: float) -> bool:
    ready, _ = ray.wait([ready_ref], timeout=timeout)
    return bool(ready)


def _rendezvous_address() -> str:
    """host:port for the group's rendezvous, on the node this task runs on."""
    import ray

    host = ray.util.get_node_ip_address()
    with socket.socket() as sock:
        sock.bind((host, 0))
        return f"{host}:{sock.getsockname()[1]}"
