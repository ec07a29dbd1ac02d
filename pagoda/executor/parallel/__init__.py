"""Tensor parallelism: one model split across processes (Megatron-style).

    partition.py      which heads, MLP rows and vocabulary rows each rank holds (pure arithmetic)
    communication.py  the rank's process group (torch.distributed: gloo on CPU, NCCL on CUDA)
    slicing.py        a loaded linear / embedding of any weight format cut to rows or columns
    layers.py         the parallel layers: row-parallel (all-reduce), vocab-parallel embedding
                      and logits head (all-gather)
    sharding.py       a loaded Llama-family model cut down to one rank's share, in place
    worker.py         one rank: joins the group, builds its share, runs what the engine sends
    tp_runner.py      the engine's side: sends each step to every rank, takes rank 0's output
    mp_workers.py     ranks as local processes (worker_process.py), the default backend
    ray_workers.py    ranks as Ray actors placed on a Ray cluster

The engine (scheduler, block manager) stays in its process and holds no weights: every step
it sends the plain-data SchedulerOutput to all ranks, they run the same forward (their
collectives keep them in step) and the same sampler over the gathered logits, and rank 0's
output goes back to the engine.
"""
