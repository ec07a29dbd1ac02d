"""The data-parallel router without a model: load balancing, prefix affinity, the balance
threshold, unhealthy replicas, and its bounded prefix record."""

from __future__ import annotations

import pytest

from pagoda.engine.data_parallel.router import (
    NoHealthyReplicaError,
    Router,
    prefix_block_hashes,
)

BLOCK = 4


def prompt(first: int, num_blocks: int, tail: int = 1) -> list[int]:
    """num_blocks full blocks of ids from `first` on, then `tail` more tokens."""
    return list(range(first, first + num_blocks * BLOCK + tail))


def test_prefix_hashes_chain_whole_blocks_only():
    a = prefix_block_hashes(list(range(11)), BLOCK)
    b = prefix_block_hashes(list(range(8)) + [99, 98], BLOCK)
    assert len(a) == 2 and a == b  # the partial third block is not hashed
    c = prefix_block_hashes([7] + list(range(1, 8)), BLOCK)
    assert c[0] != a[0] and c[1] != a[1]  # block 1 is equal, but its prefix is not


def test_least_loaded_and_idle_replicas_take_turns():
    router = Router(3, BLOCK)
    picks = [router.route(f"r{i}", [i]) for i in range(3)]
    assert sorted(picks) == [0, 1, 2]
    router.finish("r1")
    assert router.route("r3", [3]) == picks[1]  # the only one with nothing in flight
    for request_id in ("r0", "r2", "r3"):
        router.finish(request_id)
    # all idle: each new request goes to the replica chosen least recently
    turns = []
    for i in range(6):
        turns.append(router.route(f"s{i}", [i]))
        router.finish(f"s{i}")
    assert sorted(turns[:3]) == [0, 1, 2] and turns[3:] == turns[:3]


def test_load_counts_sequences_of_n_and_finish_undoes_it():
    router = Router(2, BLOCK)
    first = router.route("a", [1], num_seqs=3)
    assert router.load(first) == 3
    others = [router.route(f"b{i}", [i]) for i in range(3)]
    assert others == [1 - first] * 3  # 0 < 1 < 2 < 3: the other replica until it catches up
    router.finish("a")
    router.finish("unknown")  # a no-op
    assert router.load(first) == 0 and router.load(1 - first) == 3


def test_shared_prefix_goes_to_the_replica_that_has_it():
    router = Router(2, BLOCK)
    system = prompt(100, 4, tail=0)
    home = router.route("a", system + [1, 2])
    # the other replica is idle, home has one request: affinity wins over the small gap
    assert router.route("b", system + [3, 4, 5]) == home
    assert router.route("c", system + [6]) == home
    # a prompt without the prefix goes to the least loaded
    assert router.route("d", prompt(500, 4)) == 1 - home


def test_balance_threshold_overrides_affinity():
    router = Router(2, BLOCK, balance_abs_threshold=2, balance_rel_threshold=1.5)
    system = prompt(100, 4, tail=0)
    home = router.route("p0", system + [0])
    for i in range(1, 3):  # home: 3 in flight, other: 0 -> gap 3 > 2
        assert router.route(f"p{i}", system + [i]) == home
    # gap 3 > abs threshold and 3 > 0 * 1.5: imbalanced -> the least loaded takes it
    assert router.route("p3", system + [3]) == 1 - home
    # now both hold the prefix; among equal matches the least loaded wins
    assert router.route("p4", system + [4]) == 1 - home


def test_relative_threshold_keeps_affinity_under_heavy_even_load():
    router = Router(2, BLOCK, balance_abs_threshold=2, balance_rel_threshold=1.5)
    router.set_healthy(1, False)
    for i in range(10):  # replica 0 gets 10 unrelated requests
        assert router.route(f"x{i}", [i]) == 0
    router.set_healthy(1, True)
    system = prompt(100, 4, tail=0)
    home = router.route("p", system + [0])
    assert home == 1
    for i in range(4):  # home may go up to 15 (= 10 * 1.5) before it counts as imbalanced
        router.route(f"q{i}", system + [i + 1], num_seqs=1)
    assert router.load(home) == 5
    assert router.route("y", system + [9], num_seqs=10) == home  # 5 <= 10 + 2
    assert router.load(home) == 15
    assert router.route("z", system + [8]) == home  # 15 - 10 > 2 but 15 <= 10 * 1.5
    assert router.route("w", system + [7]) == 1 - home  # 16 > 15: imbalanced


def test_a_short_match_does_not_pull():
    router = Router(2, BLOCK, min_match_fraction=0.5)
    home = router.route("a", prompt(100, 1, tail=0) + list(range(500, 520)))
    # 1 block of 4 matches out of 24 tokens: under half, so plain least-loaded routing
    assert router.route("b", prompt(100, 1, tail=0) + list(range(700, 720))) == 1 - home


def test_unhealthy_replicas_are_skipped_and_forget_their_prefixes():
    router = Router(3, BLOCK)
    system = prompt(100, 4)
    home = router.route("a", system)
    router.set_healthy(home, False)
    assert not router.is_healthy(home) and router.num_recorded_blocks(home) == 0
    picks = {router.route(f"b{i}", system + [i]) for i in range(5)}
    assert home not in picks
    router.set_healthy(home, True)
    router.finish("a")
    # back, idle, but its cache is gone: the prefix now lives elsewhere
    assert router.route("c", system + [77]) != home
    for replica in range(3):
        router.set_healthy(replica, False)
    with pytest.raises(NoHealthyReplicaError):
        router.route("d", [1])


def test_prefix_record_is_bounded_and_forgets_tails_first():
    router = Router(1, BLOCK, capacity_blocks=5)
    old = prompt(100, 4, tail=0)
    router.route("a", old)
    router.route("b", prompt(500, 3, tail=0))  # 7 blocks recorded > 5: two evicted
    assert router.num_recorded_blocks(0) == 5
    record = router._replicas[0].prefix_hashes
    old_hashes = prefix_block_hashes(old, BLOCK)
    # the old chain lost its tail (blocks 2, 3), and keeps its head
    assert [h in record for h in old_hashes] == [True, True, False, False]
    assert Router._match_blocks(router._replicas[0], old_hashes) == 2
