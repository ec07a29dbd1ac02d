"""Per request, whether to propose and how well its proposals fare: speculation costs a
wider forward for every proposed token, so a request whose proposals keep being rejected (a
non-repetitive text for n-gram lookup, a draft that disagrees with the target) should stop
proposing, and try again later; how many a proposing request verifies is decided for the
whole step from these rates (step_cost.allocate_proposals).

Each request estimates its acceptance rate r, the chance that its next proposal is
accepted given the ones before it were (so that its j-th proposal pays off with r^j): the
accepted proposals over the accepted ones plus the rejections (one per verification that
stopped short), both as moving averages. When r falls below MIN_ACCEPTANCE_RATE the
request pauses for PAUSE_STEPS decoding steps, then proposes again from r at the
threshold, so one more poor verification pauses it again, for twice as long (up to
MAX_PAUSE_STEPS); a good one lifts it back. Between verifications r drifts back towards 1
(RELAX), so a request left without proposals is tried again.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_ACCEPTANCE_RATE = 0.2
"""Below it a request pauses: even where one more token in a step is nearly free, proposals
that are four times out of five wrong are not worth looking up or drafting."""
DECAY = 0.5
"""Weight the moving averages keep of the verifications before the latest."""
RELAX = 0.02
"""Pseudo-accepted proposal added to a request's averages at each of its decoding steps."""
PAUSE_STEPS = 8
MAX_PAUSE_STEPS = 256


@dataclass
class _RequestAcceptance:
    accepted: float = 1.0
    """Moving average of accepted proposals (a prior of one accepted, none rejected)."""
    attempts: float = 1.0
    """Moving average of accepted proposals plus rejections."""
    pause_steps: int = 0
    """Steps left before the request proposes again."""
    next_pause: int = PAUSE_STEPS

    @property
    def rate(self) -> float:
        return self.accepted / self.attempts


class AdaptiveSwitch:
    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._requests: dict[str, _RequestAcceptance] = {}

    def rate(self, request_id: str) -> float | None:
        """The request's acceptance rate (1 before any verification), or None while it is
        paused; asked once per decoding step of the request (counts a pause down)."""
        state = self._requests.get(request_id)
        if state is None or not self.enabled:
            return 1.0
        if state.pause_steps > 0:
            state.pause_steps -= 1
            return None
        # Drift towards the prior of 1: a request given no proposals for a while (its rate
        # did not pay for a wider step) is tried again, or its rate would never change.
        state.accepted += RELAX
        state.attempts += RELAX
        return state.rate

    def record(self, request_id: str, num_proposed: int, num_accepted: int) -> None:
        """One verification of the request's proposals."""
        if not self.enabled or num_proposed == 0:
            return
        state = self._requests.setdefault(request_id, _RequestAcceptance())
        rejected = 1 if num_accepted < num_proposed else 0
        state.accepted = DECAY * state.accepted + num_accepted
        state.attempts = DECAY * state.attempts + num_accepted + rejected
        if state.rate < MIN_ACCEPTANCE_RATE:
            state.pause_steps = state.next_pause
            state.next_pause = min(2 * state.next_pause, MAX_PAUSE_STEPS)
            state.accepted, state.attempts = MIN_ACCEPTANCE_RATE, 1.0
        elif state.rate >= 2 * MIN_ACCEPTANCE_RATE:
            state.next_pause = PAUSE_STEPS

    def remove(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
