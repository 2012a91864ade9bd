"""`bench soak`: the served app under churn and overload, as `serve run` starts it.

Two phases, each on its own `serve run` of `serve_configs/config.yaml` (a fresh local Ray, free port,
see `benchmarks.load.start_ours`):

  * **soak** (the shipped config): REQUESTS streaming `/v1/completions` from CLIENTS closed-loop
    clients, greedy and sampled alternating by request index, `max_tokens` 8-256 (fixed per
    index), and DROP_FRACTION of the streams dropped mid-way (the client closes the connection
    after a fixed number of chunks, about a third of its budget). A kept request is *lost* unless it
    ends with `[DONE]` (after its text, or after a clean SSE error event). Afterwards the snapshot
    must show nothing left in any queue or map, and the replica's resident memory is compared with
    where it was after warm-up.
  * **overload** (a small queue: `max_waiting_rows` and `max_waiting_rows_per_key` small, few
    batch windows): OVERLOAD_CLIENTS clients in a closed loop for OVERLOAD_S seconds; a refused
    client waits its `Retry-After` and tries again. Each refusal must be 429/503 with `Retry-After`
    in OpenAI's error shape, answered within 100 ms (time to the status line); every admitted
    request must complete.

    python -m benchmarks.soak            # or: mtplx bench soak [--quick]

Writes `build/bench/soak-<stamp>.json` and the `bench:soak` section of `BENCHMARKS.md`.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, List, Optional
from urllib.parse import urlsplit

from mtplx.scheduler.service import IDLE_HEAP_RELEASE_S

from benchmarks.load import ROOT, _snapshot, percentile, prompt_for, replace_section, start_ours

REQUESTS, CLIENTS, DROP_FRACTION = 1000, 32, 0.30
MIN_BUDGET, MAX_BUDGET = 8, 256
SAMPLED = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
OVERLOAD_CLIENTS, OVERLOAD_S = 128, 60.0
OVERLOAD_PROCESSES = 4    # the overload clients' processes (an event loop each)
# The small queue of the overload phase: 4 windows of 8 rows reach the replica, 8 rows may wait at
# the ingress and 4 per key beyond the widest lane at the replica.
OVERLOAD_ARGS = {"max_concurrent_batches": 4, "max_waiting_rows": 8, "max_waiting_rows_per_key": 4,
                 "retry_after_s": 1}
REFUSAL_BOUND_S = 0.100
STEADY_AFTER_S = 10.0     # overload refusals of requests sent after this: past the opening burst
WARMUP_PER_CLIENT = 4
REQUEST_TIMEOUT_S = 900
MEMORY_BOUND = 0.10


def soak_plan(n: int, seed: int = 0) -> List[dict]:
    """Per request index: body, and the chunk count after which a dropped stream leaves (None: kept)."""
    rng = random.Random(seed)
    plan = []
    for i in range(n):
        budget = rng.randint(MIN_BUDGET, MAX_BUDGET)
        body = {"model": "", "prompt": prompt_for(i), "max_tokens": budget, "stream": True,
                "stream_options": {"include_usage": True}}
        body.update({**SAMPLED, "seed": 5000 + i} if i % 2 else {"temperature": 0.0})
        drop = max(2, budget // 3) if rng.random() < DROP_FRACTION else None
        plan.append({"index": i, "body": body, "drop_after": drop})
    return plan


def _new_row(index: int) -> dict:
    return {"index": index, "status": None, "outcome": "lost", "status_s": None, "ttft": None, "e2e": None,
            "tokens": 0, "chunks": 0, "retry_after": None, "error": None}


def _refusal_error(raw: bytes) -> dict:
    try:
        return json.loads(raw)["error"]
    except (ValueError, KeyError, TypeError):
        return {"unparsed": raw[:160].decode(errors="replace")}


def _sse_line(row: dict, line: str, t0: float) -> None:
    """Apply one line of a completion stream to its row: text chunks, usage, an error event, and at
    `[DONE]` the outcome (done, or error_event after an error event)."""
    if not line.startswith("data: "):
        return
    if line == "data: [DONE]":
        row["outcome"] = "error_event" if row["error"] else "done"
        return
    obj = json.loads(line[6:])
    if obj.get("error"):
        row["error"] = obj["error"]
    elif obj.get("usage"):
        row["tokens"] = obj["usage"].get("completion_tokens", 0)
    if (obj.get("choices") or [{}])[0].get("text"):
        row["chunks"] += 1
        if row["ttft"] is None:
            row["ttft"] = time.perf_counter() - t0


class RawConnection:
    """One keep-alive HTTP/1.1 connection of the load generator, on asyncio's streams. The clients
    share two cores with the server here, so they must cost little: in the overload's opening burst
    (first 0.4 s) the 4 client processes took 0.08 CPU-seconds on it against 0.13-0.17 with aiohttp
    (an httpx client had taken 0.63 of the two cores over the whole overload)."""

    def __init__(self, base_url: str, headers: Optional[dict] = None):
        u = urlsplit(base_url)
        self.host, self.port = u.hostname, u.port or 80
        self.extra_headers = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self.reader = self.writer = None

    async def request(self, path: str, body: dict) -> tuple:
        """Send a POST; the response's status and headers (its body is read with `body`)."""
        if self.writer is None or self.reader.at_eof():    # new, or closed by the server while idle
            self.close()
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        data = json.dumps(body).encode()
        self.writer.write(f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                          f"{self.extra_headers}Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
                          .encode() + data)
        head = (await self.reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        headers = {}
        for line in head[1:]:
            name, _, value = line.partition(":")
            if name:
                headers[name.strip().lower()] = value.strip()
        return int(head[0].split(" ", 2)[1]), headers

    async def body(self, headers: dict):
        """The response body's pieces (chunked or sized); the connection is ready for the next request
        after the last, or closed when the server asked."""
        if headers.get("transfer-encoding", "").lower() == "chunked":
            while size := int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16):
                yield (await self.reader.readexactly(size + 2))[:-2]
            await self.reader.readuntil(b"\r\n")      # the end of the (empty) trailer
        elif length := int(headers.get("content-length", 0)):
            yield await self.reader.readexactly(length)
        if headers.get("connection", "").lower() == "close":
            self.close()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


async def raw_stream(conn: RawConnection, index: int, body: dict, drop_after: Optional[int] = None) -> dict:
    """One streaming completion. Outcome: done ([DONE] after text), error_event (a clean SSE error then
    [DONE]), dropped (we left after `drop_after` text chunks, closing the connection), refused (status
    != 200), or lost (anything else: no [DONE], a broken stream)."""
    t0 = time.perf_counter()
    row = _new_row(index)
    try:
        async with asyncio.timeout(REQUEST_TIMEOUT_S):
            await _read_stream(conn, row, body, drop_after, t0)
    except Exception as exc:   # a broken stream (before [DONE]) is a lost request, recorded
        if row["outcome"] == "lost":
            row["error"] = {"exception": f"{type(exc).__name__}: {exc}"[:200]}
        conn.close()
    row["e2e"] = time.perf_counter() - t0
    return row


async def _read_stream(conn: RawConnection, row: dict, body: dict, drop_after: Optional[int], t0: float) -> None:
    status, headers = await conn.request("/v1/completions", body)
    row["status"], row["status_s"] = status, time.perf_counter() - t0
    if status != 200:
        row.update(outcome="refused", retry_after=headers.get("retry-after"),
                   error=_refusal_error(b"".join([piece async for piece in conn.body(headers)])))
    else:
        pending = b""
        async for piece in conn.body(headers):     # read to the end, so the connection is reusable
            *lines, pending = (pending + piece).split(b"\n")
            for line in lines:
                _sse_line(row, line.decode().rstrip("\r"), t0)
                if drop_after is not None and row["chunks"] >= drop_after and row["outcome"] == "lost":
                    row["outcome"] = "dropped"
                    conn.close()       # leaves mid-stream
                    return


async def soak(base_url: str, plan: List[dict], clients: int, model: str) -> tuple:
    pending = iter(plan)
    rows: List[dict] = []

    async def worker():
        conn = RawConnection(base_url)
        for p in pending:
            rows.append(await raw_stream(conn, p["index"], {**p["body"], "model": model}, p["drop_after"]))
        conn.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    return sorted(rows, key=lambda r: r["index"]), time.perf_counter() - t0


async def overload(base_url: str, clients: int, duration_s: float, model: str, first: int = 0,
                   step: int = 1) -> tuple:
    """Closed loop for `duration_s`, a keep-alive connection per client; a refused client sleeps its
    Retry-After, then tries again. Request indices `first`, `first + step`, ... (one part of a split load)."""
    rows: List[dict] = []
    stop_at = time.perf_counter() + duration_s
    counter = iter(range(first, 10 ** 9, step))

    async def worker():
        conn = RawConnection(base_url)
        while time.perf_counter() < stop_at:
            i = next(counter)
            body = {"model": model, "prompt": prompt_for(i), "max_tokens": 32 + (i * 37) % 97, "stream": True,
                    "temperature": 0.0, "stream_options": {"include_usage": True}}
            sent = time.perf_counter() - t0
            row = await raw_stream(conn, i, body)
            row["sent_s"] = sent
            rows.append(row)
            if row["outcome"] == "refused":
                await asyncio.sleep(float(row["retry_after"] or 1))
        conn.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    return rows, time.perf_counter() - t0


async def _warm_client(base_url: str, model: str) -> None:
    """One short request through the client's whole path (connect, POST, streamed read), so that its
    first-use work (imports, parser set-up) is done before the clock starts. Cold, the 4 processes
    spent 0.77 CPU-seconds of the opening burst's first 0.46 s on it (warm: 0.14), slowing both the
    requests they sent and the server they shared two cores with."""
    conn = RawConnection(base_url)
    await raw_stream(conn, -1, {"model": model, "prompt": "warm-up", "max_tokens": 1, "stream": True})
    conn.close()


def _overload_part(base_url: str, clients: int, duration_s: float, model: str, part: int, parts: int,
                   ready, go, results) -> None:
    """One process's share of the overload clients: warm up, ready, wait for the others, run, send rows."""
    asyncio.run(_warm_client(base_url, model))
    ready.put(part)
    go.wait()
    results.put(asyncio.run(overload(base_url, clients, duration_s, model, first=part, step=parts)))


def overload_processes(base_url: str, clients: int, duration_s: float, model: str,
                       processes: int = OVERLOAD_PROCESSES) -> tuple:
    """`overload` with the clients split over `processes` processes that start together. One event
    loop of 128 clients opens their 128 connections one after another: in the opening burst the
    last one waited 20-50 ms for its own loop before its request left (4 processes: 14-29 ms)."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    ready, go, results = ctx.Queue(), ctx.Event(), ctx.Queue()
    shares = [clients // processes + (k < clients % processes) for k in range(processes)]
    procs = [ctx.Process(target=_overload_part, daemon=True,
                         args=(base_url, n, duration_s, model, k, processes, ready, go, results))
             for k, n in enumerate(shares) if n]
    for pr in procs:
        pr.start()
    try:
        for _ in procs:
            ready.get(timeout=120)
        go.set()
        parts = [results.get(timeout=duration_s + 900) for _ in procs]
    finally:
        for pr in procs:
            pr.join(timeout=10)
            if pr.is_alive():
                pr.kill()
    return [r for rows, _ in parts for r in rows], max(wall for _, wall in parts)


def probe(base_url: str, seconds: float, model: str) -> List[dict]:
    """One request at a time for `seconds` (run in its own process, beside the overload clients):
    the server's time to answer, measured by a client that is not itself loaded."""
    import httpx

    rows = []
    stop_at = time.perf_counter() + seconds
    with httpx.Client(base_url=base_url, timeout=60) as c:
        i = 0
        while time.perf_counter() < stop_at:
            body = {"model": model, "prompt": prompt_for(i), "max_tokens": 8, "temperature": 0.0}
            t0 = time.perf_counter()
            r = c.post("/v1/completions", json=body)
            rows.append({"status": r.status_code, "s": time.perf_counter() - t0,
                         "retry_after": r.headers.get("retry-after")})
            i += 1
            time.sleep(0.05)
    return rows


def _start_probe(base_url: str, seconds: float, model: str):
    import subprocess

    return subprocess.Popen([sys.executable, "-m", "benchmarks.soak", "--probe", base_url,
                             "--probe-seconds", str(seconds), "--probe-model", model],
                            cwd=ROOT, stdout=subprocess.PIPE, text=True)


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


def _memory(snap: Optional[dict]) -> dict:
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


class _MemorySampler:
    """Samples the replicas' resident memory every `period_s` while a phase runs: (seconds, MB)."""

    def __init__(self, base_url: str, period_s: float = 15.0):
        import threading

        self.base_url, self.period_s, self.samples = base_url, period_s, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        t0 = time.monotonic()
        while not self._stop.wait(self.period_s):
            self.samples.append((round(time.monotonic() - t0), _memory(_snapshot(self.base_url))["rss"]))

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def _wait_idle(base_url: str, timeout_s: float = 30.0) -> dict:
    """The snapshot once nothing is left in any queue or map, taken after the replica has been idle
    long enough to return its free heap to the OS (`IDLE_HEAP_RELEASE_S`): memory read while the
    last rows' buffers are still mapped would measure the allocator's timing, not what it holds."""
    deadline = time.monotonic() + timeout_s
    while True:
        snap = _snapshot(base_url)
        state = _idle_state(snap)
        if all(not v for v in state.values()):
            time.sleep(2 * IDLE_HEAP_RELEASE_S)
            snap = _snapshot(base_url)
            return {"state": _idle_state(snap), "snapshot": snap}
        if time.monotonic() > deadline:
            return {"state": state, "snapshot": snap}
        time.sleep(0.5)


def _steady(o: dict) -> str:
    if o.get("steady_refused") is None:
        return "-"
    return (f"{o['steady_refused']}, {o['steady_refusal_p50_ms']} / {o['steady_refusal_p99_ms']}, "
            f"{o['steady_refused_within_bound']}/{o['steady_refused']}")


def _rss_range(curve: Optional[List[list]]) -> str:
    mbs = [mb for _t, mb in curve or []]
    return f"{min(mbs):.0f}-{max(mbs):.0f}" if mbs else "-"


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


def bench_soak(model_dir: Optional[str] = None, requests: int = REQUESTS, clients: int = CLIENTS,
               overload_clients: int = OVERLOAD_CLIENTS, overload_s: float = OVERLOAD_S,
               ready_timeout_s: float = 600.0, direct_http: bool = False,
               log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True)) -> dict:
    import mtplx

    started = time.time()
    model_path = Path(model_dir).resolve() if model_dir else None
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out_dir = ROOT / "build" / "bench"
    (out_dir / "logs").mkdir(parents=True, exist_ok=True)
    record = {"bench": "soak", "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
              "model": str(model_path) if model_path else "shipped",
              "plan": {"requests": requests, "clients": clients, "drop_fraction": DROP_FRACTION,
                       "direct_http": direct_http,
                       "budgets": [MIN_BUDGET, MAX_BUDGET], "sampled": SAMPLED,
                       "overload_clients": overload_clients, "overload_s": overload_s,
                       "overload_processes": OVERLOAD_PROCESSES,
                       "overload_args": OVERLOAD_ARGS, "refusal_bound_s": REFUSAL_BOUND_S},
              "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(),
                          "runtime": mtplx.runtime_info()},
              "loadavg_start": os.getloadavg() if hasattr(os, "getloadavg") else None}
    with tempfile.TemporaryDirectory(prefix="mtplx-bench-soak-") as tmp:
        work = Path(tmp)
        log(f"soak: {requests} streaming requests from {clients} clients ({DROP_FRACTION:.0%} dropped)")
        server = start_ours(model_path, out_dir / "logs" / f"soak-{stamp}-soak.log", work, ready_timeout_s,
                            direct_http=direct_http)
        try:
            model = server.model
            # warm-up (WARMUP_PER_CLIENT requests per client, same mix), so that memory is measured
            # after first-use costs: lane buffers at every width, allocator pools, caches
            asyncio.run(soak(server.url, soak_plan(clients * WARMUP_PER_CLIENT, seed=99), clients, model))
            idle0 = _wait_idle(server.url)
            mem0 = _memory(idle0["snapshot"])
            with _MemorySampler(server.url) as curve:
                rows, wall = asyncio.run(soak(server.url, soak_plan(requests), clients, model))
            idle = _wait_idle(server.url)
            mem1 = _memory(idle["snapshot"])
            s = summarize_soak(rows, wall)
            s.update(idle_after=idle["state"], memory_before_mb=mem0, memory_after_mb=mem1,
                     rss_curve_mb=curve.samples, rss_trend=rss_trend(curve.samples),
                     ingress=(idle["snapshot"] or {}).get("ingress"))
            if mem0["rss"]:
                s["rss_growth"] = mem1["rss"] / mem0["rss"] - 1
                # what is not the bounded prefix cache filling up
                s["rss_growth_beside_prefix_bank"] = (mem1["rss"] - mem1["prefix_bank"]) / \
                    (mem0["rss"] - mem0["prefix_bank"]) - 1
            record["soak"] = s
            log(f"soak: {s['outcomes']} in {s['wall_s']} s, lost {s['lost']}, 5xx {s['status_5xx']}, "
                f"idle {s['idle_after']}, memory {mem0} -> {mem1} MB")
        finally:
            record["soak_stop"] = server.stop()
        log(f"overload: {overload_clients} clients for {overload_s:.0f} s against a small queue {OVERLOAD_ARGS}")
        server = start_ours(model_path, out_dir / "logs" / f"soak-{stamp}-overload.log", work, ready_timeout_s,
                            args_overrides=OVERLOAD_ARGS, direct_http=direct_http)
        try:
            # a probe in its own process, after the clients have filled the queues
            prober = _start_probe(server.url, max(5.0, overload_s - 10.0), server.model)
            rows, wall = overload_processes(server.url, overload_clients, overload_s, server.model)
            probe_rows = json.loads(prober.communicate(timeout=120)[0] or "[]")
            idle = _wait_idle(server.url)
            o = summarize_overload(rows, wall)
            o["idle_after"] = idle["state"]
            o["probe"] = summarize_probe(probe_rows)
            o["front"] = server_refusals(server.cleanup_dir, direct_http)
            record["overload"] = o
            log(f"overload: {o['refused']} refused ({o['refused_statuses']}, p50 {o['refusal_p50_ms']} ms, "
                f"p99 {o['refusal_p99_ms']} ms), {o['admitted_completed']}/{o['admitted']} admitted completed")
        finally:
            record["overload_stop"] = server.stop()
    s, o = record["soak"], record["overload"]
    record["checks"] = {
        "soak_none_lost": s["lost"] == 0,
        "soak_no_5xx": s["status_5xx"] == 0,
        "soak_nothing_left": all(not v for v in s["idle_after"].values()),
        "soak_memory_within_10pct": (s.get("rss_growth_beside_prefix_bank") is not None
                                     and s["rss_growth_beside_prefix_bank"] <= MEMORY_BOUND),
        "overload_refusals_shaped": o["refused"] > 0 and o["refused_openai_shape_with_retry_after"] == o["refused"],
        "overload_refusals_within_100ms": o["refused"] > 0 and o["refused_within_bound"] == o["refused"],
        "overload_refusal_p99_within_100ms_after_10s": (o.get("steady_refusal_p99_ms") is not None
                                                       and o["steady_refusal_p99_ms"] <= REFUSAL_BOUND_S * 1000),
        "overload_probe_refusal_p50_within_100ms": (o["probe"]["refusal_p50_ms"] is not None
                                                    and o["probe"]["refusal_p50_ms"] <= REFUSAL_BOUND_S * 1000),
        "overload_admitted_all_complete": o["admitted_completed"] == o["admitted"],
    }
    record["elapsed_s"] = time.time() - started
    record["loadavg_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    record["artifacts"] = {"json": str(out_dir / f"soak-{stamp}.json")}
    return record


def render_section(record: dict, command: str) -> str:
    m, rt, s, o = record["machine"], record["machine"]["runtime"], record["soak"], record["overload"]
    p = record["plan"]
    mb0, mb1 = s["memory_before_mb"], s["memory_after_mb"]
    quick = " (quick smoke run: not the full workload)" if record.get("quick") else ""
    ok = lambda b: "yes" if b else "**no**"   # noqa: E731
    c = record["checks"]
    lines = [
        f"## bench soak{' (direct HTTP)' if p.get('direct_http') else ''}: churn and overload{quick}",
        "",
        f"`{command}`, {record['date']}, {record['elapsed_s'] / 60:.1f} min. Machine: `{m['platform']}`, "
        f"{m['cpu_count']} CPUs, BLAS {rt.get('blas')}, mlx {rt.get('mlx_version')} on `{rt.get('mlx_device')}`. "
        f"Model: {record['model']}. Each phase on its own `serve run serve_configs/config.yaml`"
        + (", clients on the ingress replica's own port (`--direct-http`: Serve's direct ingress, no proxy "
           "hop)" if p.get("direct_http") else "") + ". "
        f"Load average (1/5/15 min) at start {_load(record.get('loadavg_start'))}, at end "
        f"{_load(record.get('loadavg_end'))}: the CPUs are shared with the bench client and other work.",
        "",
        f"**Soak**: {p['requests']} streaming `/v1/completions` from {p['clients']} closed-loop clients, greedy and "
        f"sampled (t {SAMPLED['temperature']}, top_p {SAMPLED['top_p']}, top_k {SAMPLED['top_k']}) alternating, "
        f"`max_tokens` {p['budgets'][0]}-{p['budgets'][1]}, {p['drop_fraction']:.0%} of streams dropped mid-way "
        "(the client closes after about a third of its budget). Lost: a kept request that did not end with "
        f"`[DONE]`. Memory: the replica's resident set after a {p['clients'] * WARMUP_PER_CLIENT}-request warm-up "
        f"(same mix) vs after the run, each read once the replica has been idle {2 * IDLE_HEAP_RELEASE_S:g} s "
        "(an idle replica hands its free heap back to the OS); under load it is higher: sampled every 15 s "
        "(`rss_curve_mb` in the JSON), its range is in the last column. The "
        "prompt-prefix bank is a bounded LRU cache (512 MiB budget) that fills by design, so the check is "
        "on the growth beside it.",
        "",
        "| requests | done | dropped | clean error events | lost | 5xx | 429/503 | completion tok/s | TTFT p50 / p99 ms "
        "| E2E p50 / p99 s | left in queues/maps | replica RSS MB before -> after | of which prefix bank MB "
        "| RSS under load MB (min-max); peak, 2nd half vs 1st half |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|",
        f"| {s['requests']} | {s['outcomes'].get('done', 0)} | {s['dropped']} | {s['error_events']} | {s['lost']} | "
        f"{s['status_5xx']} | {s['refused']} | {s['tok_s_done']} | {s['ttft_p50_ms']} / {s['ttft_p99_ms']} | "
        f"{_fmt(s['e2e_p50_s'])} / {_fmt(s['e2e_p99_s'])} | "
        f"{'none' if all(not v for v in s['idle_after'].values()) else s['idle_after']} | "
        f"{mb0['rss']} -> {mb1['rss']} ({_pct(s.get('rss_growth'))}; {_pct(s.get('rss_growth_beside_prefix_bank'))} "
        f"beside the prefix bank) | {mb0['prefix_bank']} -> {mb1['prefix_bank']} | {_rss_range(s.get('rss_curve_mb'))}; "
        f"{_pct(s.get('rss_trend'))} |",
        "",
        f"**Overload**: {p['overload_clients']} closed-loop streaming clients for {p['overload_s']:.0f} s against a "
        f"small queue (app args {json.dumps(p['overload_args'])}); a refused client waits its `Retry-After`. "
        f"Refusal time: request sent to status line, as the clients see it ({p.get('overload_processes', 1)} "
        "processes sharing them, an event loop each with a plain HTTP/1.1 client, on the same CPUs as the server), as a probe "
        "sees it (a separate process sending one non-streaming request at a time while the clients keep the queues full), and as the server's HTTP front logged it (Serve's proxy, or "
        "with direct HTTP the ingress replica, whose access log the shipped config turns off: arrival there to its response, no client on the path). The "
        "opening seconds are a burst (every client "
        f"sends at once, and comes back after its `Retry-After`); refusals of requests sent after the first "
        f"{STEADY_AFTER_S:g} s are also given apart.",
        "",
        "| requests | admitted | admitted completed | refused | refused statuses | OpenAI shape + Retry-After "
        "| refusal p50 / p99 / max ms | within 100 ms "
        f"| after the first {STEADY_AFTER_S:g} s: refused, p50 / p99 ms, within 100 ms "
        "| probe: refused, p50 / p99 ms, within 100 ms "
        "| at the server's HTTP front: p50 / p99 ms, within 100 ms | admitted TTFT p50 ms | tok/s |",
        "|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| {o['requests']} | {o['admitted']} | {o['admitted_completed']} | {o['refused']} | {o['refused_statuses']} | "
        f"{o['refused_openai_shape_with_retry_after']} | {o['refusal_p50_ms']} / {o['refusal_p99_ms']} / "
        f"{o['refusal_max_ms']} | {o['refused_within_bound']}/{o['refused']} | {_steady(o)} | {_probe(o.get('probe'))} | {_front(o.get('front'))} | "
        f"{o['admitted_ttft_p50_ms']} | "
        f"{o['tok_s']} |",
        "",
        "Checks: " + ", ".join(f"{k.replace('_', ' ')}: {ok(v)}" for k, v in c.items()) + ".",
    ]
    return "\n".join(lines) + "\n"


def _probe(p: Optional[dict]) -> str:
    if not p:
        return "-"
    return (f"{p['refused']}/{p['requests']}, {p['refusal_p50_ms']} / {p['refusal_p99_ms']}, "
            f"{p['refused_within_bound']}/{p['refused']}")


def _front(p: Optional[dict]) -> str:
    if not p:
        return "-"
    return f"{p['refusal_p50_ms']} / {p['refusal_p99_ms']}, {p['refused_within_bound']}/{p['refused']}"


def _load(v) -> str:
    return "-" if not v else "/".join(f"{x:.1f}" for x in v)


def _fmt(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.2f}"


def _pct(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:+.1%}"


def write_outputs(record: dict, command: str) -> dict:
    """The JSON under build/bench/ and the `soak` section of BENCHMARKS.md (`soak-direct` for a
    `--direct-http` run)."""
    name = "soak-direct" if record["plan"].get("direct_http") else "soak"
    md = ROOT / "BENCHMARKS.md"
    md.write_text(replace_section(md.read_text() if md.exists() else "", name, render_section(record, command)))
    Path(record["artifacts"]["json"]).write_text(json.dumps(record, indent=2, default=str))
    record["artifacts"]["markdown"] = str(md)
    return record["artifacts"]


def run_cli(quick: bool = False, model: Optional[str] = None, json_out: bool = False,
            direct_http: bool = False) -> dict:
    """The `mtplx bench soak` entry: `--quick` is 100 requests and 15 s of overload."""
    opts = dict(requests=100, overload_s=15.0) if quick else {}
    record = bench_soak(model_dir=model, direct_http=direct_http, **opts)
    record["quick"] = quick
    command = "mtplx bench soak" + (" --quick" if quick else "") + (f" --model {model}" if model else "") + \
        (" --direct-http" if direct_http else "")
    out = write_outputs(record, command)
    if json_out:
        print(json.dumps(record, default=str), flush=True)
    else:
        print(json.dumps(record["checks"], indent=2))
        print(f"\nJSON: {out['json']}\nsection: {out['markdown']}", flush=True)
    return record


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="100 requests, 15 s of overload")
    p.add_argument("--model", default=None, help="checkpoint dir (default: the shipped model)")
    p.add_argument("--json", action="store_true", help="print the JSON record")
    p.add_argument("--direct-http", action="store_true", help="clients call the ingress replica on its own port")
    p.add_argument("--probe", default=None, help=argparse.SUPPRESS)          # internal: the refusal probe
    p.add_argument("--probe-seconds", type=float, default=30.0, help=argparse.SUPPRESS)
    p.add_argument("--probe-model", default="", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.probe:
        print(json.dumps(probe(a.probe, a.probe_seconds, a.probe_model)), flush=True)
        return 0
    record = run_cli(quick=a.quick, model=a.model, json_out=a.json, direct_http=a.direct_http)
    return 0 if all(record["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
