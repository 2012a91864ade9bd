"""What a running lane counts, and the snapshot other threads read.

The lane writes its `LaneCounters` on the thread that steps it; nothing else may read them while
it steps. At the end of each step (`RunningLane.drain_events`) it publishes a `LaneStats`: a copy
of its counters with what the lane looks like then (width, rows, last step kind), taken whole on
the owner thread and swapped in as one reference, so a reader on another thread (the service's
snapshot, metrics) sees one step's state, never a counter from one step beside another from the
next (vLLM's `SchedulerStats`, mlx-lm's `BatchGenerator.stats()`, one object per read).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Optional

from mtplx.engine.installed import DEPTHS


@dataclass
class LaneCounters:
    """A lane's counts since it started (the service sums them over its lanes)."""

    cycles: int = 0                  # steps: MTP cycles and plain AR steps
    mtp_cycles: int = 0
    ar_steps: int = 0
    overlapped_cycles: int = 0       # MTP cycles launched at the step before theirs
    ahead_cycles: int = 0            # MTP cycles launched before the last one's verify was read
    row_cycles: int = 0              # live rows summed over cycles
    peak_rows: int = 0               # most live rows in one cycle
    width_cycles: dict = field(default_factory=dict)     # width -> cycles run at it
    accepted: int = 0                # drafts kept
    rejected: int = 0
    accepted_at: list = field(default_factory=lambda: [0] * max(DEPTHS))   # kept drafts by chain position
    draft_proposals: int = 0         # rows' drafting cycles
    draft_tokens: int = 0            # the drafts they chained
    greedy_first_drafts: int = 0     # greedy rows' first drafts (the lane's greedy acceptance) ...
    greedy_first_kept: int = 0       # ... and how many were kept
    admitted: int = 0
    shared_prefills: int = 0         # rows admitted with a sibling's prefill (n > 1)
    batched_prefills: int = 0        # forwards that prefilled several rows together
    widenings: int = 0
    narrowings: int = 0
    depth_switches: int = 0          # moves between depths at one width
    graph_retraces: int = 0          # compiled cycle graphs traced again at new shapes
    graph_first_runs: int = 0        # compiled graphs run first at a span and shape: traced, checked eagerly
    cycle_s: float = 0.0             # time in cycles
    prefill_s: float = 0.0           # time in admission prefill
    lane_host_s: float = 0.0         # host work in cycles besides the proposer's
    lane_wait_s: float = 0.0         # cycles' waits for the device besides the proposer's

    def copy_fields(self) -> dict:
        return {f.name: _copied(getattr(self, f.name)) for f in fields(LaneCounters)}


@dataclass
class LaneStats(LaneCounters):
    """A lane's counters and its shape, as of the end of one step: a copy nothing writes."""

    host_s: float = 0.0              # host work in cycles: sampling, accept tests, host drafts, books
    device_s: float = 0.0            # time in MLX's evaluation: handing graphs over and waiting for them
    device_drafts: int = 0           # sampled drafts drawn on the device
    context_drafts: int = 0          # drafts taken from the rows' own context (mtplx.engine.ngram)
    width: int = 0
    route_id: Optional[str] = None
    depth: Optional[int] = None
    live_rows: int = 0
    greedy_rows: int = 0
    prefilling_rows: int = 0
    waiting_rows: int = 0
    last_step: Optional[str] = None  # "mtp" or "ar"


def _copied(value):
    return dict(value) if isinstance(value, dict) else list(value) if isinstance(value, list) else value
