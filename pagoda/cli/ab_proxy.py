"""`pagoda ab-proxy`: a live A/B test between two OpenAI-compatible servers, in front of users.

    pagoda ab-proxy --primary http://127.0.0.1:8000 --candidate http://127.0.0.1:8001 \\
        --mirror --record ab.jsonl --port 8080
    pagoda bench ab --from-record ab.jsonl          # the report on both sides

Every flag is checked here before anything starts (exit 2 with one line); then
pagoda/ab/proxy_serve.py serves the proxy (a primary or candidate that does not answer at start
is a warning, not an error: it may come up later).
"""

from __future__ import annotations

import argparse
import logging

logger = logging.getLogger(__name__)

LOCAL_HOSTS = ("127.0.0.1", "localhost", "0.0.0.0", "::1", "::")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "ab-proxy", help="live A/B: relay users to a primary server, mirror or split to a "
                         "candidate, record both sides' latencies",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--primary", required=True, metavar="URL",
                   help="the server that answers the users, e.g. http://127.0.0.1:8000")
    p.add_argument("--candidate", required=True, metavar="URL", help="the server under test")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--mirror", action="store_true",
                      help="send the candidate a shadow copy of every generation request "
                           "(its answer is timed and dropped)")
    mode.add_argument("--split", type=float, default=None, metavar="FRACTION",
                      help="serve this fraction of generation requests from the candidate "
                           "(falling back to the primary if it fails before answering)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8080, help="port to listen on")
    p.add_argument("--record", default=None, metavar="FILE",
                   help="append both sides' timings here, one JSON line per (side, request), "
                        "for `pagoda bench ab --from-record FILE`")
    p.add_argument("--api-key", default=None,
                   help="bearer token sent to the candidate instead of the user's own "
                        "Authorization header (the primary always gets the user's headers)")
    p.add_argument("--candidate-timeout", type=float, default=30.0, metavar="S",
                   help="seconds the candidate may take to connect, to start its answer, or "
                        "between its chunks (default: %(default)s)")
    p.add_argument("--max-shadow-in-flight", type=int, default=64, metavar="N",
                   help="most shadow requests at once; more are dropped and counted "
                        "(default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seeds --split's choices")
    p.set_defaults(func=run_ab_proxy)


def check_not_itself(flag: str, url: str, host: str, port: int) -> None:
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    upstream_port = parts.port or (443 if parts.scheme == "https" else 80)
    if upstream_port == port and (parts.hostname == host or (
            parts.hostname in LOCAL_HOSTS and host in LOCAL_HOSTS)):
        raise ValueError(f"{flag} {url} is this proxy's own address (--host {host} --port "
                         f"{port}); point it at the server, or listen on another --port")


def run_ab_proxy(args: argparse.Namespace) -> int:
    from pagoda.ab.proxy_config import ProxyConfig, normalize_upstream_url

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    config = ProxyConfig(
        primary=normalize_upstream_url("--primary", args.primary),
        candidate=normalize_upstream_url("--candidate", args.candidate),
        mirror=args.mirror, split=args.split, record_path=args.record, api_key=args.api_key,
        candidate_timeout=args.candidate_timeout,
        max_shadow_in_flight=args.max_shadow_in_flight, seed=args.seed)
    check_not_itself("--primary", config.primary, args.host, args.port)
    check_not_itself("--candidate", config.candidate, args.host, args.port)
    if config.primary == config.candidate:
        logger.warning("--primary and --candidate are the same server: %s", config.primary)

    from pagoda.ab.proxy_serve import serve_proxy

    serve_proxy(config, args.host, args.port)
    return 0
