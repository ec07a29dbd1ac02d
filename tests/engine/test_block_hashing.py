"""Block hashes: xxh3-128 chained through a request's full blocks, stable across processes,
registered as blocks fill (no model, no torch)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pagoda.engine.core.block_manager
from pagoda.engine.core.block_manager import ROOT_HASH, BlockManager, hash_block_tokens
from tests.engine.block_manager_helpers import (
    BS,
    PROMPT_A,
    admit,
    finish_step,
    make_request,
    reference_hash,
)


def test_hash_block_tokens_is_xxh3_128_of_parent_and_int64_tokens():
    h0 = hash_block_tokens(ROOT_HASH, [1, 2, 3, 4])
    h1 = hash_block_tokens(h0, [5, 6, 7, 8])
    assert h0 == reference_hash(0, [1, 2, 3, 4])
    assert h1 == reference_hash(h0, [5, 6, 7, 8])
    # Pinned values: these change only if the hash function or its byte layout changes.
    assert h0 == 78400612675248042949629215794929603409
    assert h1 == 120740794330660498665250917613430832059
    assert hash_block_tokens(ROOT_HASH, (1, 2, 3, 4)) == h0  # tuples hash like lists


def test_hash_block_tokens_is_stable_across_processes():
    # Fresh interpreters with different str-hash seeds must agree with this one (and with
    # the pinned values above). The `pagoda` package is stubbed so that its heavy __init__
    # (torch, the model stack) is skipped; that also checks block_manager needs no torch.
    code = (
        "import sys, types\n"
        "pkg = types.ModuleType('pagoda'); pkg.__path__ = [sys.argv[1]]\n"
        "sys.modules['pagoda'] = pkg\n"
        "from pagoda.engine.core.block_manager import hash_block_tokens as h\n"
        "assert 'torch' not in sys.modules\n"
        "print(h(h(0, [1, 2, 3, 4]), [5, 6, 7, 8]))\n"
    )
    package_dir = str(Path(pagoda.engine.core.block_manager.__file__).parents[2])
    results = {
        subprocess.run(
            [sys.executable, "-c", code, package_dir],
            capture_output=True, text=True, check=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        ).stdout.strip()
        for seed in ("1", "2")
    }
    expected = hash_block_tokens(hash_block_tokens(0, [1, 2, 3, 4]), [5, 6, 7, 8])
    assert results == {str(expected)}


def test_hashes_chain_through_earlier_blocks():
    bm = BlockManager(num_blocks=16, block_size=BS)
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    same = make_request("same", [1, 2, 3, 4, 5, 6, 7, 8, 100])
    other_head = make_request("other", [99, 2, 3, 4, 5, 6, 7, 8, 9])
    for r in (a, same, other_head):
        bm.get_computed_blocks(r)
    assert len(a.block_hashes) == 2  # only full blocks
    assert a.block_hashes == same.block_hashes
    assert a.block_hashes[0] == hash_block_tokens(ROOT_HASH, [1, 2, 3, 4])
    assert a.block_hashes[1] == hash_block_tokens(a.block_hashes[0], [5, 6, 7, 8])
    # Same tokens in block 1, different block 0: both hashes differ.
    assert other_head.block_hashes[0] != a.block_hashes[0]
    assert other_head.block_hashes[1] != a.block_hashes[1]


def test_only_full_blocks_are_hashed_and_cached():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_request("a", PROMPT_A)
    admit(bm, a)
    assert len(a.block_hashes) == 2
    assert [b.block_hash for b in bm.blocks[:2]] == a.block_hashes
    assert bm.blocks[2].block_hash is None  # partial tail
    assert set(bm.cached_blocks) == set(a.block_hashes)
    assert all(bm.cached_blocks[h] is bm.blocks[i] for i, h in enumerate(a.block_hashes))


def test_partial_chunk_registers_only_blocks_full_after_the_chunk():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_request("a", PROMPT_A)
    assert bm.allocate_slots(a, 6) == [0, 1]  # chunk of 6: block 0 full, block 1 half
    assert bm.blocks[0].block_hash == a.block_hashes[0]
    assert bm.blocks[1].block_hash is None
    assert set(bm.cached_blocks) == {a.block_hashes[0]}
    finish_step(a, 6)
    assert bm.allocate_slots(a, 4) == [2]
    assert bm.blocks[1].block_hash == a.block_hashes[1]
    assert set(bm.cached_blocks) == set(a.block_hashes)


def test_generated_tokens_fill_and_register_blocks():
    bm = BlockManager(num_blocks=8, block_size=BS)
    r = make_request("r", [1, 2, 3])
    admit(bm, r)
    assert bm.cached_blocks == {}
    finish_step(r, 3, sampled=40)
    bm.allocate_slots(r, 1)  # computes token 40: block 0 = [1, 2, 3, 40] is full
    assert bm.blocks[0].block_hash == hash_block_tokens(ROOT_HASH, [1, 2, 3, 40])
    assert bm.cached_blocks == {bm.blocks[0].block_hash: bm.blocks[0]}
