"""Per request, how many tokens to propose: speculation costs a wider forward for every
proposed token, so a request whose proposals are mostly accepted should propose many, one
whose proposals keep being rejected (a non-repetitive text for n-gram lookup, a draft that
disagrees with the target) few or none, and try again later.

Each request keeps an exponential moving average `rate` of its acceptance (accepted /
proposed per verification, starting at 1). With acceptance rate a per token, k proposals
yield 1 + a + ... + a^k tokens for a forward that costs about 1 + VERIFY_COST * k one-token
steps; the request proposes the k (up to the configured number) that maximises the ratio.
When `rate` falls below MIN_ACCEPTANCE_RATE (where even k = 1 gains nothing) the request
pauses for PAUSE_STEPS decoding steps, then proposes again with the average reset to the
threshold, so one more poor verification pauses it again, for twice as long (up to
MAX_PAUSE_STEPS); a good one lifts it back.
"""

from __future__ import annotations

from dataclasses import dataclass

VERIFY_COST = 0.3
"""Cost of one more token in a decode step, in one-token steps: measured on an AVX2 CPU with
the bundled model (a 4-token step ~13 ms, a 1-token step ~7 ms; BENCHMARKS.md section 15).
Cheaper elsewhere (wider vectors, GPUs), where proposing more would pay: this is cautious."""
MIN_ACCEPTANCE_RATE = 0.3
"""Below it one proposal costs more than it returns: (1 + a) / (1 + VERIFY_COST) < 1."""
SMOOTHING = 0.5
"""Weight of the latest verification in the moving average."""
PAUSE_STEPS = 8
MAX_PAUSE_STEPS = 256


def best_num_proposals(rate: float, max_proposals: int) -> int:
    """The k in 1..max_proposals with the most expected tokens per unit of step cost."""
    def gain(k: int) -> float:
        return sum(rate**i for i in range(k + 1)) / (1 + VERIFY_COST * k)

    return max(range(1, max_proposals + 1), key=gain)


@dataclass
class _RequestAcceptance:
    rate: float = 1.0
    pause_steps: int = 0
    """Steps left before the request proposes again."""
    next_pause: int = PAUSE_STEPS


class AdaptiveSwitch:
    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._requests: dict[str, _RequestAcceptance] = {}

    def num_to_propose(self, request_id: str, max_proposals: int) -> int:
        """Asked once per decoding step of the request (counts down a pause): 0 while
        paused, else how many tokens to propose."""
        state = self._requests.get(request_id)
        if state is None or not self.enabled:
            return max_proposals
        if state.pause_steps > 0:
            state.pause_steps -= 1
            return 0
        return best_num_proposals(state.rate, max_proposals)

    def record(self, request_id: str, num_proposed: int, num_accepted: int) -> None:
        """One verification of the request's proposals."""
        if not self.enabled or num_proposed == 0:
            return
        state = self._requests.setdefault(request_id, _RequestAcceptance())
        state.rate += SMOOTHING * (num_accepted / num_proposed - state.rate)
        if state.rate < MIN_ACCEPTANCE_RATE:
            state.pause_steps = state.next_pause
            state.next_pause = min(2 * state.next_pause, MAX_PAUSE_STEPS)
            state.rate = MIN_ACCEPTANCE_RATE
        elif state.rate >= 2 * MIN_ACCEPTANCE_RATE:
            state.next_pause = PAUSE_STEPS

    def remove(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
