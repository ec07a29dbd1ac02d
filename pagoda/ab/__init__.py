"""A/B tests between OpenAI-compatible servers: `pagoda bench ab` (the same traffic replayed
to two or more endpoints, interleaved) and `pagoda ab-proxy` (a live split or mirror in front
of users), judged by the same statistics.

    run.py             `pagoda bench ab` once pagoda/cli/bench_ab.py has checked its flags
    replay.py          the replay: the same requests to each endpoint, block by block
    trace_import.py    public traces (ShareGPT, Azure, Mooncake) as traffic entries
    stats.py           intervals and the verdict (bootstrap.py: the resampling;
                       verdict.py: the verdict in words)
    report.py          the terminal summary and the offline HTML page
    proxy.py           `pagoda ab-proxy`'s ASGI app (proxy_config.py: flags and counters;
                       proxy_record.py: both sides timed, one JSON line each;
                       proxy_upstream.py: its HTTP/1.1 client; proxy_serve.py:
                       `pagoda ab-proxy` once pagoda/cli/ab_proxy.py has checked its flags)

The traffic record both the server's recorder and the replay use is pagoda/traffic_record.py,
outside this package: the server imports nothing of A/B. This package builds on
pagoda/bench/ (the timed client, metrics, reports); nothing in pagoda/bench imports it.
"""
