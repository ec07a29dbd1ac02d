"""Which layers share a KV-cache block pool, and how many blocks each pool gets.

Most models have one group: every layer, one pool, one block table per request. A model with
sliding-window layers (Gemma 2/3 interleave them with global ones; Mistral, Qwen2/3, Mixtral
may slide everywhere) has up to two, so that the windowed layers' memory is bounded by the
window (the engine frees their out-of-window blocks: pagoda/engine/core/kv_cache_groups.py):

    group 0  full-attention layers                  window None
    group 1  sliding-window layers (largest window)  window W

(a model whose every layer slides has only the windowed group). Each group's layers get KV
tensors sized by that group's number of blocks; a request has one block table per group.
Pure Python: the runner calls these with what it knows of the model and memory.
"""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def kv_cache_groups(
    layer_windows: list[int | None], max_model_len: int | None = None
) -> tuple[list[int | None], list[int]]:
    """Per-layer windows (None: full attention) -> (window of each group, group of each
    layer). Full attention first; windowed layers together under their largest window (a
    layer with a smaller one masks more, and its blocks are kept a little longer). A window
    of max_model_len or more never leaves a block behind: full attention, as far as the
    cache is concerned."""
    if max_model_len is not None:
        layer_windows = [None if w is not None and w >= max_model_len else w
                         for w in layer_windows]
    windows: list[int | None] = []
    if any(w is None for w in layer_windows):
        windows.append(None)
    sliding = [w for w in layer_windows if w is not None]
    if sliding:
        windows.append(max(sliding))
    group_of_layer = [0 if w is None else len(windows) - 1 for w in layer_windows]
    return windows, group_of_layer


def window_blocks_needed(
    window: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
    max_model_len: int,
) -> int:
    """Most blocks a windowed group can hold at once. A sequence computing c tokens in a step
    holds positions [p0 - W + 1, p0 + c - 1] at most: cdiv(W - 1 + c, bs) + 1 blocks
    <= cdiv(W - 1, bs) + cdiv(c, bs) + 1 <= cdiv(W - 1, bs) + c / bs + 2, and the c of a
    step sum to at most the token budget. No more than whole max_model_len sequences."""
    bounded = (max_num_seqs * (cdiv(window - 1, block_size) + 2)
               + cdiv(max_num_batched_tokens, block_size))
    return max(1, min(bounded, max_num_seqs * cdiv(max_model_len, block_size)))


def split_kv_blocks(
    num_blocks: int, windows: list[int | None], layers_per_group: list[int],
    window_blocks: int, most_useful: int,
) -> list[int]:
    """Share a budget of `num_blocks` blocks of every layer between the groups.

    The windowed group gets what it can ever use (`window_blocks`), or, if memory is short,
    as many blocks as the full group (a request never holds more windowed blocks than full
    ones); the full group gets the rest of the memory, up to `most_useful` (max_num_seqs
    sequences of max_model_len)."""
    if windows == [None]:
        return [num_blocks]
    if windows == [windows[0]]:  # the windowed group alone
        return [max(1, min(num_blocks, window_blocks))]
    num_full_layers, num_window_layers = layers_per_group
    layer_blocks = num_blocks * (num_full_layers + num_window_layers)  # (layer, block) units
    if window_blocks * (num_full_layers + num_window_layers) <= layer_blocks:
        full = (layer_blocks - window_blocks * num_window_layers) // num_full_layers
        return [max(1, min(full, most_useful)), window_blocks]
    return [max(1, num_blocks), max(1, num_blocks)]


def kv_capacity_tokens(
    windows: list[int | None], num_blocks_per_group: list[int], block_size: int,
    max_num_batched_tokens: int, max_model_len: int,
) -> int:
    """Longest sequence (up to max_model_len) the groups hold alone: a full group its
    blocks' tokens; a windowed group any length once it holds a window and a step's chunk."""
    capacity = max_model_len
    for window, num_blocks in zip(windows, num_blocks_per_group):
        one_sequence = cdiv(max_model_len, block_size)
        if window is not None:
            one_sequence = min(one_sequence,
                               cdiv(window - 1 + max_num_batched_tokens, block_size) + 1)
        if num_blocks < one_sequence:
            capacity = min(capacity, num_blocks * block_size)
    return capacity
