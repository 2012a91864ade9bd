"""Cycles launched early. With `overlap`, the next MTP cycle launches once a step's decisions are
made, before its events go out (`_launch_next`). Running ahead goes further: a lane of greedy
rows launches each MTP cycle from the last one's verify before the host reads it. What a greedy,
unconstrained row keeps follows from the verify alone, so the device computes it (the accept
test), the next primaries and the commit; the host, reading the verify a cycle later, makes its
decisions as before, checks them against the device's keep and settles its cache lengths (upper
bounds meanwhile)."""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np

from mtplx.engine.commit import commit_positions
from mtplx.engine.step import Step
from mtplx.models.cache import settle_rows


class LaneAhead:
    """`RunningLane`'s cycles launched early (its rows, `LaneState` and cycles are the lane's own)."""

    def _launch_next(self) -> None:
        """The next step's choice, and if it is an MTP cycle its launch (`_launch_cycle`)."""
        kind = self._choose_step()
        if kind != "mtp" or not any(r is not None and r.wants_draft() for r in self.rows):
            self._next_kind = kind
            return
        t0 = time.perf_counter()
        self._launched = self._launch_cycle()
        self._launch_s = time.perf_counter() - t0

    def _finish_launched(self, launched: tuple, ahead: bool) -> None:
        """Finish a launched MTP cycle, first launching the next from it when it runs `ahead`
        (`_ahead_ok`)."""
        if ahead:
            self._launched = self._launch_ahead(launched)
        self._finish_cycle(launched)
        self.last_step = "mtp"

    def _ahead_ok(self) -> bool:
        """Whether the next MTP cycle may launch before the host reads this one's verify: with
        `run_ahead`, the boundary idle, every row greedy, unconstrained and without
        log-probabilities (what a row keeps then follows from the verify alone), the lane's
        caches all ragged KV (their commit can move on the device), and an MTP cycle next."""
        if not self.run_ahead:
            return False
        rows = [r for r in self.rows if r is not None]
        if any(not r.greedy or r.grammar is not None or r.req.logprobs is not None for r in rows):
            return False
        if not self.state.all_ragged():
            return False
        return any(r.wants_draft() for r in rows) and self._boundary_idle() and self._choose_step() == "mtp"

    def _launch_ahead(self, launched: tuple) -> tuple:
        """The next MTP cycle, launched from `launched`'s verify before the host reads it. Its rows
        are all greedy, so what each keeps follows from the verify alone: its drafts' longest
        prefix equal to the target's argmax, then the target's token there (its next primary).
        The device computes that keep and commits it (the caches' offsets, the last hidden and
        logits, the head's history and the entries rows owe it); when the host reads the verify,
        it checks its own decisions against that keep and settles its lengths (`_settle`)."""
        step, (tokens, H, L, read) = launched
        ids, depth = read[1], step.depth
        drafts = tokens[:, 1:]
        judged = mx.arange(depth)[None] < mx.array(step.row_depth)[:, None]
        kept = mx.cumprod(((drafts == ids[:, :depth]) & judged).astype(mx.int32), axis=1).sum(axis=1)
        keep = mx.where(mx.array(step.active), 1 + kept, 0)
        mx.async_eval(keep)             # queued ahead of the next cycle: the host reads it with this verify
        self.state.h_last, self.state.logits_last = commit_positions(self.state.caches, H, L, keep, 1 + depth)
        self.state.logits_host = None
        self.state.history.record(H, drafts)
        step.device_keep = keep
        x0 = mx.take_along_axis(ids, kept[:, None], axis=1)[:, 0]
        self.counters.ahead_cycles += 1
        return self._launch_cycle((Step(step.active.copy(), step.active.copy(), True, x0, ahead=True), kept))

    def _settle(self, step: Step) -> None:
        """A step committed on the device (`_launch_ahead`), read: each live row's decisions kept
        what the device did (a row that finished on the way kept its positions there, unread),
        and the host lengths follow the device's keep: the target's caches for this step's verify,
        the head's for the next cycle's head forward (its owed entries and draft entry: 1 + kept
        again, the same keep)."""
        keep = np.array(step.device_keep)
        live = np.array([r is not None for r in self.rows])
        if not np.array_equal(keep[live], step.keep[live]):
            raise RuntimeError(f"the device kept {keep[live].tolist()} positions of the live rows' verify, "
                               f"their decisions {step.keep[live].tolist()}")
        settle_rows(self.state.caches, 1 + step.depth, keep)
        settle_rows(self.state.mtp_caches, self.state.history.hidden.shape[1] + 1, keep)

    def _ahead_primaries(self, step: Step) -> None:
        """A step launched ahead, now that the last step's decisions are made: the rows still live,
        and which of its primaries they emitted then (their pending tokens, which its primaries,
        from the device, must equal)."""
        step.active &= np.array([r is not None for r in self.rows])
        pending = np.array([-1 if r is None or r.pending is None else r.pending for r in self.rows])
        step.has_pending = pending >= 0
        wrong = np.flatnonzero(step.has_pending & (pending != step.x0_host))
        if wrong.size:
            b = int(wrong[0])
            raise RuntimeError(f"row {b}'s primary from the device ({int(step.x0_host[b])}) is not the "
                               f"token its last decisions left pending ({pending[b]})")
