"""Backpressure: rows admitted here but not yet sent to a replica are bounded; beyond the bound a
request is answered at once (429 or 503 with Retry-After), never queued without bound."""

from __future__ import annotations

from typing import Iterable

from mtplx.api.errors import overloaded

from .pending import PendingRow


class WaitingBound:
    """Counts the rows waiting here for a replica (from admission until their batch starts or they
    end, each once) and the requests past the door whose rows are not waiting yet."""

    def __init__(self, max_waiting_rows: int, retry_after_s: float, overload_status: int):
        self.max_waiting_rows = int(max_waiting_rows)
        self.retry_after_s = float(retry_after_s)
        self.overload_status = int(overload_status)
        self.waiting_rows = 0
        self.admitting = 0

    def check(self) -> None:
        """Refuse at once while the rows waiting here, with the requests admitted before them whose
        rows are not waiting yet, fill the bound."""
        waiting = self.waiting_rows + self.admitting
        if waiting >= self.max_waiting_rows:
            raise overloaded(f"The server is overloaded ({waiting} requests waiting); retry after "
                             f"{self.retry_after_s:g} s", self.retry_after_s, status=self.overload_status)

    def admit(self) -> "Admission":
        """`check`, then hold a place in the bound until this request's rows wait. Taken once the
        body is read (a slow upload holds no place), before it is parsed and tokenized: with the
        check alone, every request of an opening burst passed it (no row waited yet) and the excess
        was refused only after its parse and tokenization, with the other refusals queued behind."""
        self.check()
        return Admission(self)

    def row_waits(self, row: PendingRow) -> None:
        row.waiting_here = True
        self.waiting_rows += 1

    def row_leaves_wait(self, row: PendingRow) -> None:
        if row.waiting_here:
            row.waiting_here = False
            self.waiting_rows -= 1


class Admission:
    """A request's place in the bound, from the door until its rows wait for a batch (`hand_over`)
    or it fails (leaving the `with` block); released once."""

    def __init__(self, bound: WaitingBound):
        self.bound = bound
        self.held = True
        bound.admitting += 1

    def hand_over(self, runs: Iterable) -> None:
        """The rows (`RowStream`s) take the place over: they count as waiting from now (no await in
        between)."""
        for run in runs:
            run.start_pump()
        self.release()

    def release(self) -> None:
        if self.held:
            self.held = False
            self.bound.admitting -= 1

    def __enter__(self) -> "Admission":
        return self

    def __exit__(self, *exc) -> None:
        self.release()
