"""A job's own `solo_runner` (the seed's MTPBatchJob parameter): what its return value means for
the job's result. The service calls the runner at the job's turn; this module reads its output."""

from __future__ import annotations

from mtplx.end import End
from mtplx.scheduler.results import Placement, build_result


def unpack_runner_result(out) -> tuple:
    """(tokens, End, stats, extra result keys) from a solo runner's return value. A runner that
    reports only a coarse finish_reason (a result dict, a GenerationResult of its own making) gets
    the End that reason reads as (`End.from_finish_reason`)."""
    if isinstance(out, dict):
        stats = dict(out.get("stats") or {})
        extra = {k: v for k, v in out.items() if k not in ("tokens", "stats", "finish_reason", "end")}
        end = out.get("end") or End.from_finish_reason(out.get("finish_reason") or stats.get("finish_reason"))
        return list(out.get("tokens") or []), end, stats, extra
    tokens = getattr(out, "tokens", None)
    if tokens is None:
        raise TypeError(f"solo_runner returned {type(out).__name__}; expected a result dict or a "
                        f"GenerationResult")
    end = getattr(out, "end", None) or End.from_finish_reason(getattr(out, "finish_reason", None))
    return list(tokens), end, dict(getattr(out, "stats", {}) or {}), {}


def runner_result(job, placement: Placement, out) -> tuple:
    """(the job's result dict, (cycles, accepted, rejected)) from its runner's output; (None, ())
    when the job was cancelled meanwhile."""
    if job.cancel_requested():
        return None, ()
    tokens, end, runner_stats, extra = unpack_runner_result(out)
    _take_decode(job, placement, tokens, runner_stats.get("prompt_eval_time_s"))
    counts = tuple(int(runner_stats.get(k, 0) or 0) for k in ("verify_calls", "accepted_drafts", "rejected_drafts"))
    extra_stats = {k: v for k, v in runner_stats.items() if k in ("acceptance_rate", "mean_tokens_per_verify")}
    result = build_result(job, placement, end=end, cycles=counts[0], accepted=counts[1],
                          rejected=counts[2], cached_tokens=int(runner_stats.get("cached_tokens", 0) or 0),
                          solo=True, extra_stats=extra_stats)
    for k, v in extra.items():
        result.setdefault(k, v)
    return result, counts


def _take_decode(job, placement: Placement, tokens: list, prompt_eval_s) -> None:
    """The job's tokens and decode start from its runner's output, where it did not stream them
    through `emit_token` or stamp them itself; its prefill is reported done."""
    if not job.tokens and tokens:
        job.tokens = [int(t) for t in tokens]
    if job.decode_started_s is None:
        valid = isinstance(prompt_eval_s, (int, float)) and prompt_eval_s >= 0
        job.decode_started_s = placement.started_s + (prompt_eval_s if valid else 0)
    job.emit_prefill({"phase": "completed", "tokens_total": len(job.prompt_ids),
                      "tokens_done": len(job.prompt_ids), "cached_tokens": 0})
