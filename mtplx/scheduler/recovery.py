"""What a lane fault ends, and where the lane's other rows go (`MTPBatchGenerationService`).

A lane step that raised ends at most one row. A row's own work that raised (its sampler,
grammar, stop rule, log-probabilities; the engine's `RowFailure`) or whose values went
non-finite is blamed and fails alone. Any other fault (a batched forward) blames nobody. Either
way the lane is rebuilt: every other unfinished row re-joins a new lane of its key, resuming
from its prompt plus the tokens it had emitted and reported, with its RNG and drafting policy
as they were then (`RunningLane.salvage`), so a greedy row's text and a seeded row's text are
what they would have been, with no token lost or repeated.

Rows re-admitted after a fault that blamed nobody are suspects. When a lane holding suspects
faults again unblamed, each suspect goes on alone, in a lane of its own, where any fault is its
own: only a row that fails again alone is failed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class Recovery:
    """A faulted lane's rows: those that end (job, exception) and those that re-join a lane
    (job, resuming request, alone: in a lane of its own)."""
    blamed: Optional[str]
    failed: list = field(default_factory=list)
    rejoin: list = field(default_factory=list)


def recover(exc: BaseException, salvaged: list, suspects: set, lone_row: Optional[str] = None) -> Recovery:
    """The fate of each row a faulted lane held. `salvaged`: (job, request) for its unfinished
    rows, the request resuming where the row's last completed step left it; `suspects`: jobs
    re-admitted after an unblamed fault (updated here); `lone_row`: the row id of a lane that
    holds one isolated row (the fault is that row's)."""
    from mtplx.engine.row import RowFailure

    blamed = lone_row if lone_row is not None else exc.request_id if isinstance(exc, RowFailure) else None
    isolate = blamed is None and any(job in suspects for job, _ in salvaged)
    out = Recovery(blamed)
    for job, req in salvaged:
        if job is None or job.future.done():
            continue
        if req.request_id == blamed:
            out.failed.append((job, exc))
        elif job.cancel_requested():
            out.failed.append((job, job._cancel_exception()))
        elif len(job.tokens) != len(req.resume.tokens if req.resume is not None else ()):
            out.failed.append((job, RuntimeError(
                f"request {job.request_id}: its lane failed ({type(exc).__name__}: {exc}) and it cannot "
                f"resume without losing or repeating a token")))
        else:
            alone = isolate and job in suspects
            if blamed is None:
                suspects.add(job)
            out.rejoin.append((job, req, alone))
    return out
