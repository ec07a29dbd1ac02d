"""Both engine front-ends are EngineClients (pagoda/engine/loop/protocol.py): every member the
protocol declares exists on each, methods with the protocol's parameters, so the server,
the web view and the model registry can be typed against the one interface."""

from __future__ import annotations

import inspect

import pytest

from pagoda.engine.data_parallel.engine import DataParallelEngine
from pagoda.engine.loop.async_engine import AsyncLLMEngine
from pagoda.engine.loop.protocol import EngineClient


def protocol_members() -> tuple[list[str], list[str], list[str]]:
    """(methods, properties, plain attributes) the protocol declares."""
    methods, properties = [], []
    for name, value in vars(EngineClient).items():
        if isinstance(value, property):
            properties.append(name)
        elif inspect.isfunction(value) and not name.startswith("_"):
            methods.append(name)
    attributes = [name for name in EngineClient.__annotations__]
    return methods, properties, attributes


def parameters(function) -> list[tuple]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]


@pytest.mark.parametrize("front_end", [AsyncLLMEngine, DataParallelEngine])
def test_each_front_end_has_the_protocols_methods(front_end) -> None:
    methods, properties, attributes = protocol_members()
    assert len(methods) >= 9 and {"loop", "is_alive", "snapshot"} <= set(properties)
    for name in methods:
        ours = getattr(front_end, name)
        assert inspect.iscoroutinefunction(ours) == inspect.iscoroutinefunction(
            getattr(EngineClient, name)), name
        assert parameters(ours) == parameters(getattr(EngineClient, name)), name
    # (the constructors of the class and of the front-end it builds on)
    init_source = "".join(inspect.getsource(cls.__init__) for cls in front_end.__mro__
                          if "__init__" in vars(cls) and cls is not object)
    for name in properties:  # a property on the class, or an attribute set in __init__
        assert isinstance(getattr(front_end, name, None), property) or \
            f"self.{name}" in init_source, name
    for name in attributes:
        assert f"self.{name}" in init_source, name


def test_the_server_is_typed_against_the_protocol() -> None:
    from pagoda.entrypoints.openai.model_registry import ServedModel
    from pagoda.entrypoints.openai.server_state import ServerState

    assert ServedModel.__annotations__["engine"] == "EngineClient"
    assert ServerState.__annotations__["models"] == "list[ServedModel]"


def test_one_front_end_over_two_cores() -> None:
    """The stream and request logic is written once (front_end.py); each front-end only
    picks its core, and no module reaches into both cores."""
    from pathlib import Path

    from pagoda.engine.loop.front_end import EngineFrontEnd

    for front_end in (AsyncLLMEngine, DataParallelEngine):
        assert issubclass(front_end, EngineFrontEnd)
        own = {name for name in vars(front_end) if not name.startswith("__")}
        assert not own & {"add_request", "abort", "generate", "cancel_all", "check_queue",
                          "deliver", "shutdown", "wait_dead"}, front_end
    package = Path(__file__).parents[2] / "pagoda"
    for path in package.rglob("*.py"):
        text = path.read_text()
        assert not ("pagoda.engine.loop.thread_core" in text
                    and "pagoda.engine.data_parallel.replica_set_core" in text), path
