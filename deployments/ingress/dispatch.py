"""The ingress's side of the replicas: the `@serve.batch` window (one cohort call per window to
one replica, its per-row updates demultiplexed back into the rows' batch slots), row
cancellation pinned to the replica running the row, and calls fanned out to every replica."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from typing import Any, Callable, Dict, List, Optional

from ray import serve
from ray.serve.exceptions import BackPressureError

from ..router import PIN_KWARG, known_replicas
from .admission import WaitingBound
from .pending import DISCONNECT, STOP_STRING, PendingRow

log = logging.getLogger("ray.serve")

# How a row ended early at the ingress, in the replica's words.
_REPLICA_REASON = {DISCONNECT: "cancelled", STOP_STRING: "stop_string"}

_SHUTTING_DOWN = {"kind": "unavailable", "message": "the server is shutting down; retry"}
_REPLICA_FAILED = {"kind": "unavailable",
                   "message": "The model replica serving this request failed; retry (a new replica is starting)"}
_NO_RESULT = {"kind": "internal", "message": "the replica ended the cohort without a result"}


def detached(coro):
    """Run a coroutine as a task in an empty context. Handle calls made inside a request inherit
    that request's Serve context, internal request id included; several concurrent calls with the
    same id confuse replica routing (and our pinning router), so each call gets a fresh one."""
    return asyncio.get_running_loop().create_task(coro, context=contextvars.Context())


async def call(handle, *args, timeout_s: float = 30.0, **kwargs):
    async def go():
        return await handle.remote(*args, **kwargs)

    return await asyncio.wait_for(detached(go()), timeout=timeout_s)


class ReplicaDispatcher:
    """Sends windows of rows to the model replicas and routes what comes back."""

    def __init__(self, replica, bound: WaitingBound, stats: dict, metric: Callable, *, retry_after_s: float,
                 max_batch_size: int, batch_wait_timeout_s: float, max_concurrent_batches: int):
        self._replica = replica
        self._replica_stream = replica.options(stream=True)
        self.replica_name = getattr(replica, "deployment_name", "MTPReplica")
        self.bound = bound
        self._stats = stats
        self._metric = metric
        self.retry_after_s = retry_after_s
        # a row's batch slot: `async for update in dispatcher.rows(row)`
        self.rows = serve.batch(max_batch_size=max_batch_size, batch_wait_timeout_s=batch_wait_timeout_s,
                                max_concurrent_batches=max_concurrent_batches)(self._cohort_batch)
        self.row_replica: Dict[str, str] = {}    # row id -> replica running its cohort (while the call runs)
        self._background: set = set()

    def spawn(self, coro) -> asyncio.Task:
        """A background task, referenced until it ends."""
        task = asyncio.get_running_loop().create_task(coro)
        self._keep(task)
        return task

    def _keep(self, task: asyncio.Task) -> None:
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ------------------------------------------------------------------------------------------
    # The batch window: one call per window, demultiplexed per row

    async def _cohort_batch(self, rows: List[PendingRow]):
        queue: asyncio.Queue = asyncio.Queue()
        live = self._open_window(rows, queue)
        # The whole window goes to one replica as one call; there each row joins the running lane
        # of its compatibility key (the one place rows are grouped by key).
        task = detached(self._drive_cohort([rows[i] for i in live], live, queue)) if live else None
        try:
            async for out in _demultiplex(queue, len(rows)):
                yield out
        finally:
            if task is not None and not task.done():
                task.cancel()

    def _open_window(self, rows: List[PendingRow], queue: asyncio.Queue) -> List[int]:
        """Mark the window's rows started; a row whose client left before dispatch is dropped here.
        Returns the slots of the rows to send."""
        now, live = time.time(), []
        for slot, row in enumerate(rows):
            row.batch_started_at = now
            self.bound.row_leaves_wait(row)
            if row.ended_early:
                self._stats["rows_dropped_before_dispatch"] += 1
                queue.put_nowait((slot, ("error", {"kind": "cancelled"})))
            else:
                live.append(slot)
        self._stats["batches"] += 1
        _count(self._stats["batch_size_histogram"], len(rows))
        return live

    def dropped_unsent(self, row: PendingRow) -> None:
        """Serve dropped the row from its window before the window started (its caller left)."""
        self._stats["rows_dropped_before_dispatch"] += 1
        self.bound.row_leaves_wait(row)

    async def _drive_cohort(self, rows: List[PendingRow], slots: List[int], queue: asyncio.Queue) -> None:
        self._stats["cohorts"] += 1
        _count(self._stats["cohort_size_histogram"], len(rows))
        self._metric("cohorts")
        self._metric("cohort_size", len(rows))
        done: set = set()
        error: Optional[dict] = None
        try:
            async for msg in self._replica_stream.run_cohort.remote([row.spec for row in rows]):
                self._route_message(msg, rows, slots, queue, done)
        except asyncio.CancelledError:
            error = _SHUTTING_DOWN
            raise
        except BackPressureError as exc:
            error = {"kind": "overloaded", "retry_after_s": self.retry_after_s,
                     "message": "The model replicas' queues are full; retry later"}
            log.warning("mtplx ingress: replica queue full for rows %s: %s", [r.request_id for r in rows], exc)
        except Exception:
            log.exception("mtplx ingress: the cohort stream of rows %s failed", [r.request_id for r in rows])
            error = _REPLICA_FAILED
        finally:
            for i, row in enumerate(rows):
                self.row_replica.pop(row.request_id, None)
                if i not in done:
                    queue.put_nowait((slots[i], ("error", error or _NO_RESULT)))

    def _route_message(self, msg: dict, rows: List[PendingRow], slots: List[int], queue: asyncio.Queue,
                       done: set) -> None:
        """One message of the cohort stream: {"replica": id} first, then tokens ("t", with "lp"
        when rows asked for log-probabilities) and finals ("f") keyed by the row's index."""
        if "replica" in msg:
            for row in rows:
                self.row_replica[row.request_id] = msg["replica"]
                if row.ended_early:       # it ended while its call was on the way
                    self._send_cancel(row.request_id, msg["replica"], _REPLICA_REASON[row.ended_early])
            return
        logprobs = msg.get("lp") or {}
        for i, tokens in (msg.get("t") or {}).items():
            if i not in done:
                queue.put_nowait((slots[i], ("tokens", tokens, logprobs.get(i))))
        for i, final in (msg.get("f") or {}).items():
            if i not in done:
                done.add(i)
                queue.put_nowait((slots[i], ("error", final["error"]) if "error" in final else ("final", final)))

    # ------------------------------------------------------------------------------------------
    # Rows that end here: a client that left, a stop string that matched

    def end_row(self, row: PendingRow, why: str) -> None:
        """End one row wherever it is (fire and forget; never the whole cohort). The mark on the row
        is all the state there is: a row not yet in a batch is dropped at dispatch, a row whose
        cohort call has not reached its replica is ended when the replica answers, and after its
        cohort ended the mark is simply never read."""
        if row.ended_early:
            return
        row.ended_early = why
        if why == STOP_STRING:
            self._stats["stop_string_stops"] += 1
        else:
            self._stats["row_cancels"] += 1
            self._metric("cancels", 1, {"reason": why})
        replica_id = self.row_replica.get(row.request_id)
        if replica_id is not None:
            self._send_cancel(row.request_id, replica_id, _REPLICA_REASON[why])

    def _send_cancel(self, rid: str, replica_id: Optional[str], reason: str) -> None:
        async def send():
            try:
                kwargs = {PIN_KWARG: replica_id} if replica_id else {}
                await call(self._replica.cancel, rid, reason=reason, timeout_s=30, **kwargs)
            except Exception as exc:
                log.warning("mtplx ingress: cancel of %s failed: %s", rid, exc)

        self._keep(detached(send()))

    async def cancel_request(self, rid: str, owner: Optional[str]) -> int:
        """The cancel route: every row of request `rid` that `owner` (the caller's key digest; None:
        no keys configured) created; how many were live. The replica checks the owner, so a cancel
        through another ingress replica is checked alike."""
        replica_id = self.row_replica.get(rid)
        if replica_id is not None:
            return await call(self._replica.cancel, rid, owner=owner, timeout_s=10, **{PIN_KWARG: replica_id})
        # maybe in flight through another ingress replica: ask every model replica
        results = await self.fan_out("cancel", rid, owner=owner, timeout_s=10)
        return sum(v for v in results.values() if isinstance(v, int))

    async def fan_out(self, method: str, *args, timeout_s: float = 10.0, **kwargs) -> Dict[str, Any]:
        """Call `method` on every live replica (pinned); one unpinned call if none is known yet.
        A replica that fails to answer is logged and answers {"ok": False, ...}."""
        ids = known_replicas(self.replica_name)
        handle = getattr(self._replica, method)
        if not ids:
            res = await call(handle, *args, timeout_s=timeout_s, **kwargs)
            return {res.get("replica_id", "unknown") if isinstance(res, dict) else "unknown": res}
        results = await asyncio.gather(*(call(handle, *args, timeout_s=timeout_s, **kwargs, **{PIN_KWARG: r})
                                         for r in ids), return_exceptions=True)
        out = {}
        for rid, res in zip(ids, results):
            if isinstance(res, BaseException):
                log.warning("mtplx ingress: %s on replica %s failed: %s: %s", method, rid, type(res).__name__, res)
                res = {"ok": False, "error": "the replica did not answer"}
            out[rid] = res
        return out


async def _demultiplex(queue: asyncio.Queue, n: int):
    """The window's per-slot updates as `@serve.batch` wants them: a list of n (events or
    StopAsyncIteration) each time something arrived. A row's stream is ended right after its final
    or error event, not when the whole window ends."""
    finished: set = set()
    while len(finished) < n:
        items = [await queue.get()]
        while not queue.empty():
            items.append(queue.get_nowait())
        out: List[Any] = [[] for _ in range(n)]
        ended = []
        for slot, event in items:
            if slot in finished:
                continue
            out[slot].append(event)
            if event[0] in ("final", "error"):
                finished.add(slot)
                ended.append(slot)
        yield out
        if ended:
            yield [StopAsyncIteration if slot in ended else [] for slot in range(n)]


def _count(histogram: dict, size: int) -> None:
    histogram[str(size)] = histogram.get(str(size), 0) + 1
