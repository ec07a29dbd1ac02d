"""Data parallelism: N engine replicas, each a whole engine in its own process, behind one
API server process (`pagoda serve --data-parallel-size N`).

    server process (event loop)                                replica process i
    ---------------------------                                -----------------
    DataParallelEngine.add_request --route--> Router           an EngineLoop around
        Add(EngineRequest) ────────────── Pipe ──────────────>  build_engine(config, dp=1)
        stream <─ Batch([Added(id), Out(id, RequestOutput), ...]) ─ one per loop iteration
        metrics <─ Batch([Snapshot(fields)])  ─────────────────  every SNAPSHOT_INTERVAL_S

- router.py      which replica gets a request (load, prefix affinity); pure Python
- launcher.py    starts one replica process and returns a handle (the seam a Ray actor
                 would fill); PDEATHSIG and pipe EOF make replicas die with the server
- replica_main.py  what runs inside a replica
- messages.py    the typed dataclasses that cross the pipe (errors, snapshots)
- engine.py      DataParallelEngine: the engine front-end (../front_end.py) over a
                 ReplicaSetCore
- replica_set_core.py  ReplicaSetCore: routing, acks, a replica's loss, merged snapshots
- supervisor.py  the replicas' processes: start, watch, restart the dead, stop
- replica_slot.py  the server's view of one replica (state, in-flight ids, reader thread)
- snapshots.py   replicas' snapshots added up, counters kept across restarts
- metrics.py     per-replica Prometheus series (replica="i") plus the totals

Nothing here imports torch at module level: a replica must set OMP_NUM_THREADS before
torch loads (replica_main.py).
"""
