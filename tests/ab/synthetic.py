"""Synthetic `pagoda bench ab` results for the statistics and report tests: every request's
TTFT, gaps and end-to-end latency are made up, with known differences between endpoints."""

from __future__ import annotations

import numpy as np


def request(endpoint: str, key, ttft: float | None, tpot: float = 0.02, output_tokens: int = 20,
            success: bool = True, error_kind: str | None = None, greedy: bool = True,
            output_text: str | None = "same", start: float = 0.0, repeat: int = 0,
            block: int | None = None) -> dict:
    """One request dict as the A/B result holds it (RequestRecord.to_json() fields + tags).
    block None: independent requests (drawn one by one, as a proxy's record)."""
    ok = success and ttft is not None
    gaps = [tpot] * (output_tokens - 1) if ok else []
    latency = ttft + tpot * (output_tokens - 1) if ok else 0.05
    return {"endpoint": endpoint, "key": key, "repeat": repeat, "block": block, "greedy": greedy,
            "output_text": output_text if ok else None, "index": 0, "start": start,
            "success": ok, "error": None if ok else f"failed with {error_kind}",
            "error_kind": None if ok else error_kind, "http_status": 200 if ok else 500,
            "latency": latency, "prompt_tokens": 10, "output_tokens": output_tokens if ok else None,
            "expected_output_tokens": output_tokens, "finish_reason": "length" if ok else None,
            "ttft": ttft if ok else None,
            "tpot": tpot if ok and output_tokens > 1 else None, "itl": gaps}


def result(requests: list[dict], names=("A", "B"), durations=None, costs=None,
           labels=None) -> dict:
    durations = durations or dict.fromkeys(names, 30.0)
    return {"kind": "ab", "engine": "pagoda-bench", "config": {}, "host": {},
            "endpoints": [{"name": n, "url": f"http://127.0.0.1:{8000 + i}",
                           "label": (labels or {}).get(n),
                           "hardware": {"cpu": "test"} if i == 0 else None,
                           "cost_per_hour": (costs or {}).get(n)}
                          for i, n in enumerate(names)],
            "requests": requests, "duration": durations}


def lognormal_run(n: int = 200, ttft_factor: dict | None = None, tpot_factor: dict | None = None,
                  names=("A", "B"), sigma: float = 0.5, seed: int = 0, same_requests: bool = False,
                  key_offset: dict | None = None, noise: float = 0.0) -> dict:
    """n requests per endpoint; TTFT lognormal around 200 ms times the endpoint's factor.
    same_requests: every endpoint sees the same per-request base TTFT (times a per-request
    noise of `noise` log-sd), as when request size drives latency; else independent draws."""
    rng = np.random.default_rng(seed)
    base = np.exp(rng.normal(np.log(0.2), sigma, size=n))
    requests = []
    for name in names:
        own = base if same_requests else np.exp(rng.normal(np.log(0.2), sigma, size=n))
        own = own * np.exp(rng.normal(0.0, noise, size=n)) if noise else own
        tpot = 0.02 * (tpot_factor or {}).get(name, 1.0) * np.exp(rng.normal(0, 0.1, size=n))
        for i in range(n):
            requests.append(request(name, i + (key_offset or {}).get(name, 0),
                                    float(own[i] * (ttft_factor or {}).get(name, 1.0)),
                                    tpot=float(tpot[i]), start=i * 0.1))
    return result(requests, names)


def drifting_blocks_run(num_blocks: int, block_size: int, drift: float, seed: int,
                        blocked: bool = True) -> dict:
    """Two identical endpoints replayed in blocks (A then B in each block) on a machine whose
    speed drifts from minute to minute: every request of one endpoint's pass over a block is
    slowed by that pass's own lognormal factor (log-sd `drift`), on top of request-to-request
    noise. The true difference is zero. blocked False: the same requests without block tags."""
    rng = np.random.default_rng(seed)
    requests = []
    for block in range(num_blocks):
        base = np.exp(rng.normal(np.log(0.2), 0.3, size=block_size))
        for name in ("A", "B"):
            slow = np.exp(rng.normal(0.0, drift))
            noise = np.exp(rng.normal(0.0, 0.05, size=block_size))
            for i in range(block_size):
                key = block * block_size + i
                requests.append(request(name, key, float(base[i] * slow * noise[i]),
                                        tpot=0.02 * slow, block=block if blocked else None))
    return result(requests)
