"""What each row keeps of a verified step, decided on the host after the step's one wait: its
primary (if not yet emitted), then its drafts judged left to right by the acceptor, the residual
at the first rejection or the bonus when every draft is kept; a row that did not draft keeps the
target's own next token. A row's decisions read only its own positions (in the `Step`, and its
row of the last logits for its primary's log-probability) and draw only from its own RNG, in the
solo path's order, so no row's tokens depend on its neighbours'. `DecisionLog` records them for
a reader that asks.

The lane runs the step and moves its state (`RunningLane`); this module is the per-row part
between the verify and the commit, as vLLM keeps its rejection sampler apart from its scheduler."""

from __future__ import annotations

import mlx.core as mx

from mtplx.engine.acceptor import accept_chain
from mtplx.engine.lane_stats import LaneCounters
from mtplx.engine.row import LaneRow, host_logprob
from mtplx.engine.step import Step


class DecisionLog:
    """A lane's decisions, recorded for whoever reads them back (the install self-check, tests):
    each live row's kept positions at each step (`keeps`), and each draft judged (`drafts`:
    request id, output position, draft, index in its chain). A lane given none records nothing
    (`NO_DECISION_LOG`, which has no `keeps` or `drafts` to read)."""

    def __init__(self):
        self.keeps: list = []
        self.drafts: list = []

    def step(self, step: Step) -> None:
        self.keeps.extend(int(k) for k, a in zip(step.keep, step.active) if a)

    def judged(self, request_id: str, position: int, draft: int, j: int) -> None:
        self.drafts.append((request_id, position, draft, j))


class _NoDecisionLog(DecisionLog):
    """Records nothing, and has nothing to read back: a reader must give the lane its own log."""

    def __init__(self):
        pass

    def step(self, step: Step) -> None:
        pass

    def judged(self, request_id: str, position: int, draft: int, j: int) -> None:
        pass


NO_DECISION_LOG = _NoDecisionLog()


class RowDecisions:
    """Each row's decisions in a step, counted for the lane (`counters`), the row and its drafting
    policy, and recorded in `log`."""

    def __init__(self, counters: LaneCounters, log: DecisionLog):
        self.counters = counters
        self.log = log

    def ended(self, step: Step) -> None:
        """The step's decisions are all made (its rows' keeps final)."""
        self.log.step(step)

    def ar(self, step: Step, b: int, row: LaneRow, logits_last: mx.array) -> None:
        """Row b's part of a plain AR step: its primary (if not yet emitted), then the target's
        next token."""
        if step.has_pending[b] or not self._emit_primary(b, row, int(step.x0_host[b]), logits_last):
            self._keep_target(step, b, row)

    def cycle(self, step: Step, b: int, row: LaneRow, logits_last: mx.array) -> None:
        """Row b's part of an MTP cycle: its primary (if not yet emitted), then its drafts judged
        left to right, the residual at the first rejection, or the bonus when every draft is kept."""
        if not step.has_pending[b] and self._emit_primary(b, row, int(step.x0_host[b]), logits_last):
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

    @staticmethod
    def _emit_primary(b: int, row: LaneRow, token: int, logits_last: mx.array) -> bool:
        """Emit row b's primary token (not yet emitted: it came from last step's logits); True
        when the row finished on it."""
        return row.emit(token, host_logprob(logits_last[b], token, row.req.logprobs))

    @staticmethod
    def _keep_target(step: Step, b: int, row: LaneRow) -> None:
        """A row that did not draft keeps the target's own next token (AR's draws)."""
        row.skipped()
        tok = step.targets.token(row, b, 0)
        row.pending, row.owed, step.keep[b] = None, 0, 1
        if not row.emit(tok, step.entry(row, b, 0, tok)):
            row.pending = tok

    def _judge(self, step: Step, b: int, row: LaneRow, j: int, draft: int) -> tuple:
        """The acceptor's verdict on row b's j-th draft, counted for the lane, the row and its
        drafting policy."""
        kept, token = step.targets.judge(row, b, j, draft, step.proposal.q_of(b, j))
        r, c = row.result, self.counters
        if j == 0:
            row.drafted(kept)           # its policy reads its first draft's outcome
            if row.greedy:
                c.greedy_first_drafts += 1
                c.greedy_first_kept += int(kept)
            r.mtp_depth = max(r.mtp_depth, int(step.row_depth[b]))
            c.draft_proposals += 1
            c.draft_tokens += int(step.row_depth[b])
        self.log.judged(row.req.request_id, len(r.tokens), draft, j)
        if kept:
            c.accepted += 1
            c.accepted_at[j] += 1
            r.accepted_drafts += 1
        else:
            c.rejected += 1
            r.rejected_drafts += 1
        return kept, token

    @staticmethod
    def _bonus(step: Step, b: int, row: LaneRow, depth: int) -> None:
        """Every draft of its chain kept: the verify's position after them gives one more token
        (unless the row omits it)."""
        if row.req.omit_speculative_bonus or len(row.result.tokens) >= row.req.max_tokens:
            return
        bonus = step.targets.token(row, b, depth)
        if not row.emit(bonus, step.entry(row, b, depth, bonus)):
            row.pending = bonus
