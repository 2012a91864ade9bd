"""Solo decoding: plain autoregressive (`generate_ar`, the baseline) and MTP speculative
decoding (`generate_mtpk`). Both share one prefill partition so greedy outputs are comparable
token for token: the prompt body in chunks, then the last prompt token alone.

`generate_mtpk` decodes as a one-row cohort of the batched lane (`mtplx.engine.lane`, one
decode engine for solo and batched rows). One MTP cycle (depth K):
  primary x0 (pending from the last cycle, or sampled from the last logits)
  -> K chained drafts from the MTP head (its history entries for accepted tokens folded into the
     same head forward)
  -> one target verify forward over [x0, d1..dK]
  -> accept drafts left to right (greedy: equal to argmax; sampled: verify_one_token), the first
     rejection emits the residual sample; if all are accepted a bonus token comes from the last
     verify row. The emitted correction/bonus is the next cycle's pending primary.
  -> keep the target KV of accepted positions; the MTP head's history keeps target hiddens only.
RNG order per cycle: primary, drafts, accept draws/residual, bonus.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable, Optional

import mlx.core as mx
import numpy as np

from mtplx.engine.lane import A3BMTPBatchRequest, generate_a3b_mtp_batch, solo_lane
from mtplx.engine.prefill import check_request, prefill
from mtplx.sampling import SamplerConfig, row_distribution, sample


@dataclass
class GenerationResult:
    tokens: list[int]
    finish_reason: str                  # "stop" | "length" | "cancelled"
    stats: dict = field(default_factory=dict)


class _Row:
    """`generate_ar`'s per-request bookkeeping: budget, stops, penalties, RNG."""

    def __init__(self, model, sampler, max_tokens, seed, stop_token_ids):
        self.sampler = sampler
        self.max_tokens = int(max_tokens)
        self.stop = frozenset(int(t) for t in stop_token_ids)
        self.rng = np.random.default_rng(seed)
        self.vocab = model.vocab_size
        self.tokens: list[int] = []
        self.finish_reason: Optional[str] = None
        self.counts = {} if sampler.has_penalties else None     # completion token -> count

    def dist(self, logits_row, cfg=None):
        return row_distribution(logits_row, cfg or self.sampler, self.counts)

    def emit(self, token: int, on_token=None) -> bool:
        """Record a token; returns True when the row is finished."""
        self.tokens.append(token)
        if self.counts is not None:
            self.counts[token] = self.counts.get(token, 0) + 1
        if on_token is not None:
            on_token(token)
        if token in self.stop:
            self.finish_reason = "stop"
        elif len(self.tokens) >= self.max_tokens:
            self.finish_reason = "length"
        return self.finish_reason is not None


def _finish_stats(row: _Row, t_start, t_decode, prompt_len, extra) -> dict:
    t_end = time.perf_counter()
    decode_s = max(t_end - t_decode, 1e-9)
    n = len(row.tokens)
    stats = {
        "prompt_tokens": prompt_len,
        "completion_tokens": n,
        "prompt_eval_time_s": t_decode - t_start,
        "decode_elapsed_s": decode_s,
        "decode_tok_s": n / decode_s,
        "elapsed_s": t_end - t_start,
        "end_to_end_tok_s": n / max(t_end - t_start, 1e-9),
    }
    stats.update(extra)
    return stats


def generate_ar(model, prompt_ids, max_tokens: int = 64, sampler: SamplerConfig = SamplerConfig(),
                seed: int = 0, stop_token_ids: Iterable[int] = frozenset(), on_token=None) -> GenerationResult:
    """Plain autoregressive decoding: one [1, 1] target forward per token."""
    prompt = check_request(model, prompt_ids, max_tokens)
    row = _Row(model, sampler, max_tokens, seed, stop_token_ids)
    t_start = time.perf_counter()
    cache = model.make_cache()
    logits, _ = prefill(model, prompt, cache)
    t_decode = time.perf_counter()
    if sampler.is_greedy and not sampler.has_penalties:
        # Pipelined like mlx-lm: build step n+1 on the device before reading token n.
        y = mx.argmax(logits)
        mx.async_eval(y)
        while True:
            nxt = mx.argmax(model.logits(model.hidden(y.reshape(1, 1), cache))[0, -1])
            mx.async_eval(nxt)
            if row.emit(int(y.item()), on_token):
                break
            y = nxt
    else:
        while True:
            token = sample(row.dist(logits), row.rng)
            if row.emit(token, on_token):
                break
            logits = model.logits(model.hidden(mx.array([[token]]), cache))[0, -1]
    stats = _finish_stats(row, t_start, t_decode, len(prompt), {"mode": "ar", "generation_mode": "ar",
                                                               "verify_calls": 0})
    return GenerationResult(row.tokens, row.finish_reason, stats)


def _generate_in_lane(model, prompt, max_tokens, sampler, draft_sampler, depth, seed, stop_token_ids,
                      omit_speculative_bonus, on_token, session_restore, session_commit) -> GenerationResult:
    """A one-row cohort of the batched lane chaining `depth` drafts: the same decode code and RNG
    order as the lanes, with the cycle's forwards compiled for fixed shapes."""
    errors = []

    def forward_token(token):
        try:
            on_token(token)
        except BaseException as exc:  # surface the caller's own exception, as the loop path does
            errors.append(exc)
            raise

    req = A3BMTPBatchRequest(
        request_id="solo", prompt_ids=prompt, sampler=sampler, draft_sampler=draft_sampler, seed=seed,
        max_tokens=int(max_tokens), stop_token_ids=frozenset(stop_token_ids),
        omit_speculative_bonus=omit_speculative_bonus,
        on_token=forward_token if on_token is not None else (lambda _t: None),
        session_restore=session_restore, session_commit=session_commit)
    t_start = time.perf_counter()
    res = generate_a3b_mtp_batch(solo_lane(model, depth), [req])
    if errors:
        raise errors[0]
    s = res.streams[0]
    n = len(s.tokens)
    decode_s = max(s.terminal_perf_s - (t_start + res.prefill_s), 1e-9)
    elapsed = max(s.terminal_perf_s - t_start, 1e-9)
    stats = {
        "prompt_tokens": len(prompt), "completion_tokens": n, "prompt_eval_time_s": res.prefill_s,
        "decode_elapsed_s": decode_s, "decode_tok_s": n / decode_s, "elapsed_s": elapsed,
        "end_to_end_tok_s": n / elapsed, "mode": "mtp", "generation_mode": "mtp", "mtp_depth": depth,
        "cached_tokens": s.cached_tokens, "accepted_drafts": s.accepted_drafts,
        "rejected_drafts": s.rejected_drafts, "verify_calls": s.cycles,
        "acceptance_rate": s.accepted_drafts / max(s.accepted_drafts + s.rejected_drafts, 1),
        "mean_tokens_per_verify": n / max(s.cycles, 1),
    }
    return GenerationResult(list(s.tokens), s.finish_reason, stats)


def generate_mtpk(model, prompt_ids, max_tokens: int = 64, sampler: SamplerConfig = SamplerConfig(),
                  draft_sampler: Optional[SamplerConfig] = None, depth: int = 1, seed: int = 0,
                  stop_token_ids: Iterable[int] = frozenset(), omit_speculative_bonus: bool = False,
                  on_token=None, session_restore=None, session_commit=None) -> GenerationResult:
    """MTP speculative decoding with the model's own head (depth 1-3). Exact: greedy output equals
    `generate_ar`; sampled output keeps the target distribution."""
    if model.mtp is None:
        raise ValueError(f"this model has no MTP head ({model.mtp_disabled_reason}); use generate_ar")
    if not 1 <= int(depth) <= 3:
        raise ValueError(f"depth={depth} is invalid: must be 1, 2 or 3")
    prompt = check_request(model, prompt_ids, max_tokens)
    return _generate_in_lane(model, prompt, max_tokens, sampler, draft_sampler or sampler, int(depth), seed,
                             stop_token_ids, omit_speculative_bonus, on_token, session_restore, session_commit)
