"""The sealed-cohort driver: every row prefilled before the first cycle, no row joins later."""

from __future__ import annotations

import time
from typing import Optional

from mtplx.engine.installed import InstalledA3BMTPBatchLane, validate_cohort
from mtplx.engine.lane import RunningLane
from mtplx.engine.proposer import Proposer
from mtplx.engine.row import A3BMTPBatchResult
from mtplx.engine.settings import EngineSettings
from mtplx.engine.decisions import DecisionLog

def generate_a3b_mtp_batch(lane: InstalledA3BMTPBatchLane, requests, *, draft_draw: Optional[str] = None,
                           decision_log: Optional[DecisionLog] = None,
                           proposer: Optional[Proposer] = None) -> A3BMTPBatchResult:
    """Decode 2..width requests as one sealed cohort of this lane (every row prefilled before the
    first cycle; no row joins later). Rows are returned in request order. `draft_draw`: where
    sampled rows draw their drafts ("device" | "host"; None: `EngineSettings`' default);
    `proposer`: the drafts' source (None: the model's head; the self-check's `ScriptedProposer`);
    `decision_log`: where the lane records its decisions (the self-check reads them)."""
    requests = list(requests)
    validate_cohort(lane, requests)
    settings = EngineSettings() if draft_draw is None else EngineSettings(draft_draw=draft_draw)
    running = RunningLane(lane, decision_log=decision_log, settings=settings, proposer=proposer)
    streams = [running.add(r) for r in requests]
    t_prefill = time.perf_counter()
    running.admit_all()
    t_decode = time.perf_counter()
    max_cycles = max(r.max_tokens for r in requests) + 2
    while running.has_work:
        if running.counters.cycles >= max_cycles:
            raise RuntimeError(f"cohort exceeded its safety cap of {max_cycles} cycles")
        running.step()
    t_end = time.perf_counter()
    stats = running.stats()
    result = A3BMTPBatchResult(
        streams=streams, cycles=stats.cycles, accepted_drafts=stats.accepted,
        rejected_drafts=stats.rejected, route_id=lane.route_id, width_histogram={lane.width: stats.cycles},
        real_width=len(requests), fixed_width=lane.width, prefill_s=t_decode - t_prefill,
        decode_s=t_end - t_decode, host_s=stats.host_s)
    return result
