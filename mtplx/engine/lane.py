"""The running lane: many rows decoded as one fixed-width batch while rows come and go.

Each step, for all rows at once: rows whose prefill is done take free slots, then one MTP cycle
(the proposer drafts, one target verify forward judges every row's drafts, the acceptor keeps
0..depth of them per row with the row's own RNG, the commit keeps each row's positions) or,
where no row drafts or drafting does not pay (`StepPolicy`), one plain AR step. The lane name
and route ids follow MTPLX's A3B lane; the lane here is architecture-neutral.
"""

from __future__ import annotations

import time
import weakref
from collections import deque
from itertools import chain
from typing import Callable, Iterable, Optional

import mlx.core as mx
import numpy as np

from mtplx.engine.acceptor import Targets, accept_chain
from mtplx.engine.admission import Admission
from mtplx.engine.commit import HISTORY_FLUSH_AT, HeadHistory, commit_positions
from mtplx.engine.forwards import CycleForwards
from mtplx.engine.installed import (DEPTH, DEPTHS, DRAFT_DRAWS, VERIFY_T, InstalledA3BMTPBatchLane,
                                    default_draft_draw, solo_lane, sorted_ladder)
from mtplx.engine.policy import NARROW_AFTER_CYCLES, StepCostMeter, StepPolicy
from mtplx.engine.prefill import PREFILL_CHUNK
from mtplx.engine.proposer import Proposer
from mtplx.engine.repetition import RepetitionLimits
from mtplx.engine.row import (ROW_ACCEPT_PRIOR, A3BMTPBatchRequest, A3BMTPBatchStreamResult, LaneRow, RowEvent,
                              host_logprob, validate_request)
from mtplx.engine.step import Step
from mtplx.models.cache import RaggedKVCache, commit_rows, empty_batch_layer
from mtplx.sampling import sample, to_host

PRIOR_TEXT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number, computed iteratively."""\n'
PRIOR_TOKENS = 48


class RunningLane:
    """A fixed-width lane that keeps running while rows come and go (continuous admission),
    shaped after mlx-lm's `BatchGenerator`: `insert` rows, `step()` returns what each row did
    (`RowEvent`s), `remove` rows. `ladder` is the installed lanes it may run as: when more rows
    want in than the current width holds it widens to the narrowest installed width that fits,
    carrying the live rows' state over; after `narrow_after` cycles of low demand it narrows
    again. The compiled graphs belong to the installed lanes, so rows coming and going never
    recompile. Rows of any sampling settings share the lane; `greedy_ladder` (the same widths,
    chaining more drafts) is what it runs as while every row that drafts is greedy, and a drafting
    sampled row moves it back to `ladder`'s depth at the boundary where it is queued.

    A new row is prefilled alone, at its own length, one chunk per step while the others decode,
    then merged into a free slot of the ragged caches. A row that does not draft
    (`speculative=False`, or an `adaptive` row that stopped: `LaneRow.drafted`) keeps the target's
    next token each cycle, with `generate_ar`'s draws. Where no row's draws depend on it (greedy
    adaptive rows) the `StepPolicy` may run a plain AR step instead: one target forward [W, 1],
    no head forward, the head's history entries owed (`HeadHistory`).
    """

    def __init__(self, ladder, prefill_budget: Optional[int] = PREFILL_CHUNK,
                 narrow_after: int = NARROW_AFTER_CYCLES, keep_log: bool = False,
                 draft_draw: Optional[str] = None, greedy_ladder=None, sampled_ladder=None,
                 repetition_limits: Optional[RepetitionLimits] = None):
        if draft_draw is not None and draft_draw not in DRAFT_DRAWS:
            raise ValueError(f"draft_draw={draft_draw!r}: expected one of {DRAFT_DRAWS}")
        self.ladder = sorted_ladder(ladder)
        widths = [ln.width for ln in self.ladder]
        # The installed lanes by width and depth. Greedy rows chain `greedy_ladder`'s depth at its
        # widths (a greedy row's tokens are the same at any depth); a sampled row chains its own
        # depth (`draft_depth`, else `sampled_ladder`'s, else `ladder`'s) at every width.
        self._lanes_at: dict = {}
        extra = {"greedy_ladder": greedy_ladder, "sampled_ladder": sampled_ladder}
        for name, lanes in [("ladder", self.ladder)] + [(k, sorted_ladder(v)) for k, v in extra.items() if v is not None]:
            if [ln.width for ln in lanes] != widths:
                raise ValueError(f"{name} widths {[ln.width for ln in lanes]} differ from the ladder's {widths}")
            for ln in lanes:
                self._lanes_at.setdefault(ln.width, {})[ln.depth] = ln
        self.greedy_depths = {ln.width: ln.depth for ln in sorted_ladder(greedy_ladder or self.ladder)}
        # a sampled row's depth at every width: sampled_ladder's, else the ladder's shallowest
        sampled = {ln.depth for ln in sorted_ladder(sampled_ladder or self.ladder)}
        if sampled_ladder is not None and len(sampled) != 1:
            raise ValueError(f"sampled_ladder chains {sorted(sampled)} drafts: a sampled row chains one depth at every width")
        self.sampled_depth = min(sampled)
        self.model = self.ladder[0].model
        self.prefill_chunk = self.ladder[0].prefill_chunk
        self.prefill_budget = prefill_budget          # prompt tokens prefilled per step; None: all
        self.narrow_after = int(narrow_after)
        # the limits of rows that arm the repetition stop (None: MTPLX_REPETITION_STOP_*, else MTPLX's)
        self.repetition_limits = repetition_limits or RepetitionLimits.from_env()
        self.lane: Optional[InstalledA3BMTPBatchLane] = None
        self.rows: list = []                           # slot -> LaneRow or None (free)
        self.waiting: deque = deque()                  # rows not yet prefilling
        self.admitting: deque = deque()                # Admission, FIFO
        self._removed: set = set()                     # request ids to drop at the next boundary
        self._reporting: list = []                     # rows whose news the next drain_events returns
        self.caches = self.mtp_caches = None
        self.logits_last = self.h_last = None
        self.logits_host: Optional[np.ndarray] = None   # logits_last on the host, kept by sampled cycles
        self.history: Optional[HeadHistory] = None
        self.forwards: Optional[CycleForwards] = None
        # where sampled rows draw their drafts: "device" (no wait between the head and the verify:
        # one synchronization a cycle) or "host" (from the whole draft distribution, after a wait)
        self.proposer = Proposer(self.model.vocab_size, draft_draw or default_draft_draw())
        self.cycles = self.accepted = self.rejected = 0
        self.draft_proposals = self.draft_tokens = 0    # rows' drafting cycles, the drafts they chained
        self.accepted_at = [0] * max(DEPTHS)           # accepted drafts by position in their chain
        self.row_cycles = self.peak_rows = 0            # live rows: summed over cycles, most in one
        self.width_cycles: dict = {}
        self.admitted = self.widenings = self.narrowings = 0
        self.depth_switches = 0                        # moves between depths at one width
        self.shared_prefills = 0                       # rows admitted with a sibling's prefill (n > 1)
        self.cycle_s = self.prefill_s = 0.0            # time spent in cycles / in admission prefill
        self.graph_retraces = 0                        # compiled cycle graphs traced again at new shapes
        self._host_s = 0.0                             # host work in cycles besides the proposer's
        self._wait_s = 0.0                             # cycles' waits for the device besides the proposer's
        self._low_demand = 0
        self.keep_log = [] if keep_log else None
        self.draft_log = [] if keep_log else None      # (request id, output position, draft, index in its chain)
        self._policies: dict = {}   # depth -> StepPolicy (a chain's acceptance is its own)
        self.mtp_cycles = self.ar_steps = 0            # of `cycles`, by kind
        self.last_step: Optional[str] = None
        self._step_costs = StepCostMeter()
        # tests: step_plan(cycle index) -> "mtp" | "ar" forces the kind of each step
        self.step_plan: Optional[Callable[[int], str]] = None
        # the self-check's hook: inject_drafts(row index, output position) -> draft token or None
        self.inject_drafts: Optional[Callable[[int, int], Optional[int]]] = None

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

    @draft_draw.setter
    def draft_draw(self, where: str) -> None:
        if where not in DRAFT_DRAWS:
            raise ValueError(f"draft_draw={where!r}: expected one of {DRAFT_DRAWS}")
        self.proposer.draft_draw = where

    @property
    def device_drafts(self) -> int:
        return self.proposer.device_drafts

    @property
    def host_s(self) -> float:
        """Host work in cycles: sampling, accept tests, drafts drawn on the host, rows' bookkeeping."""
        return self._host_s + self.proposer.host_s

    @property
    def device_wait_s(self) -> float:
        """Time cycles spent waiting for the device (the verify, the head where drafts are drawn on
        the host); the rest of `cycle_s` not in `host_s` built the graphs and kept the books."""
        return self._wait_s + self.proposer.wait_s

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
        return self.live_rows + len(self.admitting) + len(self.waiting)

    @property
    def has_work(self) -> bool:
        return self.demand > 0

    def _all_rows(self) -> list:
        return list(self.waiting) + [a.row for a in self.admitting] + [r for r in self.rows if r is not None]

    # -- rows in and out ---------------------------------------------------------------------------

    def add(self, req: A3BMTPBatchRequest) -> A3BMTPBatchStreamResult:
        """Queue a row; it joins at a cycle boundary when a slot is free. Returns its stream."""
        validate_request(self.model, req)
        prior = draft_acceptance_prior(self.model) if req.speculative and req.adaptive else ROW_ACCEPT_PRIOR
        row = LaneRow(req, self.model.vocab_size, prior, self.repetition_limits)
        if not row.greedy:
            row.chain_depth = self._checked_depth(req)
        self.waiting.append(row)
        return row.result

    def _checked_depth(self, req: A3BMTPBatchRequest) -> int:
        depth = self.sampled_depth if req.draft_depth is None else int(req.draft_depth)
        shallow = [w for w, at in self._lanes_at.items() if max(at) < depth]
        if req.speculative and shallow:
            raise ValueError(f"request {req.request_id}: draft_depth={depth} but this lane chains at most "
                             f"{max(self._lanes_at[shallow[0]])} drafts at width {shallow[0]}")
        return depth

    def insert(self, requests: Iterable[A3BMTPBatchRequest]) -> list:
        """Queue rows (each joins at a cycle boundary when a slot is free); returns their ids."""
        return [self.add(req).request_id for req in requests]

    def remove(self, request_ids: Iterable[str]) -> None:
        """Cancel rows: each ends ("cancelled") at the next boundary, wherever it is."""
        self._removed.update(request_ids)

    def cancel_all(self, reason: str = "cancelled") -> None:
        self._reporting += self._all_rows()
        for row in self._all_rows():
            row.finish(reason)
        self.waiting.clear()
        self.admitting.clear()
        self.rows = [None] * len(self.rows)

    # -- one cycle boundary and one step ------------------------------------------------------------

    def step(self) -> list[RowEvent]:
        """One cycle boundary and one cycle: `admit`, then `decode`. Returns each row's
        `RowEvent` (new tokens, its end) for the rows this step changed."""
        return self.admit() + self.decode()

    def admit(self) -> list[RowEvent]:
        """The cycle boundary: removed rows leave, the width follows the demand, prefills advance
        within the budget and finished ones take free slots (each row's first token comes from
        its prefill). Its events can reach clients before the cycle runs (time to first token)."""
        self._reporting += self._all_rows()
        self._drop_cancelled()
        self._resize()
        t0 = time.perf_counter()
        self._admit()
        self.prefill_s += time.perf_counter() - t0
        return self.drain_events()

    def decode(self) -> list[RowEvent]:
        """One MTP cycle or plain AR step for the live rows."""
        self._reporting += self._all_rows()
        if self.live_rows:
            t1 = time.perf_counter()
            kind, previous = self._choose_step(), self.last_step
            self._run_step(kind)
            dt = time.perf_counter() - t1
            self.cycle_s += dt
            self._step_costs.observe(self.lane, self.last_step, previous, dt, self.cycles)
        return self.drain_events()

    def drain_events(self) -> list[RowEvent]:
        """Each row's news not yet returned, for the rows the lane held when its last step (or
        `admit_all`, `cancel_all`) began and those it holds now: after a step that raised, the
        rows that ended before the fault still report their ends."""
        rows = {id(r): r for r in self._reporting}
        rows.update((id(r), r) for r in self._all_rows())
        self._reporting = []
        return [e for e in (row.drain_event() for row in rows.values()) if e is not None]

    def _choose_step(self) -> str:
        """An MTP cycle or a plain AR step for the next cycle. A row that wants to draft and whose
        draws the choice would change (sampled, or forced "mtp") gets an MTP cycle; greedy
        adaptive rows leave it to the cost model."""
        if self.step_plan is not None:
            return self.step_plan(self.cycles)
        live = [r for r in self.rows if r is not None]
        wanting = [r for r in live if r.wants_draft()]
        if not wanting:
            return "ar"
        if any(not (r.greedy and r.req.adaptive) for r in wanting):
            return "mtp"
        if self.policy.acceptance is None:
            # from the model's prior, as its rows start: estimated from its first outcome alone,
            # one rejected first draft sent a lane to 16 + 32 AR steps
            p = draft_acceptance_prior(self.model)       # per draft; a chain's j-th needs all before it
            self.policy.acceptance = sum(p ** j for j in range(1, self.lane.depth + 1))
        return self.policy.choose(self.lane.step_costs, len(live), len(wanting), self.lane.depth)

    def _run_step(self, kind: str) -> None:
        # an MTP cycle in which no row drafts is an AR step (and the head's history is owed)
        if kind == "mtp" and any(r is not None and r.wants_draft() for r in self.rows):
            self.mtp_cycles += 1
            self._cycle()
        else:
            kind = "ar"             # its time is an AR step's
            self.ar_steps += 1
            self._ar_step()
        self.last_step = kind

    def admit_all(self) -> None:
        """Prefill and merge every waiting row that fits, before any cycle (a sealed cohort)."""
        budget, self.prefill_budget = self.prefill_budget, None
        self._reporting += self._all_rows()
        try:
            self._drop_cancelled()
            self._resize()
            self._admit()
        finally:
            self.prefill_budget = budget

    def _gone(self, row: LaneRow) -> bool:
        return row.req.request_id in self._removed or row.cancelled()

    def _drop_cancelled(self) -> None:
        for row in [r for r in self.waiting if self._gone(r)]:
            self.waiting.remove(row)
            row.finish("cancelled")
        for adm in [a for a in self.admitting if self._gone(a.row)]:
            self.admitting.remove(adm)
            adm.row.finish("cancelled")
        for b, row in enumerate(self.rows):
            if row is not None and self._gone(row):
                row.finish("cancelled")
                self.rows[b] = None
        self._removed.clear()

    # -- width and depth -----------------------------------------------------------------------------

    def _lane_at(self, width: int) -> InstalledA3BMTPBatchLane:
        """The installed lane of this width for the rows live or queued: deep enough for every
        sampled row that drafts in its next cycle, and for greedy rows that draft, their depth
        here (`greedy_ladder`); the shallowest such lane installed (else the deepest). With no row
        drafting the depth stays (a row that does not draft makes the same draws at any depth)."""
        at = self._lanes_at[width]
        rows = [r for r in chain(self.rows, (a.row for a in self.admitting), self.waiting)
                if r is not None and r.wants_draft()]
        greedy = [self.greedy_depths[width]] if any(r.greedy for r in rows) else []
        need = max([r.chain_depth for r in rows if not r.greedy] + greedy, default=0)
        if not need:
            need = self.lane.depth if self.lane is not None else self.ladder[0].depth
        return at[min((d for d in at if d >= need), default=max(at))]

    def _resize(self) -> None:
        """Pick the narrowest installed width that fits the demand: widen at once, narrow after
        `narrow_after` cycles of low demand (never below the live rows). The depth follows the
        rows at once (`_lane_at`)."""
        width = next((ln.width for ln in self.ladder if ln.width >= self.demand), self.ladder[-1].width)
        fit = self._lane_at(width)
        narrower = self.lane is not None and fit.width < self.width and self.live_rows <= fit.width
        if self.lane is None:
            self._reshape(fit, [])
        elif fit.width > self.width:
            self.widenings += 1
            self._low_demand = 0
            self._reshape(fit, list(range(self.width)))
        elif narrower and self._narrow_due():
            self.narrowings += 1
            self._reshape(fit, [b for b, r in enumerate(self.rows) if r is not None])
        else:
            if not narrower:
                self._low_demand = 0
            here = self._lane_at(self.width)
            if here is not self.lane:         # same width, another depth
                self.depth_switches += 1
                self._reshape(here, list(range(self.width)))

    def _narrow_due(self) -> bool:
        self._low_demand += 1
        if self._low_demand >= self.narrow_after or not self.live_rows:
            self._low_demand = 0
            return True
        return False

    def _reshape(self, lane: InstalledA3BMTPBatchLane, keep: list) -> None:
        """Run as `lane` from now on; the rows in slots `keep` move to slots 0.. with their state.
        Onto a lane chaining another number of drafts, rows first settle the head history their
        last cycle left owed (its layout is [W, depth]), as before an AR step."""
        if self.history is not None:
            if self.lane is not None and lane.depth != self.lane.depth:
                self.history.owe_rows(self.rows)
                self.history.redepth(lane.depth)
            self.history.write(self.model, self.mtp_caches)     # its columns are as wide as the old width
        index = keep + [None] * (lane.width - len(keep))
        rows = [self.rows[i] if i is not None else None for i in index]
        if index == list(range(self.width)) and lane.width == self.width:
            pass                         # every row stays in its slot: the state as it is
        elif self.caches is not None and any(r is not None for r in rows):
            self._move_rows(index)
        else:            # nothing live to carry: start from empty layers at the new width
            self.caches = self.mtp_caches = self.history = None
        self.lane, self.rows = lane, rows
        self.forwards = self.logits_host = None
        self._reserve_for_life([r for r in rows if r is not None])

    def _move_rows(self, index: list) -> None:
        """New slot i takes old slot index[i]'s state (None: an empty slot)."""
        take = [i if i is not None else 0 for i in index]
        self.caches = [c.take_rows(index) for c in self.caches]
        self.mtp_caches = [c.take_rows(index) for c in self.mtp_caches]
        sel = mx.array(take, dtype=mx.int32)
        self.logits_last, self.h_last = self.logits_last[sel], self.h_last[sel]
        self.history.take(take)

    def _reserve_for_life(self, rows: list) -> None:
        """A compiled lane's KV buffers sized now for these rows' whole lives, so its graphs are not
        traced again while they decode."""
        if not self.lane.compiled or not rows or self.caches is None:
            return
        need = max(len(r.req.prompt_ids) + r.req.max_tokens for r in rows) + max(VERIFY_T, HISTORY_FLUSH_AT)
        for layer in self.caches + self.mtp_caches:
            if isinstance(layer, RaggedKVCache):
                layer.ensure_capacity(need)

    # -- admission -----------------------------------------------------------------------------------

    def _ensure_state(self, adm: Admission) -> None:
        """Empty lane state at the current width, shaped like this first row's."""
        if self.caches is not None:
            return
        W = self.width
        self.caches = [empty_batch_layer(c, W) for c in adm.cache]
        self.mtp_caches = [empty_batch_layer(c, W) for c in adm.mtp_cache or []]
        logits, hidden = adm.out
        self.logits_last = mx.zeros((W,) + logits.shape, logits.dtype)
        self.h_last = mx.zeros((W,) + hidden.shape[1:], hidden.dtype)
        self.history = HeadHistory(W, self.lane.depth, hidden)

    def _admit(self) -> None:
        """Start prefills for free slots (FIFO), advance them within the prefill budget, and merge
        each finished prefill into a free slot."""
        free = self.width - self.live_rows
        while self.waiting and len(self.admitting) < free:
            self.admitting.append(Admission(self.model, self.waiting.popleft(), self.prefill_chunk))
        budget = self.prefill_budget
        spent = 0
        while self.admitting and (budget is None or spent < budget):
            adm = self.admitting[0]
            spent += adm.advance()
            if adm.out is not None:
                self.admitting.popleft()
                self._place(adm)
                self._place_siblings(adm)

    def _place_siblings(self, adm: Admission) -> None:
        """Rows of adm's prefill group that have not started their own prefill take its prefill
        instead, as far as free slots go (the rest prefill on their own when a slot frees)."""
        group = adm.row.req.prefill_group
        if group is None:
            return
        prompt = adm.row.req.prompt_ids
        queued = [a.row for a in self.admitting if a.steps is None] + list(self.waiting)
        for row in [r for r in queued if r.req.prefill_group == group and r.req.prompt_ids == prompt]:
            if None not in self.rows:
                return
            if row in self.waiting:
                self.waiting.remove(row)
            else:
                self.admitting.remove(next(a for a in self.admitting if a.row is row))
            self.shared_prefills += 1
            self._place(adm.shared_with(row))

    def _place(self, adm: Admission) -> None:
        self._ensure_state(adm)
        b = self.rows.index(None)
        for layer, per_row in zip(self.caches, adm.cache):
            layer.put_row(b, per_row)
        for layer, per_row in zip(self.mtp_caches, adm.mtp_cache or []):
            layer.put_row(b, per_row)
        self._reserve_for_life([adm.row])
        logits, hidden = adm.out
        self.logits_last[b] = logits
        self.h_last[b] = hidden[0]
        self.logits_host = None
        self.history.clear_slot(b)
        row = adm.row
        r = row.result
        self.rows[b] = row
        r.admitted_at_cycle, r.fixed_width, r.route_id = self.cycles, self.width, self.lane.route_id
        r.real_width = self.live_rows
        self.admitted += 1
        row.decode_started_s = time.perf_counter()
        try:
            row.req.on_decode_start()
        except Exception:
            row.finish("cancelled")
            self.rows[b] = None
            return
        # The first token comes from the prefill's logits: emit it now rather than after a cycle
        # (time to first token); the next cycle feeds it as the row's primary. Same draw, same order.
        first = int(mx.argmax(logits).item()) if row.greedy else sample(row.dist(to_host(logits)), row.rng)
        if row.emit(first, host_logprob(logits, first, row.req.logprobs)):
            self.rows[b] = None
        else:
            row.pending = first

    # -- a step's shared parts: primaries, verify, decisions' end, commit ----------------------------

    def _forwards(self) -> CycleForwards:
        if self.forwards is None:
            self.forwards = CycleForwards(self.lane, self.caches, self.mtp_caches, weakref.proxy(self))
        return self.forwards

    def _count_step(self) -> None:
        """Count a step for the lane and its live rows."""
        W, n_live = self.width, self.live_rows
        self.cycles += 1
        self.row_cycles += n_live
        self.peak_rows = max(self.peak_rows, n_live)
        self.width_cycles[W] = self.width_cycles.get(W, 0) + 1
        for row in self.rows:
            if row is not None:
                r = row.result
                r.cycles += 1
                r.occupancy_sum += n_live
                r.real_width = max(r.real_width, n_live)
                if W >= r.fixed_width:
                    r.fixed_width, r.route_id = W, self.lane.route_id

    def _primaries(self) -> Step:
        """Start a step: count it, and pick each row's primary token (its pending token, else
        drawn from its last logits)."""
        self._count_step()
        rows = self.rows
        active = np.array([r is not None for r in rows])
        has_pending = np.array([r is not None and r.pending is not None for r in rows])
        pending = np.array([r.pending if r is not None and r.pending is not None else 0 for r in rows],
                           dtype=np.int64)
        if all(r.greedy for r in rows if r is not None):
            x0 = mx.where(mx.array(has_pending), mx.array(pending, dtype=mx.uint32),
                          mx.argmax(self.logits_last, axis=-1).astype(mx.uint32))
            return Step(active, has_pending, True, x0)
        logits_host = self.logits_host if self.logits_host is not None else to_host(self.logits_last)
        t_host = time.perf_counter()
        x0_host = pending.copy()
        for b in np.flatnonzero(active & ~has_pending):
            x0_host[b] = sample(rows[b].dist(logits_host[b]), rows[b].rng)
        self._host_s += time.perf_counter() - t_host
        return Step(active, has_pending, False, mx.array(x0_host, dtype=mx.uint32), x0_host)

    def _verify(self, step: Step, tokens: mx.array, graph: Optional[str] = None):
        """The target forward over `tokens` [W, T]; the step learns its targets, its primaries and
        drafts on the host, and its log-probability logits. Returns (hidden, logits, host logits)."""
        H, L = self._forwards().verify(tokens, graph=graph)
        L_host = None
        t_wait = time.perf_counter()
        if step.greedy:
            ids = mx.argmax(L, axis=-1)
            mx.eval(tokens, ids)
            self._wait_s += time.perf_counter() - t_wait
            host = np.array(tokens)
            step.targets = Targets(self.model.vocab_size, ids=np.array(ids))
        else:
            mx.eval(L, tokens)         # the step's one wait (drafts drawn on the device ride along)
            self._wait_s += time.perf_counter() - t_wait
            L_host, host = to_host(L), np.array(tokens)
            step.targets = Targets(self.model.vocab_size, logits=L_host)
        step.x0_host, step.d_host = host[:, 0], host[:, 1:]
        if any(r is not None and r.req.logprobs is not None for r in self.rows):
            step.lp_host = L_host if L_host is not None else to_host(L)
        return H, L, L_host

    def _emit_primary(self, b: int, row: LaneRow, token: int) -> bool:
        """Emit row b's primary token (not yet emitted: it came from last step's logits); True
        when the row finished on it."""
        return row.emit(token, host_logprob(self.logits_last[b], token, row.req.logprobs))

    def _keep_target(self, step: Step, b: int, row: LaneRow) -> None:
        """A row that did not draft keeps the target's own next token (AR's draws)."""
        row.skipped()
        tok = step.targets.token(row, b, 0)
        row.pending, row.owed, step.keep[b] = None, 0, 1
        if not row.emit(tok, step.entry(row, b, 0, tok)):
            row.pending = tok

    def _end_decisions(self, step: Step) -> None:
        """After every row's decision: the repetition stop, and finished rows leave their slots
        (their state frozen: keep 0)."""
        for b, row in enumerate(self.rows):
            if step.active[b] and row.live and row.req.repetition_stop:
                row.check_repetition()
            if step.active[b] and not row.live:
                step.keep[b] = 0
                self.rows[b] = None
        if self.keep_log is not None:
            self.keep_log.extend(int(k) for k, a in zip(step.keep, step.active) if a)

    # -- a plain AR step -----------------------------------------------------------------------------

    def _ar_step(self) -> None:
        """One plain AR step for every live row: one target forward over [W, 1] = [primary], no
        head forward; each row keeps its target's next token (the same draws, in the same order,
        as a non-drafting row in an MTP cycle: `generate_ar`'s). The head-history entries of these
        positions (and any entry owed from the last MTP cycle) are owed."""
        step = self._primaries()
        if self.mtp_caches:
            may_draft = self.history.owe_rows(self.rows)
            if may_draft.any():
                self.history.owe(self.h_last, step.x0, may_draft)
        H, L, L_host = self._verify(step, step.x0[:, None], graph="ar")
        t_host = time.perf_counter()
        step.keep = np.zeros(self.width, dtype=np.int64)
        for b in np.flatnonzero(step.active):
            row = self.rows[b]
            if step.has_pending[b] or not self._emit_primary(b, row, int(step.x0_host[b])):
                self._keep_target(step, b, row)
        self._end_decisions(step)
        self._host_s += time.perf_counter() - t_host
        commit_rows(self.caches, 1, step.keep)
        self.h_last, self.logits_last = H, L[:, 0]
        self.logits_host = None if L_host is None else L_host[:, 0]
        if self.history.due:
            self.history.write(self.model, self.mtp_caches)

    # -- an MTP cycle ----------------------------------------------------------------------------------

    def _cycle(self) -> None:
        """One MTP cycle: the proposer drafts for the rows that want to, one verify forward over
        [W, 1 + depth] = [primary, drafts] judges them, each row keeps what the acceptor accepts
        (and the bonus when it keeps every draft), and the commit keeps each row's positions."""
        self._forwards()
        self.history.write(self.model, self.mtp_caches)     # what AR steps owed, first
        drafting = np.array([r is not None and r.wants_draft() for r in self.rows])
        step = self._primaries()
        step.drafting = drafting
        step.depth = self.lane.depth if self.inject_drafts is None else 1   # the self-check injects single drafts
        step.row_depth = np.array([min(r.chain_depth or step.depth, step.depth) if drafting[b] else 0
                                   for b, r in enumerate(self.rows)], dtype=np.int64)
        owed = np.array([r.owed if r is not None else 0 for r in self.rows])
        step.proposal = self.proposer.propose(self.forwards, self.history, self.h_last, step.x0, self.rows,
                                              step.row_depth, owed, step.active, step.greedy, step.depth)
        drafts = step.proposal.drafts
        if self.inject_drafts is not None:
            drafts = mx.array(self._injected(np.array(drafts[:, 0]), step), dtype=mx.uint32)[:, None]
        H, L, L_host = self._verify(step, mx.concatenate([step.x0[:, None], drafts], axis=1))
        self.proposer.settle(step.proposal, step.d_host, check=self.inject_drafts is None)
        t_host = time.perf_counter()
        step.keep = np.zeros(self.width, dtype=np.int64)
        for b in np.flatnonzero(step.active):
            self._decide(step, b, self.rows[b])
        self._end_decisions(step)
        self.policy.observe(step.drafted, step.accepted)
        self._host_s += time.perf_counter() - t_host
        T = 1 + step.depth
        self.history.record(H, step.d_host)
        self.h_last, self.logits_last = commit_positions(self.caches, H, L, step.keep, T)
        self.logits_host = None if L_host is None else L_host[np.arange(self.width), np.maximum(step.keep - 1, 0)]

    def _injected(self, drafts: np.ndarray, step: Step) -> np.ndarray:
        """Drafts replaced by `inject_drafts` (row index = request id in a sealed cohort); the
        draft guesses the output position after this cycle's primary."""
        for b, row in enumerate(self.rows):
            if step.drafting[b]:
                primary_at = len(row.result.tokens) - int(step.has_pending[b])
                tok = self.inject_drafts(int(row.req.request_id), primary_at + 1)
                if tok is not None:
                    drafts[b] = tok
        return drafts

    def _decide(self, step: Step, b: int, row: LaneRow) -> None:
        """Row b's part of the cycle, with its own RNG in the solo path's order: its primary (if
        not yet emitted), then its drafts judged left to right, the residual at the first
        rejection, or the bonus when every draft is kept."""
        if not step.has_pending[b] and self._emit_primary(b, row, int(step.x0_host[b])):
            return
        if not step.drafting[b]:
            self._keep_target(step, b, row)
            return
        row.pending = None
        step.drafted += 1
        depth = int(step.row_depth[b])
        kept, residual = accept_chain(
            step.d_host[b, :depth], lambda j, draft: self._judge(step, b, row, j, draft),
            lambda j, tok: row.emit(tok, step.entry(row, b, j, tok)))
        step.accepted += kept
        if not row.live:
            return
        if residual is not None:
            step.keep[b], row.pending = 1 + kept, residual
        else:
            step.keep[b] = 1 + depth
            self._bonus(step, b, row, depth)
        row.owed = kept                  # entries (H[j], draft j) for its accepted drafts

    def _judge(self, step: Step, b: int, row: LaneRow, j: int, draft: int) -> tuple:
        """The acceptor's verdict on row b's j-th draft, counted for the lane, the row and its
        drafting policy."""
        kept, token = step.targets.judge(row, b, j, draft, step.proposal.q_of(b, j))
        r = row.result
        if j == 0:
            row.drafted(kept)           # its policy reads its first draft's outcome
            r.mtp_depth = max(r.mtp_depth, int(step.row_depth[b]))
            self.draft_proposals += 1
            self.draft_tokens += int(step.row_depth[b])
        if self.draft_log is not None:
            self.draft_log.append((row.req.request_id, len(r.tokens), draft, j))
        if kept:
            self.accepted += 1
            self.accepted_at[j] += 1
            r.accepted_drafts += 1
        else:
            self.rejected += 1
            r.rejected_drafts += 1
        return kept, token

    def _bonus(self, step: Step, b: int, row: LaneRow, depth: int) -> None:
        """Every draft of its chain kept: the verify's position after them gives one more token
        (unless the row omits it)."""
        if row.req.omit_speculative_bonus or len(row.result.tokens) >= row.req.max_tokens:
            return
        bonus = step.targets.token(row, b, depth)
        if not row.emit(bonus, step.entry(row, b, depth, bonus)):
            row.pending = bonus


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
        drafts = running.accepted + running.rejected
        prior = model._draft_acceptance_prior = running.accepted / drafts if drafts else ROW_ACCEPT_PRIOR
    return prior


def _prior_prompt(model) -> tuple:
    tokenizer = getattr(model, "tokenizer", None)
    ids = list(tokenizer.encode(PRIOR_TEXT)) if tokenizer is not None else []
    if ids and all(0 <= t < model.vocab_size for t in ids):
        return tuple(ids)
    return tuple(3 + i % (model.vocab_size - 3) for i in range(16))
