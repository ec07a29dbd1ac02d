"""A local tensor-parallel worker process (the "mp" backend; mp_workers.py starts N):
`python -m pagoda.executor.parallel.worker_process FD`, FD its end of a socket pair with the
engine. It reads (config, rank, world_size, init_method, log level), builds its
TensorParallelWorker, answers ("ok", BuiltRunner), then answers each (method, args) the
engine sends with ("ok", result) or ("error", message), until it sends None or goes away."""

from __future__ import annotations

import logging
import signal
from multiprocessing.connection import Connection

from pagoda.child_process import connect_to_parent
from pagoda.child_process import receive_message as receive
from pagoda.child_process import send_message as send
from pagoda.parent_death import die_with_parent

logger = logging.getLogger(__name__)


def worker_main(connection: Connection) -> None:
    die_with_parent(signal.SIGTERM)
    config, rank, world_size, init_method, log_level = receive(connection)
    logging.basicConfig(level=log_level,
                        format=f"%(asctime)s %(levelname)s [tp{rank}] %(name)s: %(message)s")
    from pagoda.executor.parallel.worker import TensorParallelWorker

    try:
        worker = TensorParallelWorker(config, rank, world_size, init_method)
    except Exception as error:
        logger.exception("start-up failed")
        send(connection, ("error", f"{type(error).__name__}: {error}"))
        return
    send(connection, ("ok", worker.built))
    while True:
        try:
            message = receive(connection)
        except (EOFError, OSError):
            break  # the engine is gone
        if message is None:
            break
        try:
            reply = ("ok", worker.run(*message))
        except Exception as error:
            logger.exception("%s failed", message[0])
            reply = ("error", f"{type(error).__name__}: {error}")
        send(connection, reply)
    worker.close()


if __name__ == "__main__":
    worker_main(connect_to_parent())
