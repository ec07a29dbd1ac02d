"""`pagoda serve --ray-serve`: deploy the application (app.py) on Ray Serve and hold it until
SIGTERM/SIGINT.

    --ray-address ADDR|auto   join that cluster (an error naming it if unreachable)
    (none)                    join a cluster running here, else start a local one (for trying
                              it: it stops when this command does)

Ray Serve's HTTP proxy listens on --host/--port on every node. Once deployed, the driver
also runs two monitors until it stops:

    autoscaler ledger   (scaling_ledger.py) replicas over time, replica-hours,
                        scaling decisions and cost, logged; its series on --ledger-port; its
                        summary logged at the end
    metrics targets     (replica_metrics.py, with --metrics-targets-file) the Prometheus
                        file_sd file of every engine replica's own metrics address; emptied
                        at the end

On SIGTERM/SIGINT the
application is deleted, each replica first finishing its in-flight requests for up to
--shutdown-timeout seconds; a Ray this command started is stopped too. Exit code 0. (Ctrl-C
in a terminal reaches a local Ray's processes too, so that try-it mode may skip the drain.)
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)


def connect(address: str | None) -> bool:
    """ray.init for --ray-address; True when it started a local Ray (ours to stop)."""
    import ray

    if address is not None:
        try:
            ray.init(address=address, logging_level=logging.WARNING)
        except (ConnectionError, RuntimeError) as e:
            raise ValueError(f"--ray-address {address}: cannot join that Ray cluster "
                             f"({e})") from None
        return False
    try:
        ray.init(address="auto", logging_level=logging.WARNING)
        return False
    except (ConnectionError, RuntimeError):
        ray.init(logging_level=logging.WARNING)
        logger.info("no Ray cluster running here: started a local one")
        return True


def deploy(args: argparse.Namespace, build_state: Callable) -> None:
    """Start Serve's proxy on --host/--port and run the application; returns once it is
    RUNNING (every initial replica up), raises RuntimeError if it failed."""
    from ray import serve

    from pagoda.deploy.application import application

    serve.start(proxy_location=args.proxy_location,
                http_options={"host": args.host, "port": args.port})
    serve.run(application(args, build_state), name=args.app_name, route_prefix="/",
              blocking=False)


DELETE_MARGIN_S = 30.0
"""Seconds beyond --shutdown-timeout the app's deletion may take before we stop waiting."""


def delete_app(name: str, timeout: float) -> None:
    """serve.delete, waited for at most `timeout` seconds: a local Ray started by us shares
    this terminal's process group, so Ctrl-C may have stopped it already, and a delete on a
    dead cluster would wait forever."""
    from ray import serve

    done = threading.Thread(target=serve.delete, args=(name,), daemon=True)
    done.start()
    done.join(timeout)
    if done.is_alive():
        logger.warning("the application %r was not deleted within %.0f s (is the Ray cluster "
                       "still up?); exiting anyway", name, timeout)


def start_monitors(args: argparse.Namespace):
    """The started autoscaler ledger (LedgerPoller) and metrics targets writer (None without
    --metrics-targets-file)."""
    from ray import serve

    from pagoda.deploy.replica_metrics import start_targets_file
    from pagoda.deploy.scaling_ledger import start_ledger

    ledger = start_ledger(args.cost_per_hour, serve.status, metrics_port=args.ledger_port)
    targets = None
    if args.metrics_targets_file is not None:
        targets = start_targets_file(args.metrics_targets_file)
        logger.info("engine replicas' metrics addresses: %s (Prometheus file_sd)",
                    args.metrics_targets_file)
    return ledger, targets


def stop_monitors(ledger, targets) -> None:
    """Stop both (either may be None) and log the ledger's summary."""
    if targets is not None:
        targets.stop()
    if ledger is not None:
        ledger.stop()
        logger.info("autoscaler ledger: %s", json.dumps(ledger.ledger.summary()))


def run_ray_serve(args: argparse.Namespace, build_state: Callable) -> int:
    """`build_state`: entrypoints/openai/api_server.build_server_state (each replica's
    engines and state)."""
    import ray
    from ray import serve

    pagoda_logger = logging.getLogger("pagoda")
    if pagoda_logger.getEffectiveLevel() > logging.INFO:
        pagoda_logger.setLevel(logging.INFO)  # the deployment, the ledger, the shutdown
    started_local = connect(args.ray_address)
    stop = threading.Event()
    handlers = {sig: signal.signal(sig, lambda *_: stop.set())
                for sig in (signal.SIGTERM, signal.SIGINT)}
    ledger = targets = None
    try:
        deploy(args, build_state)
        logger.info("Pagoda on Ray Serve: app %r at http://%s:%d (replicas %d..%d, Ray "
                    "cluster at %s)", args.app_name, args.host, args.port, args.min_replicas,
                    args.max_replicas, ray.get_runtime_context().gcs_address)
        ledger, targets = start_monitors(args)
        stop.wait()
        logger.info("stopping: replicas finish their in-flight requests (up to %ss)",
                    args.shutdown_timeout)
        delete_app(args.app_name, args.shutdown_timeout + DELETE_MARGIN_S)
    finally:
        stop_monitors(ledger, targets)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        if started_local:
            serve.shutdown()
        ray.shutdown()
    return 0
