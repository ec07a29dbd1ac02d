"""The tiered prefix cache's executor side (issue 37): KV blocks copied out of the paged
pool into a host-memory tier and a disk tier, and back (worker.py). A block travels as a
checked record (record.py) of its every layer's K/V bytes (block_copy.py); host_tier.py and
disk_tier.py keep them LRU within their byte budgets."""

from pagoda.executor.kv_offload.worker import STAT_NAMES, KVOffloadConfig, KVOffloadWorker

__all__ = ["STAT_NAMES", "KVOffloadConfig", "KVOffloadWorker"]
