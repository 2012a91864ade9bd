"""Cycles launched early. With `overlap`, the next MTP cycle launches once a step's decisions are
made, before its events go out (`RunningLane._launch_next`). Running ahead goes further: a lane of
greedy rows launches each MTP cycle from the last one's verify before the host reads it. What a
greedy, unconstrained row keeps follows from the verify alone, so the device computes it (the
accept test), the next primaries and the commit (`commit_on_device`); the host, reading the verify
a cycle later, makes its decisions as before, checks them against the device's keep and settles
its cache lengths (upper bounds meanwhile: `settle_ahead`).

The lane owns the cycles and their rows; this module holds what a step decided or launched early
(`NextStep`) and the functions over the lane's state that running ahead adds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import numpy as np

from mtplx.engine.commit import commit_positions
from mtplx.engine.lane_state import LaneState
from mtplx.engine.step import Step
from mtplx.models.cache import settle_rows


@dataclass
class NextStep:
    """The lane's next step, as far as it was settled before the step runs: the MTP cycle launched
    early (step, verify) with its launch's host time, or else the kind chosen for it."""

    kind: Optional[str] = None
    launched: Optional[tuple] = None
    launch_s: float = 0.0

    def clear(self) -> None:
        """Forget it (the lane's rows were all cancelled); a dropped launch is no step's cost."""
        self.kind = self.launched = None
        self.launch_s = 0.0

    def take(self) -> tuple:
        """(the launched cycle, its launch's host time), cleared here: the step runs it now."""
        launched, launch_s = self.launched, self.launch_s
        self.launched, self.launch_s = None, 0.0
        return launched, launch_s


def rows_may_run_ahead(rows: list, state: LaneState) -> bool:
    """Whether what each of these rows (slot -> row or None) keeps follows from the verify alone:
    every row greedy, unconstrained, without log-probabilities and not drafting from its context
    (read on the host at launch), one of them drafting, and the lane's caches all ragged KV (their
    commit can move on the device)."""
    live = [r for r in rows if r is not None]
    if any(not r.greedy or r.grammar is not None or r.req.logprobs is not None or r.context is not None
           for r in live):
        return False
    return state.all_ragged() and any(r.wants_draft() for r in live)


def commit_on_device(state: LaneState, launched: tuple) -> tuple:
    """A launched cycle's outcome, computed and committed on the device before the host reads its
    verify; returns (the next cycle's Step, its rows' owed head-history entries), to launch it from.
    Its rows are all greedy, so what each keeps follows from the verify alone: its drafts' longest
    prefix equal to the target's argmax, then the target's token there (its next primary). The
    device commits that keep (the caches' offsets, the last hidden and logits, the head's history
    and the entries rows owe it); the host later checks its own decisions against it (`settle_ahead`)."""
    step, (tokens, H, L, read) = launched
    ids, depth = read[1], step.depth
    drafts = tokens[:, 1:]
    judged = mx.arange(depth)[None] < mx.array(step.row_depth)[:, None]
    kept = mx.cumprod(((drafts == ids[:, :depth]) & judged).astype(mx.int32), axis=1).sum(axis=1)
    keep = mx.where(mx.array(step.active), 1 + kept, 0)
    mx.async_eval(keep)             # queued ahead of the next cycle: the host reads it with this verify
    state.h_last, state.logits_last = commit_positions(state.caches, H, L, keep, 1 + depth)
    state.logits_host = None
    state.history.record(H, drafts)
    step.device_keep = keep
    x0 = mx.take_along_axis(ids, kept[:, None], axis=1)[:, 0]
    return Step(step.active.copy(), step.active.copy(), True, x0, ahead=True), kept


def settle_ahead(step: Step, rows: list, state: LaneState) -> None:
    """A step committed on the device (`commit_on_device`), read: each live row's decisions kept
    what the device did (a row that finished on the way kept its positions there, unread), and
    the host lengths follow the device's keep: the target's caches for this step's verify, the
    head's for the next cycle's head forward (its owed entries and draft entry: 1 + kept again,
    the same keep)."""
    keep = np.array(step.device_keep)
    live = np.array([r is not None for r in rows])
    if not np.array_equal(keep[live], step.keep[live]):
        raise RuntimeError(f"the device kept {keep[live].tolist()} positions of the live rows' verify, "
                           f"their decisions {step.keep[live].tolist()}")
    settle_rows(state.caches, 1 + step.depth, keep)
    settle_rows(state.mtp_caches, state.history.hidden.shape[1] + 1, keep)


def check_ahead_primaries(step: Step, rows: list) -> None:
    """A step launched ahead, now that the last step's decisions are made: the rows still live,
    and which of its primaries they emitted then (their pending tokens, which its primaries,
    from the device, must equal)."""
    step.active &= np.array([r is not None for r in rows])
    pending = np.array([-1 if r is None or r.pending is None else r.pending for r in rows])
    step.has_pending = pending >= 0
    wrong = np.flatnonzero(step.has_pending & (pending != step.x0_host))
    if wrong.size:
        b = int(wrong[0])
        raise RuntimeError(f"row {b}'s primary from the device ({int(step.x0_host[b])}) is not the "
                           f"token its last decisions left pending ({pending[b]})")
