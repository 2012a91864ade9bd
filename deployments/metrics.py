"""The app's metrics: every series it exports (one table), and the replica's cohort monitor.

Ray's metrics agent exports a series named `x` as `ray_x` (gauges), `ray_x_total` (counters) and
`ray_x_bucket|_sum|_count` (histograms); `ray.serve.metrics` adds the `deployment`, `replica` and
`application` labels. The speculative-decoding counters carry vLLM's names
(`spec_decode_num_drafts`, ...), under our `mtplx_` namespace as Ray Serve LLM exports vLLM's as
`ray_vllm_*`. Labels stay bounded: lane routes (a running lane's `route` by its live rows:
`greedy`, `sampled`, `mixed`, `idle`; `queue` for rows not yet at a lane), row samplings (`greedy`, `sampled`), widths, finish reasons,
HTTP routes and statuses; never request ids, model ids, paths or user strings.

`CohortMonitor` turns the service's own counters (its snapshot) into metric increments and a
compact log summary, from a thread of the replica once a second: the model-owner thread does no
work for it beyond the counters it already keeps.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Callable, Dict, Iterable, Optional

from mtplx.end import CANCELLED, EOS, GRAMMAR_COMPLETE, LENGTH, REPETITION, STOP_STRING, STOP_TOKEN, End

SECONDS_BOUNDARIES = [0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0]
TPOT_BOUNDARIES = [0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0]
CYCLE_BOUNDARIES = [0.002, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1, 0.2, 0.5]
WIDTH_BOUNDARIES = [1.5, 2.5, 3.5, 4.5, 5.5, 6.5, 7.5, 8.5, 16.5, 32.5]
# a cycle chaining d drafts keeps 1 to 1 + d tokens a row (d = 1, or 2-3 in greedy lanes where
# greedy_depths says so): a row's mean acceptance length lies in [1, 4]
ACCEPT_LENGTH_BOUNDARIES = [1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7, 1.8, 1.9, 2.0, 2.25, 2.5, 2.75, 3.0, 3.5, 4.0]
FINISH_REASONS = ("stop", "length", "cancelled", "repetition", "overloaded", "capacity", "unavailable", "internal")
# a running lane's `route` in the snapshot (by its live rows; rows of any sampling share one lane
# per model): the `lane` / `route` label values of the lane series
LANE_ROUTES = ("greedy", "sampled", "mixed", "idle")
ROW_SAMPLINGS = ("greedy", "sampled")    # a live row's own sampling (`sampling` label)

# key -> (kind, series name, description, tag keys, histogram boundaries)
REPLICA_SERIES = {
    # speculative decoding, vLLM's names (a proposal: one drafting row's chain of 1-3 drafts in a cycle)
    "drafts": ("counter", "mtplx_spec_decode_num_drafts", "Draft proposals (one per drafting row per cycle)", (), None),
    "draft_tokens": ("counter", "mtplx_spec_decode_num_draft_tokens", "Draft tokens proposed (chained drafts)", (), None),
    "accepted": ("counter", "mtplx_spec_decode_num_accepted_tokens", "Draft tokens accepted", (), None),
    "accepted_per_pos": ("counter", "mtplx_spec_decode_num_accepted_tokens_per_pos",
                         "Draft tokens accepted, by draft position", ("position",), None),
    "accept_length": ("histogram", "mtplx_spec_decode_acceptance_length",
                      "A finished row's mean acceptance length (1 + accepted / proposals)", (), ACCEPT_LENGTH_BOUNDARIES),
    # lanes and the queue
    "waiting_rows": ("gauge", "mtplx_waiting_rows",
                     "Rows waiting for a lane slot (prefilling included); lane=queue: not yet at a lane", ("lane",), None),
    "live_rows": ("gauge", "mtplx_lane_live_rows", "Rows decoding in a running lane now", ("lane", "width"), None),
    # lanes per route and their rows: one lane per model is the healthy state (rows of any sampling
    # share it); more running lanes than models mean rows are split (fragmentation)
    "running_lanes": ("gauge", "mtplx_running_lanes",
                      "Running lanes by route (greedy, sampled, mixed: by their live rows; idle: none live yet)",
                      ("route",), None),
    "lane_rows": ("gauge", "mtplx_lane_rows",
                  "Live rows in running lanes, by the lane's route and the row's own sampling (greedy, sampled)",
                  ("route", "sampling"), None),
    # a running lane's step choice (adaptive speculation): lanes sharing a label and width averaged
    "lane_speculating": ("gauge", "mtplx_lane_speculating",
                         "Share of running lanes whose step is now an MTP cycle (1) rather than a plain AR step (0)",
                         ("lane", "width"), None),
    "lane_acceptance": ("gauge", "mtplx_lane_acceptance_estimate",
                        "A running lane's draft acceptance estimate (the moving average its step choice uses): "
                        "accepted drafts per drafting row and cycle, up to the drafts its cycles chain",
                        ("lane", "width"), None),
    "lane_step_cost": ("gauge", "mtplx_lane_step_cost_seconds",
                       "A running lane's cost model: the measured time of one step of each kind (mtp cycle, ar step)",
                       ("lane", "width", "kind"), None),
    "lane_cycles": ("counter", "mtplx_lane_cycles", "Lane cycles (one verify forward each), by lane width", ("width",), None),
    "steps": ("counter", "mtplx_lane_steps",
              "Lane steps by kind: mtp (draft + verify cycles) or ar (plain target steps a lane runs instead)",
              ("kind",), None),
    "row_cycles": ("counter", "mtplx_lane_row_cycles", "Live rows summed over lane cycles", (), None),
    "cycle_seconds": ("counter", "mtplx_lane_cycle_seconds", "Time spent in lane cycles", (), None),
    "cycle_time": ("histogram", "mtplx_lane_cycle_time_seconds",
                   "Mean lane cycle time over each 1 s sample", (), CYCLE_BOUNDARIES),
    "admissions": ("counter", "mtplx_admissions", "Rows admitted into running lanes", (), None),
    "prefill_seconds": ("counter", "mtplx_prefill_seconds", "Time spent prefilling admitted rows", (), None),
    "cohorts": ("counter", "mtplx_cohorts", "Cohort calls received from the ingress", ("generation_mode",), None),
    "width": ("histogram", "mtplx_cohort_real_width", "Rows per cohort call", (), WIDTH_BOUNDARIES),
    # requests (vLLM's names where it has one)
    "prompt_tokens": ("counter", "mtplx_prompt_tokens", "Prompt tokens of finished rows", (), None),
    "generation_tokens": ("counter", "mtplx_generation_tokens", "Completion tokens of finished rows", (), None),
    "prefill_tokens": ("counter", "mtplx_prefill_tokens", "Prompt tokens prefilled (not from the prefix cache)", (), None),
    "prefix_queries": ("counter", "mtplx_prefix_cache_queries", "Prompt tokens looked up in the prefix cache", (), None),
    "prefix_hits": ("counter", "mtplx_prefix_cache_hits", "Prompt tokens served from the prefix cache", (), None),
    "prefix_requests": ("counter", "mtplx_prefix_cache_requests",
                        "Finished rows by whether the prefix cache served any of their prompt (hit: true/false)",
                        ("hit",), None),
    "finished": ("counter", "mtplx_requests_finished", "Rows ended, by finish reason", ("finish_reason",), None),
    # a lane step that raised ends at most the row it is blamed on; the lane is rebuilt with the rest
    "rows_failed": ("counter", "mtplx_rows_failed",
                    "Rows a lane fault was blamed on (their own work raised or went non-finite), failed alone",
                    (), None),
    "lanes_rebuilt": ("counter", "mtplx_lanes_rebuilt",
                      "Lanes rebuilt after a fault, their other rows resumed where they were", (), None),
    "ttft": ("histogram", "mtplx_time_to_first_token_seconds",
             "Cohort call received to a row's first token (replica)", (), SECONDS_BOUNDARIES),
    "tpot": ("histogram", "mtplx_request_time_per_output_token_seconds",
             "A finished row's mean time between its tokens (its inter-token latency)", (), TPOT_BOUNDARIES),
    "e2e": ("histogram", "mtplx_e2e_request_latency_seconds",
            "A finished row's time from submit to its end (replica)", (), SECONDS_BOUNDARIES),
    "decode_tok_s": ("histogram", "mtplx_row_decode_tok_s", "A finished row's decode tokens/s", (),
                     [5, 10, 20, 50, 100, 200, 500, 1000, 2000]),
}

INGRESS_SERIES = {
    "requests": ("counter", "mtplx_http_requests", "HTTP requests by route/status", ("route", "status"), None),
    "ttft": ("histogram", "mtplx_http_ttft_seconds", "Request arrival to first text", ("route",), SECONDS_BOUNDARIES),
    "cohorts": ("counter", "mtplx_ingress_cohorts", "Cohorts sent to replicas", (), None),
    "cohort_size": ("histogram", "mtplx_ingress_cohort_size", "Rows per cohort sent", (), WIDTH_BOUNDARIES),
    "cancels": ("counter", "mtplx_row_cancels", "Rows cancelled by the ingress", ("reason",), None),
    "routes": ("counter", "mtplx_routing_decisions",
               "Rows routed, by why their replica was chosen: session, prefix (the longest cached prefix), spill "
               "(the preferred replicas were at their load bound), fallback (neither decided: the least loaded), "
               "power_of_two (routing: power_of_two, Serve's choice)",
               ("reason",), None),
    "rows_moved": ("counter", "mtplx_rows_moved",
                   "Rows whose replica went away mid-stream: resumed on another replica, or failed (none took them)",
                   ("outcome",), None),
}

# Ray Serve's own series the shipped dashboards also plot
RAY_SERVE_SERIES = ("ray_serve_actual_batch_size_sum", "ray_serve_actual_batch_size_count")


def exported_names(series: Iterable[dict] = (REPLICA_SERIES, INGRESS_SERIES)) -> set:
    """Every Prometheus series name the app exports (as Ray's agent names them)."""
    suffixes = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}
    return {f"ray_{name}{sfx}" for table in series for kind, name, *_ in table.values() for sfx in suffixes[kind]}


def make_metrics(series: dict, log: logging.Logger) -> Optional[dict]:
    """Ray Serve metric objects for a series table; None outside a Ray worker (metrics are optional)."""
    try:
        from ray.serve import metrics

        out = {}
        for key, (kind, name, description, tag_keys, boundaries) in series.items():
            if kind == "histogram":
                out[key] = metrics.Histogram(name, description=description, boundaries=boundaries,
                                             tag_keys=tag_keys)
            else:
                cls = metrics.Counter if kind == "counter" else metrics.Gauge
                out[key] = cls(name, description=description, tag_keys=tag_keys)
        return out
    except Exception as exc:
        log.warning("mtplx metrics disabled: %s", exc)
        return None


def record(metrics: Optional[dict], name: str, value: float = 1, tags: Optional[dict] = None) -> None:
    """Observe a histogram, set a gauge or increment a counter; metrics never break a request."""
    m = metrics and metrics.get(name)
    if not m:
        return
    try:
        if hasattr(m, "observe"):
            m.observe(value, tags=tags)
        elif hasattr(m, "set"):
            m.set(value, tags=tags)
        elif value:
            m.inc(value, tags=tags)
    except Exception:
        pass


def lane_route_label(ln: dict) -> str:
    """The `lane` / `route` label of a snapshot lane: its `route` (greedy, sampled, mixed, idle);
    "other" for a route this module does not know, so labels stay bounded."""
    return ln["route"] if ln["route"] in LANE_ROUTES else "other"


# A row's End as its `finish_reason` label, one of FINISH_REASONS: a stop string is a stop, not
# a cancellation
FINISH_REASON_OF_END = {EOS: "stop", STOP_TOKEN: "stop", STOP_STRING: "stop", LENGTH: "length",
                        GRAMMAR_COMPLETE: "stop", REPETITION: "stop", CANCELLED: "cancelled"}


def finish_reason_label(end: End) -> str:
    return FINISH_REASON_OF_END[end.kind]


def error_label(kind: Optional[str]) -> str:
    """The `finish_reason` label of a row that ended with an error event (its `kind`)."""
    return kind if kind in FINISH_REASONS else "other"


def _lane_gauges(snap: dict) -> dict:
    """(series, tags) -> value of every lane gauge in a snapshot: rows waiting and live, running
    lanes and their rows by route and sampling, and each lane's step policy (lanes sharing a
    label and width averaged)."""
    counts: Dict[tuple, float] = {("waiting_rows", (("lane", "queue"),)): int(snap.get("pending") or 0)}
    policy: Dict[tuple, list] = {}
    for ln in snap.get("lanes") or ():
        lane, width = lane_route_label(ln), str(ln["width"])
        rows = zip(ROW_SAMPLINGS, (ln["greedy_rows"], ln["live_rows"] - ln["greedy_rows"]))
        for key, n in [(("waiting_rows", (("lane", lane),)), ln["waiting_rows"] + ln["prefilling_rows"]),
                       (("live_rows", (("lane", lane), ("width", width))), ln["live_rows"]),
                       (("running_lanes", (("route", lane),)), 1)] + [
                (("lane_rows", (("route", lane), ("sampling", sampling))), n) for sampling, n in rows if n > 0]:
            counts[key] = counts.get(key, 0) + n
        if ln["width"]:
            for key, value in _policy_gauges(ln.get("step_policy") or {}, (("lane", lane), ("width", width))):
                policy.setdefault(key, []).append(value)
    counts.update({key: sum(vs) / len(vs) for key, vs in policy.items()})
    return counts


def _policy_gauges(pol: dict, tags: tuple) -> list:
    """A running lane's step choice as gauges: MTP cycles or AR steps, its acceptance estimate,
    and its cost model."""
    out = []
    if pol.get("kind"):
        out.append((("lane_speculating", tags), float(pol["kind"] == "mtp")))
    if pol.get("acceptance") is not None:
        out.append((("lane_acceptance", tags), pol["acceptance"]))
    for kind, key in (("mtp", "mtp_cycle_s"), ("ar", "ar_step_s")):
        if pol.get(key) is not None:
            out.append((("lane_step_cost", tags + (("kind", kind),)), pol[key]))
    return out


class CohortMonitor:
    """Samples a replica's service snapshot once a second: the counters' growth goes to the metrics,
    and every `log_every_s` (while there is work) a compact summary goes to the replica's log.

    ``snapshot``: the service's ``snapshot`` method. ``metrics``: from ``make_metrics(REPLICA_SERIES)``
    (or None). ``log_every_s``: 0 turns the summaries off.
    """

    def __init__(self, snapshot: Callable[[], dict], metrics: Optional[dict], log: logging.Logger,
                 log_every_s: float = 10.0, sample_s: float = 1.0, name: str = "mtplx replica"):
        self._snapshot, self._metrics, self._log = snapshot, metrics, log
        self.log_every_s, self.sample_s, self.name = float(log_every_s), float(sample_s), name
        self._prev = self._totals(snapshot())   # warm-up and anything before now is not counted
        # (time, tokens decoded so far) per sample, ~10 s of them: the recent decode rate
        self._decoded: deque = deque(maxlen=int(10 / max(self.sample_s, 0.1)) + 1)
        self._lanes_prev: Dict[int, dict] = {}     # lane serial -> its counters at the last sample
        self._period = self._new_period()
        self._gauges: set = set()                  # label sets set non-zero last time (zeroed when gone)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    # -- lifecycle ---------------------------------------------------------------------------------

    def start(self) -> "CohortMonitor":
        self._thread = threading.Thread(target=self._run, name="mtplx-cohort-monitor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        next_log, last_error = time.monotonic() + self.log_every_s, None
        while not self._stop.wait(self.sample_s):
            try:
                self.sample()
                if self.log_every_s > 0 and time.monotonic() >= next_log:
                    line = self.summary()
                    if line:
                        self._log.info(line)
                    next_log = time.monotonic() + self.log_every_s
            except Exception as exc:   # a monitor bug must not take the replica down; say each new one once
                said = f"{type(exc).__name__}: {exc}"
                if said != last_error:
                    self._log.warning("%s: cohort monitor: %s", self.name, said)
                last_error = said

    # -- sampling ----------------------------------------------------------------------------------

    @staticmethod
    def _totals(snap: dict) -> dict:
        keys = ("accepted_draft_tokens", "rejected_draft_tokens", "draft_proposals", "draft_tokens",
                "lane_row_cycles", "admissions",
                "cycle_seconds_total", "prefill_seconds_total", "completion_tokens", "requests_completed",
                "requests_failed", "requests_cancelled", "lane_cycles", "mtp_cycles", "ar_steps", "rows_failed",
                "lanes_rebuilt")
        out = {k: snap.get(k) or 0 for k in keys}
        out["by_width"] = dict(snap.get("fixed_width_histogram") or {})
        out["by_position"] = list(snap.get("accepted_by_position") or [])
        return out

    def _new_period(self) -> dict:
        return {"started": time.monotonic(), "lanes": {}, "totals": dict(self._prev, by_width={}, by_position=[])}

    def sample(self) -> dict:
        """Take one snapshot; record what grew since the last one. Returns the snapshot."""
        snap = self._snapshot()
        cur = self._totals(snap)
        d = {k: max(0, cur[k] - self._prev[k]) for k in cur if k not in ("by_width", "by_position")}
        m = self._metrics
        if d["draft_proposals"]:
            record(m, "drafts", d["draft_proposals"])
            record(m, "draft_tokens", d["draft_tokens"])
        if d["accepted_draft_tokens"]:
            record(m, "accepted", d["accepted_draft_tokens"])
        seen = self._prev.get("by_position") or []
        for pos, n in enumerate(cur["by_position"]):
            grew = n - (seen[pos] if pos < len(seen) else 0)
            if grew > 0:
                record(m, "accepted_per_pos", grew, {"position": str(pos)})
        for w, c in cur["by_width"].items():
            grew = c - self._prev["by_width"].get(w, 0)
            if grew > 0:
                record(m, "lane_cycles", grew, {"width": str(w)})
        record(m, "steps", d["mtp_cycles"], {"kind": "mtp"})
        record(m, "steps", d["ar_steps"], {"kind": "ar"})
        record(m, "row_cycles", d["lane_row_cycles"])
        record(m, "rows_failed", d["rows_failed"])
        record(m, "lanes_rebuilt", d["lanes_rebuilt"])
        record(m, "admissions", d["admissions"])
        record(m, "cycle_seconds", d["cycle_seconds_total"])
        record(m, "prefill_seconds", d["prefill_seconds_total"])
        if d["lane_cycles"] and d["cycle_seconds_total"]:   # (a sample may fall inside a cycle: skip it)
            record(m, "cycle_time", d["cycle_seconds_total"] / d["lane_cycles"])
        self._set_gauges(snap)
        self._add_to_period(snap, d)
        self._prev = cur
        # a token per live row and cycle, plus each accepted draft
        self._decoded.append((time.monotonic(), cur["lane_row_cycles"] + cur["accepted_draft_tokens"]))
        return snap

    def decode_tok_s(self, window_s: float = 5.0) -> Optional[float]:
        """Tokens decoded per second over the last `window_s` of samples (None before two samples).
        A page polling the snapshot gets the rate at once, however close its own polls fall."""
        samples = tuple(self._decoded)
        if len(samples) < 2:
            return None
        t1, n1 = samples[-1]
        t0, n0 = next((t, n) for t, n in samples if t1 - t <= window_s + 1e-6)
        return (n1 - n0) / (t1 - t0) if t1 > t0 else None

    def _set_gauges(self, snap: dict) -> None:
        now = _lane_gauges(snap)
        for key in self._gauges - set(now):   # a lane that ended reads 0, not its last value
            now[key] = 0
        for (name, tags), v in now.items():
            record(self._metrics, name, v, dict(tags))
        self._gauges = {k for k, v in now.items() if v}

    def _add_to_period(self, snap: dict, d: dict) -> None:
        lanes_prev, seen = self._lanes_prev, {}
        for ln in snap.get("lanes") or ():
            before = lanes_prev.get(ln["serial"], {})
            agg = self._lane_period(ln)
            admitted = max(0, ln["admitted"] - before.get("admitted", 0))
            for k in ("admitted", "cycles", "row_cycles", "accepted", "rejected"):
                agg[k] += max(0, ln[k] - before.get(k, 0))
            # rows hold slots from admission to their end: those that left are the ones missing
            agg["finished"] += max(0, before.get("live_rows", 0) + admitted - ln["live_rows"])
            agg["waiting"] = ln["waiting_rows"] + ln["prefilling_rows"]
            if ln["route"] not in agg["routes"]:
                agg["routes"].append(ln["route"])
            seen[ln["serial"]] = ln
        for serial, ln in lanes_prev.items():   # a lane that ended: its live rows finished with it
            if serial not in seen:
                self._lane_period(ln)["finished"] += ln["live_rows"]
        self._lanes_prev = seen
        self._period["pending"] = int(snap.get("pending") or 0)

    def _lane_period(self, ln: dict) -> dict:
        """This period's sums for a lane's (label, width)."""
        return self._period["lanes"].setdefault(
            (ln["key"], ln["width"]), {"admitted": 0, "finished": 0, "cycles": 0, "row_cycles": 0,
                                       "accepted": 0, "rejected": 0, "waiting": 0, "routes": []})

    def summary(self) -> Optional[str]:
        """The summary of the period since the last one, or None when nothing ran or waited."""
        p, self._period = self._period, self._new_period()
        elapsed = max(time.monotonic() - p["started"], 1e-9)
        t0, t1 = p["totals"], self._prev
        grew = {k: t1[k] - t0[k] for k in ("completion_tokens", "requests_completed", "requests_failed",
                                           "requests_cancelled", "accepted_draft_tokens",
                                           "rejected_draft_tokens", "admissions", "lane_cycles")}
        if not p["lanes"] and not any(grew.values()) and not p.get("pending"):
            return None
        drafts = grew["accepted_draft_tokens"] + grew["rejected_draft_tokens"]
        parts = [f"{self.name}: last {elapsed:.0f}s: {grew['completion_tokens'] / elapsed:.1f} tok/s, "
                 f"{grew['admissions']} rows admitted, {grew['requests_completed']} finished, "
                 f"{grew['requests_cancelled']} cancelled, {grew['requests_failed']} failed, acceptance "
                 + (f"{grew['accepted_draft_tokens'] / drafts:.2f}" if drafts else "-")
                 + f", {p.get('pending', 0)} queued"]
        for (key, width), a in sorted(p["lanes"].items()):
            if not width:   # rows wait for a lane that has not taken its first width yet
                parts.append(f"lane {key} starting: waiting {a['waiting']}")
                continue
            drafted = a["accepted"] + a["rejected"]
            # the routes it took this period (by its live rows), idle only if it had no live row
            # (none when the period saw only its end)
            routes = [r for r in a["routes"] if r != "idle"] or a["routes"]
            route = f"[{'+'.join(routes)}]" if routes else ""
            # a lane's tokens: one per live row and cycle, plus its accepted drafts
            parts.append(
                f"lane {key}{route} w{width}: admitted {a['admitted']}, finished {a['finished']}, occupancy "
                f"{a['row_cycles'] / max(a['cycles'], 1):.2f}/{width}, acceptance "
                + (f"{a['accepted'] / drafted:.2f}" if drafted else "-")
                + f", {(a['row_cycles'] + a['accepted']) / elapsed:.1f} tok/s, waiting {a['waiting']}")
        return " | ".join(parts)
