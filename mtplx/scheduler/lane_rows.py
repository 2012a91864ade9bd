"""A job as a row of a running lane: the engine's request built from it (`lane_request`), and
the job's result built from the row's final stream (`lane_result`)."""

from __future__ import annotations

import time
from typing import Callable, Optional

from mtplx.scheduler.job import failsafe
from mtplx.scheduler.results import build_result, lane_placement, lane_row_stats


def lane_request(job, *, numerics: str, repetition_stop: bool, on_result: Callable):
    """The engine's request for a job: its fields, its callbacks (prefill progress, tokens,
    cancellation) and `on_result(stream)` at its terminal."""
    from mtplx.engine.row import A3BMTPBatchRequest

    def on_admit():
        job.admitted_s = time.perf_counter()
        job.emit_prefill({"phase": "started", "tokens_total": len(job.prompt_ids), "tokens_done": 0})

    def on_decode_start():
        job.mark_decode_started()
        job.emit_prefill({"phase": "completed", "tokens_total": len(job.prompt_ids),
                          "tokens_done": len(job.prompt_ids)})

    def on_terminal(reason, cycles):
        if reason == "cancelled" and not job.stopped_by_caller:   # a cancelled row's future fails at once
            job._fail(job._cancel_exception())

    return A3BMTPBatchRequest(
        request_id=job.request_id, prompt_ids=tuple(job.prompt_ids), sampler=job.sampler,
        draft_sampler=job.draft_sampler, seed=job.seed, max_tokens=job.max_tokens,
        stop_token_ids=job.stop_token_ids, omit_speculative_bonus=job.omit_speculative_bonus,
        on_token=job.emit_token, logprobs=job.logprobs, on_admit=on_admit, on_decode_start=on_decode_start,
        on_terminal=on_terminal, on_result=on_result, cancelled=job.cancel_requested,
        speculative=job.speculative,
        # b1-exact rows decode as the solo path does: drafting every cycle
        adaptive=job.adaptive and numerics != "b1-exact", prefill_group=job.prefill_group,
        repetition_stop=repetition_stop or bool(job.generation_limits.get("uncapped_repetition_stop_enabled", False)),
        session_restore=failsafe(job.session_restore), session_commit=failsafe(job.session_commit))


def lane_result(job, stream, *, numerics: str, mtp_disabled_reason: Optional[str]) -> Optional[dict]:
    """A lane row's result at its own terminal, from its final stream; None when it was
    cancelled. A row its caller stopped (a stop string) ends as a stop."""
    stopped = job.stopped_by_caller
    if (stream.finish_reason == "cancelled" or job.cancel_requested()) and not stopped:
        return None
    placement = lane_placement(stream, numerics)
    placement.started_s = job.admitted_s if job.admitted_s is not None else placement.started_s
    extra = dict(lane_row_stats(stream), mtp_disabled_reason=mtp_disabled_reason)
    if stream.repetition_stop is not None:   # the repeats already streamed; the result drops them
        cut = len(job.tokens) - stream.repetition_stop.trimmed_tokens
        del job.tokens[cut:], job.token_times[cut:]
    finish_reason = stream.finish_reason
    if stopped and finish_reason == "cancelled":
        finish_reason, extra["engine_finish_reason"] = "stop", "stop_string"
    return build_result(job, placement, finish_reason=finish_reason, cycles=stream.cycles,
                        accepted=stream.accepted_drafts, rejected=stream.rejected_drafts,
                        terminal_perf_s=stream.terminal_perf_s, cached_tokens=stream.cached_tokens,
                        solo=stream.fixed_width <= 1, extra_stats=extra, depth=stream.mtp_depth or None)
