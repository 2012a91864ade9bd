"""A job as a row of a running lane: the engine's request built from it (`lane_request`), a lane
step's news of it into the job and, for a job with a cohort sink, as `RowNews` (`deliver_event`),
and the job's result built from the row's final stream (`lane_result`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from mtplx.api.rows import RowCheckpoint
from mtplx.end import CANCELLED, End
from mtplx.scheduler.job import failsafe
from mtplx.scheduler.results import build_result, lane_placement, lane_row_stats


def lane_request(job, row_id: str, *, numerics: str, repetition_stop: bool):
    """The engine's request for a job (its row is `row_id` in its lane). No callbacks: the lane's
    `RowEvent`s bring the row's progress, tokens and end back (`deliver_event`). A job resumed
    from another replica's tokens resumes as a row re-admitted after a lane fault does."""
    from mtplx.engine.row import A3BMTPBatchRequest

    return A3BMTPBatchRequest(
        request_id=row_id, prompt_ids=tuple(job.prompt_ids), sampler=job.sampler,
        draft_sampler=job.draft_sampler, seed=job.seed, max_tokens=job.max_tokens,
        stop_token_ids=job.stop_token_ids, eos_token_ids=job.eos_token_ids, omit_speculative_bonus=job.omit_speculative_bonus,
        logprobs=job.logprobs, speculative=job.speculative,
        # b1-exact rows decode as the solo path does: drafting every cycle
        adaptive=job.adaptive and numerics != "b1-exact", prefill_group=job.prefill_group,
        repetition_stop=repetition_stop or bool(job.generation_limits.get("uncapped_repetition_stop_enabled", False)),
        session_restore=failsafe(job.session_restore), session_commit=failsafe(job.session_commit),
        constraint=job.constraint, resume=resume_from(job), stop_text=job.stop_text)


def resume_from(job):
    """The engine's `RowResume` of a job that continues after `job.resume_tokens` (None: a job that
    starts afresh). With its checkpoint after exactly those tokens it continues with the draws it
    would have made; without one, its caches take every token and it draws afresh from its seed
    there (a greedy row's tokens are the same either way)."""
    from mtplx.engine.row import RowResume

    if not job.resume_tokens:
        return None
    cp = job.checkpoint
    if cp is None or cp.tokens != len(job.resume_tokens):
        return RowResume(job.resume_tokens, (), False, None, None)
    return RowResume(job.resume_tokens, (), bool(cp.pending), cp.rng_state, tuple(cp.policy))


def remove_cancelled(running, job_of: dict) -> None:
    """The rows whose callers cancelled their jobs leave the lane at its next boundary."""
    for row_id, job in job_of.items():
        if job.cancel_requested():
            running.remove([row_id], End(CANCELLED))


@dataclass(frozen=True)
class RowNews:
    """One row's part of a lane step, as its cohort's sink takes it: the tokens its client is shown
    (a stop token that ended it is not one), their log-probability entries (None unless the row
    asked for them), and its state after all its tokens so far (None: unknown, as after its last
    step)."""
    job: Any
    tokens: list
    logprobs: Optional[list]
    checkpoint: Optional[RowCheckpoint]


def deliver_event(job, event) -> Optional[RowNews]:
    """A lane step's news of one row, into its job: prefill progress, tokens (with their
    log-probability entries), and at its end a cancelled row's failure (any other end's result
    follows through `lane_result`). A job with a cohort sink records its tokens and returns its
    news for the sink (None: none); one without forwards each token to its callbacks."""
    if event.prefill_started_s is not None:
        job.admitted_s = event.prefill_started_s
        job.emit_prefill({"phase": "started", "tokens_total": len(job.prompt_ids), "tokens_done": 0})
    if event.decode_started_s is not None:
        if job.decode_started_s is None:
            job.decode_started_s = event.decode_started_s
        job.emit_prefill({"phase": "completed", "tokens_total": len(job.prompt_ids),
                          "tokens_done": len(job.prompt_ids)})
    news = None
    if job.sink is not None:
        news = _news(job, event)
    else:
        for i, token in enumerate(event.tokens):
            job.emit_token(token, event.logprobs[i] if event.logprobs else None, at=event.times[i])
        if event.mark is not None:
            job.emit_checkpoint(checkpoint_of(event.mark))
    if event.end is not None and event.end.kind == CANCELLED:   # its future fails at once
        job._fail(job._cancel_exception())
    return news


def checkpoint_of(mark) -> RowCheckpoint:
    """The engine's `RowMark` as the plain `RowCheckpoint` a stream carries."""
    return RowCheckpoint(mark.tokens, mark.pending, mark.rng_state, mark.policy)


def _news(job, event) -> Optional[RowNews]:
    """The job records the event's tokens; its client is shown all but a stop token."""
    if job.cancel_requested():
        return None
    tokens = [int(t) for t in event.tokens]
    job.tokens.extend(tokens)
    job.token_times.extend(event.times)
    shown = [i for i, t in enumerate(tokens) if t not in job.stop_token_ids]
    checkpoint = None if event.mark is None else checkpoint_of(event.mark)
    if not shown and checkpoint is None:
        return None
    entries = [event.logprobs[i] for i in shown] if job.logprobs is not None and event.logprobs else None
    return RowNews(job, [tokens[i] for i in shown], entries, checkpoint)


def lane_result(job, stream, *, numerics: str, mtp_disabled_reason: Optional[str]) -> Optional[dict]:
    """A lane row's result at its own terminal, from its final stream; None when it was
    cancelled (by the engine, or by its caller before the row ended otherwise)."""
    if stream.end.kind == CANCELLED or job.cancel_requested():
        return None
    placement = lane_placement(stream, numerics)
    placement.started_s = job.admitted_s if job.admitted_s is not None else placement.started_s
    extra = dict(lane_row_stats(stream), mtp_disabled_reason=mtp_disabled_reason)
    if stream.repetition_stop is not None:   # the repeats already streamed; the result drops them
        cut = len(job.tokens) - stream.repetition_stop.trimmed_tokens
        del job.tokens[cut:], job.token_times[cut:]
    return build_result(job, placement, end=stream.end, cycles=stream.cycles,
                        accepted=stream.accepted_drafts, rejected=stream.rejected_drafts,
                        terminal_perf_s=stream.terminal_perf_s, cached_tokens=stream.cached_tokens,
                        solo=stream.fixed_width <= 1, extra_stats=extra, depth=stream.mtp_depth or None)
