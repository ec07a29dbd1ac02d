"""What `pagoda ab-proxy` is told (ProxyConfig, checked on creation: each error names its
flag) and what it counts (ProxyStats, served at GET /ab-proxy/stats). No I/O here: the CLI
checks its flags with this before anything starts."""

from __future__ import annotations

import math
import urllib.parse
from dataclasses import dataclass


def normalize_upstream_url(flag: str, url: str) -> str:
    """'http://host:8000/v1/' -> 'http://host:8000'; a ValueError naming `flag` otherwise."""
    url = url.strip().rstrip("/")
    parts = urllib.parse.urlsplit(url)
    try:
        parts.port  # noqa: B018 (raises ValueError for a bad port)
    except ValueError:
        raise ValueError(f"{flag} {url!r}: bad port") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query:
        raise ValueError(f"{flag} {url!r}: write the server's http(s) URL, "
                         "e.g. http://127.0.0.1:8000")
    return url.removesuffix("/v1")


@dataclass(frozen=True)
class ProxyConfig:
    primary: str
    """Base URL of the engine that serves the users (normalize_upstream_url)."""
    candidate: str
    """Base URL of the engine under test."""
    mirror: bool = False
    """Send the candidate a shadow copy of every generation request."""
    split: float | None = None
    """Or: serve this fraction of generation requests from the candidate, in (0, 1)."""
    record_path: str | None = None
    """Append the record's JSON lines here (None: count only)."""
    api_key: str | None = None
    """Sent to the candidate as 'Authorization: Bearer KEY' instead of the user's own header."""
    candidate_timeout: float = 30.0
    """Seconds the candidate may take to connect, answer with headers, or send its next bytes."""
    max_shadow_in_flight: int = 64
    """Most shadow requests at once; more are dropped (and counted)."""
    seed: int = 0
    """Seeds --split's choices."""

    def __post_init__(self) -> None:
        if self.mirror == (self.split is not None):
            raise ValueError("give one of --mirror or --split FRACTION")
        if self.split is not None and not 0 < self.split < 1:
            raise ValueError(f"--split must be a fraction in (0, 1), got {self.split}")
        if not (self.candidate_timeout > 0 and math.isfinite(self.candidate_timeout)):
            raise ValueError(f"--candidate-timeout must be positive seconds, "
                             f"got {self.candidate_timeout}")
        if self.max_shadow_in_flight < 1:
            raise ValueError(f"--max-shadow-in-flight must be >= 1, "
                             f"got {self.max_shadow_in_flight}")


@dataclass
class ProxyStats:
    requests_forwarded: int = 0
    """Every request the proxy received (stats excluded)."""
    generation_requests: int = 0
    primary_failures: int = 0
    """Requests the primary never answered (the user got a 502)."""
    shadows_sent: int = 0
    shadows_dropped: int = 0
    """Not sent: --max-shadow-in-flight were running."""
    shadows_failed: int = 0
    shadows_in_flight: int = 0
    split_to_candidate: int = 0
    """Generation requests --split chose for the candidate (fallbacks included)."""
    split_fallbacks: int = 0
    """Of those, served by the primary after the candidate failed before its first byte."""
