"""One tensor-parallel worker process (pagoda/executor/parallel/workers.py starts N of them):
`python -m pagoda.executor.parallel.worker_process FD`, FD its end of a socket pair with the
engine. It reads (config, rank, world_size, init_method, log level), joins the group, builds
its share of the model, answers its BuiltRunner, then runs each (method, args) the engine
sends until it sends None or goes away."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import signal
import sys
from multiprocessing.connection import Connection

from pagoda.executor.parallel.workers import receive, send

logger = logging.getLogger(__name__)


def worker_main(connection: Connection) -> None:
    _die_with_parent()
    config, rank, world_size, init_method, log_level = receive(connection)
    logging.basicConfig(level=log_level,
                        format=f"%(asctime)s %(levelname)s [tp{rank}] %(name)s: %(message)s")
    from pagoda.executor.loader.model_loader import resolve_device
    from pagoda.executor.parallel.communication import init_tensor_parallel, leave_tensor_parallel
    from pagoda.executor.runner_builder import build_runner

    try:
        group = init_tensor_parallel(rank, world_size, init_method, resolve_device(config.device))
        runner, built = build_runner(config, group)
    except Exception as error:
        logger.exception("start-up failed")
        send(connection, ("error", f"{type(error).__name__}: {error}"))
        return
    send(connection, ("ok", built))
    while True:
        try:
            message = receive(connection)
        except (EOFError, OSError):
            break  # the engine is gone
        if message is None:
            break
        method, args = message
        try:
            result = getattr(runner, method)(*args)
        except Exception as error:
            logger.exception("%s failed", method)
            send(connection, ("error", f"{type(error).__name__}: {error}"))
            continue
        if rank and method == "execute_model":  # the others' tokens, checked against rank 0's
            result = (result.sampled_token_ids, result.num_accepted_tokens)
        elif rank:
            result = None
        send(connection, ("ok", result))
    leave_tensor_parallel()


def _die_with_parent() -> None:
    """Linux: this process gets SIGTERM when the process that started it dies."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG




if __name__ == "__main__":
    worker_main(Connection(int(sys.argv[1])))
