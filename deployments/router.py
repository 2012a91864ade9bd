"""Request router for the MTP replica deployment: lets a call name the replica it must reach.

A cohort runs on one replica; cancelling one of its rows, or asking every replica for its service
snapshot, must reach that particular replica. A call that passes the keyword argument
`_mtplx_replica=<replica unique id>` is routed to that replica only; every other call (cohorts,
info) is routed to the less loaded of two random replicas, the usual power-of-two-choices rule.

The router runs in the caller's process (the ingress), so it also records the live replica ids
of each deployment in `KNOWN_REPLICAS`, which the ingress reads to fan a snapshot out. Serve
pickles this module *by value* into the caller, so the router reaches the real module's registry
by importing it at run time (and the module holds no locks or other unpicklable state).
"""

from __future__ import annotations

import importlib
import random
from typing import Dict, List, Optional

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

PIN_KWARG = "_mtplx_replica"

KNOWN_REPLICAS: Dict[str, List[str]] = {}   # deployment name -> replica unique ids


def known_replicas(deployment_name: str) -> List[str]:
    return list(KNOWN_REPLICAS.get(deployment_name, ()))


class ReplicaPinningRouter(RequestRouter):
    def initialize_state(self, **kwargs) -> None:
        pass

    def update_replicas(self, replicas: List[RunningReplica]) -> None:
        super().update_replicas(replicas)
        ids = sorted(r.replica_id.unique_id for r in replicas)
        registry = importlib.import_module("deployments.router").KNOWN_REPLICAS
        registry[self._deployment_id.name] = ids   # one dict store: atomic under the GIL

    async def choose_replicas(
        self,
        candidate_replicas: List[RunningReplica],
        pending_request: Optional[PendingRequest] = None,
    ) -> List[List[RunningReplica]]:
        if not candidate_replicas:
            return []
        pin = None
        if pending_request is not None:
            # Back off between attempts when the chosen replicas are busy; without this the
            # router's retry loop spins without yielding and starves its own queue probes.
            pending_request.routing_context.should_backoff = True
            pin = (pending_request.kwargs or {}).get(PIN_KWARG)
        if pin is not None:
            for replica in candidate_replicas:
                if replica.replica_id.unique_id == pin:
                    return [[replica]]
            # The replica is gone: any replica answers (a cancel there finds nothing to cancel).
        if len(candidate_replicas) <= 2:
            picks = list(candidate_replicas)
            random.shuffle(picks)
        else:
            picks = random.sample(candidate_replicas, 2)
        # One rank: Serve asks both for their queue length and takes the shorter queue.
        return [picks]
