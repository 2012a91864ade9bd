"""The running lane: many rows decoded as one fixed-width batch while rows come and go.

Each step, for all rows at once: rows whose prefill is done take free slots, then one MTP cycle
(the proposer drafts, one target verify forward judges every row's drafts, the acceptor keeps
0..depth of them per row with the row's own RNG, the commit keeps each row's positions) or,
where no row drafts or drafting does not pay (`StepPolicy`), one plain AR step. The lane name
and route ids follow MTPLX's A3B lane; the lane here is architecture-neutral.

Why one file: a cycle's steps (primaries, the proposer's call, the verify, each row's decisions,
their end, the commit) read and write one set of per-cycle state (the rows, their slots, the last
logits and hidden states), in an order that exactness depends on; read top to bottom, the order
of a cycle is here, and each of its parts is a call: a row's own decisions (`decisions.py`, which
read only that row's part of the step), the commit (`commit.py`), a cycle committed on the device
ahead of the host (`ahead.py`). A reshape (another width or depth) and a row's placement move
that same state.
"""

from __future__ import annotations

import time
from dataclasses import replace
from functools import partial
from typing import Iterable, Optional

import mlx.core as mx
import numpy as np

from mtplx.end import CANCELLED, End
from mtplx.engine.acceptor import DeviceVerdicts, Targets
from mtplx.engine.admission import Admitter, RowPrefill
from mtplx.engine.ahead import NextStep, check_ahead_primaries, commit_on_device, rows_may_run_ahead, settle_ahead
from mtplx.engine.commit import commit_positions
from mtplx.engine.decisions import NO_DECISION_LOG, DecisionLog, RowDecisions
from mtplx.engine.forwards import CycleForwards
from mtplx.engine.installed import DEPTH, InstalledA3BMTPBatchLane, row_positions, solo_lane
from mtplx.engine.lane_state import LaneState
from mtplx.engine.lane_stats import LaneCounters, LaneStats
from mtplx.engine.ngram import NgramIndex
from mtplx.engine.policy import NARROW_AFTER_CYCLES, CostSteps, StepCostMeter, StepChooser, StepPolicy
from mtplx.engine.prefill import PREFILL_CHUNK
from mtplx.engine.proposer import ContextScore, Proposer
from mtplx.engine.settings import EngineSettings
from mtplx.engine.row import (ROW_ACCEPT_PRIOR, A3BMTPBatchRequest, A3BMTPBatchStreamResult, LaneRow, RowEvent,
                              RowFailure, check_finite, host_logprob, row_work, validate_request)
from mtplx.engine.shape import LaneShapes
from mtplx.engine.step import Step
from mtplx.models.cache import commit_rows
from mtplx.sampling import sample, to_host
from mtplx.structured import grammar_tokenizer

PRIOR_TEXT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number, computed iteratively."""\n'
PRIOR_TOKENS = 48
ACCEPTANCE_PRIOR_WEIGHT = 32     # drafts' worth of the prior in a lane's greedy acceptance


class RunningLane:
    """A fixed-width lane that keeps running while rows come and go (continuous admission),
    shaped after mlx-lm's `BatchGenerator`: `insert` rows, `step()` returns what each row did
    (`RowEvent`s), `remove` rows. `ladder` is the installed lanes it may run as: when more rows
    want in than the current width holds it widens to the narrowest installed width that fits,
    carrying the live rows' state over; after `narrow_after` cycles of low demand it narrows
    again. The compiled graphs belong to the installed lanes, so rows coming and going never
    recompile. Rows of any sampling settings share the lane, and one verify serves rows of
    different depths: a greedy row chains its lane's depth (`greedy_ladder`'s at each width; its
    tokens are the same at any depth), a sampled row its own (`draft_depth`, else
    `sampled_ladder`'s) at every width, so its draws never depend on its neighbours; the lane runs
    at the shallowest installed depth its drafting rows need.

    A new row is prefilled at its own length, one chunk per step while the others decode (rows
    whose prefill is one chunk, admitted at one boundary, in one forward), then merged into a
    free slot of the ragged caches. A row that does not draft
    (`speculative=False`, or an `adaptive` row that stopped: `LaneRow.drafted`) keeps the target's
    next token each cycle, with `generate_ar`'s draws. Where no row's draws depend on it (greedy
    adaptive rows) the `StepPolicy` may run a plain AR step instead: one target forward [W, 1],
    no head forward, the head's history entries owed (`HeadHistory`). With `overlap`, a step
    whose next boundary has nothing to do launches the next MTP cycle before returning its
    events (`decode`). With `run_ahead`, a lane of greedy rows launches each MTP cycle before the
    host reads the last one's verify, from that verify's outcome computed on the device
    (`ahead.commit_on_device`): the device never waits for the host's decisions.

    Its parts: `rows` (slot -> `LaneRow`), `state` (`LaneState`: caches, last logits and hidden
    states, the head's history), `admitter` (`Admitter`: rows queued and prefilling), `shapes`
    (`LaneShapes`: the installed lanes it may run as, and which one its rows want), `proposer`,
    `decisions` (`RowDecisions`: what each row keeps of a verified step), `step_chooser` and the
    step policies with their cost meter, `next_step` (`NextStep`: the next step's kind, or its
    cycle, when settled early), `counters` (published as `stats()`).
    """

    def __init__(self, ladder, prefill_budget: Optional[int] = PREFILL_CHUNK,
                 narrow_after: int = NARROW_AFTER_CYCLES, decision_log: Optional[DecisionLog] = None,
                 greedy_ladder=None, sampled_ladder=None, depth_ladders: Optional[list] = None,
                 settings: Optional[EngineSettings] = None, proposer: Optional[Proposer] = None,
                 step_chooser: Optional[StepChooser] = None):
        settings = settings or EngineSettings()
        # the installed lanes it may run as, and which one its rows want
        self.shapes = LaneShapes(ladder, greedy_ladder, sampled_ladder, depth_ladders, narrow_after)
        self.model = self.shapes.ladder[0].model
        self.repetition_limits = settings.repetition_limits    # what rows that arm the stop stop within
        self.lane: Optional[InstalledA3BMTPBatchLane] = None
        self.rows: list = []                           # slot -> LaneRow or None (free)
        self._removed: dict = {}                       # request id -> its End, to drop at the next boundary
        self._reporting: list = []                     # rows whose news the next drain_events returns
        self.state = LaneState()                        # caches, last logits and hidden states, head history
        self.forwards: Optional[CycleForwards] = None
        # the drafts' source: the model's head, sampled rows' drafts drawn where `draft_draw` says
        # ("device": no wait between the head and the verify; "host": from the whole q, after a
        # wait); the self-check passes a `ScriptedProposer`
        self.proposer = proposer or Proposer(self.model.vocab_size, settings.draft_draw)
        self.context_drafts = settings.context_drafts     # greedy rows get an NgramIndex to draft from
        # each step's kind: by measured cost, or a test's known sequence (`ScriptedSteps`)
        self.step_chooser = step_chooser or CostSteps(partial(draft_acceptance_prior, self.model))
        # written here, on the thread that steps the lane; other threads read `stats()`
        self.counters = LaneCounters()
        # rows on their way in: queued, prefilling (`prefill_budget` prompt tokens a step; None: all)
        self.admitter = Admitter(self.model, self.shapes.ladder[0].prefill_chunk, prefill_budget, self.counters)
        self._stats = LaneStats()
        # each row's decisions after a verify, recorded where `decision_log` says (a reader's, or none)
        self.decisions = RowDecisions(self.counters, decision_log or NO_DECISION_LOG)
        self._policies: dict = {}   # depth -> StepPolicy (a chain's acceptance is its own)
        self.last_step: Optional[str] = None
        # overlapped cycles: the next MTP cycle launched at a step's end, or the next step's kind
        self.overlap = settings.lane_overlap()
        self.next_step = NextStep()
        self.run_ahead = settings.run_ahead
        self.device_judging = settings.lane_device_judging()   # sampled chains judged on the device
        self._step_costs = StepCostMeter()

    # -- what the lane looks like ----------------------------------------------------------------

    @property
    def width(self) -> int:
        return self.lane.width if self.lane is not None else 0

    @property
    def route_id(self) -> Optional[str]:
        return self.lane.route_id if self.lane is not None else None

    @property
    def draft_draw(self) -> str:
        return self.proposer.draft_draw

    @property
    def policy(self) -> StepPolicy:
        """The step policy of the current lane's draft depth."""
        return self._policies.setdefault(self.lane.depth if self.lane is not None else DEPTH, StepPolicy())

    @property
    def live_rows(self) -> int:
        return sum(1 for r in self.rows if r is not None)

    @property
    def greedy_rows(self) -> int:
        return sum(1 for r in self.rows if r is not None and r.greedy)

    @property
    def demand(self) -> int:
        """Rows that want a slot: live, prefilling and waiting."""
        return self.live_rows + len(self.admitter)

    @property
    def has_work(self) -> bool:
        return self.demand > 0

    def greedy_acceptance(self) -> float:
        """Greedy rows' draft acceptance in this lane: their first drafts' outcomes, after
        ACCEPTANCE_PRIOR_WEIGHT drafts' worth of the head's acceptance on a fixed prompt."""
        n = ACCEPTANCE_PRIOR_WEIGHT
        c = self.counters
        return (n * draft_acceptance_prior(self.model) + c.greedy_first_kept) / (n + c.greedy_first_drafts)

    def stats(self) -> LaneStats:
        """The lane's counters and shape as of its last step's end, safe to read from any thread.
        Device time (`device_s`) is MLX's evaluation: handing graphs over (`mx.async_eval`, which
        on the CPU backend computes most of a forward) and waiting for them; the rest of `cycle_s`
        not in `host_s` built the graphs in Python and kept the books."""
        return self._stats

    def _publish_stats(self) -> None:
        c, p = self.counters, self.proposer
        self._stats = LaneStats(
            **c.copy_fields(), host_s=c.lane_host_s + p.host_s, device_s=c.lane_wait_s + p.wait_s,
            device_drafts=p.device_drafts, context_drafts=p.drafts_from_context, width=self.width, route_id=self.route_id,
            depth=self.lane.depth if self.lane is not None else None, live_rows=self.live_rows,
            greedy_rows=self.greedy_rows, prefilling_rows=len(self.admitter.admitting), waiting_rows=len(self.admitter.waiting),
            last_step=self.last_step)

    def _all_rows(self) -> list:
        return self.admitter.rows() + [r for r in self.rows if r is not None]

    # -- rows in and out ---------------------------------------------------------------------------

    def add(self, req: A3BMTPBatchRequest) -> A3BMTPBatchStreamResult:
        """Queue a row; it joins at a cycle boundary when a slot is free. Returns its stream."""
        validate_request(self.model, req)
        prior = draft_acceptance_prior(self.model) if req.speculative and req.adaptive else ROW_ACCEPT_PRIOR
        row = LaneRow(req, self.model.vocab_size, prior, self.repetition_limits,
                      self._grammar_tokenizer() if req.constraint is not None and req.constraint.reads_text else None)
        if not row.greedy:
            row.chain_depth = self.shapes.checked_depth(req)
        if self.context_drafts and req.speculative and row.greedy and row.grammar is None:
            row.context = NgramIndex(req.prompt_ids + tuple(row.result.tokens))
            row.context_score = ContextScore()
        self.admitter.add(row)
        return row.result

    def _grammar_tokenizer(self):
        tokenizer = getattr(self.model, "tokenizer", None)
        if tokenizer is None:
            raise ValueError("a constrained row needs the model's tokenizer; this model was loaded without one")
        return grammar_tokenizer(tokenizer, self.model.vocab_size)

    def insert(self, requests: Iterable[A3BMTPBatchRequest]) -> list:
        """Queue rows (each joins at a cycle boundary when a slot is free); returns their ids."""
        return [self.add(req).request_id for req in requests]

    def remove(self, request_ids: Iterable[str], end: End = End(CANCELLED)) -> None:
        """End rows early: each ends with `end` (a cancel, unless the caller says otherwise) at
        the next boundary, wherever it is."""
        self._removed.update((rid, end) for rid in request_ids)

    def cancel_all(self) -> None:
        self.next_step.clear()
        self._reporting += self._all_rows()
        for row in self._all_rows():
            row.finish(End(CANCELLED))
        self.admitter.clear()
        self.rows = [None] * len(self.rows)

    # -- one cycle boundary and one step ------------------------------------------------------------

    def step(self) -> list[RowEvent]:
        """One cycle boundary and one cycle: `admit`, then `decode`. Returns each row's
        `RowEvent` (new tokens, its end) for the rows this step changed."""
        return self.admit() + self.decode()

    def admit(self) -> list[RowEvent]:
        """The cycle boundary: removed rows leave, the width follows the demand, prefills advance
        within the budget and finished ones take free slots (each row's first token comes from
        its prefill). Its events can reach clients before the cycle runs (time to first token).
        While a launched cycle computes (`overlap`) it waits: `decode` runs it after that cycle."""
        self._reporting += self._all_rows()
        if self.next_step.launched is None:
            self._boundary()
            self._mark_rows()
        return self.drain_events()

    def _boundary(self) -> None:
        shape = (self.lane, [id(r) for r in self.rows]) if self.next_step.kind is not None else None
        self._drop_cancelled()
        self._resize()
        t0 = time.perf_counter()
        self._admit()
        self.counters.prefill_s += time.perf_counter() - t0
        if shape is not None and shape != (self.lane, [id(r) for r in self.rows]):
            self.next_step.kind = None           # chosen for other rows

    def decode(self) -> list[RowEvent]:
        """One MTP cycle or plain AR step for the live rows (the one launched at the last step's
        end, then the boundary that waited for it, if any). With `run_ahead`, where the next
        cycle may launch before this one's verify is read (`_ahead_ok`), it does, and stays
        launched when this step returns. With `overlap`, when the next boundary has nothing to
        do, the next MTP cycle is launched before this step's events go out: the device computes
        it while the caller streams them."""
        self._reporting += self._all_rows()
        if self.next_step.launched is not None:
            t1, previous = time.perf_counter(), self.last_step
            launched, launch_s = self.next_step.take()
            self.counters.mtp_cycles += 1
            self.counters.overlapped_cycles += 1
            self._finish_launched(launched, self._ahead_ok())
            # a step's time is all it did (the next cycle's launch ahead included: it waits for
            # this one's verify) and the launch `_launch_next` did between steps
            self._observe_step(previous, time.perf_counter() - t1 + launch_s)
            if self.next_step.launched is None and not self._boundary_idle():
                self._boundary()
        elif self.live_rows:
            t1 = time.perf_counter()
            kind, previous = self.next_step.kind or self._choose_step(), self.last_step
            self.next_step.kind = None
            if kind == "mtp" and self._ahead_ok():
                self.counters.mtp_cycles += 1
                self._finish_launched(self._launch_cycle(), True)
            else:
                self._run_step(kind)
            self._observe_step(previous, time.perf_counter() - t1)
        self._mark_rows()           # before a launch: its primaries' draws belong to the next step
        if self.overlap and self.next_step.launched is None and self._boundary_idle():
            self._launch_next()
        return self.drain_events()

    def _launch_next(self) -> None:
        """The next step's kind, chosen now, and if it is an MTP cycle its launch."""
        kind = self._choose_step()
        if kind != "mtp" or not self._any_drafting():
            self.next_step.kind = kind
            return
        t0 = time.perf_counter()
        self.next_step.launched = self._launch_cycle()
        self.next_step.launch_s = time.perf_counter() - t0

    def _finish_launched(self, launched: tuple, ahead: bool) -> None:
        """Finish a launched MTP cycle, first launching the next from it when it runs `ahead`
        (`_ahead_ok`)."""
        if ahead:
            self.counters.ahead_cycles += 1
            self.next_step.launched = self._launch_cycle(commit_on_device(self.state, launched))
        self._finish_cycle(launched)
        self.last_step = "mtp"

    def _ahead_ok(self) -> bool:
        """Whether the next MTP cycle may launch before the host reads this one's verify: with
        `run_ahead`, rows whose keep follows from the verify alone (`rows_may_run_ahead`), the
        boundary idle and an MTP cycle next."""
        return (self.run_ahead and rows_may_run_ahead(self.rows, self.state) and self._boundary_idle()
                and self._choose_step() == "mtp")

    def _observe_step(self, previous: Optional[str], dt: float) -> None:
        self.counters.cycle_s += dt
        self._step_costs.observe(self.lane, self.last_step, previous, dt, self.counters.cycles,
                                 self.counters.graph_first_runs)

    def _boundary_idle(self) -> bool:
        """Whether the next boundary would change nothing: rows live, none waiting, prefilling,
        removed or cancelled, and the lane already at the width and depth its rows want."""
        if not self.live_rows or len(self.admitter) or self._removed or not self.step_chooser.ahead:
            return False
        if any(r is not None and self._gone(r) for r in self.rows):
            return False
        return self.shapes.fit_width(self.demand) == self.width and self._lane_at(self.width) is self.lane and self.proposer.follows_head

    def _mark_rows(self) -> None:
        """Each live row's state now that its step completed: where it resumes if a later step fails."""
        for row in self.rows:
            if row is not None:
                row.mark()

    def salvage(self) -> list[A3BMTPBatchRequest]:
        """After a step raised: the request of every row that had not ended, to re-admit in a new
        lane, each resuming from the end of its last completed step (`LaneRow.mark`): the tokens
        it emitted and reported then, its RNG and drafting policy. What the failed step did to it
        is dropped (the lane's caches may be half-written); it does it again. Rows that ended
        before the fault keep their ends (`drain_events`)."""
        requests = []
        for row in self._all_rows():
            if row.live:
                at = row.resume_point()
                requests.append(row.req if at is None else replace(row.req, resume=at, prefill_group=None,
                                                                    session_restore=None, session_commit=None))
        return requests

    def drain_events(self) -> list[RowEvent]:
        """Each row's news not yet returned, for the rows the lane held when its last step (or
        `admit_all`, `cancel_all`) began and those it holds now: after a step that raised, the
        rows that ended before the fault still report their ends."""
        rows = {id(r): r for r in self._reporting}
        rows.update((id(r), r) for r in self._all_rows())
        self._reporting = []
        self._publish_stats()
        return [e for e in (row.drain_event() for row in rows.values()) if e is not None]

    def _any_drafting(self) -> bool:
        """Whether a row would draft in an MTP cycle now (else that cycle is an AR step)."""
        return any(r is not None and r.wants_draft() for r in self.rows)

    def _choose_step(self) -> str:
        """An MTP cycle or a plain AR step for the next cycle (`step_chooser`)."""
        return self.step_chooser(self)

    def _run_step(self, kind: str) -> None:
        # an MTP cycle in which no row drafts is an AR step (and the head's history is owed)
        if kind == "mtp" and self._any_drafting():
            self.counters.mtp_cycles += 1
            self._cycle()
        else:
            kind = "ar"             # its time is an AR step's
            self.counters.ar_steps += 1
            self._ar_step()
        self.last_step = kind

    def admit_all(self) -> None:
        """Prefill and merge every waiting row that fits, before any cycle (a sealed cohort)."""
        budget, self.admitter.budget = self.admitter.budget, None
        self._reporting += self._all_rows()
        try:
            self._drop_cancelled()
            self._resize()
            self._admit()
        finally:
            self.admitter.budget = budget

    def _gone(self, row: LaneRow) -> Optional[End]:
        """The End of a row removed or cancelled (None: it goes on)."""
        end = self._removed.get(row.req.request_id)
        return end if end is not None else End(CANCELLED) if row.cancelled() else None

    def _drop_cancelled(self) -> None:
        self.admitter.drop(self._gone)
        for b, row in enumerate(self.rows):
            end = None if row is None else self._gone(row)
            if end is not None:
                row.finish(end)
                self.rows[b] = None
        self._removed.clear()

    # -- width and depth ----------------------------------------------------------------------------

    def _lane_at(self, width: int) -> InstalledA3BMTPBatchLane:
        """The installed lane of this width its rows (live and on their way in) want."""
        rows = [r for r in self.rows if r is not None] + self.admitter.rows()
        return self.shapes.lane_at(width, rows, self.lane, self.greedy_acceptance)

    def _resize(self) -> None:
        """Run at the narrowest installed width that fits the demand: widen at once, narrow after
        `narrow_after` cycles of low demand (never below the live rows). The depth follows the
        rows at once (`_lane_at`)."""
        fit = self._lane_at(self.shapes.fit_width(self.demand))
        narrower = self.lane is not None and fit.width < self.width and self.live_rows <= fit.width
        if self.lane is None:
            self._reshape(fit, [])
        elif fit.width > self.width:
            self.counters.widenings += 1
            self.shapes.demand_held()
            self._reshape(fit, list(range(self.width)))
        elif narrower and self.shapes.narrow_due(self.live_rows):
            self.counters.narrowings += 1
            self._reshape(fit, [b for b, r in enumerate(self.rows) if r is not None])
        else:
            if not narrower:
                self.shapes.demand_held()
            here = fit if fit.width == self.width else self._lane_at(self.width)
            if here is not self.lane:         # same width, another depth
                self.counters.depth_switches += 1
                self._reshape(here, list(range(self.width)))

    def _reshape(self, lane: InstalledA3BMTPBatchLane, keep: list) -> None:
        """Run as `lane` from now on; the rows in slots `keep` move to slots 0.. with their state.
        Onto a lane chaining another number of drafts, rows first settle the head history their
        last cycle left owed (its layout is [W, depth]), as before an AR step."""
        if self.state.history is not None:
            if self.lane is not None and lane.depth != self.lane.depth:
                self.state.history.owe_rows(self.rows)
                self.state.history.redepth(lane.depth)
            self.state.history.write(self.model, self.state.mtp_caches)     # its columns are as wide as the old width
        index = keep + [None] * (lane.width - len(keep))
        rows = [self.rows[i] if i is not None else None for i in index]
        if index == list(range(self.width)) and lane.width == self.width:
            pass                         # every row stays in its slot: the state as it is
        elif not self.state.empty and any(r is not None for r in rows):
            self.state.move_rows(index)
        else:            # nothing live to carry: start from empty layers at the new width
            self.state.clear()
        self.lane, self.rows = lane, rows
        self.forwards = self.state.logits_host = None
        self._reserve_for_life([r for r in rows if r is not None])

    def _reserve_for_life(self, rows: list) -> None:
        """A compiled lane's KV buffers sized now for these rows' whole lives, so its graphs are not
        traced again while they decode."""
        if not self.lane.compiled or not rows or self.state.empty:
            return
        self.state.reserve(max(row_positions(len(r.req.prompt_ids), r.req.max_tokens) for r in rows))

    # -- rows on their way in ----------------------------------------------------------------------

    def _admit(self) -> None:
        self.admitter.admit(self.width - self.live_rows, lambda: None in self.rows, self._place)

    def _place(self, adm: RowPrefill) -> None:
        """A finished prefill takes the first free slot; the row's first token comes from it."""
        if self.state.empty:
            self.state.start(adm, self.width, self.lane.depth)
        b = self.rows.index(None)
        self.state.put(b, adm)
        self._reserve_for_life([adm.row])
        logits, hidden = adm.out
        row = adm.row
        r = row.result
        self.rows[b] = row
        if row.req.resume is None:        # a resumed row's placement stats go on from its first lane
            r.admitted_at_cycle, r.fixed_width, r.route_id = self.counters.cycles, self.width, self.lane.route_id
            r.real_width = self.live_rows
        self.counters.admitted += 1
        if not mx.isfinite(hidden).all().item():
            raise RowFailure(row.req.request_id, "its hidden state went non-finite (NaN or inf) in its prefill")
        if row.req.resume is not None:     # resumed: its last token, emitted before, is fed next (if not fed)
            row.pending = row.resumed_pending
            if row.pending is not None:
                return
        else:
            row.decode_started_s = time.perf_counter()
            try:
                row.req.on_decode_start()
            except Exception:
                row.finish(End(CANCELLED))
                self.rows[b] = None
                return
        # The first token comes from the prefill's logits: emit it now rather than after a cycle
        # (time to first token); the next cycle feeds it as the row's primary. Same draw, same order.
        with row_work(row):
            if row.greedy:
                first = int(mx.argmax(logits).item())
                first = first if row.grammar is None else row.constrained_argmax(first, lambda: to_host(logits))
            else:
                first = sample(row.dist(to_host(logits), allowed=row.allowed()), row.rng)
            if row.emit(first, host_logprob(logits, first, row.req.logprobs)):
                self.rows[b] = None
            else:
                row.pending = first

    # -- a step's shared parts: primaries, verify, decisions' end, commit ----------------------------

    def _forwards(self) -> CycleForwards:
        if self.forwards is None:
            self.forwards = CycleForwards(self.lane, self.state.caches, self.state.mtp_caches, self.counters)
        return self.forwards

    def _count_step(self) -> None:
        """Count a step for the lane and its live rows."""
        W, n_live, c = self.width, self.live_rows, self.counters
        c.cycles += 1
        c.row_cycles += n_live
        c.peak_rows = max(c.peak_rows, n_live)
        c.width_cycles[W] = c.width_cycles.get(W, 0) + 1
        for row in self.rows:
            if row is not None:
                r = row.result
                r.cycles += 1
                r.occupancy_sum += n_live
                r.real_width = max(r.real_width, n_live)
                if W >= r.fixed_width:
                    r.fixed_width, r.route_id = W, self.lane.route_id

    def _primaries(self) -> Step:
        """Pick each row's primary token (its pending token, else drawn from its last logits)."""
        rows = self.rows
        active = np.array([r is not None for r in rows])
        has_pending = np.array([r is not None and r.pending is not None for r in rows])
        pending = np.array([r.pending if r is not None and r.pending is not None else 0 for r in rows],
                           dtype=np.int64)
        if all(r.greedy and (r.grammar is None or r.pending is not None) for r in rows if r is not None):
            x0 = mx.where(mx.array(has_pending), mx.array(pending, dtype=mx.uint32),
                          mx.argmax(self.state.logits_last, axis=-1).astype(mx.uint32))
            return Step(active, has_pending, True, x0)
        draw = np.flatnonzero(active & ~has_pending)
        if len(draw) and self.state.logits_host is None:
            self.state.logits_host = to_host(self.state.logits_last)
        t_host = time.perf_counter()
        x0_host = pending.copy()
        for b in draw:
            with row_work(rows[b]) as row:
                x0_host[b] = sample(row.dist(self.state.logits_host[b], allowed=row.allowed()), row.rng)
        self.counters.lane_host_s += time.perf_counter() - t_host
        return Step(active, has_pending, False, mx.array(x0_host, dtype=mx.uint32), x0_host)

    def _speculate_primaries(self, step: Step) -> None:
        """Constrained rows' grammars speculate their primaries (those not yet emitted); a sampled
        one's mask after it starts its list (`Step.allowed`)."""
        step.allowed = {}
        for b in np.flatnonzero(step.active):
            row = self.rows[b]
            if row.grammar is None:
                continue
            with row_work(row):
                if not step.has_pending[b]:
                    row.grammar.speculate(int(step.x0_host[b]))
                if row.masked:
                    step.allowed[b] = [row.grammar.allowed()]

    def _verify(self, step: Step, tokens: mx.array, graph: Optional[str] = None):
        """The target forward over `tokens` [W, T]; the step learns its targets, its primaries and
        drafts on the host, and its log-probability logits. Returns (hidden, logits)."""
        return self._read_verify(step, *self._launch_verify(step, tokens, graph))

    def _launch_verify(self, step: Step, tokens: mx.array, graph: Optional[str] = None) -> tuple:
        """The verify forward's graph, set computing (`mx.async_eval`): (tokens, hidden, logits, what
        the host reads)."""
        H, L = self._forwards().verify(tokens, graph=graph)
        if self.device_judging and not step.greedy and step.proposal is not None and self.proposer.follows_head:
            step.verdicts = DeviceVerdicts.launch(L, self.rows, step.row_depth, step.proposal)
        # a row whose hidden state went non-finite (NaN, inf) fails alone: its logits are garbage
        finite = mx.isfinite(H).all(axis=(1, 2))
        read = [tokens, mx.argmax(L, axis=-1), finite, *(step.verdicts.lazy if step.verdicts else ())]
        t_device = time.perf_counter()
        mx.async_eval(read)          # on MLX's CPU backend this computes most of the graph
        self.counters.lane_wait_s += time.perf_counter() - t_device
        return tokens, H, L, read

    def _read_verify(self, step: Step, tokens: mx.array, H: mx.array, L: mx.array, read: list) -> tuple:
        """The step's one wait for the device, and what the host reads of the verify."""
        t_wait = time.perf_counter()
        mx.eval(read)
        self.counters.lane_wait_s += time.perf_counter() - t_wait
        host = np.array(tokens)
        check_finite(np.array(read[2]), self.rows, step.active)
        step.targets = Targets(self.model.vocab_size, np.array(read[1]), L, allowed=step.allowed,
                               verdicts=step.verdicts.read() if step.verdicts else None)
        step.x0_host, step.d_host = host[:, 0], host[:, 1:]
        if any(r is not None and r.req.logprobs is not None for r in self.rows):
            step.lp_host = step.targets.host_logits()
        return H, L

    def _unwind(self, step: Step) -> None:
        """Constrained rows' grammars roll back what they speculated (primary, drafts): the row's
        decisions then emit, and their grammars consume, what it keeps."""
        for row in self.rows:
            if row is not None and row.grammar is not None:
                with row_work(row):
                    row.grammar.unwind()

    def _end_decisions(self, step: Step) -> None:
        """After every row's decision: the repetition stop, and finished rows leave their slots
        (their state frozen: keep 0)."""
        for b, row in enumerate(self.rows):
            if step.active[b] and row.live and row.req.repetition_stop:
                with row_work(row):
                    row.check_repetition()
            if step.active[b] and not row.live:
                step.keep[b] = 0
                self.rows[b] = None
        self.decisions.ended(step)

    # -- a plain AR step -----------------------------------------------------------------------------

    def _ar_step(self) -> None:
        """One plain AR step for every live row: one target forward over [W, 1] = [primary], no
        head forward; each row keeps its target's next token (the same draws, in the same order,
        as a non-drafting row in an MTP cycle: `generate_ar`'s). The head-history entries of these
        positions (and any entry owed from the last MTP cycle) are owed."""
        self._count_step()
        step = self._primaries()
        self._speculate_primaries(step)
        if self.state.mtp_caches:
            may_draft = self.state.history.owe_rows(self.rows)
            if may_draft.any():
                self.state.history.owe(self.state.h_last, step.x0, may_draft)
        H, L = self._verify(step, step.x0[:, None], graph="ar")
        t_host = time.perf_counter()
        self._unwind(step)
        step.keep = np.zeros(self.width, dtype=np.int64)
        for b in np.flatnonzero(step.active):
            with row_work(self.rows[b]) as row:
                self.decisions.ar(step, b, row, self.state.logits_last)
        self._end_decisions(step)
        self.counters.lane_host_s += time.perf_counter() - t_host
        commit_rows(self.state.caches, 1, step.keep)
        self.state.h_last, self.state.logits_last = H, L[:, 0]
        self.state.logits_host = None if step.targets.logits is None else step.targets.logits[:, 0]
        if self.state.history.due:
            self.state.history.write(self.model, self.state.mtp_caches)

    # -- an MTP cycle ----------------------------------------------------------------------------------

    def _cycle(self) -> None:
        """One MTP cycle: the proposer drafts for the rows that want to, one verify forward over
        [W, 1 + depth] = [primary, drafts] judges them, each row keeps what the acceptor accepts
        (and the bonus when it keeps every draft), and the commit keeps each row's positions."""
        self._finish_cycle(self._launch_cycle())

    def _launch_cycle(self, ahead: Optional[tuple] = None) -> tuple:
        """A cycle up to its verify, set computing: (step, verify). `ahead`: (the step, its rows'
        owed head-history entries [W]) of a cycle launched before the last one's verify was read,
        its primaries and owed entries on the device (`ahead.commit_on_device`)."""
        self._forwards()
        self.state.history.write(self.model, self.state.mtp_caches)     # what AR steps owed, first
        drafting = np.array([r is not None and r.wants_draft() for r in self.rows])
        if ahead is None:
            step = self._primaries()
            self._speculate_primaries(step)
            owed = np.array([r.owed if r is not None else 0 for r in self.rows])
        else:
            step, owed = ahead
        step.drafting = drafting
        step.depth = self.proposer.depth_for(self.lane.depth)
        step.row_depth = np.array([min(r.chain_depth or step.depth, step.depth) if drafting[b] else 0
                                   for b, r in enumerate(self.rows)], dtype=np.int64)
        step.proposal = self.proposer.propose(self.forwards, self.state.history, self.state.h_last, step.x0, self.rows,
                                              step.row_depth, owed, step.active, step.greedy, step.depth,
                                              step.allowed)
        return step, self._launch_verify(step, mx.concatenate([step.x0[:, None], step.proposal.drafts], axis=1))

    def _finish_cycle(self, launched: tuple) -> None:
        """The rest of a launched cycle: the wait, each row's decisions, the commit."""
        step, verify = launched
        self._count_step()
        H, L = self._read_verify(step, *verify)
        if step.ahead:
            check_ahead_primaries(step, self.rows)
        self.proposer.settle(step.proposal, step.d_host)
        self.proposer.score_context(step.proposal, step.targets.ids, self.rows)
        t_host = time.perf_counter()
        for b, masks in (step.allowed or {}).items():    # a sampled constrained row's bonus position
            depth = int(step.row_depth[b])
            if depth:
                with row_work(self.rows[b]) as row:
                    row.grammar.speculate(int(step.d_host[b, depth - 1]))
                    masks.append(row.grammar.allowed())
        self._unwind(step)
        step.keep = np.zeros(self.width, dtype=np.int64)
        for b in np.flatnonzero(step.active):
            with row_work(self.rows[b]) as row:
                self.decisions.cycle(step, b, row, self.state.logits_last)
        self._end_decisions(step)
        self.policy.observe(step.drafted, step.accepted)
        self.counters.lane_host_s += time.perf_counter() - t_host
        if step.device_keep is not None:      # the next cycle, launched ahead, committed this one
            settle_ahead(step, self.rows, self.state)
            return
        T = 1 + step.depth
        self.state.history.record(H, verify[0][:, 1:])
        self.state.h_last, self.state.logits_last = commit_positions(self.state.caches, H, L, step.keep, T)
        L_host = step.targets.logits
        self.state.logits_host = None if L_host is None else L_host[np.arange(self.width), np.maximum(step.keep - 1, 0)]


def draft_acceptance_prior(model) -> float:
    """Where an adaptive row's acceptance estimate starts: the head's greedy acceptance over a
    fixed prompt (PRIOR_TEXT through the model's tokenizer, or without a usable tokenizer a fixed
    run of the vocabulary's ids), PRIOR_TOKENS tokens through the one-row lane, measured once per
    loaded model. A constant of the model, so rows stay reproducible and independent of each
    other; a head that never agrees starts its rows stopped (probing) instead of spending drafts,
    and lane cycles, on learning it."""
    prior = getattr(model, "_draft_acceptance_prior", None)
    if prior is None:
        running = RunningLane(solo_lane(model), prefill_budget=None)
        running.add(A3BMTPBatchRequest(request_id="draft-acceptance-prior", prompt_ids=_prior_prompt(model),
                                       max_tokens=PRIOR_TOKENS))
        while running.has_work:
            running.step()
        c = running.counters
        drafts = c.accepted + c.rejected
        prior = model._draft_acceptance_prior = c.accepted / drafts if drafts else ROW_ACCEPT_PRIOR
    return prior


def _prior_prompt(model) -> tuple:
    tokenizer = getattr(model, "tokenizer", None)
    ids = list(tokenizer.encode(PRIOR_TEXT)) if tokenizer is not None else []
    if ids and all(0 <= t < model.vocab_size for t in ids):
        return tuple(ids)
    return tuple(3 + i % (model.vocab_size - 3) for i in range(16))
