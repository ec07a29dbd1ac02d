"""Pagoda on Ray Serve, part by part and without a cluster: the prompt the router hashes,
a forwarded request played into an ASGI app, the prefix-aware request router's choices,
the flags -> deployment options, `serve run`'s args, deploy/serve_config.yaml."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from pagoda.cli.main import main
from pagoda.deploy.forwarding import ForwardedRequest, play, routing_text

pytest.importorskip("ray.serve", reason="make test installs Ray Serve (ray[serve])")

CONFIG = Path(__file__).parents[2] / "deploy" / "serve_config.yaml"


def forwarded(path: str = "/v1/completions", body: bytes = b"{}", text: str = "") -> ForwardedRequest:
    return ForwardedRequest("POST", path, b"", [(b"content-type", b"application/json")],
                            body, text)


def test_routing_text_is_the_prompt() -> None:
    assert routing_text("/v1/completions", b'{"prompt": "Once upon"}') == "Once upon"
    chat = json.dumps({"messages": [{"role": "system", "content": "Be brief."}]}).encode()
    assert routing_text("/v1/chat/completions", chat).startswith('[{"role":"system"')
    assert routing_text("/v1/responses", b'{"input": "hi"}') == "hi"
    assert routing_text("/v1/completions", b"not json") == ""
    assert routing_text("/health", b"") == ""
    assert routing_text("/v1/completions", b"[1, 2]") == ""


def test_play_passes_the_response_through_and_the_body_in() -> None:
    seen = {}

    async def app(scope, receive, send):
        seen["path"], seen["body"] = scope["path"], (await receive())["body"]
        await send({"type": "http.response.start", "status": 201,
                    "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    async def collect(app):
        return [item async for item in play(app, forwarded(body=b'{"prompt": "x"}'))]

    items = asyncio.run(collect(app))
    assert items == [("start", 201, [(b"content-type", b"text/event-stream")]),
                     b"data: 1\n\n", b"data: [DONE]\n\n"]
    assert seen == {"path": "/v1/completions", "body": b'{"prompt": "x"}'}

    async def broken(scope, receive, send):
        raise RuntimeError("boom")

    status = asyncio.run(collect(broken))
    assert status[0][:2] == ("start", 500) and b"server_error" in status[1]


def test_closing_play_early_cancels_the_app() -> None:
    cancelled = asyncio.Event()

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"a", "more_body": True})
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def first_two():
        generator = play(app, forwarded())
        items = [await generator.__anext__(), await generator.__anext__()]
        await generator.aclose()  # the client left
        return items, cancelled.is_set()

    items, was_cancelled = asyncio.run(first_two())
    assert items[1] == b"a" and was_cancelled


@dataclass(frozen=True)
class FakeReplica:
    replica_id: str


@dataclass
class FakeMetadata:
    internal_request_id: str


@dataclass
class FakePending:
    args: list
    metadata: FakeMetadata


def new_router():
    from pagoda.deploy.prefix_router import PrefixAwareRequestRouter

    router = object.__new__(PrefixAwareRequestRouter)  # Ray Serve's own state is not needed
    router.initialize_state(block_bytes=8)
    return router


def route(router, replicas, text: str, request_id: str) -> FakeReplica:
    pending = FakePending([forwarded(text=text)], FakeMetadata(request_id))
    ranks = asyncio.run(router.choose_replicas(replicas, pending))
    assert sorted(r.replica_id for rank in ranks for r in rank) == sorted(
        r.replica_id for r in replicas)  # every candidate ranked once
    chosen = ranks[0][0]
    router.on_request_routed(pending, chosen.replica_id, None)
    return chosen


def test_the_router_sends_a_shared_prefix_to_the_replica_that_has_it() -> None:
    router = new_router()
    a, b = FakeReplica("a"), FakeReplica("b")
    system = "You are a helpful assistant. " * 4
    first = route(router, [a, b], system + "question one", "r1")
    router.on_request_completed(first.replica_id, "r1")
    for i in range(5):  # the same prefix: back to the replica that has it, while balanced
        assert route(router, [a, b], system + f"question {i}", f"s{i}") == first
        router.on_request_completed(first.replica_id, f"s{i}")
    other = route(router, [a, b], "something else entirely, no shared prefix", "o1")
    assert other != first  # no match: the least recently chosen of the idle ones


def test_the_router_balances_load_and_forgets_gone_replicas() -> None:
    router = new_router()
    a, b = FakeReplica("a"), FakeReplica("b")
    chosen = [route(router, [a, b], f"prompt number {i} " * 3, f"r{i}") for i in range(4)]
    assert {r.replica_id for r in chosen} == {"a", "b"}
    assert [r.replica_id for r in chosen].count("a") == 2  # in flight: 2 and 2
    router._forget("a")  # the replica died (on_replica_actor_died / update_replicas)
    assert route(router, [b], "prompt number 0 " * 3, "r9") == b
    c = FakeReplica("c")  # a new replica (upscale) is idle: it gets the next new prompt
    assert route(router, [b, c], "a brand new prompt here", "r10") == c


def test_flags_make_the_deployment_options() -> None:
    from pagoda.deploy.app import parse_serve_args
    from pagoda.deploy.options import ROUTER_CLASS, engine_deployment_options

    args = parse_serve_args(["--min-replicas", "2", "--max-replicas", "5",
                             "--target-ongoing-requests", "3", "--upscale-delay", "1",
                             "--downscale-delay", "9", "--shutdown-timeout", "12"])
    options = engine_deployment_options(args)
    assert options["autoscaling_config"] == {
        "min_replicas": 2, "initial_replicas": 2, "max_replicas": 5,
        "target_ongoing_requests": 3.0, "upscale_delay_s": 1.0, "downscale_delay_s": 9.0,
        "look_back_period_s": 30.0}
    assert options["graceful_shutdown_timeout_s"] == 12.0
    assert options["request_router_config"] == {"request_router_class": ROUTER_CLASS}
    from ray.serve.config import AutoscalingConfig, RequestRouterConfig

    AutoscalingConfig(**options["autoscaling_config"])  # Ray Serve accepts them
    RequestRouterConfig(**options["request_router_config"])


@pytest.mark.parametrize(("argv", "message"), [
    (["--min-replicas", "3", "--max-replicas", "2"], "--min-replicas 3 is more than"),
    (["--target-ongoing-requests", "0"], "--target-ongoing-requests must be > 0"),
    (["--ingress-replicas", "0"], "--ingress-replicas must be >= 1"),
    (["--assign-timeout", "0"], "--assign-timeout must be > 0"),
    (["--ledger-port", "70000"], "--ledger-port must be a port number"),
    (["--metrics-targets-file", "/no/such/folder/t.json"],
     "--metrics-targets-file /no/such/folder/t.json: no folder /no/such/folder"),
])
def test_bad_ray_serve_flags_are_usage_errors(argv, message, capsys) -> None:
    assert main(["serve", "--ray-serve", *argv]) == 2
    assert message in capsys.readouterr().err


def test_serve_run_args_go_through_pagoda_serves_parser() -> None:
    from pagoda.deploy.app import parse_serve_args, serve_argv

    argv = serve_argv({"model": ["a", "b"], "min-replicas": 2, "ray_serve": True,
                       "api_key": None})
    assert argv == ["--model", "a", "--model", "b", "--min-replicas", "2", "--ray-serve"]
    with pytest.raises(ValueError, match="unrecognized arguments: --no-such-flag"):
        parse_serve_args(serve_argv({"no_such_flag": 1}))
    with pytest.raises(ValueError, match="--max-replicas must be >= 1"):
        parse_serve_args(serve_argv({"max_replicas": 0}))


def test_the_serve_config_is_valid_for_ray_serve_and_pagoda() -> None:
    from ray.serve.schema import ServeDeploySchema

    from pagoda.deploy.app import parse_serve_args, serve_argv

    config = yaml.safe_load(CONFIG.read_text())
    ServeDeploySchema.model_validate(config)
    (app,) = config["applications"]
    assert app["import_path"] == "pagoda.deploy.app:build_app"
    args = parse_serve_args(serve_argv(app["args"]))
    assert (args.min_replicas, args.max_replicas) == (2, 4)
