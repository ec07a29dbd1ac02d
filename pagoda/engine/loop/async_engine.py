"""AsyncLLMEngine: the engine front-end (front_end.py: streams, queue check, aborts, dead and
alive) over one LLMEngine on a thread of this process (thread_core.py: its EngineLoop).

    AsyncLLMEngine(engine)          the engine built already; `start()` starts its thread
    AsyncLLMEngine.build_on_engine_thread(build)   the engine built on the thread that will
                                    step it (one OpenMP pool: see ThreadCore)
"""

from __future__ import annotations

from collections.abc import Callable

from pagoda.engine.loop.front_end import EngineFrontEnd
from pagoda.engine.loop.thread_core import ThreadCore
from pagoda.engine.stats.metrics import EngineMetrics


class AsyncLLMEngine(EngineFrontEnd):
    def __init__(
        self,
        engine,
        metrics: EngineMetrics | None = None,
        max_queue: int | None = None,
    ) -> None:
        """`engine` is an LLMEngine (or anything with its interface); from `start()` on, only
        the engine thread may touch it. `max_queue`: most sequences allowed to wait for a
        batch slot; a request that would go over raises QueueFullError (None: no limit)."""
        super().__init__(ThreadCore(engine, metrics), max_queue=max_queue)

    @classmethod
    def build_on_engine_thread(cls, build_engine: Callable[[], object],
                               metrics: EngineMetrics | None = None,
                               max_queue: int | None = None) -> AsyncLLMEngine:
        """Build the engine on the engine thread (`build_engine()`), return the front-end
        over it; `start()` then runs the loop on that same thread. Raises what
        `build_engine` raises."""
        core = ThreadCore.build_on_engine_thread(build_engine)
        core.metrics = metrics
        front_end = cls.__new__(cls)
        EngineFrontEnd.__init__(front_end, core, max_queue=max_queue)
        return front_end

    @property
    def engine(self):
        """The LLMEngine (only the engine thread may touch it once started)."""
        return self.core.engine
