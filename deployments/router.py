"""Routing to the MTP replicas: which replica each row reaches. Both parts run in the caller's
process (the ingress).

`AffinityPolicy` decides, row by row, before a batch window's cohort call: the dispatcher groups
the window's rows by the replica chosen for each and sends one cohort call per replica, so that
batching and affinity do not fight (rows of any window join their replica's running lane anyway).

- A row of a session (the `x-session-id` header, else the request's `user`: OpenAI's field, or
  Anthropic's `metadata.user_id`; per API key) goes where its session's last row went; a session
  this ingress has not seen goes where its prompt's longest prefix is cached (another ingress
  replica's turns of it included, from the replicas' cache events), else as a row without one
  (fallback, below): its first turn lands on the least loaded replica. (A rendezvous hash of
  session and replica placed 16 new sessions 7 and 9 on two replicas in `bench sessions`, whose
  TTFT then followed the busier one.)
- A row without a session goes to the replica whose prefix cache holds the longest prefix of its
  prompt (from the replicas' own cache events, `deployments.prefix_index`), when one holds more
  than the others (a system prompt every replica holds decides nothing).
- Otherwise (fallback) the row goes to the replica with the fewest of this ingress's rows in
  flight, the fewest placed since it started breaking ties: unrelated rows spread evenly. (Serve's
  power of two choices, which `routing: power_of_two` leaves every row to, ranks replicas by
  queue lengths it caches: 8 unrelated requests in a row all went to one replica of two.)
- Load bound (consistent hashing with bounded loads): a replica takes an affinity row only while
  the rows this ingress has in flight on it stay within `load_factor` times the mean over the
  replicas (rounded up); past it the row spills to the session's next replica or the next
  longest prefix, else to the least loaded replica. With several ingress replicas each bounds
  its own rows.

`ReplicaPinningRouter` is Serve's request router for the replica deployment. A call that passes
the keyword `_mtplx_replica=<replica unique id>` (`PIN_KWARG`) reaches that replica (the cohort
calls the policy placed, cancels and snapshot calls; when it is no longer one of the
deployment's replicas, any); a call that passes `_mtplx_avoid=[ids]` (`AVOID_KWARG`) never
reaches those (replicas that failed its rows: it waits for Serve's others); every other call goes
to the less loaded of two random replicas, the usual power-of-two-choices rule. It records the
live replica ids of each deployment in `KNOWN_REPLICAS`, which the policy and the snapshot's fan
out read. Serve pickles this module *by value* into the caller, so the router reaches the real
module's registry by importing it at run time (and the module holds no locks or other
unpicklable state at import).
"""

from __future__ import annotations

import importlib
import math
import random
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from .prefix_index import PrefixIndex

PIN_KWARG = "_mtplx_replica"
AVOID_KWARG = "_mtplx_avoid"
SESSION_HEADER = "x-session-id"
ROUTING_POLICIES = ("affinity", "power_of_two")
DEFAULT_LOAD_FACTOR = 1.25
MAX_SESSIONS = 65536          # sessions the policy remembers (least recently used leave first)

KNOWN_REPLICAS: Dict[str, List[str]] = {}   # deployment name -> replica unique ids


def known_replicas(deployment_name: str) -> List[str]:
    return list(KNOWN_REPLICAS.get(deployment_name, ()))


def session_key(header: Optional[str], user: Optional[str], caller: Optional[str]) -> Optional[str]:
    """A row's session for affinity: the x-session-id header, else the request's `user`, within
    its caller's key (None: no session)."""
    session = header or user
    return None if not session else f"{caller or ''}/{session}"


@dataclass(frozen=True)
class Route:
    """A row's destination: a replica id, or None for Serve's power-of-two choice; why
    ("session", "prefix", "spill": its preferred replicas were at the load bound, "fallback": no
    session or cached prefix decided, "power_of_two": the policy leaves every row to Serve); and
    how many of its prompt's tokens the chosen replica's cache holds, as far as the policy knows."""
    replica: Optional[str]
    reason: str
    held: int = 0


class AffinityPolicy:
    """See the module docstring. `load`: rows this ingress has in flight on each replica
    (`placed` when a replica starts a cohort, `left` as each row ends)."""

    def __init__(self, deployment_name: str, policy: str = "affinity",
                 load_factor: float = DEFAULT_LOAD_FACTOR, max_sessions: int = MAX_SESSIONS):
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"routing={policy!r}: expected one of {ROUTING_POLICIES}")
        self.deployment_name = deployment_name
        self.policy = policy
        self.load_factor = float(load_factor)
        self.max_sessions = int(max_sessions)
        self.index = PrefixIndex()
        self.sessions: "OrderedDict[str, str]" = OrderedDict()   # session -> replica its last row went to
        self.load: Counter = Counter()
        self.decisions: Counter = Counter()
        self.rows_by_replica: Counter = Counter()      # rows placed on each replica, since start
        self._known: tuple = ()

    def replicas(self) -> List[str]:
        """The deployment's live replicas; the index forgets the ones that left."""
        live = known_replicas(self.deployment_name)
        if tuple(live) != self._known:
            for gone in set(self._known) - set(live):
                self.index.forget(gone)
                self.load.pop(gone, None)
            self._known = tuple(live)
        return live

    def bound(self, live: List[str], pending: Counter) -> int:
        """The most rows a replica may hold before affinity spills: `load_factor` x the mean with
        one more row, rounded up."""
        total = sum(self.load[r] + pending[r] for r in live)
        return max(1, math.ceil(self.load_factor * (total + 1) / len(live)))

    def route(self, session: Optional[str], prompt: tuple, salt: Optional[str], pending: Counter) -> Route:
        """Where a row goes (`pending`: rows of its window already given a replica)."""
        live = self.replicas()
        if self.policy != "affinity":
            return Route(None, "power_of_two")
        if not live:             # none known yet: Serve's choice
            return Route(None, "fallback")
        held = self.index.held(prompt, salt, live)
        floor = min(held.values())
        by_prefix = sorted((r for r in live if held[r] > floor), key=lambda r: (-held[r], self.load[r] + pending[r]))
        if session is not None and self.sessions.get(session) in live:
            ranked, reason = [self.sessions[session], *by_prefix], "session"
        elif by_prefix:
            ranked, reason = by_prefix, "prefix"
        else:
            ranked, reason = [], "fallback"
        cap = self.bound(live, pending)
        for k, r in enumerate(dict.fromkeys(ranked)):
            if self.load[r] + pending[r] < cap:
                return Route(r, reason if k == 0 else "spill", held[r])
        least = min(live, key=lambda r: (self.load[r] + pending[r], self.rows_by_replica[r] + pending[r], r))
        return Route(least, reason if not ranked else "spill", held[least])

    def decided(self, route: Route) -> None:
        self.decisions[route.reason] += 1

    def placed(self, replica: str, rows: int, sessions: Iterable[Optional[str]] = ()) -> None:
        """`rows` rows started on `replica` (those of `sessions` go there next time)."""
        self.load[replica] += rows
        self.rows_by_replica[replica] += rows
        for session in sessions:
            if session is not None:
                self.sessions[session] = replica
                self.sessions.move_to_end(session)
                if len(self.sessions) > self.max_sessions:
                    self.sessions.popitem(last=False)

    def left(self, replica: Optional[str], rows: int = 1) -> None:
        if replica is not None and self.load.get(replica, 0) > 0:
            self.load[replica] = max(0, self.load[replica] - rows)

    def snapshot(self) -> dict:
        live = self.replicas()
        return {"policy": self.policy, "load_factor": self.load_factor, "decisions": dict(self.decisions),
                "rows_in_flight": {r: self.load[r] for r in live}, "rows_placed": dict(self.rows_by_replica),
                "sessions": len(self.sessions), "index_names": {r: self.index.size(r) for r in live}}


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
        pin, avoid = None, ()
        if pending_request is not None:
            # Back off between attempts when the chosen replicas are busy; without this the
            # router's retry loop spins without yielding and starves its own queue probes.
            pending_request.routing_context.should_backoff = True
            kwargs = pending_request.kwargs or {}
            pin, avoid = kwargs.get(PIN_KWARG), kwargs.get(AVOID_KWARG) or ()
        candidates = [r for r in candidate_replicas if r.replica_id.unique_id not in avoid]
        if not candidates:
            return []          # every replica failed this call: wait for Serve's others
        if pin is not None:
            for replica in candidates:
                if replica.replica_id.unique_id == pin:
                    return [[replica]]
            # The replica is gone: any replica answers (a cancel there finds nothing to cancel).
        if len(candidates) <= 2:
            picks = list(candidates)
            random.shuffle(picks)
        else:
            picks = random.sample(candidates, 2)
        # One rank: Serve asks both for their queue length and takes the shorter queue.
        return [picks]
