"""A lane row: the request (`A3BMTPBatchRequest`), its stream result, and its own state while it
decodes (`LaneRow`: sampler, RNG, stop set, budget, penalties, drafting policy, output), with the
log-probability entries it reports. No forwards here: the lane runs those for all rows at once."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Optional, Protocol

import numpy as np

from mtplx.end import CANCELLED, EOS, GRAMMAR_COMPLETE, LENGTH, REPETITION, STOP_STRING, STOP_TOKEN, End
from mtplx.engine.ngram import NgramIndex
from mtplx.engine.prefill import CapacityError
from mtplx.engine.repetition import RepetitionLimits, repeated_tail
from mtplx.sampling import SamplerConfig, row_distribution, to_host
from mtplx.structured import Constraint, RowGrammar


class A3BMTPBatchCapacityError(CapacityError):
    """A row's prompt + max_tokens exceeds the model's context window."""


class RowFailure(RuntimeError):
    """One row's own work raised (its sampler, grammar, stop rule, log-probabilities), or its
    values went non-finite: that row ends alone, with this error; its neighbours continue."""

    def __init__(self, request_id: str, cause):
        self.request_id = request_id
        what = f"{type(cause).__name__}: {cause}" if isinstance(cause, BaseException) else str(cause)
        super().__init__(f"request {request_id} failed in its own decoding work ({what}); "
                         f"the other requests decoding beside it were not affected")


class row_work:
    """`with row_work(row):` marks a block as one row's own work: an exception raised in it is
    that row's (`RowFailure`), not the lane's."""

    __slots__ = ("row",)

    def __init__(self, row: "LaneRow"):
        self.row = row

    def __enter__(self) -> "LaneRow":
        return self.row

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is not None and isinstance(exc, Exception) and not isinstance(exc, RowFailure):
            raise RowFailure(self.row.req.request_id, exc) from exc
        return False


@dataclass(frozen=True)
class RowMark:
    """A live row's state at the end of its last step that completed, its news reported: how
    many tokens (and log-probability entries) it had emitted, whether its last token is still to
    be fed (its pending primary), its RNG state (None for a greedy row: it draws nothing) and its
    drafting policy. With the row's prompt and those tokens it is all a resume needs
    (`RowResume`); each `RowEvent` of a live row carries it, so that a consumer holding the
    streamed tokens can resume the row elsewhere (another lane, another process)."""
    tokens: int
    entries: int
    pending: bool
    rng_state: Optional[dict]
    policy: tuple                       # (accept_est, drafting, probe_every, probe_in)


@dataclass(frozen=True)
class RowResume:
    """Where a row stood at the end of its last step that completed: what it had emitted (and
    reported), its RNG and drafting policy, and whether its last token is still to be fed (its
    pending primary). A row re-admitted with it prefills its prompt plus its tokens and continues
    with the same draws it would have made (`RunningLane.salvage`). `rng_state` None: the row's
    RNG starts from its seed (a greedy row draws nothing); `policy` None: its drafting policy
    starts afresh; `result` None: its counters start at zero (a row resumed in another process)."""
    tokens: tuple
    logprobs: tuple
    pending: bool                       # the last token is not in the caches yet (fed next cycle)
    rng_state: Optional[dict]
    policy: Optional[tuple]             # (accept_est, drafting, probe_every, probe_in)
    result: Optional["A3BMTPBatchStreamResult"] = None   # its counters so far (its tokens and entries are the above)


class StopWatch(Protocol):
    """A row's stop strings, watched on its text as it decodes: `push` takes each emitted token
    in order (a stop token never reaches it) and returns the stop string its text completed at
    that token, else None. The engine sees only tokens; whoever builds the request owns the text
    (the replica detokenizes with `mtplx.api.text.StopStringWatch`)."""

    def push(self, token: int) -> Optional[str]: ...


def _noop(*_args, **_kwargs):
    return None


def _never() -> bool:
    return False


@dataclass(frozen=True)
class A3BMTPBatchRequest:
    request_id: str
    prompt_ids: tuple
    sampler: SamplerConfig = SamplerConfig(temperature=0.0)
    draft_sampler: Optional[SamplerConfig] = None      # None mirrors the target sampler
    seed: int = 0
    max_tokens: int = 64
    stop_token_ids: frozenset = frozenset()
    # Of stop_token_ids, the model's end of sequence: a row that ends on one of these ends as EOS,
    # on any other as the stop token its caller asked for (`mtplx.end`).
    eos_token_ids: frozenset = frozenset()
    omit_speculative_bonus: bool = False
    on_token: Callable[[int], None] = _noop
    on_admit: Callable[[], None] = _noop               # the row leaves the queue: its prefill starts
    on_decode_start: Callable[[], None] = _noop        # the row has a slot: its first cycle is next
    on_terminal: Callable[[str, int], None] = _noop
    cancelled: Callable[[], bool] = _never
    repetition_stop: bool = False
    session_restore: Optional[Callable[[], object]] = None
    session_commit: Optional[Callable[..., None]] = None
    on_result: Optional[Callable[["A3BMTPBatchStreamResult"], None]] = None  # the row's final stream, at its terminal
    speculative: bool = True                            # False: one target token per cycle (plain AR)
    # Log-probabilities: None off; k >= 0 reports, per emitted token, the target's log-softmax at it
    # and its k heaviest alternatives, as on_token(token, (logprob, ((id, logprob), ...))).
    logprobs: Optional[int] = None
    adaptive: bool = False                              # generation_mode "auto": may step aside from drafting
    # Rows of one request (n > 1) with the same prompt: the first of them to finish its prefill
    # gives its prefill to the others queued in the lane (one prefill for all of them).
    prefill_group: Optional[object] = None
    # Drafts a sampled row chains each cycle (1-3; None: its lane's `sampled_depth`). A property
    # of the row, not of its lane's width: a chain's depth decides which draws the row makes, and
    # its draws must not depend on its neighbours. Greedy rows chain their lane's depth.
    draft_depth: Optional[int] = None
    # Structured output: the row's tokens follow this grammar (`mtplx.structured`); every
    # distribution the row draws from or is judged by is restricted to what it allows there.
    constraint: Optional[Constraint] = None
    # A row re-admitted after its lane failed: it continues from here (`RowResume`)
    resume: Optional["RowResume"] = None
    # Stop strings: a fresh `StopWatch` of the row's text per call (a re-admitted row watches its
    # text again from its first token). The row ends as STOP_STRING in the step whose token
    # completed one, that token its last.
    stop_text: Optional[Callable[[], StopWatch]] = None

    def __post_init__(self):
        object.__setattr__(self, "prompt_ids", tuple(int(t) for t in self.prompt_ids))
        object.__setattr__(self, "stop_token_ids", frozenset(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "eos_token_ids", frozenset(int(t) for t in self.eos_token_ids))


@dataclass
class A3BMTPBatchStreamResult:
    request_id: str
    tokens: list = field(default_factory=list)
    end: Optional[End] = None                       # how the row ended (None: it has not)
    cycles: int = 0                                 # cycles this row was live in
    accepted_drafts: int = 0
    rejected_drafts: int = 0
    terminal_perf_s: Optional[float] = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    # what the lane looked like while this row ran (a running lane widens and narrows)
    admitted_at_cycle: Optional[int] = None         # the lane's cycle count when the row took its slot
    fixed_width: int = 0                            # widest lane width the row decoded in
    route_id: Optional[str] = None                  # that lane's route id
    real_width: int = 0                             # most live rows in one of its cycles
    occupancy_sum: int = 0                          # live rows, summed over its cycles
    mean_occupancy: float = 0.0                     # occupancy_sum / cycles
    repetition_stop: Optional[object] = None        # a RepetitionStop when the row stopped on a repeat
    logprobs: list = field(default_factory=list)    # per token, when requested: (logprob, alternatives)
    spec_cycles: int = 0                            # cycles in which this row drafted
    drafts_skipped: int = 0                         # cycles of a speculative row without a draft
    shared_prefill: bool = False                    # took a sibling row's prefill (same prefill_group)
    mtp_depth: int = 0                              # most drafts it chained in one cycle's lane (0: never drafted)

    @property
    def finish_reason(self) -> Optional[str]:
        """"stop" | "length" | "cancelled" (None: not ended): its End's coarse reason."""
        return None if self.end is None else self.end.finish_reason


@dataclass
class RowEvent:
    """What one lane step did to one row (`RunningLane.step` returns these): the tokens it emitted
    and their log-probability entries (when the row asked for them), and on the row's last event
    how it ended (its `End`) and its stream result (tokens as returned, counters). A row that stopped on a
    repetition has its repeats trimmed from `result.tokens`; its events carried every token it
    emitted, the repeats included (as a stream shows them before the stop is known)."""
    request_id: str
    tokens: list
    logprobs: list = field(default_factory=list)
    end: Optional[End] = None
    result: Optional[A3BMTPBatchStreamResult] = None
    times: list = field(default_factory=list)     # when each token was emitted (perf_counter)
    prefill_started_s: Optional[float] = None     # on the first event after its prefill started (perf_counter)
    decode_started_s: Optional[float] = None      # on the first event after it took its slot
    mark: Optional[RowMark] = None                # a live row's state after this event's tokens (`RowMark`)

    @property
    def finish_reason(self) -> Optional[str]:
        return None if self.end is None else self.end.finish_reason


@dataclass
class A3BMTPBatchResult:
    streams: list
    cycles: int
    accepted_drafts: int
    rejected_drafts: int
    route_id: str
    width_histogram: dict
    real_width: int
    fixed_width: int
    prefill_s: float = 0.0
    decode_s: float = 0.0
    host_s: float = 0.0          # of decode_s: host work (sampling, accept tests, bookkeeping)



# A row's own drafting policy (`adaptive`, generation_mode "auto"). It reads only the row's own
# accept/reject outcomes and counts only its own cycles, so a sampled row's draws (which change
# when it drafts) stay reproducible and independent of its neighbours.
ROW_ACCEPT_PRIOR = 0.5        # acceptance estimate on resuming (it starts at the model's `draft_acceptance_prior`)
# weight of each new outcome. Rejections come in bursts (a new identifier, a line's end): at 0.3 a
# burst of four stopped rows whose acceptance stayed ~0.7 (and a stopped row waits 16+ cycles for
# its probe); at 0.1 it takes 14 straight rejections from the prior 1.0.
ROW_ACCEPT_EMA = 0.1
ROW_STOP_BELOW = 0.25
ROW_PROBE_FIRST, ROW_PROBE_MAX = 16, 256   # own cycles before a stopped row drafts once to probe


class LaneRow:
    """One lane row's own state: request, budget, stops, penalties, RNG, output, and what the
    lane looked like while it ran (for its stats)."""

    def __init__(self, req: A3BMTPBatchRequest, vocab: int, prior: float = ROW_ACCEPT_PRIOR,
                 repetition_limits: RepetitionLimits = RepetitionLimits(), grammar_tokenizer=None):
        self.req = req
        # structured output: the row's grammar state (`grammar_tokenizer`: llguidance's tokenizer)
        self.grammar = None if req.constraint is None else RowGrammar(req.constraint, grammar_tokenizer, vocab)
        self.stop_watch = None if req.stop_text is None else req.stop_text()
        self.repetition_limits = repetition_limits
        self.live = True
        self.sampler = req.sampler
        self.draft_sampler = req.draft_sampler or req.sampler
        self.rng = np.random.default_rng(req.seed)
        self.counts = {} if self.sampler.has_penalties else None     # completion token -> count
        self.result = A3BMTPBatchStreamResult(request_id=req.request_id, prompt_tokens=len(req.prompt_ids))
        self.pending: Optional[int] = None
        self.owed = 0         # head-history entries owed for drafts its last MTP cycle accepted
        self.chain_depth: Optional[int] = None   # a sampled row's drafts a cycle (greedy: its lane's)
        # a greedy row's prompt and output, where it drafts from them, and whether it prefers them
        self.context: Optional[NgramIndex] = None
        self.context_score = None      # mtplx.engine.proposer.ContextScore
        # its own drafting policy (adaptive rows): from its own accept/reject history only
        self.accept_est = prior
        self.drafting = prior >= ROW_STOP_BELOW
        self.probe_every = ROW_PROBE_FIRST
        self.probe_in = 0 if self.drafting else ROW_PROBE_FIRST
        self.unreported: list = []          # tokens emitted since its last RowEvent ...
        self.unreported_entries: list = []  # ... their log-probability entries
        self.unreported_times: list = []    # ... and when each was emitted
        self.ended_reported = False
        self.prefill_started_s: Optional[float] = None    # when its prefill started / it took its slot,
        self.decode_started_s: Optional[float] = None     # until an event reports them
        self._mark: Optional[RowMark] = None              # its state at its last completed step's end
        if req.resume is not None:
            self._resume(req.resume)

    # -- a row re-admitted after a lane fault ------------------------------------------------------

    def mark(self) -> None:
        """Remember where the row stands: its last step completed and its news is reported. Its
        tokens and entries only grow, so their counts say which."""
        r = self.result
        self._mark = RowMark(len(r.tokens), len(r.logprobs), self.pending is not None,
                             None if self.greedy else self.rng.bit_generator.state,
                             (self.accept_est, self.drafting, self.probe_every, self.probe_in))

    def resume_point(self) -> Optional[RowResume]:
        """Where the row resumes after its lane failed (None: from its start). Its counters are
        as the failed step left them (stats only: they decide nothing)."""
        at = self._mark
        if at is None:
            return None
        r = self.result
        tokens, logprobs = tuple(r.tokens[:at.tokens]), tuple(r.logprobs[:at.entries])
        return RowResume(tokens, logprobs, at.pending, at.rng_state, at.policy, replace(r, tokens=[], logprobs=[]))

    def _resume(self, at: RowResume) -> None:
        base = at.result if at.result is not None else self.result
        self.result = replace(base, tokens=list(at.tokens), logprobs=list(at.logprobs), end=None,
                              terminal_perf_s=None)
        if at.rng_state is not None:
            self.rng.bit_generator.state = at.rng_state
        if at.policy is not None:
            self.accept_est, self.drafting, self.probe_every, self.probe_in = at.policy
        if self.counts is not None:
            for t in at.tokens:
                self.counts[t] = self.counts.get(t, 0) + 1
        if self.grammar is not None:
            for t in at.tokens:
                self.grammar.consume(t)
            if self.grammar.spent:
                self.grammar = None
        if self.stop_watch is not None:     # its text so far (it completed no stop string, or it had ended)
            for t in at.tokens:
                self.stop_watch.push(t)

    @property
    def prefill_ids(self) -> tuple:
        """What its prefill feeds: its prompt, and a resumed row's tokens already in its caches."""
        at = self.req.resume
        if at is None or not at.tokens:
            return self.req.prompt_ids
        return self.req.prompt_ids + at.tokens[:len(at.tokens) - int(at.pending)]

    @property
    def resumed_pending(self) -> Optional[int]:
        """A resumed row's pending token (its last emitted, not yet fed); None otherwise."""
        at = self.req.resume
        return at.tokens[-1] if at is not None and at.tokens and at.pending else None

    def wants_draft(self) -> bool:
        """Whether this row drafts in the next MTP cycle: a speculative row always unless it is
        adaptive and has stopped, in which case only when its own probe is due."""
        if not self.req.speculative:
            return False
        return not self.req.adaptive or self.drafting or self.probe_in <= 0

    def drafted(self, ok: bool) -> None:
        """After its draft's accept test. A drafting adaptive row stops when its acceptance
        estimate falls below ROW_STOP_BELOW; a stopped one resumes when its probe is accepted, and
        otherwise waits twice as long for the next probe."""
        self.result.spec_cycles += 1
        if not self.req.adaptive:
            return
        if self.drafting:
            self.accept_est += ROW_ACCEPT_EMA * (float(ok) - self.accept_est)
            if self.accept_est < ROW_STOP_BELOW:
                self.drafting, self.probe_in = False, self.probe_every
        elif ok:
            self.drafting, self.accept_est, self.probe_every = True, ROW_ACCEPT_PRIOR, ROW_PROBE_FIRST
        else:
            self.probe_every = min(2 * self.probe_every, ROW_PROBE_MAX)
            self.probe_in = self.probe_every

    def skipped(self) -> None:
        """A live cycle in which this row did not draft."""
        if self.req.speculative:
            self.result.drafts_skipped += 1
            self.probe_in -= 1

    @property
    def greedy(self) -> bool:
        """Decided from argmaxes read on the device (a constrained row's: when its grammar allows
        the argmax; else from its logits, `constrained_argmax`)."""
        return self.sampler.is_greedy and self.draft_sampler.is_greedy and not self.sampler.has_penalties

    @property
    def greedy_draft(self) -> bool:
        """Drafts the head's argmax (on the device, no RNG draw; a constrained row's checked)."""
        return self.draft_sampler.is_greedy and not self.draft_sampler.has_penalties

    @property
    def masked(self) -> bool:
        """A constrained row whose distributions are sampled: it needs its grammar's whole masks
        (a greedy one needs only the argmax checked, `constrained_argmax`)."""
        return self.grammar is not None and not self.greedy

    def constrained_argmax(self, argmax: int, logits_row) -> int:
        """A constrained greedy row's token: `argmax` when its grammar allows it, else the argmax
        over what it allows (`logits_row`: a callable giving the row's logits on the host)."""
        if self.grammar.allows(argmax):
            return int(argmax)
        return int(np.argmax(np.where(self.grammar.allowed(), logits_row(), np.float32(-np.inf))))

    def allowed(self):
        """What its grammar allows next (a bool mask over the vocabulary); None: anything."""
        return None if self.grammar is None else self.grammar.allowed()

    def dist(self, logits_row, cfg=None, allowed=None):
        """The row's distribution over one row of logits; `allowed` (a bool mask from its grammar)
        restricts it to those tokens, renormalised."""
        if allowed is not None:
            logits_row = np.where(allowed, to_host(logits_row), np.float32(-np.inf))
        return row_distribution(logits_row, cfg or self.sampler, self.counts)

    def finish(self, end: End) -> None:
        """End the row (the first end wins): its result's `end`, its terminal callbacks."""
        r = self.result
        if r.end is not None:
            return
        r.end = end
        r.terminal_perf_s = time.perf_counter()
        if r.cycles:
            r.mean_occupancy = r.occupancy_sum / r.cycles
        self.live = False
        try:
            self.req.on_terminal(end.finish_reason, r.cycles)
            if self.req.on_result is not None:
                self.req.on_result(r)
        except Exception:  # a client's callback never breaks the lane
            pass

    def drain_event(self) -> Optional[RowEvent]:
        """The row's tokens since its last event, and its end once it has ended (None: nothing new)."""
        r = self.result
        ended = r.end is not None and not self.ended_reported
        started = self.prefill_started_s is not None or self.decode_started_s is not None
        if not self.unreported and not ended and not started:
            return None
        event = RowEvent(r.request_id, self.unreported, self.unreported_entries, times=self.unreported_times,
                         prefill_started_s=self.prefill_started_s, decode_started_s=self.decode_started_s)
        self.unreported, self.unreported_entries, self.unreported_times = [], [], []
        self.prefill_started_s = self.decode_started_s = None
        if ended:
            self.ended_reported = True
            event.end, event.result = r.end, r
        elif self._mark is not None and self._mark.tokens == len(r.tokens):   # its step completed
            event.mark = self._mark
        return event

    def emit(self, token: int, logprob: Optional[tuple] = None) -> bool:
        """Record a token (and its log-probability entry, when the row asked); returns True when the
        row has finished."""
        r = self.result
        r.tokens.append(token)
        if self.context is not None:
            self.context.append(token)
        self.unreported.append(token)
        self.unreported_times.append(time.perf_counter())
        if self.counts is not None:
            self.counts[token] = self.counts.get(token, 0) + 1
        try:
            if self.req.logprobs is None:
                self.req.on_token(token)
            else:
                r.logprobs.append(logprob)
                self.unreported_entries.append(logprob)
                self.req.on_token(token, logprob)
        except Exception:
            self.finish(End(CANCELLED))
            return True
        if self.grammar is not None:
            self.grammar.consume(token)
            if self.grammar.spent:
                self.grammar = None
        end = self._end_after(token)
        if end is not None:
            self.finish(end)
        return not self.live

    def _end_after(self, token: int) -> Optional[End]:
        """The row's end on its newest token, if that token ends it: a stop token (EOS, or one
        its caller asked for), a stop string its text completed, its grammar complete, its budget
        spent (vLLM's order)."""
        if token in self.req.stop_token_ids:
            return End(EOS if token in self.req.eos_token_ids else STOP_TOKEN, token=token)
        if self.stop_watch is not None:
            matched = self.stop_watch.push(token)
            if matched is not None:
                return End(STOP_STRING, string=matched)
        if self.grammar is not None and self.grammar.ended:
            return End(GRAMMAR_COMPLETE)
        if len(self.result.tokens) >= self.req.max_tokens:
            return End(LENGTH)
        return None

    def check_repetition(self) -> None:
        """Stop with the repeats after the block's first copy trimmed (mtplx.engine.repetition)."""
        hit = repeated_tail(self.result.tokens, self.repetition_limits)
        if hit is not None:
            self.result.repetition_stop = hit
            del self.result.tokens[len(self.result.tokens) - hit.trimmed_tokens:]
            del self.result.logprobs[len(self.result.tokens):]
            self.finish(End(REPETITION))

    def cancelled(self) -> bool:
        try:
            return bool(self.req.cancelled())
        except Exception:  # a broken callback cancels its own row only
            return True



def check_finite(finite: np.ndarray, rows: list, active: np.ndarray) -> None:
    """Fail the first active row whose verify went non-finite (`finite` [W], read with the verify)."""
    bad = np.flatnonzero(active & ~finite)
    if bad.size:
        row = rows[int(bad[0])]
        raise RowFailure(row.req.request_id, "its hidden state went non-finite (NaN or inf) in the verify forward")



# `heaviest` ranks the tokens at or above the k-th largest of the row's block maxima: at least k
# tokens (those maxima) reach it, so they hold the k heaviest, and they are few.
HEAVIEST_BLOCK = 64


def heaviest(x: np.ndarray, k: int) -> np.ndarray:
    """Ids of the `k` heaviest entries of one row, heaviest first, ties by lower id (a partition of
    the whole row costs several times this at a 4k vocabulary)."""
    if k <= 0:
        return np.zeros(0, dtype=np.int64)
    pad = -x.size % HEAVIEST_BLOCK
    blocks = np.concatenate([x, np.full(pad, -np.inf, x.dtype)]) if pad else x
    block_max = blocks.reshape(-1, HEAVIEST_BLOCK).max(axis=1)
    if k >= block_max.size:        # fewer blocks than k: rank the whole row
        return np.argsort(-x, kind="stable")[:k]
    cand = np.flatnonzero(x >= np.partition(block_max, -k)[-k])
    return cand[np.argsort(-x[cand], kind="stable")][:k]


def logprob_entry(logits_row: np.ndarray, token: int, k: int) -> tuple:
    """(log-probability of `token`, its `k` heaviest alternatives as ((id, log-probability), ...))
    under one float32 logits row [V]. The normalizer sums the row's exponentials, taken in float32
    relative to the heaviest (none overflows), in float64."""
    x = logits_row
    top = x.max()
    lse = float(top) + math.log(float(np.exp(x - top).sum(dtype=np.float64)))
    return float(x[token]) - lse, tuple((int(i), float(x[i]) - lse) for i in heaviest(x, k))


def host_logprob(logits_row, token: int, k: Optional[int]) -> Optional[tuple]:
    """A row's entry for `token` under one logits row (an MLX or host array); None when off."""
    return None if k is None else logprob_entry(to_host(logits_row), token, k)


def validate_request(model, r: A3BMTPBatchRequest) -> None:
    if not r.prompt_ids:
        raise ValueError(f"request {r.request_id}: prompt_ids is empty")
    if r.max_tokens < 1:
        raise ValueError(f"request {r.request_id}: max_tokens={r.max_tokens} must be >= 1")
    bad = [t for t in r.prompt_ids if not 0 <= t < model.vocab_size]
    if bad:
        raise ValueError(f"request {r.request_id}: token id {bad[0]} is outside the vocabulary")
    if r.speculative and getattr(model, "mtp", True) is None:
        raise ValueError(f"request {r.request_id}: the model has no MTP head "
                         f"({model.mtp_disabled_reason}); send it with speculative=False (plain AR)")
    if len(r.prompt_ids) + r.max_tokens > model.max_context:
        raise A3BMTPBatchCapacityError(
            f"request {r.request_id}: prompt ({len(r.prompt_ids)}) + max_tokens ({r.max_tokens}) "
            f"exceeds the context window of {model.max_context} tokens")
