"""The ingress's side of the replicas: the `@serve.batch` window (its rows grouped by the replica
the routing policy chose for each, one cohort call per replica, every call's per-row updates
demultiplexed back into the rows' batch slots), rows that move when their replica goes away, row
cancellation pinned to the replica running the row, and calls fanned out to every replica.

A row's replica may die (a crash, `kill -9`, a node lost) or shut down under it (scaled down,
replaced by a config update, past its grace period). Its stream brought every token the client
has, each followed by the row's checkpoint after it (`mtplx.api.rows.RowCheckpoint`), so the row
is re-admitted on another replica from its prompt plus those tokens (`RowSpec.resume_tokens`):
the client's stream goes on with no token lost or repeated, and a greedy or seeded row's text is
what it would have been (`mtplx.scheduler.lane_rows.resume_from`). A row moves at most
`MAX_MOVES` times, and only while another replica takes it within `failover_timeout_s`; past
that it ends with a 503 (a row its client left, or ended with a stop string, is not moved)."""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

from ray import serve
from ray.serve.exceptions import BackPressureError

from mtplx.api.rows import RowCheckpoint, RowSpec

from ..router import AVOID_KWARG, DEFAULT_LOAD_FACTOR, PIN_KWARG, AffinityPolicy, known_replicas
from .admission import WaitingBound
from .pending import PendingRow

log = logging.getLogger("ray.serve")

_SHUTTING_DOWN = {"kind": "unavailable", "message": "the server is shutting down; retry"}
_REPLICA_FAILED = {"kind": "unavailable",
                   "message": "The model replica serving this request failed and no other took it over; retry"}
_NO_RESULT = {"kind": "internal", "message": "the replica ended the cohort without a result"}
MAX_MOVES = 3                        # replicas a row may lose before it ends with a 503
DEFAULT_FAILOVER_TIMEOUT_S = 60.0    # how long a moving row waits for a replica to take it


def detached(coro):
    """Run a coroutine as a task in an empty context. Handle calls made inside a request inherit
    that request's Serve context, internal request id included; several concurrent calls with the
    same id confuse replica routing (and our pinning router), so each call gets a fresh one."""
    return asyncio.get_running_loop().create_task(coro, context=contextvars.Context())


async def call(handle, *args, timeout_s: float = 30.0, **kwargs):
    async def go():
        return await handle.remote(*args, **kwargs)

    return await asyncio.wait_for(detached(go()), timeout=timeout_s)


@dataclass
class _Row:
    """One row of a cohort as the dispatcher follows it, across replicas if it must move."""
    pending: PendingRow
    slot: int
    tokens: list = field(default_factory=list)       # every token its client has been sent (ids)
    checkpoint: Optional[RowCheckpoint] = None       # its state after exactly `tokens` (None: unknown)
    replica: Optional[str] = None                    # the replica it is counted on (load)
    done: bool = False
    move: bool = False                               # its replica went away: resume it elsewhere
    error: Optional[dict] = None

    def spec(self) -> RowSpec:
        """What the replica gets: the row, resuming after its tokens when it has any."""
        spec = self.pending.spec
        if not self.tokens:
            return spec
        return dataclasses.replace(spec, resume_tokens=tuple(self.tokens), checkpoint=self.checkpoint,
                                   prefill_group=None)


class ReplicaDispatcher:
    """Sends windows of rows to the model replicas and routes what comes back."""

    def __init__(self, replica, bound: WaitingBound, stats: dict, metric: Callable, *, retry_after_s: float,
                 max_batch_size: int, batch_wait_timeout_s: float, max_concurrent_batches: int,
                 routing: str = "affinity", load_factor: float = DEFAULT_LOAD_FACTOR,
                 failover_timeout_s: float = DEFAULT_FAILOVER_TIMEOUT_S):
        self._replica = replica
        self._replica_stream = replica.options(stream=True)
        self.replica_name = getattr(replica, "deployment_name", "MTPReplica")
        self.bound = bound
        self._stats = stats
        self._metric = metric
        self.retry_after_s = retry_after_s
        self.failover_timeout_s = float(failover_timeout_s)
        self.policy = AffinityPolicy(self.replica_name, routing, load_factor)
        # a row's batch slot: `async for update in dispatcher.rows(row)`
        self.rows = serve.batch(max_batch_size=max_batch_size, batch_wait_timeout_s=batch_wait_timeout_s,
                                max_concurrent_batches=max_concurrent_batches)(self._cohort_batch)
        self.row_replica: Dict[str, str] = {}    # row id -> replica running it (while it runs)
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
    # The batch window: one call per target replica, demultiplexed per row

    async def _cohort_batch(self, rows: List[PendingRow]):
        queue: asyncio.Queue = asyncio.Queue()
        live = self._open_window(rows, queue)
        # Each replica's rows go as one call; there each row joins the running lane of its
        # compatibility key (the one place rows are grouped by key).
        tasks = [detached(self._drive_cohort([_Row(rows[s], s) for s in slots], queue, target))
                 for target, slots in self._by_replica(rows, live)]
        try:
            async for out in _demultiplex(queue, len(rows)):
                yield out
        finally:
            for task in tasks:
                if not task.done():
                    task.cancel()

    def _open_window(self, rows: List[PendingRow], queue: asyncio.Queue) -> List[int]:
        """Mark the window's rows started; a row whose client left before dispatch is dropped here.
        Returns the slots of the rows to send."""
        now, live = time.time(), []
        for slot, row in enumerate(rows):
            row.batch_started_at = now
            self.bound.row_leaves_wait(row)
            if row.cancelled:
                self._stats["rows_dropped_before_dispatch"] += 1
                queue.put_nowait((slot, ("error", {"kind": "cancelled"})))
            else:
                live.append(slot)
        self._stats["batches"] += 1
        _count(self._stats["batch_size_histogram"], len(rows))
        return live

    def _by_replica(self, rows: List[PendingRow], live: List[int]) -> list:
        """The window's live slots grouped by the replica the routing policy chose for each row
        (None: Serve's choice); the rows of one request (n > 1) go together (one prefill)."""
        pending, groups, of_request = Counter(), {}, {}
        for slot in live:
            spec = rows[slot].spec
            group = spec.prefill_group
            if group is not None and group in of_request:
                target = of_request[group]
            else:
                route = self.policy.route(rows[slot].session, spec.prompt_ids, spec.cache_salt, pending)
                self.policy.decided(route)
                self._metric("routes", 1, {"reason": route.reason})
                target = route.replica
                if group is not None:
                    of_request[group] = target
            if target is not None:
                pending[target] += 1
            groups.setdefault(target, []).append(slot)
        return list(groups.items())

    def dropped_unsent(self, row: PendingRow) -> None:
        """Serve dropped the row from its window before the window started (its caller left)."""
        self._stats["rows_dropped_before_dispatch"] += 1
        self.bound.row_leaves_wait(row)

    async def _drive_cohort(self, rows: List[_Row], queue: asyncio.Queue, target: Optional[str]) -> None:
        """The rows' cohort call, and the calls that take over the rows whose replica went away."""
        self._stats["cohorts"] += 1
        _count(self._stats["cohort_size_histogram"], len(rows))
        self._metric("cohorts")
        self._metric("cohort_size", len(rows))
        try:
            await self._call_until_done(rows, queue, target)
        except asyncio.CancelledError:
            for r in rows:
                r.error = r.error or _SHUTTING_DOWN
            raise
        finally:
            for r in rows:
                self.row_replica.pop(r.pending.request_id, None)
                if not r.done:
                    self._unplace(r)
                    queue.put_nowait((r.slot, ("error", r.error or (_REPLICA_FAILED if r.move else _NO_RESULT))))

    async def _call_until_done(self, rows: List[_Row], queue: asyncio.Queue, target: Optional[str]) -> None:
        """Call again with the rows that must move, away from the replicas that failed them, while
        moves and the failover time last."""
        avoid: List[str] = []
        deadline: Optional[float] = None
        todo, moves = rows, 0
        while todo:
            failed = await self._call(todo, queue, target, avoid, deadline)
            moving = [r for r in todo if r.move and not r.done]
            if not moving:
                return
            moves += 1
            if failed is not None:
                avoid.append(failed)
            deadline = deadline or time.monotonic() + self.failover_timeout_s
            if moves > MAX_MOVES or time.monotonic() >= deadline:
                self._moved(moving, "failed")
                return
            self._moved(moving, "resumed")
            if failed is None:          # which replica failed is unknown: give Serve a moment
                await asyncio.sleep(0.5)
            todo, target = moving, None

    def _moved(self, rows: List[_Row], outcome: str) -> None:
        key = "rows_moved" if outcome == "resumed" else "row_moves_failed"
        self._stats[key] += len(rows)
        self._metric("rows_moved", len(rows), {"outcome": outcome})
        for r in rows:
            if outcome == "resumed":
                r.move = False
            else:
                r.error = _REPLICA_FAILED
        log.warning("mtplx ingress: %d rows %s after their replica went away: %s", len(rows), outcome,
                    [(r.pending.request_id, len(r.tokens)) for r in rows])

    async def _call(self, rows: List[_Row], queue: asyncio.Queue, target: Optional[str], avoid: List[str],
                    deadline: Optional[float]) -> Optional[str]:
        """One cohort call of `rows` (to `target`, never to a replica in `avoid`), its messages
        routed to the rows' slots. A call that failed marks its open rows to move (a replica that
        shut down under a row says so in the row's final); returns the replica they leave. A
        call with a `deadline` (rows moving) fails when no replica takes it by then."""
        replica: List[Optional[str]] = [None]
        stream = self._replica_stream.run_cohort.remote([r.spec() for r in rows], **self._call_kwargs(target, avoid))
        try:
            if deadline is not None:      # the first message says a replica took the rows
                first = await asyncio.wait_for(stream.__anext__(), max(0.0, deadline - time.monotonic()))
                self._route_message(first, rows, replica, queue)
            async for msg in stream:
                self._route_message(msg, rows, replica, queue)
        except StopAsyncIteration:
            pass
        except BackPressureError as exc:
            self._overloaded(rows, exc)
        except Exception as exc:     # the replica died or left (a timeout: no replica took the rows)
            stream.cancel()
            self._lost(rows, replica[0] or target, exc)
        return (replica[0] or target) if any(r.move for r in rows) else None

    def _call_kwargs(self, target: Optional[str], avoid: List[str]) -> Dict[str, Any]:
        """A cohort call's keywords: how far this ingress has read each replica's prefix-cache
        events, and the router's pin and replicas to avoid."""
        kwargs: Dict[str, Any] = {"cache_seen": self.policy.index.seqs()}
        if target is not None:
            kwargs[PIN_KWARG] = target
        if avoid:
            kwargs[AVOID_KWARG] = list(avoid)
        return kwargs

    def _overloaded(self, rows: List[_Row], exc: Exception) -> None:
        log.warning("mtplx ingress: replica queue full for rows %s: %s", [r.pending.request_id for r in rows], exc)
        for r in rows:
            r.error = r.error or {"kind": "overloaded", "retry_after_s": self.retry_after_s,
                                  "message": "The model replicas' queues are full; retry later"}

    def _lost(self, rows: List[_Row], replica: Optional[str], exc: Exception) -> None:
        """The call's replica went away: its open rows move, unless their client left."""
        log.warning("mtplx ingress: the cohort call of rows %s on replica %s failed: %s: %s",
                    [r.pending.request_id for r in rows], replica, type(exc).__name__, exc)
        self._stats["replica_failures"] += 1
        for r in rows:
            if not r.done:
                self._unplace(r)
                r.move = not r.pending.cancelled
                r.error = None if r.move else _REPLICA_FAILED

    def _route_message(self, msg: dict, rows: List[_Row], replica: list, queue: asyncio.Queue) -> None:
        """One message of a cohort stream: {"replica": id} first, then tokens ("t", with "lp" when
        rows asked for log-probabilities), checkpoints ("c") and finals ("f"), keyed by the row's
        index in the call; any may carry prefix-cache events ("pc")."""
        if "replica" in msg:
            replica[0] = msg["replica"]
            self._placed(rows, msg["replica"])
        if "pc" in msg and replica[0] is not None:
            self.policy.index.apply(replica[0], msg["pc"])
        logprobs = msg.get("lp") or {}
        for i, tokens in (msg.get("t") or {}).items():
            r = rows[i]
            if not r.done:
                r.tokens.extend(tokens)
                r.checkpoint = None
                queue.put_nowait((r.slot, ("tokens", tokens, logprobs.get(i))))
        for i, cp in (msg.get("c") or {}).items():
            r = rows[i]
            r.checkpoint = cp if cp.tokens == len(r.tokens) else None
        for i, final in (msg.get("f") or {}).items():
            self._final(rows[i], final, queue)

    def _placed(self, rows: List[_Row], replica: str) -> None:
        """A replica took the rows: they count on it, cancels go there, sessions follow."""
        live = [r for r in rows if not r.done]
        for r in live:
            r.replica = replica
            self.row_replica[r.pending.request_id] = replica
            if r.pending.cancelled:       # its client left while its call was on the way
                self._send_cancel(r.pending.request_id, replica)
        self.policy.placed(replica, len(live), [r.pending.session for r in live])

    def _unplace(self, r: _Row) -> None:
        self.policy.left(r.replica)
        r.replica = None

    def _final(self, r: _Row, final: dict, queue: asyncio.Queue) -> None:
        if r.done:
            return
        self._unplace(r)
        error = final.get("error")
        if error is not None and error.get("resumable") and not r.pending.cancelled:
            r.move = True           # its replica is shutting down: the row goes on elsewhere
            return
        r.done = True
        self.row_replica.pop(r.pending.request_id, None)
        queue.put_nowait((r.slot, ("error", error) if error is not None else ("final", final)))

    # ------------------------------------------------------------------------------------------
    # Rows that end here: a client that left

    def cancel_row(self, row: PendingRow) -> None:
        """Cancel one row, its client gone, wherever it is (fire and forget; never the whole
        cohort). The mark on the row is all the state there is: a row not yet in a batch is dropped
        at dispatch, a row whose cohort call has not reached its replica is cancelled when the
        replica answers, and after its cohort ended the mark is simply never read."""
        if row.cancelled:
            return
        row.cancelled = True
        self._stats["row_cancels"] += 1
        self._metric("cancels", 1, {"reason": "disconnect"})
        replica_id = self.row_replica.get(row.request_id)
        if replica_id is not None:
            self._send_cancel(row.request_id, replica_id)

    def _send_cancel(self, rid: str, replica_id: Optional[str]) -> None:
        async def send():
            try:
                kwargs = {PIN_KWARG: replica_id} if replica_id else {}
                await call(self._replica.cancel, rid, timeout_s=30, **kwargs)
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
