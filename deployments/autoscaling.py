"""Autoscaling of the model replicas by the rows they hold (Serve's custom autoscaling policy).

Serve's default policy counts ongoing requests, which for the model replica are cohort calls
(batch windows of 1-8 rows, split per replica by the routing policy): not what fills a lane.
Each replica reports its rows instead (`MTPReplica.record_autoscaling_stats`): the rows decoding
in its running lanes, the rows prefilling or waiting for a slot, and its lane slots. This policy
asks for as many replicas as it takes to hold every row at `target_rows_per_replica` rows each
(the lane width a replica runs well at: rows beyond its widest lane wait; far fewer leave its
lanes narrow), averaged over Serve's `look_back_period_s`. Serve then applies the deployment's
`min_replicas` / `max_replicas`, `upscale_delay_s` / `downscale_delay_s` and scaling factors.

A replica scaled down leaves the routers at once (no new rows), finishes its running rows
within the deployment's `graceful_shutdown_timeout_s`, and is then stopped: rows still running
move to another replica and continue (`deployments.ingress.dispatch`).
"""

from __future__ import annotations

import math
from typing import Any, Dict, Tuple

DEFAULT_TARGET_ROWS_PER_REPLICA = 8.0
POLICY_PATH = "deployments.autoscaling:RowsAutoscaling"


def desired_replicas(rows_by_replica: Dict[Any, float], current: int, target_rows: float) -> float:
    """Replicas for these rows (a replica's mean rows over the look-back window each): their sum
    over `target_rows`, at least one while any row is held; `current` when no replica reported."""
    if not rows_by_replica:
        return float(current)
    total = sum(max(0.0, float(v)) for v in rows_by_replica.values())
    if total <= 0:
        return 0.0
    return max(1.0, math.ceil(total / target_rows - 1e-9))


class RowsAutoscaling:
    """Serve's custom policy (`policy_function: deployments.autoscaling:RowsAutoscaling`,
    `policy_kwargs: {target_rows_per_replica: 8}`); see the module docstring."""

    def __init__(self, target_rows_per_replica: float = DEFAULT_TARGET_ROWS_PER_REPLICA):
        if target_rows_per_replica <= 0:
            raise ValueError(f"target_rows_per_replica={target_rows_per_replica} must be > 0")
        self.target_rows = float(target_rows_per_replica)

    def __call__(self, ctx) -> Tuple[float, Dict[str, Any]]:
        rows = (ctx.aggregated_metrics or {}).get("rows") or {}
        live = {r: v for r, v in rows.items() if r in set(ctx.running_replicas)} if ctx.running_replicas else rows
        desired = desired_replicas(live, ctx.current_num_replicas, self.target_rows)
        return desired, {"rows": sum(live.values()) if live else None, "desired": desired}
