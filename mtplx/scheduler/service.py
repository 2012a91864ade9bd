"""The generation service of the ``mtp_batch`` lane: ``MTPBatchGenerationService`` (its jobs:
``mtplx.scheduler.job``).

Three stages (as in MTPLX's lane, with lanes that keep running while rows come and go):

1. **Job creation.** One ``MTPBatchJob`` per request: prompt ids, budget, samplers, seed, stop ids,
   a ``token_callback`` that receives ``[token]`` per committed non-stop token, and the
   ``compatibility_key`` that decides which jobs may decode together.
2. **Admission, one path for every job.** ``submit(job)`` queues the job for the one model-owner
   thread (a key with no running lane first waits up to ``batch_wait_s`` for company);
   ``submit_cohort(jobs)`` takes jobs gathered upstream (the Ray ingress's ``@serve.batch``
   window) with no wait. Leaving the queue, a job takes its decode state from the KV budget
   (``mtplx.scheduler.budget``; until it fits it stays first in the queue), then joins its key's
   ``RunningLane`` at the next cycle boundary. A lane runs at the narrowest installed width that
   holds its rows (the one-row lane for a lone row; ``force_width`` pins the narrowest), widens
   when more rows want in and narrows when few remain; lanes of different keys take turns cycle
   by cycle. Numerics ``b1-exact`` runs every lane at width 1 only, so its rows decode one at a
   time with the solo path's numerics. A job with its own ``solo_runner`` that would decode alone
   waits in the same queue and budget, and runs through its runner at its turn.
3. **Results.** Each lane step returns its rows' ``RowEvent``s (tokens with their emission times,
   when the row's prefill started and when it took its slot, its end with its stream result);
   ``mtplx.scheduler.lane_rows`` puts them into the row's job, ``mtplx.scheduler.results`` turns them into
   ``decode_elapsed_s``, ``decode_tok_s`` and the rest of the stats contract and merges where the
   row ran (widest width, occupancy, route) into ``job.request_observability``.

All MLX work (lane installation, prefill, decode) runs on the service's single model-owner thread:
MLX state is thread-affine. ``submit`` and ``cancel`` are safe from any thread; token callbacks and
result publication run on the owner thread, so a consumer on another thread hands tokens over
itself (the Ray replica buffers them for its event loop).

Deliberate differences from MTPLX: a row joins a running lane whenever a slot is free, instead of
waiting for the whole running cohort to drain, and a row's future resolves **at that row's own
terminal**, so a 3-token answer never waits for a 500-token neighbour. The owner finalize runs
each time a key's lane drains, and its failure still poisons the service (the queue fails, later
submits fail), but it cannot take back results that were already published.

Other choices worth knowing:

* ``completion_tokens = len(job.tokens)`` and ``result["tokens"]`` include a terminal stop token,
  as in MTPLX; ``result["_mtp_batch_stop_token_ids"]`` lets the caller strip it before detokenizing.
* A request that can never run (empty prompt, token id out of range, prompt + max_tokens over the
  context window or the KV budget) fails alone instead of failing the lane it would have joined.
* ``job.cancel()`` fails the job's future at once wherever it is; a queued job never reaches MLX,
  an admitted row leaves its lane at the next cycle boundary while its neighbours continue.
* A job's stop strings (``stop_text``) end its row in the step whose token completed one.
* A fault in a lane's step ends at most the one row it is blamed on; the lane is rebuilt with
  its other rows resumed where they were (`mtplx.scheduler.recovery`).

Why one file: everything here runs on, or hands work to, the one owner thread, and shares its
queue, lanes, budget and counters under one lock; split, each part would reach into the others'.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from concurrent.futures import Future
from typing import Any, Callable, Iterable, Optional

from mtplx.scheduler.budget import KVBudget, row_need
from mtplx.engine.settings import EngineSettings
from mtplx.scheduler.config import DEFAULT_BATCH_WAIT_S, DEFAULT_WIDTHS, NUMERICS
from mtplx.scheduler.job import MTPBatchJob, MTPBatchOwnerFinalizeError, MTPBatchServiceClosed
from mtplx.scheduler.job_queue import JobQueue
from mtplx.scheduler.ladder import LaneLadder
from mtplx.scheduler.lane_rows import deliver_event, lane_request, lane_result, remove_cancelled
from mtplx.scheduler.owner import ModelOwnerThread, fail_calls
from mtplx.scheduler.recovery import recover
from mtplx.scheduler.results import (MTP_DEPTH, add_lane_counters, add_runner_counters,
                                     counters_snapshot, lane_snapshot, lanes_by_route,
                                     new_service_stats, solo_placement)
from mtplx.scheduler.runner import runner_result

logger = logging.getLogger(__name__)


class _KeyLane:
    """One compatibility key's running lane in the service, and its unfinished jobs."""

    __slots__ = ("key", "running", "jobs", "serial", "job_of", "alone")

    def __init__(self, key, running, serial: int = 0, alone: bool = False):
        self.key, self.running, self.jobs = key, running, []
        self.serial = serial   # which lane this is (lanes_started when it began): tells lanes with one label apart
        self.job_of: dict = {}     # row id in the lane -> its job (ids are unique in a lane)
        self.alone = alone     # a row isolated after repeated lane faults: any fault here is its own

    def row_id(self, job) -> str:
        """The job's row id in this lane: its request id, made unique among the lane's rows."""
        row_id, n = str(job.request_id), 1
        while row_id in self.job_of:
            row_id, n = f"{job.request_id}~{n}", n + 1
        return row_id


class MTPBatchGenerationService(ModelOwnerThread):
    """Keeps one running lane per compatibility key on one model-owner thread (continuous
    admission): a submitted job joins its key's lane at the next cycle boundary, lanes of different
    keys take turns cycle by cycle, and each row resolves at its own end.

    ``lanes``: installed lanes (a mapping width -> lane, or an iterable of lanes); may be empty for
    ``numerics="b1-exact"``. ``owner_finalize(jobs) -> receipt``: runs on the owner thread each time
    a key's lane drains (with the jobs still in it); raising, or a receipt with ``cleared: False``,
    poisons the service. A job's ``sink`` (one per cohort) takes each lane step phase's news of
    its jobs in one call, before any of them resolves (`mtplx.scheduler.lane_rows.RowNews`).
    ``running_lane_cls``: the
    running lane class (tests pass a subclass to force a fault). Use ``for_model`` to build one
    with its own lanes.

    Settings (``deployments.app.AppArgs`` documents each): ``greedy_depths`` (none deeper unless
    given; "cost": chosen per width by measured cost), ``sampled_depth`` (1 unless given),
    ``settings`` (``mtplx.engine.settings.EngineSettings``: how lanes run, the pinned width, the KV
    budget, the repetition stop; the defaults unless given: the service reads no environment),
    ``kv_budget_bytes`` (None: the settings' budget).
    """

    def __init__(self, model=None, lanes=None, *, batch_wait_s: float = DEFAULT_BATCH_WAIT_S,
                 numerics: Optional[str] = None, owner_finalize: Optional[Callable[[list], Any]] = None,
                 max_cohort_rows: Optional[int] = None, start: bool = True, session_bank=None,
                 running_lane_cls=None, kv_budget_bytes: Optional[int] = None,
                 greedy_depths=None, sampled_depth: int = MTP_DEPTH,
                 settings: Optional[EngineSettings] = None):
        from mtplx.engine.installed import DEPTHS

        self.model = model
        self.settings = settings = settings or EngineSettings()
        self.ladder = LaneLadder(model, lanes, numerics=numerics, greedy_depths=greedy_depths,
                                 sampled_depth=sampled_depth, force_width=settings.force_width,
                                 compiled=settings.compiled, max_rows=max_cohort_rows)
        # Rows join lanes only while every lane's decode state fits this budget
        self.kv_budget = KVBudget(model, kv_budget_bytes if kv_budget_bytes is not None else settings.kv_budget_bytes())
        # Prompt-prefix reuse for jobs that bring no session hooks of their own (greedy output
        # is unchanged by reuse; see mtplx.engine.prefix_cache). Under a budget the bank holds only what
        # the lanes' decode state leaves, and yields it when rows need it.
        self.session_bank = session_bank
        if session_bank is not None and self.kv_budget.budget_bytes is not None:
            session_bank.room = lambda: self.kv_budget.room(self._held_bytes())
        self._owner_finalize = owner_finalize
        self._running_lane_cls = running_lane_cls
        # a model without an MTP head serves every request as plain AR rows, and says why
        self.mtp_disabled_reason: Optional[str] = (
            (getattr(model, "mtp_disabled_reason", None) or "the model has no MTP head")
            if model is not None and getattr(model, "mtp", True) is None else None)

        self._init_owner()
        self._queue = JobQueue(batch_wait_s)
        self._active: set = set()
        self._running: dict = {}              # compatibility key -> _KeyLane (owner thread writes)
        self._runner_jobs: deque = deque()    # admitted jobs waiting for their turn at their solo_runner
        self._suspects: set = set()           # jobs re-admitted after a lane fault nobody was blamed for
        self._turn = 0
        self._stats = new_service_stats(max(DEPTHS))
        if start:
            self.start()

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def for_model(cls, model, widths: Iterable[int] = DEFAULT_WIDTHS,
                  batch_wait_s: float = DEFAULT_BATCH_WAIT_S, numerics: str = "throughput",
                  **kwargs) -> "MTPBatchGenerationService":
        """A running service with its own lanes, installed (and self-checked) on its owner thread.
        ``b1-exact`` installs no lane: every row decodes in the one-row lane."""
        if numerics not in NUMERICS:
            raise ValueError(f"numerics={numerics!r} is invalid: choose one of {NUMERICS}")
        if "session_bank" not in kwargs:        # with a head or without: AR rows reuse prefixes too
            from mtplx.scheduler.session_bank import SessionBank

            kwargs["session_bank"] = SessionBank(f"{model.model_id}:{model.fingerprint}")
        service = cls(model, {}, batch_wait_s=batch_wait_s, numerics=numerics, **kwargs)
        if service.mtp_disabled_reason is not None and numerics != "b1-exact":   # no head: plain AR lanes
            from mtplx.engine.installed import ar_lanes

            service.call_on_owner(lambda: service.ladder.set_lanes(ar_lanes(model, widths, service.ladder.compiled))).result()
        elif numerics != "b1-exact":
            try:
                service.install_lanes(widths).result()
            except BaseException:
                service.shutdown(timeout_s=5)
                raise
        return service

    def install_lanes(self, widths: Iterable[int]) -> Future:
        """Install lanes of these widths on the owner thread (adds to the installed set)."""
        widths = sorted({int(w) for w in widths})
        if not widths:
            raise ValueError("widths is empty: install at least one lane width")
        return self.call_on_owner(self.ladder.install, widths)

    @property
    def numerics(self) -> str:
        return self.ladder.numerics

    @property
    def installed_widths(self) -> list:
        return sorted(self.ladder.lanes)

    @property
    def max_cohort_rows(self) -> int:
        return self.ladder.max_cohort_rows

    @property
    def batch_wait_s(self) -> float:
        return self._queue.batch_wait_s

    # -- lifecycle ---------------------------------------------------------------------------

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop admitting work, fail queued jobs, cancel active rows and wait for the owner thread.

        Raises RuntimeError when the owner did not finalize its active rows within ``timeout_s``.
        """
        with self._cond:
            if self._closed_error is None:
                self._closed_error = MTPBatchServiceClosed("MTP batch service is shut down")
            pending = self._queue.clear()
            calls, self._calls = list(self._calls), deque()
            active = list(self._active)
            self._stopping = True
            self._cond.notify_all()
            thread = self._thread
        for job in pending:
            job._fail(MTPBatchServiceClosed("MTP batch service is shut down"))
        fail_calls(calls, self._closed_error)
        for job in active:
            job.cancel()
        if thread is not None and thread.ident != threading.get_ident():
            thread.join(timeout_s)
            if thread.is_alive():
                raise RuntimeError("owner did not finalize active requests before shutdown")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    # -- submission --------------------------------------------------------------------------

    def submit(self, job: MTPBatchJob) -> Future:
        """Queue a job; it joins its key's running lane at the next cycle boundary. A key with no
        running lane first waits up to ``batch_wait_s`` for company. Returns ``job.future``."""
        self._enqueue([job], ready=False)
        return job.future

    def submit_cohort(self, jobs: Iterable[MTPBatchJob]) -> list:
        """Queue jobs gathered upstream (e.g. by ``@serve.batch``): no gather wait; each joins the
        running lane of its ``compatibility_key``. Returns the futures in the given order."""
        jobs = list(jobs)
        self._enqueue(jobs, ready=True)
        return [job.future for job in jobs]

    def cancel(self, job: MTPBatchJob) -> bool:
        """End a submitted job early (``MTPBatchJob.cancel``): it fails at once. False when it had
        finished."""
        return job.cancel()

    def _enqueue(self, jobs: list, ready: bool) -> None:
        for job in jobs:
            if not isinstance(job, MTPBatchJob):
                raise TypeError(f"submit expects MTPBatchJob, got {type(job).__name__}")
            if job._service is not None:
                raise ValueError(f"job {job.request_id!r} was already submitted")
        accepted = [job for job in jobs if self._accept(job, ready)]
        with self._cond:
            self._stats["requests_submitted"] += len(jobs)
            closed = self._closed_error
            if closed is None:
                self._queue.extend(job for job in accepted if not job.future.done())
                self._cond.notify_all()
        if closed is not None:
            for job in accepted:
                job._fail(type(closed)(str(closed)))

    def _accept(self, job: MTPBatchJob, ready: bool) -> bool:
        """Bind a job to this service; False when it ends here (ended early, or can never run)."""
        if self.mtp_disabled_reason is not None:
            job.speculative = False
        if self.session_bank is not None and job.session_restore is None and job.session_commit is None:
            job.session_restore, job.session_commit = self.session_bank.hooks(job.prompt_ids)
        job._service = self
        job._ready = ready
        job.future.add_done_callback(lambda f, j=job: self._count_outcome(j, f))
        if job.cancel_requested():
            self._end_early(job)
            return False
        error = self._admission_error(job)
        if error is not None:
            job._fail(error)
        return error is None

    def _admission_error(self, job: MTPBatchJob) -> Optional[BaseException]:
        if self.model is None:
            return ValueError("prompt_ids is empty; a prompt needs at least one token") if not job.prompt_ids else None
        from mtplx.engine.prefill import check_request

        try:
            check_request(self.model, job.prompt_ids, job.max_tokens)
        except Exception as exc:
            return exc
        return None

    def rows_wanting(self, key) -> int:
        """Rows of this compatibility key that hold or want a lane slot: queued here, or live,
        prefilling or waiting in the key's running lane (for admission limits upstream)."""
        with self._cond:
            lane = self._running.get(key)
            return (self._queue.of_key(key)
                    + sum(1 for j in self._runner_jobs if j.compatibility_key == key)
                    + (lane.running.demand if lane is not None else 0))

    def _on_job_cancelled(self, job: MTPBatchJob) -> None:
        with self._cond:
            queued = self._queue.remove(job)
            self._cond.notify_all()    # an idle owner notices the cancel at once
        if queued:
            self._end_early(job)

    def _end_early(self, job: MTPBatchJob) -> None:
        """A job cancelled before it reached a lane."""
        job._fail(job._cancel_exception())

    def _count_outcome(self, job: MTPBatchJob, fut: Future) -> None:
        with self._cond:
            self._active.discard(job)
            if fut.cancelled() or fut.exception() is not None:
                key = "requests_cancelled" if job.cancel_requested() else "requests_failed"
            else:
                key = "requests_completed"
                self._stats["completion_tokens"] += fut.result()["completion_tokens"]
            self._stats[key] += 1

    # -- the owner thread's work ---------------------------------------------------------------

    def _has_turns(self) -> bool:
        return bool(self._running or self._runner_jobs)

    def _take_ready_locked(self, head_key_only: bool = False) -> tuple:
        """Queued jobs that may be admitted now, and how long until more may (None: no limit);
        b1-exact jobs at once. Jobs that ended while queued end here."""
        for job in self._queue.drop_ended():
            self._end_early(job)
        if self._stopping:
            return [], None
        return self._queue.take_ready(self._running, self.max_cohort_rows, at_once=self.numerics == "b1-exact",
                                      head_key_only=head_key_only)

    # -- admission: one path for every job ------------------------------------------------------

    def _admit(self, jobs: list) -> None:
        """Jobs leave the queue. Each takes its decode state from the KV budget (until it fits it
        stays first in the queue), then joins its key's running lane (created on first use), or,
        a job with its own solo_runner that would decode alone, waits for its turn at it."""
        by_runner = self._runner_jobs_among(jobs)
        deferred = []
        for job in jobs:
            alone = id(job) in by_runner
            fits = self._kv_fits(job, alone)
            if fits is None:
                continue                  # failed: it can never fit
            if not fits:                  # waits for rows to finish and free their state
                deferred.append(job)
            elif alone:
                with self._cond:
                    self._runner_jobs.append(job)
                    self._active.add(job)
            else:
                self._join_lane(job)
        if deferred:
            with self._cond:
                self._queue.put_back(deferred)

    def _runner_jobs_among(self, jobs: list) -> set:
        """Ids of the jobs that decode through their own solo_runner: those that would decode
        alone (b1-exact: every one), unless they ask for what only lanes give: log-probabilities,
        structured output, stop strings."""
        of_key = Counter(j.compatibility_key for j in jobs)
        return {id(j) for j in jobs if j.solo_runner is not None and j.logprobs is None and j.constraint is None
                and j.stop_text is None and (
            self.numerics == "b1-exact" or (of_key[j.compatibility_key] == 1 and j.compatibility_key not in self._running))}

    def _join_lane(self, job: MTPBatchJob) -> None:
        lane = self._running.get(job.compatibility_key) or self._start_lane(job.compatibility_key)
        row_id = lane.row_id(job)
        try:
            lane.running.add(lane_request(job, row_id, numerics=self.numerics,
                                          repetition_stop=self.settings.repetition_stop_all))
        except Exception as exc:      # a request the lane refuses fails alone
            job._fail(exc)
            return
        lane.jobs.append(job)
        lane.job_of[row_id] = job
        with self._cond:
            self._active.add(job)
        job.emit_prefill({"phase": "queued", "tokens_total": len(job.prompt_ids), "tokens_done": 0})

    def _start_lane(self, key, alone: bool = False) -> _KeyLane:
        from mtplx.engine.installed import DEPTHS
        from mtplx.engine.lane import RunningLane

        # greedy depths chosen by cost: the running lane keeps choosing them, at its rows' acceptance
        by_cost = [self.ladder.ladder(d) for d in DEPTHS] if self.ladder.choose_greedy_depths else None
        running = (self._running_lane_cls or RunningLane)(
            self.ladder.ladder(), greedy_ladder=self.ladder.greedy_ladder(),
            sampled_ladder=self.ladder.ladder(self.ladder.sampled_depth), depth_ladders=by_cost,
            settings=self.settings)
        with self._cond:
            self._stats["lanes_started"] += 1
            lane = self._running[key] = _KeyLane(key, running, serial=self._stats["lanes_started"], alone=alone)
        return lane

    def _kv_fits(self, job: MTPBatchJob, alone: bool) -> Optional[bool]:
        """Whether every lane's decode state stays within the budget with this job in its key's
        lane (`alone`: in a one-row lane of its own). None when the job fails because it cannot
        fit even alone. A job that fits takes from the prefix bank what the rows now need."""
        budget = self.kv_budget.budget_bytes
        if budget is None:
            return True
        why = self.kv_budget.too_big(row_need(job), self.ladder.widths())
        if why is not None:
            from mtplx.engine.prefill import KVBudgetError

            job._fail(KVBudgetError(f"prompt ({len(job.prompt_ids)} tokens) + max_tokens ({job.max_tokens}) {why}"))
            return None
        total = self._held_bytes(job, alone)
        if total > budget:
            return False
        if self.session_bank is not None:
            self.session_bank.shrink(budget - total)
        return True

    def _held_bytes(self, job: Optional[MTPBatchJob] = None, alone: bool = False) -> int:
        """Every running lane's and waiting runner job's decode state, with `job` in its key's lane
        (or, `alone`, in a lane of its own) when given."""
        lanes = {key: [row_need(j) for j in lane.jobs if not j.future.done()] for key, lane in self._running.items()}
        groups = [[row_need(j)] for j in self._runner_jobs if not j.future.done()]
        if job is not None and alone:
            groups.append([row_need(job)])
        elif job is not None:
            lanes.setdefault(job.compatibility_key, []).append(row_need(job))
        return self.kv_budget.held_bytes(list(lanes.values()) + groups, self.ladder.widths())

    # -- turns: one cycle of each lane, one runner job, round robin --------------------------------

    def _step_next_turn(self) -> None:
        """The next turn, round robin: one cycle of each key's lane, then one waiting runner job,
        so no key runs to completion while another key's rows wait."""
        lanes = list(self._running.values())
        turns = len(lanes) + (1 if self._runner_jobs else 0)
        if not turns:
            return
        turn = self._turn % turns
        self._turn += 1
        if turn < len(lanes):
            self._step_lane(lanes[turn])
            return
        with self._cond:
            job = self._runner_jobs.popleft()
        self._run_runner(job)

    def _step_lane(self, lane: _KeyLane) -> None:
        """One step of a key's lane: its boundary (admissions, whose first tokens reach their
        jobs before the cycle runs), then its cycle, each phase's events into the jobs. A phase
        that raises ends at most one row and the lane is rebuilt (`_rebuild_lane`)."""
        running, failure = lane.running, None
        remove_cancelled(running, lane.job_of)
        for phase in (running.admit, running.decode):
            failure = self._run_phase(lane, phase)
            if failure is not None:
                break
        if failure is not None:
            self._rebuild_lane(lane, failure)
            return
        if any(job.future.done() for job in lane.jobs):   # a lane under steady load never drains
            self._suspects.difference_update(job for job in lane.jobs if job.future.done())
            lane.jobs = [job for job in lane.jobs if not job.future.done()]
        if not running.has_work:
            self._drain(lane)

    def _run_phase(self, lane: _KeyLane, phase) -> Optional[BaseException]:
        """One phase of a lane step, its events into the jobs; the exception it raised, if any
        (then only the ends of rows that ended before it are delivered: the rest resume)."""
        failure = None
        try:
            events = phase()
        except Exception as exc:
            failure = exc
            events = [e for e in lane.running.drain_events() if e.end is not None
                      and e.request_id != getattr(exc, "request_id", None)]
        t_deliver = time.perf_counter()
        news, ended = {}, []
        for event in events:
            self._deliver(lane, event, news, ended)
        for sink, rows in news.items():     # a cohort's rows' tokens, then their ends
            self._hand(sink, rows)
        for job, stream in ended:
            self._complete_lane_job(job, stream)
        delivered_s = time.perf_counter() - t_deliver
        with self._cond:
            self._stats["delivery_s"] += delivered_s
        return failure

    def _rebuild_lane(self, lane: _KeyLane, exc: BaseException) -> None:
        """A step of this lane raised: the row it is blamed on fails alone, the others re-join
        a new lane where they were (`mtplx.scheduler.recovery`)."""
        self._record_error(exc)
        salvaged = [(lane.job_of.get(req.request_id), req) for req in lane.running.salvage()]
        fate = recover(exc, salvaged, self._suspects, lone_row=next(iter(lane.job_of), None) if lane.alone else None)
        with self._cond:
            self._stats["rows_failed" if fate.blamed is not None else "driver_errors"] += 1
            self._stats["lanes_rebuilt"] += 1
            if self._running.get(lane.key) is lane:
                del self._running[lane.key]
            add_lane_counters(self._stats, lane.running.stats())
        for job, error in fate.failed:
            job._fail(error)
        for job, req, alone in fate.rejoin:
            self._rejoin(job, req, (job.compatibility_key, "alone", req.request_id) if alone else lane.key, alone)
        for job in lane.jobs:       # nothing admitted may hang
            if not job.future.done() and not any(job in ln.jobs for ln in self._running.values()):
                job._fail(exc)
        self._suspects.difference_update(job for job in lane.jobs if job.future.done())

    def _rejoin(self, job: MTPBatchJob, req, key, alone: bool) -> None:
        """A job re-joins a lane of `key` (created on first use) with its resuming request."""
        lane = self._running.get(key) or self._start_lane(key, alone=alone)
        try:
            lane.running.add(req)
        except Exception as exc:
            job._fail(exc)
            return
        lane.jobs.append(job)
        lane.job_of[req.request_id] = job

    def _drain(self, lane: _KeyLane) -> None:
        """The key's lane has no rows left: drop it (its buffers go with it) and finalize."""
        st = lane.running.stats()
        with self._cond:
            if self._running.get(lane.key) is lane:
                del self._running[lane.key]
            add_lane_counters(self._stats, st)
            if st.cycles:    # the last lane that ended
                s = self._stats
                s["last_fixed_width"], s["last_route_id"], s["last_real_width"] = st.width, st.route_id, st.peak_rows
        self._suspects.difference_update(lane.jobs)
        for job in lane.jobs:   # nothing admitted may hang, whatever happened
            if not job.future.done():
                job._fail(job._cancel_exception() if job.cancel_requested() else
                          RuntimeError(f"request {job.request_id}: the lane ended without a result"))
        self._finalize(lane.jobs)

    def _abandon_work(self) -> None:
        """The owner is stopping: rows still in lanes or waiting for a runner end with the
        service's closed error."""
        closed = self._closed_error or MTPBatchServiceClosed("MTP batch service is shut down")
        for lane in list(self._running.values()):
            for job in lane.jobs:
                job._fail(type(closed)(str(closed)))
            lane.running.cancel_all()
        with self._cond:
            self._running.clear()
            runner_jobs, self._runner_jobs = list(self._runner_jobs), deque()
        for job in runner_jobs:
            job._fail(type(closed)(str(closed)))

    def pump_once(self) -> bool:
        """Admit the head job's key (no gather wait) and run until its rows are done, on the
        calling thread. For tests and for services built with ``start=False``; never call it
        while the owner thread runs."""
        if self.owner_alive:
            raise RuntimeError("pump_once is for a service without a running owner thread")
        with self._cond:
            taken, _ = self._take_ready_locked(head_key_only=True)
        self._admit(taken)
        while self._has_turns():
            self._step_next_turn()
        return bool(taken)

    def _record_error(self, exc: BaseException) -> None:
        with self._cond:
            self._stats["last_error"] = f"{type(exc).__name__}: {exc}"

    def _finalize(self, jobs: list) -> None:
        """Owner finalize, once per drained lane; a failure poisons the service."""
        receipt, failure = None, None
        if self._owner_finalize is not None:
            try:
                receipt = self._owner_finalize(list(jobs))
                cleanup = receipt.get("mlx_cache_cleanup", receipt) if isinstance(receipt, dict) else None
                if isinstance(cleanup, dict) and cleanup.get("cleared") is False:
                    failure = f"receipt reports cleared=False: {receipt}"
            except Exception as exc:
                failure = f"{type(exc).__name__}: {exc}"
        else:
            receipt = {"owner_finalize": None}
        with self._cond:
            for job in jobs:
                self._active.discard(job)
            self._stats["last_owner_finalize"] = receipt if failure is None else {"error": failure}
            if failure is None:
                return
            message = f"MTP batch owner finalize failed: {failure}"
            self._stats["poisoned"] = message
            self._stats["last_error"] = message
            self._closed_error = MTPBatchOwnerFinalizeError(message)
            self._stopping = True
            pending = self._queue.clear()
            calls, self._calls = list(self._calls), deque()
            self._cond.notify_all()
        for job in pending:
            job._fail(MTPBatchOwnerFinalizeError(message))
        fail_calls(calls, self._closed_error)

    # -- lane rows ---------------------------------------------------------------------------

    def _deliver(self, lane: _KeyLane, event, news: dict, ended: list) -> None:
        """One row's `RowEvent` from a lane step into its job; its news joins its sink's
        (`news`), and at its end the job joins `ended`."""
        job = lane.job_of.get(event.request_id)
        if job is None:
            return
        try:
            row_news = deliver_event(job, event)
        except Exception as exc:   # one row's news that cannot be delivered fails that row alone
            self._record_error(exc)
            job._fail(exc)
            row_news = None
        if row_news is not None:
            news.setdefault(job.sink, []).append(row_news)
        if event.end is not None:
            del lane.job_of[event.request_id]
            ended.append((job, event.result))

    def _hand(self, sink, rows: list) -> None:
        """A cohort's news of one phase to its sink; a raising sink fails those rows alone."""
        try:
            sink(rows)
        except Exception as exc:
            self._record_error(exc)
            for n in rows:
                n.job.consumer_failed(exc)

    def _complete_lane_job(self, job: MTPBatchJob, stream) -> None:
        """Resolve one lane row at its own terminal, from its final stream (a result that cannot
        be built fails that row alone)."""
        try:
            result = lane_result(job, stream, numerics=self.numerics, mtp_disabled_reason=self.mtp_disabled_reason)
        except Exception as exc:
            self._record_error(exc)
            job._fail(exc)
            return
        if result is None:
            job._fail(job._cancel_exception())
            return
        if stream.fixed_width <= 1:
            with self._cond:
                self._stats["solo_runs"] += 1
        job._succeed(result)

    # -- jobs with their own solo runner ---------------------------------------------------------

    def _run_runner(self, job: MTPBatchJob) -> None:
        """A job's own solo_runner, at its turn: it decodes the job alone on the owner thread."""
        job.admitted_s = time.perf_counter()
        placement = solo_placement(self.numerics)
        with self._cond:
            s = self._stats
            s["solo_runs"] += 1
            s["last_fixed_width"], s["last_route_id"], s["last_real_width"] = 1, placement.route_id, 1
        try:
            if job.cancel_requested() or job.future.done():
                self._end_early(job)
                return
            job.emit_prefill({"phase": "started", "tokens_total": len(job.prompt_ids), "tokens_done": 0})
            result, counts = runner_result(job, placement, job.solo_runner(job))
            if result is None:
                job._fail(job._cancel_exception())
                return
            with self._cond:
                add_runner_counters(self._stats, *counts)
            job._succeed(result)
        except Exception as exc:  # the runner's failures stay local to its job
            self._record_error(exc)
            job._fail(exc)
        finally:
            if not job.future.done():
                job._fail(RuntimeError(f"request {job.request_id}: the solo runner ended without a result"))
            self._finalize([job])

    # -- introspection -----------------------------------------------------------------------

    def snapshot(self) -> dict:
        with self._cond:
            s = dict(self._stats, fixed_width_histogram=dict(self._stats["fixed_width_histogram"]),
                     accepted_by_position=list(self._stats["accepted_by_position"]))
            for lane in self._running.values():
                add_lane_counters(s, lane.running.stats())
            lanes = [lane_snapshot(k, ln.serial, ln.running) for k, ln in self._running.items()]
            row_bytes = self.kv_budget.row_bytes
            return {
                "pending": len(self._queue) + len(self._runner_jobs),
                "active": len(self._active),
                "waiting_rows": (len(self._queue) + len(self._runner_jobs)
                                 + sum(ln["waiting_rows"] + ln["prefilling_rows"] for ln in lanes)),
                "lanes": lanes,
                # running lanes and their live rows by route: more lanes than models means rows split
                "lanes_by_route": lanes_by_route(lanes),
                "pump_scheduled": bool(self._busy or self._queue or self._calls or self._has_turns()),
                **self.ladder.snapshot(),
                "mtp_disabled_reason": self.mtp_disabled_reason,
                # admission by memory: the budget, and what one row's state costs (None until measured)
                "kv_budget_bytes": self.kv_budget.budget_bytes,
                "kv_bytes_per_position": row_bytes[0] if row_bytes else None,
                "session_bank": self.session_bank.stats() if self.session_bank is not None else None,
                "batch_wait_s": self.batch_wait_s,
                **counters_snapshot(s),
                # sampled rows' drafts: drawn on the device (one wait a cycle) or on the host
                "draft_draw": self.settings.draft_draw,
                "shut_down": self._closed_error is not None,
                "owner_alive": self.owner_alive,
                "owner_step_age_s": self.owner_step_age_s(),
            }


__all__ = ["MTPBatchGenerationService"]
