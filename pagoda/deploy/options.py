"""`pagoda serve --ray-serve` flags and the Ray Serve deployment options they make; and the
whole of `pagoda serve`'s flags (add_serve_args: the server's, these, the engine's), which
cli/serve.py and app.py (`serve run`) both parse with.

No Ray import here (the flags are parsed by every `pagoda serve`): app.py turns
`deployment_options(args)` into the two deployments of the application:

    PagodaIngress  (ingress.py)         num_replicas = --ingress-replicas, 0 CPUs each
        │ DeploymentHandle, routed by PrefixAwareRequestRouter (prefix_router.py)
        v
    PagodaEngine   (engine_replica.py)  autoscaling_config from the flags below; each replica
                                        reserves --replica-cpus CPUs and owns one engine
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pagoda.config import EngineConfig
from pagoda.entrypoints.openai.server_args import add_server_args, check_server_args

DEFAULT_MIN_REPLICAS = 1
DEFAULT_MAX_REPLICAS = 2
DEFAULT_TARGET_ONGOING_REQUESTS = 4.0
DEFAULT_MAX_ONGOING_REQUESTS = 16
DEFAULT_UPSCALE_DELAY_S = 5.0
DEFAULT_DOWNSCALE_DELAY_S = 30.0
DEFAULT_GRACEFUL_SHUTDOWN_S = 30.0
DEFAULT_HEALTH_CHECK_PERIOD_S = 5.0
DEFAULT_HEALTH_CHECK_TIMEOUT_S = 10.0
DEFAULT_ASSIGN_TIMEOUT_S = 30.0
DEFAULT_INGRESS_REPLICAS = 2
DEFAULT_APP_NAME = "pagoda"
ROUTER_CLASS = "pagoda.deploy.prefix_router.PrefixAwareRequestRouter"


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """`pagoda serve`'s flags: the server's (entrypoints/openai/server_args.py), Ray
    Serve's (below), then the engine's (pagoda/config.py; --model may repeat)."""
    add_server_args(parser)
    add_ray_serve_args(parser)
    EngineConfig.add_cli_args(parser, ("model",))


def check_serve_args(args: argparse.Namespace) -> None:
    """Every check of `pagoda serve`'s flags that runs before anything slow; ValueError
    naming the flag."""
    check_server_args(args)
    check_ray_serve_args(args)


def add_ray_serve_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("Ray Serve (--ray-serve)")
    group.add_argument("--ray-serve", action="store_true",
                       help="serve on Ray Serve: each engine a replica behind Ray Serve's HTTP "
                            "proxy on --host/--port, autoscaled between --min-replicas and "
                            "--max-replicas, routed prefix-aware")
    group.add_argument("--ray-address", default=None, metavar="auto|ADDR",
                       help="join this Ray cluster ('auto': the one running here); default: "
                            "join one running here, else start a local one")
    group.add_argument("--min-replicas", type=int, default=DEFAULT_MIN_REPLICAS,
                       help="fewest engine replicas (default: %(default)s)")
    group.add_argument("--max-replicas", type=int, default=DEFAULT_MAX_REPLICAS,
                       help="most engine replicas (default: %(default)s)")
    group.add_argument("--target-ongoing-requests", type=float,
                       default=DEFAULT_TARGET_ONGOING_REQUESTS,
                       help="requests in flight per replica the autoscaler aims at "
                            "(default: %(default)s)")
    group.add_argument("--max-ongoing-requests", type=int, default=DEFAULT_MAX_ONGOING_REQUESTS,
                       help="most requests one replica runs at once; more wait in Ray Serve's "
                            "router (default: %(default)s)")
    group.add_argument("--upscale-delay", type=float, default=DEFAULT_UPSCALE_DELAY_S,
                       help="seconds the load must stay high before a replica is added "
                            "(default: %(default)s)")
    group.add_argument("--downscale-delay", type=float, default=DEFAULT_DOWNSCALE_DELAY_S,
                       help="seconds the load must stay low before a replica is removed "
                            "(default: %(default)s)")
    group.add_argument("--autoscale-look-back", type=float, default=30.0,
                       help="seconds of load the autoscaler averages over (default: "
                            "%(default)s)")
    group.add_argument("--proxy-location", default="EveryNode",
                       choices=("EveryNode", "HeadOnly"),
                       help="where Ray Serve runs its HTTP proxy (default: %(default)s)")
    group.add_argument("--replica-cpus", type=float, default=1.0,
                       help="CPUs each engine replica reserves in Ray (default: %(default)s)")
    group.add_argument("--ingress-replicas", type=int, default=DEFAULT_INGRESS_REPLICAS,
                       help="replicas of the small HTTP ingress in front of the engines "
                            "(default: %(default)s, so that none is a single point of failure)")
    group.add_argument("--assign-timeout", type=float, default=DEFAULT_ASSIGN_TIMEOUT_S,
                       help="seconds a request may wait for an engine replica (none alive, or "
                            "all at --max-ongoing-requests) before 503 + Retry-After "
                            "(default: %(default)s)")
    group.add_argument("--health-check-period", type=float,
                       default=DEFAULT_HEALTH_CHECK_PERIOD_S,
                       help="seconds between Ray Serve's health checks of a replica's engine "
                            "(default: %(default)s)")
    group.add_argument("--app-name", default=DEFAULT_APP_NAME,
                       help="the Ray Serve application's name (default: %(default)s)")
    group.add_argument("--ledger-port", type=int, default=None, metavar="PORT",
                       help="serve the autoscaler ledger's series (replicas, replica-hours, "
                            "scaling decisions, cost) on http://0.0.0.0:PORT/metrics for "
                            "Prometheus; 0: a free port, logged (default: none; the ledger "
                            "is logged either way)")
    group.add_argument("--metrics-targets-file", default=None, metavar="PATH",
                       help="keep PATH a Prometheus file_sd targets file listing every engine "
                            "replica's own metrics address (GET /metrics through the proxy "
                            "reaches one replica only); rewritten atomically as replicas come "
                            "and go (default: none)")


def check_ray_serve_args(args: argparse.Namespace) -> None:
    """ValueError naming the flag for a bad value (checked with or without --ray-serve)."""
    if args.min_replicas < 0:
        raise ValueError(f"--min-replicas must be >= 0, got {args.min_replicas}")
    if args.max_replicas < 1:
        raise ValueError(f"--max-replicas must be >= 1, got {args.max_replicas}")
    if args.min_replicas > args.max_replicas:
        raise ValueError(f"--min-replicas {args.min_replicas} is more than --max-replicas "
                         f"{args.max_replicas}")
    if not args.target_ongoing_requests > 0:
        raise ValueError(f"--target-ongoing-requests must be > 0, got "
                         f"{args.target_ongoing_requests}")
    if args.max_ongoing_requests < 1:
        raise ValueError(f"--max-ongoing-requests must be >= 1, got {args.max_ongoing_requests}")
    for flag in ("upscale_delay", "downscale_delay", "replica_cpus"):
        if getattr(args, flag) < 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 0, got "
                             f"{getattr(args, flag)}")
    if args.ingress_replicas < 1:
        raise ValueError(f"--ingress-replicas must be >= 1, got {args.ingress_replicas}")
    for flag in ("assign_timeout", "health_check_period", "autoscale_look_back"):
        if not getattr(args, flag) > 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be > 0 seconds, got "
                             f"{getattr(args, flag)}")
    if args.ledger_port is not None and not 0 <= args.ledger_port <= 65535:
        raise ValueError(f"--ledger-port must be a port number (0..65535; 0: a free one), "
                         f"got {args.ledger_port}")
    if args.metrics_targets_file is not None:
        folder = Path(args.metrics_targets_file).parent
        if not folder.is_dir():
            raise ValueError(f"--metrics-targets-file {args.metrics_targets_file}: no folder "
                             f"{folder} to write it in")
    if args.ray_serve and (args.ssl_keyfile or args.ssl_certfile):
        raise ValueError("--ray-serve serves plain HTTP on Ray Serve's proxy: terminate TLS in "
                         "front of it (drop --ssl-keyfile/--ssl-certfile)")


def engine_deployment_options(args: argparse.Namespace) -> dict:
    """Options of the PagodaEngine deployment (serve.deployment(**options))."""
    options = {
        "autoscaling_config": {
            "min_replicas": args.min_replicas,
            "initial_replicas": max(args.min_replicas, 1),
            "max_replicas": args.max_replicas,
            "target_ongoing_requests": args.target_ongoing_requests,
            "upscale_delay_s": args.upscale_delay,
            "downscale_delay_s": args.downscale_delay,
            "look_back_period_s": args.autoscale_look_back,
        },
        "max_ongoing_requests": args.max_ongoing_requests,
        # a replica being removed (downscale, upgrade) gets no new requests and finishes
        # its in-flight ones for up to --shutdown-timeout seconds
        "graceful_shutdown_timeout_s": args.shutdown_timeout,
        "graceful_shutdown_wait_loop_s": 1.0,
        "health_check_period_s": args.health_check_period,
        "health_check_timeout_s": DEFAULT_HEALTH_CHECK_TIMEOUT_S,
        "ray_actor_options": {"num_cpus": args.replica_cpus},
        "request_router_config": {"request_router_class": ROUTER_CLASS},
    }
    if args.autoscale_look_back <= 10.0:
        # Ray still checks its deprecated metrics_interval_s (default 10 s) against the
        # look-back; the real report periods are RAY_SERVE_*_AUTOSCALING_METRIC_PUSH_INTERVAL_S
        options["autoscaling_config"]["metrics_interval_s"] = args.autoscale_look_back / 2
    return options


def ingress_deployment_options(args: argparse.Namespace) -> dict:
    return {
        "num_replicas": args.ingress_replicas,
        "max_ongoing_requests": 10_000,  # it only forwards; the engines' limit is what counts
        "graceful_shutdown_timeout_s": args.shutdown_timeout,
        "ray_actor_options": {"num_cpus": 0},
    }
