"""Pagoda on Ray Serve (`pagoda serve --ray-serve`, `serve run pagoda.deploy.app:build_app`):
options.py (flags -> deployment options), app.py (the application), ingress.py (HTTP in),
engine_replica.py (an engine per replica), forwarding.py (the request between them),
prefix_router.py (which replica), launch.py (the command), scaling_ledger.py (the
autoscaler's ledger: replicas over time, replica-hours, decisions)."""
