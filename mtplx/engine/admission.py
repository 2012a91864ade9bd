"""A row on its way into a running lane: its own prefill, one chunk at a time."""

from __future__ import annotations

import time

from mtplx.engine.prefill import start_prefill
from mtplx.engine.row import LaneRow


class Admission:
    """A row on its way into the lane: its own prefill, one chunk at a time. The prefill starts
    (and the row's prefix restore is looked up) at the first chunk, so a row queued behind another
    with the same prompt prefix reuses what that one banked."""

    def __init__(self, model, row: LaneRow, chunk: int):
        self.model, self.row, self.chunk = model, row, chunk
        self.steps = None
        self.out = None        # (logits [V], hidden [1, 1, H]) once the prefill has ended

    def advance(self) -> int:
        """Run the next chunk; returns its token count."""
        if self.steps is None:
            req = self.row.req
            self.row.prefill_started_s = time.perf_counter()
            try:
                req.on_admit()
            except Exception:
                pass
            self.cache, self.mtp_cache, self.steps, cached = start_prefill(
                self.model, list(req.prompt_ids), self.chunk, req.session_restore, req.session_commit)
            self.row.result.cached_tokens = cached
            self.fed = cached
        try:
            n = next(self.steps)
        except StopIteration as done:     # the final chunk ran and returned the prefill's output
            self.out = done.value
            n = len(self.row.req.prompt_ids) - self.fed
        self.fed += n
        return n

    def shared_with(self, row: LaneRow) -> "Admission":
        """A finished admission for `row`, a sibling with the same prompt: this prefill's state,
        as its own would be (the lane copies a row's caches into its slot, so both may read them)."""
        row.prefill_started_s = time.perf_counter()
        try:
            row.req.on_admit()
        except Exception:
            pass
        sib = Admission(self.model, row, self.chunk)
        sib.cache, sib.mtp_cache, sib.out = self.cache, self.mtp_cache, self.out
        row.result.cached_tokens, row.result.shared_prefill = self.row.result.cached_tokens, True
        return sib
