"""`bench soak`'s load generator: the soak's and the overload's requests, sent by lean HTTP/1.1
clients on asyncio's streams, and the refusal probe in a process of its own."""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from typing import List, Optional
from urllib.parse import urlsplit

from benchmarks.load.workload import prompt_for
from benchmarks.report import ROOT


REQUESTS, CLIENTS, DROP_FRACTION = 1000, 32, 0.30
MIN_BUDGET, MAX_BUDGET = 8, 256
SAMPLED = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
OVERLOAD_CLIENTS, OVERLOAD_S = 128, 60.0
OVERLOAD_PROCESSES = 4    # the overload clients' processes (an event loop each)
# The small queue of the overload phase: 4 windows of 8 rows reach the replica, 8 rows may wait at
# the ingress and 4 per key beyond the widest lane at the replica.
OVERLOAD_ARGS = {"max_concurrent_batches": 4, "max_waiting_rows": 8, "max_waiting_rows_per_key": 4,
                 "retry_after_s": 1}
WARMUP_PER_CLIENT = 4
REQUEST_TIMEOUT_S = 900


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


def start_probe(base_url: str, seconds: float, model: str):
    import subprocess

    return subprocess.Popen([sys.executable, "-m", "benchmarks.soak", "--probe", base_url,
                             "--probe-seconds", str(seconds), "--probe-model", model],
                            cwd=ROOT, stdout=subprocess.PIPE, text=True)
