"""Solo decoding: plain autoregressive (`generate_ar`, the baseline) and MTP speculative
decoding (`generate_mtpk`). Both share one prefill partition so greedy outputs are comparable
token for token: the prompt body in chunks, then the last prompt token alone.

`generate_mtpk` decodes as a one-row cohort of the batched lane (`mtplx.a3b_mtp_batch`, one
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
from typing import Callable, Iterable, Optional

import mlx.core as mx
import numpy as np

from .sampling import SamplerConfig, row_distribution, sample

PREFILL_CHUNK = 256


class CapacityError(ValueError):
    """prompt + max_tokens does not fit the model's context window."""


class KVBudgetError(CapacityError):
    """prompt + max_tokens needs more decode state (KV, recurrent state) than a server's whole
    budget for it."""


@dataclass
class GenerationResult:
    tokens: list[int]
    finish_reason: str                  # "stop" | "length" | "cancelled"
    stats: dict = field(default_factory=dict)


def check_request(model, prompt_ids, max_tokens: int) -> list[int]:
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise ValueError("prompt_ids is empty; a prompt needs at least one token")
    if int(max_tokens) < 1:
        raise ValueError(f"max_tokens={max_tokens} is invalid: must be >= 1")
    bad = [t for t in prompt if not 0 <= t < model.vocab_size]
    if bad:
        raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {model.vocab_size})")
    if len(prompt) + int(max_tokens) > model.max_context:
        raise CapacityError(
            f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceeds the model's context "
            f"window of {model.max_context} tokens")
    return prompt


def prefill_steps(model, prompt: list[int], cache, mtp_cache=None, chunk: int = PREFILL_CHUNK,
                  start: int = 0, boundary_hook=None):
    """The prefill as a generator: each `next()` runs one chunk of the prompt and yields its token
    count; the generator returns (logits_last [V], hidden_last [1, 1, H]).

    The prompt is split at absolute multiples of `chunk` (the last prompt token rides in the final
    chunk), so every path (AR, MTP, lane rows, prefix restores) uses one partition and greedy
    outputs agree token for token. A running lane drives it one chunk per cycle, so a long prompt
    delays the lane's live rows by at most one chunk per cycle. The MTP history (h_i, token_{i+1})
    is primed for every position but the last when `mtp_cache` is given. `start` is a chunk
    boundary whose state the caches already hold (a prefix restore); `boundary_hook(m)` is called
    after the last full chunk boundary m before the final token (prefix snapshots).
    """
    n = len(prompt)
    last_boundary = ((n - 1) // chunk) * chunk if mtp_cache is not None else 0
    for s in range(start, n, chunk):
        piece = prompt[s:s + chunk]
        h = model.hidden(mx.array([piece]), cache)
        following = prompt[s + 1:s + 1 + len(piece)]       # one short in the final chunk
        if mtp_cache is not None and following:
            model.draft_hidden(h[:, :len(following)], mx.array([following]), mtp_cache)
        state = [c.state for c in cache] + ([c.state for c in mtp_cache] if mtp_cache else [])
        if s + len(piece) < n:
            mx.eval(state)
            if boundary_hook is not None and s + len(piece) == last_boundary and last_boundary > start:
                boundary_hook(last_boundary)
            yield len(piece)
            continue
        h_last = h[:, -1:]
        logits_last = model.logits(h_last)[0, -1]
        mx.eval(state, logits_last, h_last)
        return logits_last, h_last


def run_steps(steps, cancelled: Callable[[], bool] = lambda: False):
    """Drive a `prefill_steps` generator to its end; None when cancelled between chunks."""
    while True:
        if cancelled():
            return None
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def prefill(model, prompt: list[int], cache, mtp_cache=None, chunk: int = PREFILL_CHUNK,
            cancelled: Callable[[], bool] = lambda: False, start: int = 0, boundary_hook=None):
    """`prefill_steps` run to the end. Returns (logits_last [V], hidden_last [1, 1, H]), or None
    when cancelled between chunks."""
    return run_steps(prefill_steps(model, prompt, cache, mtp_cache, chunk, start, boundary_hook), cancelled)


def start_prefill(model, prompt: list[int], chunk: int = PREFILL_CHUNK, session_restore=None,
                  session_commit=None):
    """A prefill with the MTP history that reuses a banked prefix state when one matches.

    `session_restore()` returns a PrefixState or None; `session_commit(state)` receives the
    state at the last chunk boundary and, when the prefill ends, the whole prompt's state. A
    whole-prompt state of this exact prompt leaves nothing to prefill. Both hooks are fail-safe:
    a bank problem only costs reuse.
    Returns (cache, mtp_cache, steps, cached_tokens); `steps` is a `prefill_steps` generator.
    """
    from .prefix_cache import restore, snapshot, snapshot_whole

    cache, mtp_cache, start = None, None, 0
    if session_restore is not None:
        try:
            state = session_restore()
            if state is not None and state.whole and state.key == tuple(prompt):
                cache, mtp_cache = restore(state)
                return cache, mtp_cache, _finished(state.out), len(prompt)
            if state is not None and not state.whole and 0 < state.cached_tokens < len(prompt) \
                    and state.cached_tokens % chunk == 0 and tuple(prompt[:len(state.key)]) == state.key:
                cache, mtp_cache = restore(state)
                start = state.cached_tokens
        except Exception:
            cache, start = None, 0
    if cache is None:
        cache, mtp_cache = model.make_cache(), model.make_mtp_cache()

    def commit(make_state, *args):
        try:
            session_commit(make_state(prompt, *args))
        except Exception:
            pass

    def steps():
        out = yield from prefill_steps(model, prompt, cache, mtp_cache, chunk, start, hook)
        if session_commit is not None and len(prompt) > 1:   # (one token: the head holds no history yet)
            commit(snapshot_whole, cache, mtp_cache, out)
        return out

    hook = (lambda m: commit(snapshot, m, cache, mtp_cache)) if session_commit is not None else None
    return cache, mtp_cache, steps(), start


def _finished(out):
    """A `prefill_steps` generator with no chunk left: it returns `out` at once."""
    return out
    yield  # noqa: unreachable; makes this a generator


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
    from .a3b_mtp_batch import A3BMTPBatchRequest, generate_a3b_mtp_batch, solo_lane

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
