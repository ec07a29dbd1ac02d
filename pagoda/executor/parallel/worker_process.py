"""A local tensor-parallel worker process (the "mp" backend; mp_workers.py starts N):
`python -m pagoda.executor.parallel.worker_process FD`, FD its end of a socket pair with the
engine. It reads a WorkerStart, builds its TensorParallelWorker, replies with its BuiltRunner,
then answers each Call with a Reply (messages.py), until a Shutdown or the socket's end."""

from __future__ import annotations

import logging
import signal
from multiprocessing.connection import Connection

from pagoda.child_process import connect_to_parent
from pagoda.child_process import receive_message as receive
from pagoda.child_process import send_message as send
from pagoda.executor.parallel.messages import Call, Reply, Shutdown, WorkerStart
from pagoda.parent_death import die_with_parent

logger = logging.getLogger(__name__)


def worker_main(connection: Connection) -> None:
    die_with_parent(signal.SIGTERM)
    start = receive(connection)
    if not isinstance(start, WorkerStart):
        send(connection, Reply(error=f"expected WorkerStart, got {type(start).__name__}"))
        return
    logging.basicConfig(level=start.log_level, format=(
        f"%(asctime)s %(levelname)s [tp{start.rank}] %(name)s: %(message)s"))
    from pagoda.executor.parallel.worker import TensorParallelWorker

    try:
        worker = TensorParallelWorker(start.config, start.rank, start.world_size,
                                      start.init_method)
    except Exception as error:
        logger.exception("start-up failed")
        send(connection, Reply.failure(error))
        return
    send(connection, Reply(worker.built))
    while True:
        try:
            message = receive(connection)
        except (EOFError, OSError):
            break  # the engine is gone
        if isinstance(message, Shutdown):
            break
        if not isinstance(message, Call):
            send(connection, Reply(error=f"expected Call, got {type(message).__name__}"))
            continue
        try:
            reply = Reply(worker.run(message.method, message.args))
        except Exception as error:
            logger.exception("%s failed", message.method)
            reply = Reply.failure(error)
        send(connection, reply)
    worker.close()


if __name__ == "__main__":
    worker_main(connect_to_parent())
