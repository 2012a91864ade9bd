"""`bench soak`'s figures: outcomes and refusal times of each phase, what is left in the server's
queues and maps, and the replicas' memory."""

from __future__ import annotations

import time
from pathlib import Path
from typing import List, Optional

from benchmarks.load.summary import percentile
from benchmarks.servers import snapshot
from mtplx.scheduler.config import IDLE_HEAP_RELEASE_S

REFUSAL_BOUND_S = 0.100
STEADY_AFTER_S = 10.0     # overload refusals of requests sent after this: past the opening burst
MEMORY_BOUND = 0.10


def _ms(v: Optional[float]) -> Optional[float]:
    return None if v is None else round(v * 1000, 1)


def summarize_soak(rows: List[dict], wall: float) -> dict:
    by = {}
    for r in rows:
        by[r["outcome"]] = by.get(r["outcome"], 0) + 1
    kept = [r for r in rows if r["outcome"] != "dropped"]
    done = [r for r in rows if r["outcome"] == "done"]
    return {
        "requests": len(rows), "wall_s": round(wall, 1), "outcomes": by,
        "kept": len(kept), "dropped": by.get("dropped", 0), "lost": by.get("lost", 0),
        "status_5xx": sum(1 for r in rows if (r["status"] or 0) >= 500),
        "error_events": by.get("error_event", 0), "refused": by.get("refused", 0),
        "completion_tokens_done": sum(r["tokens"] for r in done),
        "tok_s_done": round(sum(r["tokens"] for r in done) / wall, 1) if wall else None,
        "ttft_p50_ms": _ms(percentile([r["ttft"] for r in rows], 50)),
        "ttft_p99_ms": _ms(percentile([r["ttft"] for r in rows], 99)),
        "e2e_p50_s": percentile([r["e2e"] for r in done], 50), "e2e_p99_s": percentile([r["e2e"] for r in done], 99),
        "lost_samples": [r for r in rows if r["outcome"] == "lost"][:3],
        "error_samples": [r["error"] for r in rows if r["error"]][:3],
    }


def summarize_overload(rows: List[dict], wall: float) -> dict:
    refused = [r for r in rows if r["outcome"] == "refused"]
    admitted = [r for r in rows if r["outcome"] != "refused"]
    shaped = [r for r in refused if r["status"] in (429, 503) and r["retry_after"]
              and isinstance(r["error"], dict) and {"message", "type", "param", "code"} <= set(r["error"])]
    status_s = [r["status_s"] for r in refused]
    # the first seconds: every client sends at once and each refused one comes back after its
    # Retry-After; afterwards the refusals arrive spread out, as overload that lasts looks
    steady = [r["status_s"] for r in refused if r.get("sent_s", 0.0) >= STEADY_AFTER_S]
    return {
        "requests": len(rows), "wall_s": round(wall, 1), "refused": len(refused), "admitted": len(admitted),
        "refused_statuses": sorted({r["status"] for r in refused}),
        "refused_openai_shape_with_retry_after": len(shaped),
        "refusal_p50_ms": _ms(percentile(status_s, 50)), "refusal_p99_ms": _ms(percentile(status_s, 99)),
        "refusal_max_ms": _ms(max(status_s) if status_s else None),
        "refused_within_bound": sum(1 for s in status_s if s <= REFUSAL_BOUND_S),
        "steady_after_s": STEADY_AFTER_S, "steady_refused": len(steady),
        "steady_refusal_p50_ms": _ms(percentile(steady, 50)), "steady_refusal_p99_ms": _ms(percentile(steady, 99)),
        "steady_refused_within_bound": sum(1 for s in steady if s <= REFUSAL_BOUND_S),
        "admitted_completed": sum(1 for r in admitted if r["outcome"] == "done"),
        "admitted_not_completed": [r for r in admitted if r["outcome"] != "done"][:3],
        "admitted_ttft_p50_ms": _ms(percentile([r["ttft"] for r in admitted], 50)),
        "admitted_e2e_p50_s": percentile([r["e2e"] for r in admitted], 50),
        "tok_s": round(sum(r["tokens"] for r in admitted) / wall, 1) if wall else None,
    }


def summarize_probe(rows: List[dict]) -> dict:
    refused = [r["s"] for r in rows if r["status"] in (429, 503)]
    return {"requests": len(rows), "refused": len(refused),
            "refused_with_retry_after": sum(1 for r in rows if r["status"] in (429, 503) and r["retry_after"]),
            "refusal_p50_ms": _ms(percentile(refused, 50)), "refusal_p99_ms": _ms(percentile(refused, 99)),
            "refused_within_bound": sum(1 for v in refused if v <= REFUSAL_BOUND_S)}


def server_refusals(ray_tmp: Optional[Path], direct_http: bool = False) -> Optional[dict]:
    """Refusal times as the server's HTTP front logged them (Serve's proxy, or with direct HTTP the
    ingress replica; access lines end with the time from the request reaching it to its response):
    the server's own share of the time, with no client on the path. None without access lines (the
    shipped config turns the ingress's off)."""
    times = []
    pattern = "replica_mtplx_OpenAIIngress_*.log" if direct_http else "proxy_*.log"
    logs = {f.resolve() for f in Path(ray_tmp or "/nonexistent").glob(f"ray/session_*/logs/serve/{pattern}")}
    for f in logs:     # (session_latest links to the session's own folder)
        for line in f.read_text(errors="replace").splitlines():
            parts = line.split()
            if len(parts) > 2 and parts[-2] in ("429", "503") and parts[-1].endswith("ms"):
                times.append(float(parts[-1][:-2]) / 1000)
    if not times:
        return None
    return {"refused": len(times), "refusal_p50_ms": _ms(percentile(times, 50)),
            "refusal_p99_ms": _ms(percentile(times, 99)),
            "refused_within_bound": sum(1 for v in times if v <= REFUSAL_BOUND_S)}


def _idle_state(snap: Optional[dict]) -> dict:
    """What is still held anywhere (all zero / empty when idle)."""
    if not snap:
        return {"snapshot": "unavailable"}
    ing = snap.get("ingress") or {}
    out = {"ingress_rows_in_flight": ing.get("rows_in_flight"), "ingress_rows_waiting": ing.get("rows_waiting"),
           "ingress_requests_admitting": ing.get("requests_admitting")}
    for rid, rep in (snap.get("replicas") or {}).items():
        for k in ("live_requests", "pending", "active", "waiting_rows"):
            out[f"{k}"] = out.get(k, 0) + int(rep.get(k) or 0)
        out["lanes"] = out.get("lanes", 0) + len(rep.get("lanes") or [])
    return out


def replica_memory(snap: Optional[dict]) -> dict:
    """Replica memory, summed over replicas: resident set, MLX active / cache, and the prompt-prefix
    bank (a bounded LRU cache that fills by design, up to its byte budget)."""
    out = {"rss": 0, "mlx_active": 0, "mlx_cache": 0, "prefix_bank": 0}
    for rep in ((snap or {}).get("replicas") or {}).values():
        out["rss"] += int(rep.get("rss_bytes") or 0)
        out["mlx_active"] += int((rep.get("mlx_memory") or {}).get("active_bytes") or 0)
        out["mlx_cache"] += int((rep.get("mlx_memory") or {}).get("cache_bytes") or 0)
        out["prefix_bank"] += int((rep.get("session_bank") or {}).get("bytes") or 0)
    return {k: round(v / 2 ** 20, 1) for k, v in out.items()}


def rss_trend(samples: List[tuple]) -> Optional[float]:
    """Highest resident memory in the second half of the run over the highest in the first half,
    minus 1: about 0 when memory plateaus under load, positive and growing with run length for a
    leak."""
    if len(samples) < 4:
        return None
    half = len(samples) // 2
    first, second = max(v for _, v in samples[:half]), max(v for _, v in samples[half:])
    return second / first - 1 if first else None


class MemorySampler:
    """Samples the replicas' resident memory every `period_s` while a phase runs: (seconds, MB)."""

    def __init__(self, base_url: str, period_s: float = 15.0):
        import threading

        self.base_url, self.period_s, self.samples = base_url, period_s, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        t0 = time.monotonic()
        while not self._stop.wait(self.period_s):
            self.samples.append((round(time.monotonic() - t0), replica_memory(snapshot(self.base_url))["rss"]))

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def wait_idle(base_url: str, timeout_s: float = 30.0) -> dict:
    """The snapshot once nothing is left in any queue or map, taken after the replica has been idle
    long enough to return its free heap to the OS (`IDLE_HEAP_RELEASE_S`): memory read while the
    last rows' buffers are still mapped would measure the allocator's timing, not what it holds."""
    deadline = time.monotonic() + timeout_s
    while True:
        snap = snapshot(base_url)
        state = _idle_state(snap)
        if all(not v for v in state.values()):
            time.sleep(2 * IDLE_HEAP_RELEASE_S)
            snap = snapshot(base_url)
            return {"state": _idle_state(snap), "snapshot": snap}
        if time.monotonic() > deadline:
            return {"state": state, "snapshot": snap}
        time.sleep(0.5)
