"""The PagodaEngine deployment's Ray Serve request router: the data-parallel router's rule
(pagoda/engine/data_parallel/router.py: longest cached prefix unless that replica is much
more loaded than the least loaded, else the least loaded) over Ray Serve's replicas.

Ray Serve runs one instance in every process holding a handle to the deployment (each
ingress replica), so each keeps its own approximate record, as SGLang's routers do.

    choose_replicas(candidates, request)  ->  [[the rule's pick], [the other candidates]]
        Ray Serve then sends to the first rank with room (its max_ongoing_requests check),
        so a full replica is skipped rather than waited for.
    on_request_routed(request, replica)   ->  Router.record (load + prefix blocks there)
    on_request_completed(replica, id)     ->  Router.finish
    a replica gone (downscale, death)     ->  its slot marked unhealthy, its record dropped
                                              (slots are never reused)

The prompt is the ForwardedRequest's routing_text (the ingress has text, not token ids): its
UTF-8 bytes stand in for tokens, in blocks of BLOCK_BYTES (about 16 tokens of English).
"""

from __future__ import annotations

import logging
from typing import Any

from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    ReplicaResult,
    RequestRouter,
    RunningReplica,
)

from pagoda.deploy.forwarding import ForwardedRequest
from pagoda.engine.data_parallel.router import Router

logger = logging.getLogger(__name__)

BLOCK_BYTES = 64


def prompt_bytes(pending_request: PendingRequest | None) -> list[int]:
    """The request's routing text as a list of byte values ([] when it has none)."""
    args = pending_request.args if pending_request is not None else ()
    for arg in args or ():
        if isinstance(arg, ForwardedRequest):
            return list(arg.routing_text.encode("utf-8"))
    return []


class PrefixAwareRequestRouter(RequestRouter):
    def initialize_state(self, block_bytes: int = BLOCK_BYTES, **router_kwargs: Any) -> None:
        # one slot per replica ever seen, never reused (a request still counted on a gone
        # replica's slot finishes there); slot 0 is never used (Router needs one at start)
        self._rule = Router(1, block_bytes, **router_kwargs)
        self._rule.set_healthy(0, False)
        self._slots: dict[ReplicaID, int] = {}

    def _slot(self, replica_id: ReplicaID) -> int:
        slot = self._slots.get(replica_id)
        if slot is None:
            slot = self._slots[replica_id] = self._rule.add_replica()
        return slot

    def _forget(self, replica_id: ReplicaID) -> None:
        slot = self._slots.pop(replica_id, None)
        if slot is not None:
            self._rule.set_healthy(slot, False)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        by_slot = {self._slot(r.replica_id): r for r in candidate_replicas}
        best = by_slot[self._rule.choose(prompt_bytes(pending_request), among=by_slot)]
        return [[best], [r for r in candidate_replicas if r is not best]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: ReplicaResult) -> None:
        request_id = pending_request.metadata.internal_request_id
        self._rule.record(request_id, self._slot(replica_id), prompt_bytes(pending_request))

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._rule.finish(internal_request_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        alive = {r.replica_id for r in replicas}
        for replica_id in [r for r in self._slots if r not in alive]:
            self._forget(replica_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget(replica_id)
