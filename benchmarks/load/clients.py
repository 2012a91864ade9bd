"""`bench load`'s clients: streaming completions over httpx, in a closed loop of N clients or an
open loop of timed arrivals."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Callable, List, Optional


async def _one_request(client, index: int, body: dict) -> dict:
    """Stream one completion; times are from just before the request is sent."""
    t0 = time.perf_counter()
    row = {"index": index, "error": None, "ttft": None, "itl": None, "e2e": None, "tokens": 0, "text": "",
           "gaps": [], "prompt_tokens": None}
    times, pieces, usage_tokens = [], [], None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                detail = (await r.aread()).decode(errors="replace")[:160]
                row["error"] = f"HTTP {r.status_code}: {detail}"
                return row
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                if obj.get("error"):
                    row["error"] = f"stream error: {str(obj['error'])[:160]}"
                    return row
                if obj.get("usage"):
                    usage_tokens = obj["usage"].get("completion_tokens")
                    row["prompt_tokens"] = obj["usage"].get("prompt_tokens")
                text = (obj.get("choices") or [{}])[0].get("text")
                if text:
                    times.append(time.perf_counter())
                    pieces.append(text)
    except Exception as exc:   # a failed request is a data point, not the end of the arm
        row["error"] = f"{type(exc).__name__}: {exc}"[:200]
        return row
    end = time.perf_counter()
    tokens = usage_tokens if usage_tokens is not None else len(pieces)
    row.update(e2e=end - t0, tokens=tokens, text="".join(pieces),
               gaps=[b - a for a, b in zip(times, times[1:])])
    if times:
        row["ttft"] = times[0] - t0
        if tokens > 1:
            row["itl"] = (times[-1] - times[0]) / (tokens - 1)
    return row


def _client(base_url: str, connections: int):
    import httpx

    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    return httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(900, connect=30), limits=limits)


async def closed_loop(base_url: str, bodies: List[dict], clients: int,
                      at_drain: Optional[Callable] = None) -> tuple:
    """`clients` workers; each sends the next request index as soon as its previous one ends.
    `at_drain(client)` (async) runs once, when the first worker finds no request left: from then
    on the last requests run with fewer neighbours. Returns (rows in index order, wall seconds)."""
    pending = iter(range(len(bodies)))
    rows: List[dict] = []
    drained = []

    async def worker(client):
        for i in pending:
            rows.append(await _one_request(client, i, bodies[i]))
        if at_drain is not None and not drained:
            drained.append(True)
            await at_drain(client)

    async with _client(base_url, clients) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(clients)))
        wall = time.perf_counter() - t0
    return sorted(rows, key=lambda r: r["index"]), wall


async def open_loop(base_url: str, bodies: List[dict], arrivals: List[float]) -> tuple:
    """Request i is sent at arrivals[i] seconds after the start, whatever is still in flight."""
    async with _client(base_url, len(bodies)) as client:
        t0 = time.perf_counter()

        async def send(i):
            await asyncio.sleep(max(0.0, t0 + arrivals[i] - time.perf_counter()))
            return await _one_request(client, i, bodies[i])

        rows = await asyncio.gather(*(send(i) for i in range(len(bodies))))
        wall = time.perf_counter() - t0
    return list(rows), wall
