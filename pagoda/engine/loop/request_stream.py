"""What a request's consumer sees of the engine front-end: its stream of outputs, and the
errors that end it (the front-end is front_end.py, the engine loop engine_loop.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from pagoda.outputs import RequestOutput


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (crashed or shut down); no request can be served."""


class EngineStepError(RuntimeError):
    """The engine failed while running this request's batch; the request was aborted."""


class QueueFullError(RuntimeError):
    """More requests are waiting than the server allows (--max-queue)."""


Delivery = list[tuple[str, RequestOutput | BaseException]]
"""Outputs and errors for requests' streams, in order; an error or a finished output ends
its request."""


class RequestStream:
    """The outputs of one request, in order; the last has `finished` set. Iterate it once."""

    def __init__(self, request_id: str, num_seqs: int) -> None:
        self.request_id = request_id
        self.num_seqs = num_seqs
        self.finished = False
        """True once the last output (or an error) was delivered."""
        self._queue: asyncio.Queue[RequestOutput | BaseException | None] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException | None) -> None:
        """An output, an error to raise, or None: aborted, end the iteration."""
        self._queue.put_nowait(item)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished and self._queue.empty():
            raise StopAsyncIteration
        item = await self._queue.get()
        if item is None:
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item


async def generate_outputs(engine, request_id: str, prompt: str | list[int], params,
                           priority: int = 0,
                           lora_request=None) -> AsyncIterator[RequestOutput]:
    """Validate (InvalidRequestError for a bad request), add_request and iterate `engine`'s
    stream (an EngineFrontEnd: AsyncLLMEngine or DataParallelEngine); aborts the request if
    the consumer stops early. `lora_request`: a pagoda.lora.request.LoRARequest or None."""
    request = engine.input_processor.process(request_id, prompt, params, priority=priority,
                                             lora_request=lora_request)
    stream = await engine.add_request(request)
    try:
        async for output in stream:
            yield output
    finally:
        if not stream.finished:
            engine.abort(request_id)


def check_capacity(num_unfinished_seqs: int, num_seqs: int, num_running_slots: int,
                   num_waiting_seqs: int, max_queue: int) -> None:
    """QueueFullError if `num_seqs` more sequences would leave more than `max_queue`
    waiting: those beyond the running slots (`num_running_slots`: max_num_seqs of each
    engine), or, when the engine reported a queue after its last step (KV-cache pressure),
    that queue plus the newcomers (first come, first served: they queue behind it)."""
    would_wait = num_unfinished_seqs + num_seqs - num_running_slots
    if num_waiting_seqs > 0:
        would_wait = max(would_wait, num_waiting_seqs + num_seqs)
    if would_wait > max_queue:
        raise QueueFullError(
            f"the server is at capacity: {max(would_wait - num_seqs, 0)} sequence(s) are "
            f"waiting and the queue holds at most {max_queue}; retry later"
        )
