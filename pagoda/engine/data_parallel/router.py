"""Which replica gets a request: the least loaded one, unless another holds a long prefix of
its prompt in its KV cache (cache-aware routing, as SGLang's router).

Load of a replica = sequences routed to it and not finished (a request with n = 2 counts
twice); ties go to fewer outstanding prompt tokens, then to the replica chosen least
recently (so idle replicas take turns).

Prefix affinity. The router keeps, per replica, an approximate record of the prompt blocks
it was sent: each full block of `block_size` prompt tokens hashed in a chain, as the block
manager hashes them (block_manager.hash_block_tokens), so equal hashes mean equal whole
prefixes:

    prompt      [ block 0 ][ block 1 ][ block 2 ][ tail ]
    hashes        h0 ──────> h1 ──────> h2                (the tail is never recorded)
    replica r   {h0, h1}            -> match of 2 blocks = 2 * block_size tokens

A request goes to the replica with the longest match when the match covers at least
`min_match_fraction` of its prompt and that replica is not much more loaded than the least
loaded one:

    imbalanced = load - min_load > balance_abs_threshold
                 and load > min_load * balance_rel_threshold

(both, as SGLang's), else it goes to the least loaded replica. Among replicas with the same
match the least loaded wins, so once a popular prefix has spread the load evens out again.

Bounds: each replica's record is an LRU of at most `capacity_blocks` hashes (set to about
its KV cache's size); a prompt's blocks are touched tail first, so, as in the block
manager, a chain's tail is forgotten before its head. An unhealthy replica's record is
dropped (its cache died with it).

Pure Python, no torch: unit-tested without a model (tests/engine/test_dp_router.py).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

from pagoda.engine.core.block_manager import hash_block_tokens, root_hash

DEFAULT_CAPACITY_BLOCKS = 1 << 16
DEFAULT_BALANCE_ABS_THRESHOLD = 8
DEFAULT_BALANCE_REL_THRESHOLD = 1.5
DEFAULT_MIN_MATCH_FRACTION = 0.5


class NoHealthyReplicaError(RuntimeError):
    """Every replica is down (restarting or failed)."""


def prefix_block_hashes(token_ids: list[int], block_size: int,
                        lora_int_id: int = 0) -> list[int]:
    """Chained hashes of the full blocks of `token_ids` (block i's hash covers blocks 0..i),
    from the root of the request's LoRA adapter (0: the base model), as the block manager's."""
    hashes: list[int] = []
    parent = root_hash(lora_int_id)
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start:start + block_size])
        hashes.append(parent)
    return hashes


@dataclass
class _ReplicaRecord:
    healthy: bool = True
    num_seqs: int = 0
    """Load: sequences in flight."""
    num_prompt_tokens: int = 0
    """Prompt tokens of the requests in flight (the tie-break)."""
    last_chosen: int = -1
    """Value of the router's dispatch counter when last chosen (-1: never)."""
    prefix_hashes: OrderedDict[int, None] = field(default_factory=OrderedDict)
    """Block hashes sent to it, least recently used first."""


@dataclass(frozen=True)
class _InFlight:
    replica: int
    num_seqs: int
    num_prompt_tokens: int


class Router:
    def __init__(
        self,
        num_replicas: int,
        block_size: int,
        *,
        capacity_blocks: int = DEFAULT_CAPACITY_BLOCKS,
        balance_abs_threshold: int = DEFAULT_BALANCE_ABS_THRESHOLD,
        balance_rel_threshold: float = DEFAULT_BALANCE_REL_THRESHOLD,
        min_match_fraction: float = DEFAULT_MIN_MATCH_FRACTION,
    ) -> None:
        if num_replicas < 1 or block_size < 1 or capacity_blocks < 1:
            raise ValueError("num_replicas, block_size and capacity_blocks must be >= 1")
        self.block_size = block_size
        self.capacity_blocks = capacity_blocks
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.min_match_fraction = min_match_fraction
        self._replicas = [_ReplicaRecord() for _ in range(num_replicas)]
        self._in_flight: dict[str, _InFlight] = {}
        self._dispatches = itertools.count()

    # ---- state -------------------------------------------------------------------------------

    def set_healthy(self, replica: int, healthy: bool) -> None:
        """Route to it (True) or not (False: its prefix record is dropped). Requests still
        counted on it stay counted until `finish`."""
        record = self._replicas[replica]
        record.healthy = healthy
        if not healthy:
            record.prefix_hashes.clear()

    def is_healthy(self, replica: int) -> bool:
        return self._replicas[replica].healthy

    def load(self, replica: int) -> int:
        return self._replicas[replica].num_seqs

    def num_recorded_blocks(self, replica: int) -> int:
        return len(self._replicas[replica].prefix_hashes)

    # ---- routing -----------------------------------------------------------------------------

    def route(self, request_id: str, prompt_token_ids: list[int], num_seqs: int = 1,
              lora_int_id: int = 0) -> int:
        """Pick the replica for a request and count it there until `finish(request_id)`.
        `lora_int_id`: the request's adapter (0: none): prefixes match under the same
        adapter only. Raises NoHealthyReplicaError when none is healthy."""
        hashes = prefix_block_hashes(prompt_token_ids, self.block_size, lora_int_id)
        replica = self.choose(prompt_token_ids, hashes)
        self.record(request_id, replica, prompt_token_ids, num_seqs, hashes)
        return replica

    def record(self, request_id: str, replica: int, prompt_token_ids: list[int],
               num_seqs: int = 1, hashes: list[int] | None = None) -> None:
        """Count a request on `replica` (chosen by `choose`, or by a caller that may override
        it: Ray Serve's router, pagoda/deploy/prefix_router.py) until `finish(request_id)`."""
        if hashes is None:
            hashes = prefix_block_hashes(prompt_token_ids, self.block_size)
        record = self._replicas[replica]
        record.num_seqs += num_seqs
        record.num_prompt_tokens += len(prompt_token_ids)
        record.last_chosen = next(self._dispatches)
        self._in_flight[request_id] = _InFlight(replica, num_seqs, len(prompt_token_ids))
        self._remember(record, hashes)

    def add_replica(self) -> int:
        """One more replica slot (healthy, empty); returns its index."""
        self._replicas.append(_ReplicaRecord())
        return len(self._replicas) - 1

    def finish(self, request_id: str) -> None:
        """The request ended (finished, failed or aborted); a no-op for unknown ids."""
        entry = self._in_flight.pop(request_id, None)
        if entry is None:
            return
        record = self._replicas[entry.replica]
        record.num_seqs -= entry.num_seqs
        record.num_prompt_tokens -= entry.num_prompt_tokens

    def choose(self, prompt_token_ids: list[int], hashes: list[int] | None = None,
               among: Iterable[int] | None = None) -> int:
        """The replica `route` would pick, recording nothing; `among`: only these (healthy)
        replicas are candidates (default: all)."""
        if hashes is None:
            hashes = prefix_block_hashes(prompt_token_ids, self.block_size)
        candidates = range(len(self._replicas)) if among is None else among
        healthy = [i for i in candidates if self._replicas[i].healthy]
        if not healthy:
            raise NoHealthyReplicaError("no engine replica is healthy")
        min_load = min(self._replicas[i].num_seqs for i in healthy)
        matches = {i: self._match_blocks(self._replicas[i], hashes) for i in healthy}
        best = max(matches.values())
        if best > 0 and best * self.block_size >= self.min_match_fraction * len(prompt_token_ids):
            affine = self._least_loaded([i for i in healthy if matches[i] == best])
            if not self._imbalanced(self._replicas[affine].num_seqs, min_load):
                return affine
        return self._least_loaded(healthy)

    def _least_loaded(self, candidates: list[int]) -> int:
        def key(i: int) -> tuple[int, int, int]:
            r = self._replicas[i]
            return (r.num_seqs, r.num_prompt_tokens, r.last_chosen)

        return min(candidates, key=key)

    def _imbalanced(self, load: int, min_load: int) -> bool:
        return (load - min_load > self.balance_abs_threshold
                and load > min_load * self.balance_rel_threshold)

    @staticmethod
    def _match_blocks(record: _ReplicaRecord, hashes: list[int]) -> int:
        """Leading blocks of the prompt this replica was sent (the chain stops at a gap)."""
        num = 0
        for block_hash in hashes:
            if block_hash not in record.prefix_hashes:
                break
            num += 1
        return num

    def _remember(self, record: _ReplicaRecord, hashes: list[int]) -> None:
        """Touch the prompt's blocks tail first (the head ends most recent), then evict the
        least recently used beyond capacity."""
        prefix_hashes = record.prefix_hashes
        for block_hash in reversed(hashes):
            prefix_hashes[block_hash] = None
            prefix_hashes.move_to_end(block_hash)
        while len(prefix_hashes) > self.capacity_blocks:
            prefix_hashes.popitem(last=False)
