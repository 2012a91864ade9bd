"""Prefill: a prompt into a fresh cache in chunks, then its last token alone (the partition
every decode path shares, so greedy outputs compare token for token), with the prefix bank's
restore and commit hooks; and the request checks every path makes first."""

from __future__ import annotations

from typing import Callable

import mlx.core as mx

PREFILL_CHUNK = 256

class CapacityError(ValueError):
    """prompt + max_tokens does not fit the model's context window."""

class KVBudgetError(CapacityError):
    """prompt + max_tokens needs more decode state (KV, recurrent state) than a server's whole
    budget for it."""


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
    last_boundary = ((n - 1) // chunk) * chunk       # with a head or without (AR rows bank prefixes too)
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
    from mtplx.engine.prefix_cache import restore, snapshot, snapshot_whole

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


