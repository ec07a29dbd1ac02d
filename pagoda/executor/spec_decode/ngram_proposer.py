"""N-gram prompt lookup (no extra model): find the request's last n tokens earlier in its
prompt or output and propose the k tokens that followed them there.

    tokens   ... a b c d e f ... x y a b c
                 ^^^^^                 ^^^^^  last n = 3 tokens, matched earlier
                       d e f                  proposed (k = 3)

n runs from prompt_lookup_max down to prompt_lookup_min; the longest n with a match wins,
and among its matches the most recent one (text being copied is usually the latest).
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int,
                 prompt_lookup_max: int) -> None:
        self.num_speculative_tokens = num_speculative_tokens
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max

    def propose(self, token_ids: np.ndarray) -> list[int]:
        """token_ids (num_tokens,) int64, a request's prompt then output -> up to k tokens
        (fewer when the match sits near the end, none without a match)."""
        num_tokens = len(token_ids)
        for n in range(min(self.prompt_lookup_max, num_tokens - 1), self.prompt_lookup_min - 1, -1):
            # windows start at 0 .. num_tokens - 1 - n: every n-gram but the suffix itself
            windows = sliding_window_view(token_ids[: num_tokens - 1], n)
            matches = np.flatnonzero((windows == token_ids[num_tokens - n:]).all(axis=1))
            if len(matches):
                start = int(matches[-1]) + n
                return token_ids[start : start + self.num_speculative_tokens].tolist()
        return []
