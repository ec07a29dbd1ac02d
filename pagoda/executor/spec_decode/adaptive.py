"""Per-request switch-off: speculation costs a wider forward for every proposed token, so a
request whose proposals keep being rejected (a non-repetitive text for n-gram lookup, a
draft that disagrees with the target) should stop proposing, and try again later.

Each request keeps an exponential moving average of its acceptance rate (accepted /
proposed per verification, starting at 1). When it falls below MIN_ACCEPTANCE_RATE, the
request pauses for PAUSE_STEPS decoding steps, then proposes again with the average reset
to the threshold, so one more poor verification pauses it again, for twice as long (up to
MAX_PAUSE_STEPS); a good one lifts it back.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_ACCEPTANCE_RATE = 0.3
"""Below this the verification of k proposals costs more than their accepted tokens save
(on CPU a k+1-token forward costs about as much as 1.5 one-token steps: BENCHMARKS.md)."""
SMOOTHING = 0.5
"""Weight of the latest verification in the moving average."""
PAUSE_STEPS = 8
MAX_PAUSE_STEPS = 256


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

    def should_propose(self, request_id: str) -> bool:
        """Asked once per decoding step of the request (counts down a pause)."""
        state = self._requests.get(request_id)
        if state is None or state.pause_steps == 0:
            return True
        state.pause_steps -= 1
        return False

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
