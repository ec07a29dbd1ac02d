"""Tensor parallelism: one model split across processes (Megatron-style).

    partition.py      which heads, MLP rows and vocabulary rows each rank holds (pure arithmetic)
    communication.py  the rank's process group (torch.distributed: gloo on CPU, NCCL on CUDA)
    slicing.py        a loaded linear / embedding of any weight format cut to rows or columns
    layers.py         the parallel layers: row-parallel (all-reduce), vocab-parallel embedding
                      and logits head (all-gather)
    sharding.py       a loaded Llama-family model cut down to one rank's share, in place
    workers.py        the engine's side: rank 0's runner plus worker processes that mirror it
    worker_main.py    a worker process: build its shard, then run what rank 0 broadcasts

The engine (scheduler, block manager) stays in one process: every step rank 0 broadcasts
the plain-data SchedulerOutput, all ranks run the same forward (their collectives keep them
in step) and the same sampler over the gathered logits, and rank 0's output goes back to the
engine.
"""
