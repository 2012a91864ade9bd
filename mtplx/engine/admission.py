"""Rows on their way into a running lane (`Admitter`: queued, then prefilling): each row's own
prefill, one chunk at a time (`RowPrefill`), and the rows admitted at one cycle boundary whose
prefill is a single chunk, prefilled together."""

from __future__ import annotations

import time
from collections import deque
from typing import Callable, Optional

import mlx.core as mx
import numpy as np

from mtplx.end import End
from mtplx.engine.prefill import start_prefill
from mtplx.engine.row import LaneRow
from mtplx.models.cache import RaggedKVCache, commit_rows


class RowPrefill:
    """A row on its way into the lane: its own prefill, one chunk at a time. The prefill starts
    (and the row's prefix restore is looked up) at `begin`, so a row queued behind another with
    the same prompt prefix reuses what that one banked."""

    def __init__(self, model, row: LaneRow, chunk: int):
        self.model, self.row, self.chunk = model, row, chunk
        self.steps = None
        self.chunks_run = 0
        self.out = None        # (logits [V], hidden [1, 1, H]) once the prefill has ended

    def begin(self) -> "RowPrefill":
        """Start the prefill: the prefix restore, the caches, the chunks to run."""
        if self.steps is None:
            req = self.row.req
            if req.resume is None:        # a resumed row's prefill was reported when it first ran
                self.row.prefill_started_s = time.perf_counter()
                try:
                    req.on_admit()
                except Exception:
                    pass
            self.cache, self.mtp_cache, self.steps, cached = start_prefill(
                self.model, list(self.row.prefill_ids), self.chunk, req.session_restore, req.session_commit)
            if req.resume is None:
                self.row.result.cached_tokens = cached
            self.fed = cached
        return self

    @property
    def left(self) -> int:
        """Prompt tokens still to prefill."""
        return len(self.row.prefill_ids) - self.fed

    @property
    def one_final_chunk(self) -> bool:
        """Begun, nothing run yet, and what is left is its final chunk (from a chunk boundary)."""
        return self.steps is not None and self.out is None and not self.chunks_run and 0 < self.left <= self.chunk

    def advance(self) -> int:
        """Run the next chunk; returns its token count."""
        self.begin()
        self.chunks_run += 1
        try:
            n = next(self.steps)
        except StopIteration as done:     # the final chunk ran and returned the prefill's output
            self.out = done.value
            n = len(self.row.prefill_ids) - self.fed
        self.fed += n
        return n

    def shared_with(self, row: LaneRow) -> "RowPrefill":
        """A finished admission for `row`, a sibling with the same prompt: this prefill's state,
        as its own would be (the lane copies a row's caches into its slot, so both may read them)."""
        row.prefill_started_s = time.perf_counter()
        try:
            row.req.on_admit()
        except Exception:
            pass
        sib = RowPrefill(self.model, row, self.chunk)
        sib.cache, sib.mtp_cache, sib.out = self.cache, self.mtp_cache, self.out
        row.result.cached_tokens, row.result.shared_prefill = self.row.result.cached_tokens, True
        return sib


def siblings(row: LaneRow, other: LaneRow) -> bool:
    """Rows of one prefill group with the same prompt (one prefill serves both)."""
    group = row.req.prefill_group
    return group is not None and group == other.req.prefill_group and row.req.prompt_ids == other.req.prompt_ids


class _RowOf:
    """Row i of a batched cache layer, read as a per-row cache is (`keys`, `values`, `offset`)."""

    def __init__(self, layer: RaggedKVCache, i: int):
        if layer.keys is None:        # nothing written yet (the head's history of one-token prompts)
            self.keys = self.values = None
            self.offset = 0
            return
        self.keys, self.values, self.offset = layer.keys[i:i + 1], layer.values[i:i + 1], int(layer.lengths[i])


def batchable(model) -> bool:
    """Whether this model's rows can prefill together: every cache an attention KV cache (a
    recurrent layer's state would take in the padding after a shorter row's prompt)."""
    from mlx_lm.models.cache import KVCache

    return all(type(c) is KVCache for c in model.make_cache() + (model.make_mtp_cache() or []))


def prefill_together(model, admissions: list) -> None:
    """The final chunks of these begun admissions (`one_final_chunk`) as one forward over
    [rows, longest chunk], right-padded: each row's positions are computed as its own chunk's
    (causal attention never reaches the padding after it), and the ragged commit keeps each
    row's own. The same partition and the same history entries as each row's own prefill; each
    admission ends with its output and its rows of the batched caches (and its prefix banked)."""
    prompts = [list(a.row.prefill_ids) for a in admissions]
    pieces = [p[a.fed:] for p, a in zip(prompts, admissions)]
    follow = [p[a.fed + 1:] for p, a in zip(prompts, admissions)]        # one short: the prompt ends
    lengths = np.array([len(x) for x in pieces])
    cache = _batched([a.cache for a in admissions])
    h = model.hidden(_padded(pieces), cache)
    commit_rows(cache, h.shape[1], lengths)
    mtp_cache = _history(model, h, follow, [a.mtp_cache for a in admissions])
    h_last = h[mx.arange(len(admissions)), mx.array(lengths - 1)][:, None, :]      # [N, 1, H]
    logits = model.logits(h_last)[:, -1]
    mx.eval([c.keys for c in cache + (mtp_cache or [])], logits, h_last)
    for i, (a, prompt) in enumerate(zip(admissions, prompts)):
        a.cache = [_RowOf(c, i) for c in cache]
        a.mtp_cache = [_RowOf(c, i) for c in mtp_cache] if mtp_cache is not None else a.mtp_cache
        a.out, a.fed, a.chunks_run = (logits[i], h_last[i:i + 1]), len(prompt), 1
        _bank(a, prompt)


def _bank(a: RowPrefill, prompt: list) -> None:
    """The whole prompt's state into the row's prefix bank, as its own prefill would commit it."""
    from mtplx.engine.prefix_cache import snapshot_whole

    if a.row.req.session_commit is not None and len(prompt) > 1:
        try:
            a.row.req.session_commit(snapshot_whole(prompt, a.cache, a.mtp_cache, a.out))
        except Exception:     # a bank problem only costs reuse
            pass


def _history(model, h: mx.array, follow: list, per_row: list) -> Optional[list]:
    """The head's history entries (h_i, token_i+1) of the rows' chunks, in their batched MTP
    caches (None: no head)."""
    if not per_row[0]:
        return None
    mtp_cache = _batched(per_row)
    F = max(len(f) for f in follow)
    if F:
        model.draft_hidden(h[:, :F], _padded(follow), mtp_cache)
        commit_rows(mtp_cache, F, np.array([len(f) for f in follow]))
    return mtp_cache


def _batched(per_row: list) -> list:
    """Per layer, one ragged cache whose row i is admission i's cache."""
    layers = []
    for row_layers in zip(*per_row):
        layer = RaggedKVCache.empty_rows(len(row_layers))
        for i, kv in enumerate(row_layers):
            layer.put_row(i, kv)
        layers.append(layer)
    return layers


def _padded(rows: list, pad: int = 0) -> mx.array:
    T = max(len(r) for r in rows)
    return mx.array([list(r) + [pad] * (T - len(r)) for r in rows], dtype=mx.uint32)


class Admitter:
    """A running lane's rows on their way in: queued (`waiting`), then prefilling (`admitting`,
    FIFO), started as slots free up and advanced within the prefill budget at each boundary
    (`admit`). Rows next in line whose whole prefill is one chunk prefill together, in one
    forward; queued rows of one prefill group (n > 1 choices) take the prefill of the first of
    them placed. The lane places each finished prefill in a free slot (its `place`)."""

    def __init__(self, model, prefill_chunk: int, budget: Optional[int], counters):
        self.model = model
        self.prefill_chunk = prefill_chunk
        self.budget = budget                    # prompt tokens prefilled per boundary; None: all
        self.counters = counters                # the lane's
        self.waiting: deque = deque()           # rows not yet prefilling
        self.admitting: deque = deque()         # RowPrefill, FIFO
        self._batchable: Optional[bool] = None  # whether the model's rows can prefill together

    def __len__(self) -> int:
        return len(self.waiting) + len(self.admitting)

    def rows(self) -> list:
        return list(self.waiting) + [a.row for a in self.admitting]

    def add(self, row: LaneRow) -> None:
        self.waiting.append(row)

    def clear(self) -> None:
        self.waiting.clear()
        self.admitting.clear()

    def drop(self, gone: Callable[[LaneRow], Optional[End]]) -> None:
        """Rows removed or cancelled on their way in end here, with the End `gone` gives them."""
        for row in list(self.waiting):
            end = gone(row)
            if end is not None:
                self.waiting.remove(row)
                row.finish(end)
        for adm in list(self.admitting):
            end = gone(adm.row)
            if end is not None:
                self.admitting.remove(adm)
                adm.row.finish(end)

    def admit(self, free: int, has_slot: Callable[[], bool], place: Callable[[RowPrefill], None]) -> None:
        """Start prefills for `free` slots (FIFO), advance them within the budget, and `place` each
        finished prefill while the lane `has_slot`."""
        while self.waiting and len(self.admitting) < free:
            self.admitting.append(RowPrefill(self.model, self.waiting.popleft(), self.prefill_chunk))
        budget = self.budget
        spent = 0
        while self.admitting and (budget is None or spent < budget):
            if self.admitting[0].out is None:
                together = self._prefill_group(None if budget is None else budget - spent)
                if len(together) > 1:
                    spent += sum(a.left for a in together)
                    prefill_together(self.model, together)
                    self.counters.batched_prefills += 1
                else:
                    spent += self.admitting[0].advance()
            while self.admitting and self.admitting[0].out is not None and has_slot():
                adm = self.admitting.popleft()
                place(adm)
                self._place_siblings(adm, has_slot, place)
            if self.admitting and self.admitting[0].out is not None:
                break       # prefilled, but its siblings took the free slots: it waits for one

    def _prefill_group(self, room: Optional[int]) -> list:
        """The admissions next in line whose whole prefill is one final chunk, as many as fit in
        `room` prompt tokens (None: all), if the model's rows can prefill together."""
        if self._batchable is None:
            self._batchable = batchable(self.model)
        group, tokens = [], 0
        for adm in self.admitting:
            if any(siblings(adm.row, a.row) for a in group):
                continue                  # it takes that row's prefill when that one is placed
            if not self._batchable or not adm.begin().one_final_chunk:
                break
            if room is not None and group and tokens + adm.left > room:
                break
            group.append(adm)
            tokens += adm.left
        return group

    def _place_siblings(self, adm: RowPrefill, has_slot, place) -> None:
        """Rows of adm's prefill group that have not started their own prefill take its prefill
        instead, as far as free slots go (the rest prefill on their own when a slot frees)."""
        queued = [a.row for a in self.admitting if a.steps is None] + list(self.waiting)
        for row in [r for r in queued if siblings(r, adm.row)]:
            if not has_slot():
                return
            if row in self.waiting:
                self.waiting.remove(row)
            else:
                self.admitting.remove(next(a for a in self.admitting if a.row is row))
            self.counters.shared_prefills += 1
            place(adm.shared_with(row))
