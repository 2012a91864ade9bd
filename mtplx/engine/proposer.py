"""The proposer: each drafting row's chain of drafts from the model's own MTP head, or, for a
greedy row, from its own context (`context_drafts`: mtplx.engine.ngram) where its last tokens
occurred before and its context has been right more often than the head where the two first
drafts differed (the row's `ContextScore`: on Gemma 3 270M the context, on the shipped model,
whose head copies well, the head); a chained draft after a context draft is the head's from it. The head
runs over [W, 1 + D] (each row's owed history entries, then its draft entry (h_last, primary));
at depth 2-3 it runs again on its own output and last draft per chained draft. Where a draft
comes from: the head's argmax for a greedy draft sampler (q a point mass, no draw); otherwise a
draw from the row's own draft distribution q with its own RNG, on the device (no wait between
the head and the verify) or on the host (after a wait, from the whole q; always for a draft
sampler with penalties, whose token counts live on the host). A constrained row's draft j comes
from q restricted to what its grammar allows after its primary and drafts 0..j-1: its head
logits are masked on the device before the argmax or the draw. Its first draft's mask is known
before the head runs (its primary is on the host); a chained draft's needs the drafts before it
on the host, one wait per chained draft in a lane holding a constrained row."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional


import mlx.core as mx
import numpy as np

from mtplx.engine.row import row_work
from mtplx.engine.settings import EngineSettings
from mtplx.models.cache import commit_rows
from mtplx.sampling import (SamplerConfig, device_draft_distribution, device_draft_draw, draft_uniform,
                            draws_on_device, sample, to_host)


@dataclass
class Proposal:
    """A cycle's drafts [W, depth] (lazy) and what the acceptor needs of how they were drawn."""
    drafts: mx.array
    depth: int
    q: list = field(default_factory=list)        # [depth][W]: a drawn draft's distribution (None: a point mass)
    device_draws: list = field(default_factory=list)   # per chained draft: (rows drawn on the device, the draw)
    context: Optional[tuple] = None   # the rows' context drafts (has [W, depth], tokens [W, depth]), used or not
    head_first: Optional[mx.array] = None    # the head's own first drafts [W], where context drafts exist

    def q_of(self, b: int, j: int):
        return self.q[j][b] if self.q else None


class Proposer:
    """Drafts for a lane's rows. `draft_draw`: "device" or "host" (where drawn drafts are drawn)."""

    follows_head = True     # the drafts are the head's own: a cycle may launch before the last is read

    def __init__(self, vocab: int, draft_draw: str):
        self.vocab, self.draft_draw = vocab, draft_draw
        self.device_drafts = 0            # drafts drawn on the device
        self.drafts_from_context = 0      # drafts taken from the rows' own context
        self.host_s = 0.0                 # host time spent drawing drafts and rebuilding their q
        self.wait_s = 0.0                 # time in MLX's evaluation of the head (its drafts)

    def depth_for(self, lane_depth: int) -> int:
        """The drafts a cycle chains at a lane of `lane_depth`."""
        return lane_depth

    def propose(self, forwards, history, h_last, x0, rows, row_depth: np.ndarray, owed,
                keep_history: np.ndarray, greedy: bool, depth: int, allowed: Optional[dict] = None) -> Proposal:
        """The drafts of every row [W, depth]: row b drafts its first `row_depth[b]` (0: it does not
        draft); past them a row's entries are whatever the head gave, never judged, and make no
        draws. The head forward also writes each row's owed history entries (`owed` [W]: on the
        host, or on the device when the last cycle's verify is not read yet). `allowed`: each
        sampled constrained row's masks so far ([after its primary]); the mask each of its chained
        drafts is drawn under is appended (the lane appends the last, after the verify)."""
        allowed = allowed or {}
        constrained = [b for b, r in enumerate(rows) if r is not None and r.grammar is not None and row_depth[b] > 0]
        W, D = len(rows), history.hidden.shape[1]
        proposal = Proposal(drafts=None, depth=depth, q=[] if greedy else [[None] * W for _ in range(depth)])
        on_device = isinstance(owed, mx.array)          # a cycle launched before the last one was read
        # rows with an `NgramIndex` (`LaneRow.context`): read on the host, so never run ahead
        context = None if on_device else self._context(rows, row_depth, x0, depth)
        q_logits, g = forwards.draft(history.hidden, h_last, history.tokens, x0,
                                     owed if on_device else mx.array(owed.astype(np.int32)))   # [W, V], [W, 1, H]
        commit_rows(forwards.mtp_caches, D + 1, mx.where(mx.array(keep_history), 1 + owed, 0) if on_device
                    else np.where(keep_history, 1 + owed, 0))
        head_first = self._draws(self._masked(q_logits, rows, constrained, row_depth, 0, None, allowed),
                                 rows, row_depth > 0, greedy, proposal, 0)
        proposal.context, proposal.head_first = context, head_first if context is not None else None
        used = self._preferred(context, rows)
        drafts = [self._with_context(head_first, used, 0)]
        self._start(drafts[-1])
        for j in range(1, depth):
            q_logits, g = forwards.chain(g, drafts[-1])
            commit_rows(forwards.mtp_caches, 1, np.zeros(W, dtype=np.int64))
            q_logits = self._masked(q_logits, rows, constrained, row_depth, j, drafts[-1], allowed)
            drafts.append(self._with_context(self._draws(q_logits, rows, row_depth > j, greedy, proposal, j), used, j))
            self._start(drafts[-1])
        proposal.drafts = mx.stack(drafts, axis=1) if depth > 1 else drafts[0][:, None]
        return proposal

    def _context(self, rows, row_depth: np.ndarray, x0: mx.array, depth: int) -> Optional[tuple]:
        """(has [W, depth], tokens [W, depth]): each row's drafts from its context (`LaneRow.context`),
        continuing its tokens and its primary; None where no row has one."""
        takers = [b for b, r in enumerate(rows) if r is not None and r.context is not None and row_depth[b] > 0]
        if not takers:
            return None
        t_host = time.perf_counter()
        x0_host = np.array(x0)              # a greedy lane's argmaxes of the last verify: computed
        has = np.zeros((len(rows), depth), dtype=bool)
        tokens = np.zeros((len(rows), depth), dtype=np.uint32)
        for b in takers:
            row = rows[b]
            # a pending primary is emitted already (in the row's tokens); a drawn one is not yet
            drafts = row.context.propose(int(row_depth[b]), None if row.pending is not None else int(x0_host[b]))
            has[b, :len(drafts)] = True
            tokens[b, :len(drafts)] = drafts
        self.host_s += time.perf_counter() - t_host
        return (has, tokens) if has.any() else None

    def score_context(self, proposal: Proposal, target_ids: np.ndarray, rows) -> None:
        """After the verify: where a row's context and head first drafts differed, which was the
        target's token (`target_ids` [W, T]: the verify's argmaxes; position 0 judges the first
        draft, whichever was used), into the row's own score."""
        if proposal.context is None:
            return
        has, tokens = proposal.context
        head = np.array(proposal.head_first)          # computed with the verify
        for b in np.flatnonzero(has[:, 0]):
            if tokens[b, 0] != head[b]:
                rows[b].context_score.observe(int(tokens[b, 0]) == int(target_ids[b, 0]),
                                              int(head[b]) == int(target_ids[b, 0]))

    def _preferred(self, context: Optional[tuple], rows) -> Optional[tuple]:
        """The context drafts of the rows whose score prefers them (the others' are scored, not used)."""
        if context is None:
            return None
        has = context[0] & np.array([r is not None and r.context is not None and r.context_score.prefers_context()
                                     for r in rows])[:, None]
        self.drafts_from_context += int(has.sum())
        return (has, context[1]) if has.any() else None

    @staticmethod
    def _with_context(draft: mx.array, context: Optional[tuple], j: int) -> mx.array:
        if context is None or not context[0][:, j].any():
            return draft
        return mx.where(mx.array(context[0][:, j]), mx.array(context[1][:, j]), draft)

    def _start(self, draft: mx.array) -> None:
        """Set a draft computing as soon as its graph is built: the device works through the head
        while the host builds the next chained draft's graph and the verify's."""
        t_device = time.perf_counter()
        mx.async_eval(draft)
        self.wait_s += time.perf_counter() - t_device

    def _draws(self, q_logits: mx.array, rows, drafting: np.ndarray, greedy: bool, proposal: Proposal,
               j: int) -> mx.array:
        """The j-th draft of every row [W] (lazy)."""
        if greedy:
            return mx.argmax(q_logits, axis=-1).astype(mx.uint32)
        coupled = np.array([drafting[b] and r.greedy_draft for b, r in enumerate(rows)])
        drawn = drafting & ~coupled
        on_device = drawn & (self.draft_draw == "device") & np.array(
            [r is not None and draws_on_device(r.draft_sampler) for r in rows])
        d = mx.array(self._host_draws(q_logits, rows, drawn & ~on_device, proposal.q[j]), dtype=mx.uint32)
        t_host = time.perf_counter()
        device_draw = None
        if on_device.any():
            m = np.array([draft_uniform(r.rng) if on_device[b] else 0 for b, r in enumerate(rows)])
            cfgs = [r.draft_sampler if on_device[b] else SamplerConfig() for b, r in enumerate(rows)]
            drafts, ids, t = device_draft_draw(q_logits, cfgs, m)
            d = mx.where(mx.array(on_device), drafts, d)
            device_draw = (ids, t, m)
            self.device_drafts += int(on_device.sum())
        proposal.device_draws.append((on_device, device_draw))
        if coupled.any():
            d = mx.where(mx.array(coupled), mx.argmax(q_logits, axis=-1).astype(mx.uint32), d)
        self.host_s += time.perf_counter() - t_host
        return d

    def _host_draws(self, q_logits: mx.array, rows, on_host: np.ndarray, q: list) -> np.ndarray:
        """Drafts drawn on the host from each row's whole q (after a wait for the head)."""
        d_host = np.zeros(len(rows), dtype=np.int64)
        if not on_host.any():
            return d_host
        t_wait = time.perf_counter()
        q_host = to_host(q_logits)          # the wait for the head
        t_host = time.perf_counter()
        self.wait_s += t_host - t_wait
        for b in np.flatnonzero(on_host):
            with row_work(rows[b]) as row:
                q[b] = row.dist(q_host[b], row.draft_sampler)
                d_host[b] = sample(q[b], row.rng)
        self.host_s += time.perf_counter() - t_host
        return d_host

    def _masked(self, q_logits: mx.array, rows, constrained: list, row_depth: np.ndarray, j: int,
                previous: Optional[mx.array], allowed: dict) -> mx.array:
        """The head's logits for draft j with each constrained drafting row's masked to what its
        grammar allows after its primary and drafts 0..j-1 (the previous draft read on the host and
        speculated first: the wait); a sampled row's mask joins its list."""
        drafting = [b for b in constrained if row_depth[b] > j]
        if not drafting:
            return q_logits
        if previous is not None:
            t_wait = time.perf_counter()
            previous = np.array(previous)          # the wait for the drafts before
            self.wait_s += time.perf_counter() - t_wait
        t_host = time.perf_counter()
        mask = np.ones(q_logits.shape, dtype=bool)
        for b in drafting:
            with row_work(rows[b]) as row:
                if previous is not None:
                    row.grammar.speculate(int(previous[b]))
                allowed_b = row.grammar.allowed()
            if allowed_b is not None:
                mask[b] = allowed_b
            if b in allowed and j > 0:
                allowed[b].append(allowed_b)
        self.host_s += time.perf_counter() - t_host
        return mx.where(mx.array(mask), q_logits, mx.array(-np.inf, dtype=q_logits.dtype))

    def settle(self, proposal: Proposal, d_host: np.ndarray) -> None:
        """After the cycle's one wait: each device-drawn draft's exact q, from its candidates and
        thresholds, and (drafts the head's own: `follows_head`) a check that the device took the
        candidate its uniform names."""
        t_host = time.perf_counter()
        for j, (on_device, device_draw) in enumerate(proposal.device_draws):
            if device_draw is None:
                continue
            ids, t, m = device_draw
            ids, t = np.asarray(ids), np.asarray(t)
            for b in np.flatnonzero(on_device):
                proposal.q[j][b], drawn = device_draft_distribution(ids[b], t[b], self.vocab, int(m[b]))
                if self.follows_head and drawn != int(d_host[b, j]):
                    raise RuntimeError(f"row {b}'s device draft {int(d_host[b, j])} is not the candidate its "
                                       f"uniform names ({drawn}): the device draw and its q disagree")
        self.host_s += time.perf_counter() - t_host


class ContextScore:
    """Which of a row's two first drafts, its context's or the head's, the target kept more often
    where they differed: counts decayed by DECAY a disagreement, from one each (a tie prefers the
    context). Both are scored every cycle, whichever was used. A row's own, so that its drafts
    never depend on its neighbours."""
    DECAY = 0.98

    def __init__(self):
        self.context_right, self.head_right = 1.0, 1.0

    def observe(self, context_right: bool, head_right: bool) -> None:
        self.context_right = self.DECAY * self.context_right + context_right
        self.head_right = self.DECAY * self.head_right + head_right

    def prefers_context(self) -> bool:
        return self.context_right >= self.head_right


class ScriptedProposer(Proposer):
    """One draft a cycle, from `script(row, output position)` where it names a token (None: the
    head's). The install self-check forces drafts the target keeps and drafts it rejects, so that
    commits of 0, 1 and 2 all happen; `row` is the row's request id, its index in a sealed
    cohort. A drawn draft it replaces is judged against the q that drew the head's (tests of row
    isolation; the self-check's rows are greedy)."""

    follows_head = False    # no cycle launched before the last is read: the script reads the rows

    def __init__(self, vocab: int, script: Callable[[int, int], Optional[int]],
                 draft_draw: str = EngineSettings.draft_draw):
        super().__init__(vocab, draft_draw)
        self.script = script

    def depth_for(self, lane_depth: int) -> int:
        return 1

    def propose(self, forwards, history, h_last, x0, rows, row_depth: np.ndarray, owed,
                keep_history: np.ndarray, greedy: bool, depth: int, allowed: Optional[dict] = None) -> Proposal:
        proposal = super().propose(forwards, history, h_last, x0, rows, row_depth, owed, keep_history, greedy,
                                   depth, allowed)
        drafts = np.array(proposal.drafts[:, 0])
        for b in np.flatnonzero(row_depth > 0):
            row = rows[b]
            primary_at = len(row.result.tokens) - (row.pending is not None)   # the draft guesses the next
            token = self.script(int(row.req.request_id), primary_at + 1)
            if token is not None:
                drafts[b] = token
        proposal.drafts = mx.array(drafts, dtype=mx.uint32)[:, None]
        return proposal
