"""A row as the ingress holds it: the spec that travels to the replica, and the state that stays
here. The ingress's own marks never travel: `RowSpec` is all the replica sees."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from mtplx.api.rows import RowSpec


@dataclass
class PendingRow:
    """`spec`, and when its HTTP request arrived and its batch started, whether it counts as
    waiting for a batch, whether its client went away before its end (`cancelled`), and its
    session for affinity routing (`deployments.router.session_key`; None: none)."""

    spec: RowSpec
    http_received_at: float
    batch_started_at: Optional[float] = None
    waiting_here: bool = False
    cancelled: bool = False
    session: Optional[str] = None

    @property
    def request_id(self) -> str:
        return self.spec.request_id
