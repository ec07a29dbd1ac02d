"""`pagoda ab-proxy` once its flags are checked (pagoda/cli/ab_proxy.py): the proxy made (its
--record opened first: a bad path is an error before anything listens), both servers probed
(a warning only: they may come up later), then served on uvicorn until stopped."""

from __future__ import annotations

import logging
import sys

import httpx
import uvicorn

from pagoda.ab.proxy import ABProxy
from pagoda.ab.proxy_config import ProxyConfig

logger = logging.getLogger(__name__)


def probe(name: str, url: str, api_key: str | None) -> None:
    """Warn (only) if `url` does not answer GET /v1/models now."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        httpx.get(url + "/v1/models", headers=headers, timeout=3.0)
    except httpx.HTTPError as e:
        logger.warning("the %s %s does not answer yet (%s: %s); %s", name, url,
                       type(e).__name__, e, "users get 502 until it does" if name == "primary"
                       else "its shadows fail until it does")


def serve_proxy(config: ProxyConfig, host: str, port: int) -> None:
    """Run the proxy on host:port until SIGINT/SIGTERM."""
    proxy = ABProxy(config)  # opens --record: a bad path is an error before the server starts
    probe("primary", config.primary, None)
    probe("candidate", config.candidate, config.api_key)
    mode = "mirror" if config.mirror else f"split {config.split:g}"
    print(f"ab-proxy on http://{host}:{port}: primary {config.primary}, candidate "
          f"{config.candidate} ({mode})" + (f", record {config.record_path}"
                                            if config.record_path else ""), file=sys.stderr)
    uvicorn.run(proxy, host=host, port=port, log_level="warning", access_log=False,
                server_header=False, date_header=False, lifespan="on")
