"""Both engine front-ends are EngineClients (pagoda/engine/protocol.py): every member the
protocol declares exists on each, methods with the protocol's parameters, so the server,
the web view and the model registry can be typed against the one interface."""

from __future__ import annotations

import inspect

import pytest

from pagoda.engine.async_engine import AsyncLLMEngine
from pagoda.engine.data_parallel.engine import DataParallelEngine
from pagoda.engine.protocol import EngineClient


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
    for name in properties:  # a property on the class, or an attribute set in __init__
        init_source = inspect.getsource(front_end.__init__)
        assert isinstance(getattr(front_end, name, None), property) or \
            f"self.{name}" in init_source, name
    init_source = inspect.getsource(front_end.__init__)
    for name in attributes:
        assert f"self.{name}" in init_source, name


def test_the_server_is_typed_against_the_protocol() -> None:
    from pagoda.entrypoints.openai.model_registry import ServedModel
    from pagoda.entrypoints.openai.server import ServerState

    for cls in (ServedModel, ServerState):
        assert cls.__annotations__["engine"] == "EngineClient"
