"""Rows on their way into a running lane: each row's own prefill, one chunk at a time, and the
rows admitted at one cycle boundary whose prefill is a single chunk, prefilled together."""

from __future__ import annotations

import time
from typing import Optional

import mlx.core as mx
import numpy as np

from mtplx.end import CANCELLED, End
from mtplx.engine.commit import HeadHistory
from mtplx.engine.prefill import start_prefill
from mtplx.engine.row import LaneRow, RowFailure, host_logprob, row_work
from mtplx.models.cache import RaggedKVCache, commit_rows, empty_batch_layer
from mtplx.sampling import sample, to_host


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


class LaneAdmission:
    """`RunningLane`'s side of admission: prefills started for free slots and advanced within the
    prefill budget, and finished ones merged into free slots (its rows, caches and counters are
    the lane's own)."""

    def _ensure_state(self, adm: RowPrefill) -> None:
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
        each finished prefill into a free slot. Rows next in line whose whole prefill is one
        chunk prefill together, in one forward (`prefill_together`)."""
        free = self.width - self.live_rows
        while self.waiting and len(self.admitting) < free:
            self.admitting.append(RowPrefill(self.model, self.waiting.popleft(), self.prefill_chunk))
        budget = self.prefill_budget
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
            while self.admitting and self.admitting[0].out is not None and None in self.rows:
                adm = self.admitting.popleft()
                self._place(adm)
                self._place_siblings(adm)
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

    def _place_siblings(self, adm: RowPrefill) -> None:
        """Rows of adm's prefill group that have not started their own prefill take its prefill
        instead, as far as free slots go (the rest prefill on their own when a slot frees)."""
        queued = [a.row for a in self.admitting if a.steps is None] + list(self.waiting)
        for row in [r for r in queued if siblings(r, adm.row)]:
            if None not in self.rows:
                return
            if row in self.waiting:
                self.waiting.remove(row)
            else:
                self.admitting.remove(next(a for a in self.admitting if a.row is row))
            self.counters.shared_prefills += 1
            self._place(adm.shared_with(row))

    def _place(self, adm: RowPrefill) -> None:
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
