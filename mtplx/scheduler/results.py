"""What a finished row reports: its result dict and stats (`build_result`), and the service's
counters summed over its running lanes (`add_lane_counters`, `lane_snapshot`)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Optional

from mtplx.end import End
from mtplx.engine.lane_stats import LaneStats
from mtplx.sampling import SamplerConfig

MTP_DEPTH = 1                          # drafts a lane chains where no other depth is given or chosen
SOLO_ROUTE_ID = "mtp_b1_solo"
B1_EXACT_ROUTE_ID = "mtp_batch_b1_exact_serial"


@dataclass
class Placement:
    """Where a row decoded: the lane's width and route, and the names its stats give them."""

    real_width: int                    # most live rows in one of its cycles
    fixed_width: int                   # widest lane width it decoded in
    route_id: Optional[str]
    policy: str                        # scheduler_policy
    lane_name: str                     # scheduler_lane
    numerics: str
    started_s: float = field(default_factory=time.perf_counter)


def solo_placement(numerics: str) -> Placement:
    """A row that decoded alone: the one-row lane (b1-exact's serial route under that profile)."""
    if numerics == "b1-exact":
        return Placement(1, 1, B1_EXACT_ROUTE_ID, "serial_b1_exact", "mtp_batch_b1_exact", numerics)
    return Placement(1, 1, SOLO_ROUTE_ID, "solo_mtp", "mtp_batch", numerics)


def lane_placement(stream, numerics: str) -> Placement:
    """A lane row's placement, from its final stream (the widest lane it decoded in)."""
    w = stream.fixed_width
    if w <= 1:
        return solo_placement(numerics)
    return Placement(stream.real_width, w, stream.route_id, f"fixed_mtp_batch_width_{w}", "mtp_batch", numerics)


def _valid_time(t, lo: float, hi: float) -> bool:
    return isinstance(t, (int, float)) and math.isfinite(t) and lo <= t <= hi


def build_result(job, placement: Placement, *, end: End, cycles: int = 0, accepted: int = 0,
                 rejected: int = 0, terminal_perf_s: Optional[float] = None, cached_tokens: int = 0,
                 solo: bool, extra_stats: Optional[dict] = None, depth: Optional[int] = None) -> dict:
    """The per-request result dict and its stats, from the job's own timestamps and its row's
    `end` (carried as "end"; "finish_reason" and the stats' reasons are its compatibility strings).
    `depth`: most drafts the row chained in a cycle (default: MTP_DEPTH for a speculative row)."""
    completed_s = time.perf_counter()
    decode_started_s = job.decode_started_s
    if not _valid_time(decode_started_s, placement.started_s, completed_s):
        decode_started_s = placement.started_s
    decode_ended_s = (terminal_perf_s if _valid_time(terminal_perf_s, decode_started_s, completed_s)
                      else completed_s)
    decode_elapsed_s = max(decode_ended_s - decode_started_s, 1e-9)
    request_elapsed_s = max(completed_s - job.created_s, 1e-9)
    admitted_s = job.admitted_s if job.admitted_s is not None else placement.started_s
    n = len(job.tokens)
    resumed = len(getattr(job, "resume_tokens", ()))      # decoded elsewhere (another replica) before
    depth = (MTP_DEPTH if depth is None else int(depth)) if job.speculative else 0
    stats = dict(extra_stats or {})
    stats.update({
        "request_id": job.request_id,
        "prompt_tokens": len(job.prompt_ids),
        "completion_tokens": n,
        "cached_tokens": int(cached_tokens),
        "prompt_eval_time_s": decode_started_s - placement.started_s,
        "decode_elapsed_s": decode_elapsed_s,
        "decode_tok_s": (n - resumed) / decode_elapsed_s,
        "elapsed_s": completed_s - placement.started_s,
        "request_elapsed_s": request_elapsed_s,
        "end_to_end_tok_s": (n - resumed) / request_elapsed_s,
        "resumed_tokens": resumed,
        "queue_wait_s": admitted_s - job.created_s,
        "generation_mode": job.generation_mode,
        "mtp_depth": depth,
        "verify_calls": int(cycles),
        "accepted_drafts": int(accepted),
        "rejected_drafts": int(rejected),
        "acceptance_rate": accepted / max(accepted + rejected, 1),
        "mtp_batch_numerics": placement.numerics,
        "mtp_disabled_reason": stats.get("mtp_disabled_reason"),
        "repetition_stop_triggered": bool(stats.get("repetition_stop_triggered", False)),
        "finish_reason": end.finish_reason,
        "engine_finish_reason": end.engine_reason,
        "cancelled": False,
        "server_seed": job.seed,
    })
    # Where the row really ran overrides whatever the caller estimated at submit time; then the
    # caller's observability is merged over the stats (later envelope stages re-apply it).
    obs = job.request_observability
    obs.update({"scheduler_policy": placement.policy, "scheduler_lane": placement.lane_name,
                "mtp_batch_fixed_width": placement.fixed_width, "mtp_batch_real_width": placement.real_width,
                "mtp_batch_route_id": placement.route_id})
    stats.update(obs)
    return {
        "request_id": job.request_id,
        "tokens": list(job.tokens),
        "stats": stats,
        "prompt_tokens": len(job.prompt_ids),
        "completion_tokens": n,
        "cached_tokens": int(cached_tokens),
        "finish_reason": end.finish_reason,
        "end": end,
        "_mtp_batch_stop_token_ids": sorted(job.stop_token_ids),
        "_mtp_batch_solo": solo,
        "_completed_s": completed_s,
    }


def lane_row_stats(stream) -> dict:
    """A lane row's own stats beyond the common ones (build_result's extra_stats)."""
    out = {"admitted_at_cycle": stream.admitted_at_cycle, "lane_mean_occupancy": round(stream.mean_occupancy, 3),
           # how much of its decode drafted (generation_mode "auto" steps aside where MTP does not pay)
           "speculated_cycles": stream.spec_cycles, "drafts_skipped": stream.drafts_skipped,
           "speculated_cycle_share": round(stream.spec_cycles / max(stream.cycles, 1), 4),
           "shared_prefill": stream.shared_prefill}
    if stream.repetition_stop is not None:
        out.update(stream.repetition_stop.stats())
    return out


def new_service_stats(max_depth: int) -> dict:
    return {
        "last_real_width": None, "last_fixed_width": None, "last_route_id": None,
        "last_error": None, "last_owner_finalize": None, "poisoned": None,
        "fixed_width_histogram": {},
        "target_verify_cycles": 0, "accepted_draft_tokens": 0, "rejected_draft_tokens": 0,
        "draft_proposals": 0, "draft_tokens": 0, "accepted_by_position": [0] * max_depth,
        "lane_row_cycles": 0, "graph_retraces": 0, "graph_first_runs": 0, "mtp_cycles": 0, "ar_steps": 0, "ahead_cycles": 0, "device_drafts": 0,
        "context_drafts": 0,
        "batched_prefills": 0, "cycle_s": 0.0, "device_s": 0.0, "host_s": 0.0, "delivery_s": 0.0, "prefill_s": 0.0, "admissions": 0, "shared_prefills": 0, "lanes_started": 0,
        "widenings": 0, "narrowings": 0, "depth_switches": 0,
        # lane faults: a row blamed and failed alone, or nobody (driver_errors); either way the
        # lane was rebuilt with its other rows resumed
        "solo_runs": 0, "driver_errors": 0, "rows_failed": 0, "lanes_rebuilt": 0,
        "requests_submitted": 0, "requests_completed": 0, "requests_failed": 0,
        "requests_cancelled": 0, "completion_tokens": 0,
    }


# A running lane's counters (`LaneStats`), by the service stat they add up to (drained lanes are
# folded into the stats once; a snapshot adds the live lanes' last published stats).
LANE_COUNTERS = {"cycles": "target_verify_cycles", "row_cycles": "lane_row_cycles",
                 "accepted": "accepted_draft_tokens", "rejected": "rejected_draft_tokens",
                 "admitted": "admissions", "shared_prefills": "shared_prefills", "batched_prefills": "batched_prefills", "widenings": "widenings",
                 "narrowings": "narrowings", "depth_switches": "depth_switches",
                 "cycle_s": "cycle_s", "device_s": "device_s", "host_s": "host_s", "prefill_s": "prefill_s", "graph_retraces": "graph_retraces",
                 "graph_first_runs": "graph_first_runs",
                 "mtp_cycles": "mtp_cycles", "ar_steps": "ar_steps", "ahead_cycles": "ahead_cycles",
                 "device_drafts": "device_drafts", "context_drafts": "context_drafts",
                 "draft_proposals": "draft_proposals", "draft_tokens": "draft_tokens"}


def add_lane_counters(stats: dict, lane: LaneStats) -> None:
    for name, key in LANE_COUNTERS.items():
        stats[key] += getattr(lane, name)
    stats["accepted_by_position"] = [a + b for a, b in zip(stats["accepted_by_position"], lane.accepted_at)]
    hist = stats["fixed_width_histogram"]
    for w, c in lane.width_cycles.items():
        hist[str(w)] = hist.get(str(w), 0) + c


def add_runner_counters(stats: dict, cycles: int, accepted: int, rejected: int) -> None:
    """A solo runner's decode, counted as one-row cycles drafting one token each."""
    stats["target_verify_cycles"] += cycles
    stats["accepted_draft_tokens"] += accepted
    stats["rejected_draft_tokens"] += rejected
    stats["draft_proposals"] += accepted + rejected
    stats["draft_tokens"] += accepted + rejected
    stats["accepted_by_position"][0] += accepted
    hist = stats["fixed_width_histogram"]
    hist["1"] = hist.get("1", 0) + cycles


def lane_label(key) -> str:
    """A short, bounded name for a compatibility key (snapshots, logs): the model id of the key
    `mtp_batch_compatibility_key` makes; a caller's own key's parts, samplers by temperature."""
    parts = [_key_part(item) for item in (key if isinstance(key, tuple) else (key,))]
    label = "/".join(p for p in parts if p)
    return label[:64] or "default"


def _key_part(item) -> str:
    if isinstance(item, SamplerConfig):
        return "greedy" if item.is_greedy else f"t{item.temperature:g}"
    if isinstance(item, bool):
        return "omit_bonus" if item else ""
    return "" if item is None else str(item)


def lane_route(live_rows: int, greedy_rows: int) -> str:
    """A running lane's route now, by its live rows: "greedy" (every row greedy), "sampled",
    "mixed", or "idle"."""
    sampled = live_rows - greedy_rows
    return "mixed" if greedy_rows and sampled else "greedy" if greedy_rows else "sampled" if sampled else "idle"


def lane_snapshot(key, serial: int, running) -> dict:
    """One running lane as the snapshot shows it: its stats as of its last step's end."""
    st = running.stats()
    return {"key": lane_label(key), "width": st.width, "route_id": st.route_id,
            # rows of any sampling settings share the lane: its route is what its live rows are
            "route": lane_route(st.live_rows, st.greedy_rows),
            "depth": st.depth, "greedy_rows": st.greedy_rows, "depth_switches": st.depth_switches,
            # greedy rows' depth chosen as it runs (`lane_depth`), at their acceptance in this lane
            # (their first drafts kept, as counted here: no model call off the owner thread)
            "depth_by_cost": running.shapes.depth_by_cost,
            "greedy_first_drafts_kept": round(st.greedy_first_kept / st.greedy_first_drafts, 4)
            if st.greedy_first_drafts else None,
            "live_rows": st.live_rows, "prefilling_rows": st.prefilling_rows,
            "waiting_rows": st.waiting_rows, "cycles": st.cycles,
            "mean_occupancy": round(st.row_cycles / max(st.cycles, 1), 3),
            # the lane's own counters since it started (periodic summaries and metrics diff them)
            "serial": serial, "admitted": st.admitted, "row_cycles": st.row_cycles,
            "accepted": st.accepted, "rejected": st.rejected,
            # its step choice: the kind of its last step, counts by kind, the cost model at its
            # width and its acceptance estimate (StepPolicy)
            "step": st.last_step, "mtp_cycles": st.mtp_cycles, "ar_steps": st.ar_steps,
            "ahead_cycles": st.ahead_cycles,
            "step_policy": running.policy.snapshot(running.lane.step_costs if running.lane is not None else {})}


def lanes_by_route(lanes: list) -> dict:
    out: dict = {}
    for ln in lanes:
        agg = out.setdefault(ln["route"], {"lanes": 0, "live_rows": 0})
        agg["lanes"] += 1
        agg["live_rows"] += ln["live_rows"]
    return out


def installed_snapshot(lanes: dict) -> dict:
    """The installed lanes by width: self-checks, compiled graphs, route ids, fingerprints."""
    def selfcheck(lane) -> dict:
        receipt = getattr(lane, "selfcheck", {})
        return {k: receipt.get(k) for k in ("ok", "dtype", "parity_tolerance", "tolerated_divergences", "skipped")
                if k in receipt}

    def compiled(lane):
        return getattr(lane, "_graphs", {}).get("eager_since") or getattr(lane, "compiled", False)

    ordered = sorted(lanes.items())
    return {
        # each lane's self-check: the dtype its parity was held to, the tolerance (0: exact) and
        # any divergence tolerated at a near-tie
        "selfchecks": {str(w): selfcheck(lane) for w, lane in ordered},
        # compiled cycle graphs (True), eager (False), or why a lane whose graph disagreed with
        # its eager forward runs eagerly now
        "compiled_graphs": {str(w): compiled(lane) for w, lane in ordered},
        "route_ids": {str(w): lane.route_id for w, lane in ordered},
        "config_fingerprints": {str(w): getattr(lane, "config_fingerprint", None) for w, lane in ordered},
    }


def counters_snapshot(s: dict) -> dict:
    """The service's counters (its stats with the live lanes' added) as the snapshot shows them."""
    return {
        "last_real_width": s["last_real_width"],
        "last_fixed_width": s["last_fixed_width"],
        "last_route_id": s["last_route_id"],
        "last_error": s["last_error"],
        "fixed_width_histogram": s["fixed_width_histogram"],
        "lane_cycles": s["target_verify_cycles"],
        "lane_row_cycles": s["lane_row_cycles"],
        "mean_lane_occupancy": round(s["lane_row_cycles"] / max(s["target_verify_cycles"], 1), 3),
        "admissions": s["admissions"],
        "shared_prefills": s["shared_prefills"],     # admissions that took a sibling's prefill (n > 1)
        "batched_prefills": s["batched_prefills"],   # forwards that prefilled rows admitted together
        # compiled cycle graphs traced again at a new shape (a KV buffer grew, which the lane
        # avoids by sizing a row's KV for prompt + max_tokens when it joins)
        "graph_retraces": s["graph_retraces"],
        # compiled graphs run for the first time at a span and shape (traced, checked eagerly:
        # about one more step each, once per width, span and shape)
        "graph_first_runs": s["graph_first_runs"],
        "cycle_seconds_total": round(s["cycle_s"], 6),
        # where the cycles' time went: in MLX's evaluation (the device's compute as the host sees
        # it), host decisions (sampling, accept tests); the rest built the graphs and kept the
        # books. And the steps' events handed to the jobs (streaming)
        "cycle_device_seconds_total": round(s["device_s"], 6),
        "cycle_host_seconds_total": round(s["host_s"], 6),
        "delivery_seconds_total": round(s["delivery_s"], 6),
        "prefill_seconds_total": round(s["prefill_s"], 6),
        "lanes_started": s["lanes_started"],
        "widenings": s["widenings"],
        # lanes moving between depth 1 and greedy_depths at one width, as sampled rows come and go
        "depth_switches": s["depth_switches"],
        "narrowings": s["narrowings"],
        "target_verify_cycles": s["target_verify_cycles"],
        # of the lanes' cycles: MTP cycles and plain AR steps (generation_mode "auto", AR rows)
        "mtp_cycles": s["mtp_cycles"],
        "ar_steps": s["ar_steps"],
        # of the MTP cycles: launched before the host read the last one's verify (greedy lanes run ahead)
        "ahead_cycles": s["ahead_cycles"],
        "device_drafts": s["device_drafts"],
        # drafts taken from the rows' own prompt and output instead of the head (context_drafts)
        "context_drafts": s["context_drafts"],
        "accepted_draft_tokens": s["accepted_draft_tokens"],
        "rejected_draft_tokens": s["rejected_draft_tokens"],
        # chained drafts (greedy_depths): rows' drafting cycles, the drafts they proposed, and
        # accepted drafts by position in the chain (vLLM's spec-decode counters)
        "draft_proposals": s["draft_proposals"],
        "draft_tokens": s["draft_tokens"],
        "accepted_by_position": s["accepted_by_position"],
        **{k: s[k] for k in ("solo_runs", "driver_errors", "rows_failed", "lanes_rebuilt", "requests_submitted",
                             "requests_completed", "requests_failed", "requests_cancelled", "completion_tokens",
                             "last_owner_finalize", "poisoned")},
    }
