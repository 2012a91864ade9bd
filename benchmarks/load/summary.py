"""`bench load`'s figures: one arm from its requests, the runs' medians and ratios, identical
greedy texts between the servers, the mixed arm, the generation modes and logprobs arms."""

from __future__ import annotations

import statistics
from typing import Dict, Iterable, List, Optional

from benchmarks.load.workload import MIXED, SHARED_TEMPERATURE, arm_label, mixed_settings


def percentile(values: Iterable[Optional[float]], q: float) -> Optional[float]:
    """q-th percentile (0..100) with linear interpolation (numpy's default); None when empty."""
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return None
    k = (len(xs) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def median_or_none(values: Iterable[Optional[float]]) -> Optional[float]:
    xs = [v for v in values if v is not None]
    return statistics.median(xs) if xs else None


def summarize_arm(rows: List[dict], wall_s: float) -> dict:
    """The figures of one arm from its per-request rows (see `clients._one_request`)."""
    ok = [r for r in rows if r["error"] is None]
    tokens = sum(r["tokens"] for r in ok)
    gaps = [g for r in ok for g in r["gaps"]]
    errors = [r["error"] for r in rows if r["error"] is not None]
    return {
        "requests": len(rows), "errors": len(errors), "error_samples": sorted(set(errors))[:3],
        "completion_tokens": tokens, "wall_s": wall_s,
        "tok_s": tokens / wall_s if wall_s > 0 else None,
        "req_s": len(ok) / wall_s if wall_s > 0 else None,
        "ttft_p50_s": percentile((r["ttft"] for r in ok), 50), "ttft_p95_s": percentile((r["ttft"] for r in ok), 95),
        "itl_p50_s": percentile((r["itl"] for r in ok), 50), "itl_p95_s": percentile((r["itl"] for r in ok), 95),
        "chunk_gap_p50_s": percentile(gaps, 50), "chunk_gap_p95_s": percentile(gaps, 95),
        "e2e_p50_s": percentile((r["e2e"] for r in ok), 50), "e2e_p95_s": percentile((r["e2e"] for r in ok), 95),
        "prompt_tokens_p50": percentile((r.get("prompt_tokens") for r in ok), 50),
    }


def _sum_counters(snapshot: Optional[dict], names: Dict[str, str]) -> Optional[dict]:
    """Each counter `names` maps to, summed over the snapshot's replicas; None when any replica
    lacks one (older servers) or the snapshot failed."""
    reps = [r for r in ((snapshot or {}).get("replicas") or {}).values() if isinstance(r, dict)]
    if not reps or any(k not in r for r in reps for k in names.values()):
        return None
    return {name: sum(r[k] for r in reps) for name, k in names.items()}


OCCUPANCY = {"rows": "lane_row_cycles", "cycles": "lane_cycles"}


def lane_occupancy(before: Optional[dict], after: Optional[dict]) -> Optional[float]:
    """Mean live rows per decode cycle between two snapshots; None without counters or cycles."""
    a, b = _sum_counters(before, OCCUPANCY), _sum_counters(after, OCCUPANCY)
    if a is None or b is None or b["cycles"] <= a["cycles"]:
        return None
    return (b["rows"] - a["rows"]) / (b["cycles"] - a["cycles"])


BREAKDOWN = {"device": "cycle_device_seconds_total", "host": "cycle_host_seconds_total",
             "cycles": "cycle_seconds_total", "prefill": "prefill_seconds_total",
             "delivery": "delivery_seconds_total", "cycle_count": "lane_cycles"}


def cycle_breakdown(before: Optional[dict], after: Optional[dict], wall_s: float) -> Optional[dict]:
    """Where the replicas' time went between two snapshots (summed over replicas): per cycle, ms
    in MLX's evaluation (the device's compute, as the host sees it: handing graphs over and
    waiting), in host decisions (sampling, accept tests), and the rest of the cycle (building its
    graphs in Python, commits, rows' books); and as shares of the arm's wall time, the cycles,
    admissions' prefill and handing each step's events to the jobs (streaming). None without the
    counters (older servers)."""
    a, b = _sum_counters(before, BREAKDOWN), _sum_counters(after, BREAKDOWN)
    if a is None or b is None or b["cycle_count"] <= a["cycle_count"] or wall_s <= 0:
        return None
    d = {k: b[k] - a[k] for k in BREAKDOWN}
    per_cycle = {k: round(1000 * d[k] / d["cycle_count"], 3) for k in ("device", "host", "cycles")}
    per_cycle["graphs_and_books"] = round(per_cycle["cycles"] - per_cycle["device"] - per_cycle["host"], 3)
    return {"cycle_ms": per_cycle,
            "wall_share": {k: round(d[k] / wall_s, 4) for k in ("cycles", "prefill", "delivery")}}


DRAFTING = {"proposals": "draft_proposals", "drafts": "draft_tokens", "accepted": "accepted_draft_tokens"}


def drafting(before: Optional[dict], after: Optional[dict]) -> Optional[dict]:
    """How deep the rows drafted between two snapshots (drafts per drafting row-cycle: the lanes'
    depth mix, as the arm met it) and the share of those drafts accepted; None without drafts or
    the counters (older servers)."""
    a, b = _sum_counters(before, DRAFTING), _sum_counters(after, DRAFTING)
    if a is None or b is None or b["proposals"] <= a["proposals"]:
        return None
    d = {k: b[k] - a[k] for k in DRAFTING}
    return {"drafts_per_row_cycle": round(d["drafts"] / d["proposals"], 3),
            "accepted_share": round(d["accepted"] / d["drafts"], 3) if d["drafts"] else None}


def comparable_text(text: str) -> str:
    """The text without one leading space: mlx-lm's streaming detokenizer drops the first
    token's leading space (`trim_space`), ours keeps it; every other character counts."""
    return text[1:] if text.startswith(" ") else text


def greedy_rows(key: str, rows: List[dict]) -> Optional[List[dict]]:
    """The rows of arm `key` whose request was greedy: all of a greedy arm's, those at temperature
    0 of the mixed arm's (`mixed_settings`); None for a sampled arm."""
    label = key.split("/")[0]
    if label == arm_label(0.0):
        return rows
    if label == MIXED:
        return [r for r in rows if mixed_settings(r["index"])[0] == 0]
    return None


def identical_by_arm(ours: Dict[str, List[dict]], peer: Dict[str, List[dict]]) -> Dict[str, dict]:
    """`identical_texts` of each arm with greedy requests, over those requests only."""
    out = {}
    for key, rows in ours.items():
        mine, theirs = greedy_rows(key, rows), greedy_rows(key, peer.get(key, []))
        if mine is not None:
            out[key] = identical_texts(mine, theirs)
    return out


def identical_texts(ours: List[dict], peer: List[dict]) -> dict:
    """How many requests (same index, both succeeded) produced the same completion text (see
    `comparable_text`), and the first indices that differ."""
    peer_by_index = {r["index"]: r for r in peer if r["error"] is None}
    pairs = [(r, peer_by_index[r["index"]]) for r in ours if r["error"] is None and r["index"] in peer_by_index]
    differ = [a["index"] for a, b in pairs if comparable_text(a["text"]) != comparable_text(b["text"])]
    same = len(pairs) - len(differ)
    return {"identical": same, "compared": len(pairs), "fraction": same / len(pairs) if pairs else None,
            "differing_indices": differ[:10]}


def _median_ratio(per_run: List[dict], num: tuple, den: tuple) -> Optional[float]:
    """Median over runs of the per-run tok/s ratio r[side][key] / r[side'][key'] for num = (side,
    key) and den = (side', key'); runs missing either figure (or with a zero one) are left out."""
    ratios = []
    for r in per_run:
        a, b = (r.get(side, {}).get(key, {}).get("tok_s") for side, key in (num, den))
        if a and b:
            ratios.append(a / b)
    return statistics.median(ratios) if ratios else None


def summarize_runs(per_run: List[dict]) -> dict:
    """Per arm: the median over runs of each figure of each server (requests and errors are
    summed, so one bad run shows), the median of the per-run tok/s ratios ours/peer, (arms with
    greedy requests: greedy, and the mixed arm's temperature-0 ones) identical texts summed over
    runs, and for the mixed arm's closed loops the medians of the per-run ratios mixed/shared:
    its tok/s over the SHARED_TEMPERATURE arm's at the same client count, ours
    (`mixed_over_shared`) and the peer's (`peer_mixed_over_shared`), None without that arm."""
    out = {}
    for key in per_run[0]["ours"]:
        entry = {}
        for side in ("ours", "peer"):
            figures = [r[side][key] for r in per_run]
            entry[side] = {f: median_or_none(s.get(f) for s in figures)
                           for f, v in figures[0].items() if isinstance(v, (int, float)) or v is None}
            entry[side].update(requests=sum(s["requests"] for s in figures), errors=sum(s["errors"] for s in figures))
            entry[side]["error_samples"] = sorted({e for s in figures for e in s["error_samples"]})[:3]
        ratios = [r["ours"][key]["tok_s"] / r["peer"][key]["tok_s"] for r in per_run
                  if r["ours"][key]["tok_s"] and r["peer"][key]["tok_s"]]
        entry["tok_s_ratio"] = statistics.median(ratios) if ratios else None
        label, _, arm = key.partition("/")
        if label == MIXED and arm.startswith("closed-"):
            shared = f"{arm_label(SHARED_TEMPERATURE)}/{arm}"
            for side, name in (("ours", "mixed_over_shared"), ("peer", "peer_mixed_over_shared")):
                entry[name] = _median_ratio(per_run, (side, key), (side, shared))
        if all(key in r["identical"] for r in per_run):
            same = sum(r["identical"][key]["identical"] for r in per_run)
            compared = sum(r["identical"][key]["compared"] for r in per_run)
            entry["greedy_identical"] = {"identical": same, "compared": compared,
                                         "fraction": same / compared if compared else None}
        out[key] = entry
    return out


def summarize_mixed(summary: dict) -> Dict[str, dict]:
    """The mixed arm's closed loops, one entry per client count (`closed-N`), from the summary:
    each server's tok/s, ours/peer, ours' lane rows per cycle, mixed/shared (ours, and the peer's)
    and identical texts of its greedy requests. Empty when the run has no mixed arm."""
    out = {}
    for key, e in summary.items():
        label, _, arm = key.partition("/")
        if label != MIXED or not arm.startswith("closed-"):
            continue
        out[arm] = {"clients": int(arm.split("-")[1]), "ours_tok_s": e["ours"].get("tok_s"),
                    "peer_tok_s": e["peer"].get("tok_s"), "ours_over_peer": e.get("tok_s_ratio"),
                    "lane_occupancy": e["ours"].get("lane_occupancy"),
                    "steady_lane_occupancy": e["ours"].get("steady_lane_occupancy"),
                    "mixed_over_shared": e.get("mixed_over_shared"),
                    "peer_mixed_over_shared": e.get("peer_mixed_over_shared"),
                    "greedy_identical": e.get("greedy_identical")}
    return out


def summarize_logprobs(per_run: List[dict]) -> dict:
    """Per arm: median tok/s without and with logprobs, and the median of the per-run ratios."""
    runs = [r["ours_logprobs"] for r in per_run if r.get("ours_logprobs")]
    arms = {}
    for key in (runs[0]["off"] if runs else ()):
        ratios = [r["on"][key]["tok_s"] / r["off"][key]["tok_s"] for r in runs
                  if r["on"][key]["tok_s"] and r["off"][key]["tok_s"]]
        arms[key] = {"off": median_or_none(r["off"][key]["tok_s"] for r in runs),
                     "on": median_or_none(r["on"][key]["tok_s"] for r in runs),
                     "on_over_off": statistics.median(ratios) if ratios else None}
    return arms


def summarize_modes(per_run: List[dict]) -> dict:
    """Per arm: each mode's median tok/s over runs and the medians of the per-run ratios auto/ar
    and auto/mtp; per temperature, the largest drop of auto's median tok/s from one client count
    to the next (1 - lowest next/previous ratio)."""
    runs = [r["ours_modes"] for r in per_run if r.get("ours_modes")]
    if not runs:
        return {}
    modes = list(runs[0])
    arms = {}
    for key in runs[0][modes[0]]:
        entry = {m: median_or_none(r[m][key]["tok_s"] for r in runs) for m in modes}
        for other in ("ar", "mtp"):
            if "auto" in modes and other in modes:
                ratios = [r["auto"][key]["tok_s"] / r[other][key]["tok_s"] for r in runs
                          if r["auto"][key]["tok_s"] and r[other][key]["tok_s"]]
                entry[f"auto_over_{other}"] = statistics.median(ratios) if ratios else None
        arms[key] = entry
    drops = {}
    if "auto" in modes:
        by_temp: Dict[str, list] = {}
        for key, entry in arms.items():
            label, arm = key.split("/")
            by_temp.setdefault(label, []).append((int(arm.split("-")[1]), entry["auto"]))
        for label, points in by_temp.items():
            points.sort()
            steps = [b / a for (_, a), (_, b) in zip(points, points[1:]) if a and b]
            drops[label] = max(0.0, 1 - min(steps)) if steps else None
    return {"arms": arms, "auto_largest_drop": drops}
