"""The Ray Serve application: PagodaIngress -> PagodaEngine (options.py draws it), for checked
`pagoda serve --ray-serve` flags: launch.py (the command) and app.py (`serve run`) call it.

A deployment update that changes these args (another model file, another engine setting)
is a Ray Serve rolling upgrade: replicas are replaced a few at a time, each old one draining
first; a new version that fails to start stops the rollout and the old replicas keep serving.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING

from ray import serve
from ray.serve import Application

from pagoda.deploy.engine_replica import PagodaEngine
from pagoda.deploy.ingress import PagodaIngress
from pagoda.deploy.options import engine_deployment_options, ingress_deployment_options

if TYPE_CHECKING:
    from pagoda.entrypoints.openai.server_state import ServerState


def application(args: argparse.Namespace,
                build_state: Callable[[argparse.Namespace], ServerState]) -> Application:
    """The bound application for checked `pagoda serve --ray-serve` flags; `build_state`
    (entrypoints/openai/api_server.build_server_state) builds each replica's engines and
    server state."""
    replica_args = {k: v for k, v in vars(args).items() if not callable(v)}
    engine = serve.deployment(PagodaEngine, name="PagodaEngine",
                              **engine_deployment_options(args))
    ingress = serve.deployment(PagodaIngress, name="PagodaIngress",
                               **ingress_deployment_options(args))
    return ingress.bind(engine.bind(replica_args, build_state), args.assign_timeout)
