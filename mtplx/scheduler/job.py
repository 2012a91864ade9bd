"""One request of the ``mtp_batch`` lane (`MTPBatchJob`) and the errors a job's future may carry.

A job carries everything its row needs (prompt, budget, samplers, seed, stops, callbacks) and
resolves once, first outcome wins: a result dict, or an exception (cancelled, refused, failed).
"""

from __future__ import annotations

import secrets
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Hashable, Iterable, Optional

from mtplx.api.rows import RowCheckpoint, mtp_batch_compatibility_key
from mtplx.sampling import SamplerConfig
from mtplx.structured import Constraint


class MTPBatchCancelled(RuntimeError):
    """Default ``cancel_error``: the request was cancelled."""


class MTPBatchServiceClosed(RuntimeError):
    """The service was shut down (or poisoned); the job was not run."""


class MTPBatchOwnerFinalizeError(MTPBatchServiceClosed):
    """The owner finalize of a cohort failed: the service is poisoned."""


def _default_cancel_error(job: "MTPBatchJob") -> BaseException:
    return MTPBatchCancelled(f"request {job.request_id} cancelled")


def failsafe(hook: Optional[Callable]) -> Optional[Callable]:
    """Wrap a caller's hook (session, lane step) so that it can never break a cohort (errors read
    as 'no state')."""
    if hook is None:
        return None

    def safe(*args, **kwargs):
        try:
            return hook(*args, **kwargs)
        except Exception:
            return None

    safe.__wrapped__ = hook
    return safe


class MTPBatchJob:
    """One request of the ``mtp_batch`` lane.

    Constructor fields follow MTPLX. ``solo_runner=None`` means the built-in path: the job is a
    row of its key's running lane (the one-row lane when it decodes alone). Otherwise it is a
    callable ``(job) -> result dict`` (or a ``GenerationResult``) that the service calls, at the
    job's turn and within the KV budget like any row, when the job would decode alone.
    ``compatibility_key=None`` uses ``mtp_batch_compatibility_key(None)``: every job of any
    sampling settings shares one lane. ``seed=None`` draws a fresh seed (recorded in ``job.seed``).
    ``session_id`` is accepted (the seed's signature) and unused: prefix reuse needs no session.
    ``resume_tokens`` / ``checkpoint``: a row that decoded elsewhere (another replica) continues
    after these tokens from that state (``mtplx.api.rows.RowSpec`` says how); they count in its
    ``tokens`` and ``max_tokens`` but are not emitted again. ``checkpoint_callback(checkpoint)``:
    after each lane step that emitted tokens of a live row, its state after them (a
    ``RowCheckpoint``), once those tokens have reached ``token_callback``. ``eos_token_ids``: which
    of ``stop_token_ids`` are the model's end of sequence (the row's `End` says EOS for those,
    a requested stop token for the others).
    """

    def __init__(self, request_id: str, prompt_ids: Iterable[int], max_tokens: int,
                 sampler: Optional[SamplerConfig] = None, draft_sampler: Optional[SamplerConfig] = None,
                 seed: Optional[int] = 0, stop_token_ids: Iterable[int] = frozenset(),
                 token_callback: Optional[Callable[[list], None]] = None,
                 compatibility_key: Optional[Hashable] = None, generation_limits: Optional[dict] = None,
                 solo_runner: Optional[Callable[["MTPBatchJob"], Any]] = None,
                 cancel_error: Optional[Callable[["MTPBatchJob"], BaseException]] = None, *,
                 prefill_callback: Optional[Callable[[dict], None]] = None,
                 cancel_event: Optional[threading.Event] = None,
                 request_observability: Optional[dict] = None, logprobs: Optional[int] = None,
                 omit_speculative_bonus: bool = False, session_id: Optional[str] = None,
                 session_restore: Optional[Callable[[], Any]] = None,
                 session_commit: Optional[Callable[..., Any]] = None, speculative: bool = True,
                 adaptive: bool = True, prefill_group: Optional[Hashable] = None,
                 constraint: Optional[Constraint] = None, cache_salt: Optional[str] = None,
                 resume_tokens: Iterable[int] = (), checkpoint: Optional[RowCheckpoint] = None,
                 checkpoint_callback: Optional[Callable[[RowCheckpoint], None]] = None,
                 eos_token_ids: Iterable[int] = frozenset(),
                 stop_text: Optional[Callable[[], Any]] = None, sink: Optional[Callable[[list], None]] = None):
        self.request_id = str(request_id)
        self.prompt_ids = [int(t) for t in prompt_ids]
        self.max_tokens = max(1, int(max_tokens))
        self.sampler = sampler if sampler is not None else SamplerConfig()
        self.draft_sampler = draft_sampler
        self.seed = int(seed) if seed is not None else secrets.randbits(63)
        self.stop_token_ids = frozenset(int(t) for t in stop_token_ids)
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.token_callback = token_callback
        # None: off; k >= 0: each streamed token comes with the target's (logprob, k alternatives),
        # as token_callback([token], [entry]) (from the lane: such a job never goes to its solo_runner)
        self.logprobs = None if logprobs is None else int(logprobs)
        self.omit_speculative_bonus = bool(omit_speculative_bonus)
        self.speculative = bool(speculative)     # False: a lane row that decodes plain AR
        self.adaptive = bool(adaptive)           # speculative rows: MTP steps aside where it does not pay
        self.compatibility_key = (compatibility_key if compatibility_key is not None
                                  else mtp_batch_compatibility_key(None))
        self.generation_limits = dict(generation_limits or {})
        self.solo_runner = solo_runner
        self.cancel_error = cancel_error or _default_cancel_error
        self.prefill_callback = prefill_callback
        self.cancel_event = cancel_event if cancel_event is not None else threading.Event()
        self.request_observability = request_observability if request_observability is not None else {}
        self.session_id = session_id
        self.session_restore = session_restore
        self.session_commit = session_commit
        # jobs of one request (n > 1, same prompt) that share one prefill in their lane
        self.prefill_group = prefill_group
        # structured output (a JSON schema, grammar, tool-call format, thinking budget): enforced
        # by the lane row (such a job never goes to its solo_runner)
        self.constraint = constraint
        # stop strings: the lane row's `StopWatch` factory (`A3BMTPBatchRequest.stop_text`); the
        # row ends in the step whose token completed one (a solo_runner decodes to its own end)
        self.stop_text = stop_text
        # a cohort's sink, shared by its jobs: called on the owner thread once per lane step phase
        # with the `RowNews` of those of its jobs that have any (their tokens then go to no
        # token_callback or checkpoint_callback); a raising sink fails those jobs
        self.sink = sink
        # the prefix bank's partition its prompt is looked up and banked in (`SessionBank.job_hooks`):
        # a digest of its caller and its request's cache salt; None: the shared partition
        self.cache_salt = cache_salt
        self.resume_tokens = tuple(int(t) for t in resume_tokens)
        self.checkpoint = checkpoint
        self.checkpoint_callback = checkpoint_callback

        # runtime
        self.created_s = time.perf_counter()
        self.future: Future = Future()
        self.tokens: list[int] = list(self.resume_tokens)
        self.token_times: list[float] = [self.created_s] * len(self.resume_tokens)
        self.callback_error: Optional[BaseException] = None
        self.admitted_s: Optional[float] = None
        self.decode_started_s: Optional[float] = None
        self.completed_s: Optional[float] = None
        self._lock = threading.Lock()
        self._resolved = False
        self._service = None                      # the MTPBatchGenerationService it was submitted to
        self._ready = False                       # submitted as a cohort: no gather wait

    def __repr__(self) -> str:
        return (f"MTPBatchJob(request_id={self.request_id!r}, prompt={len(self.prompt_ids)} tokens, "
                f"max_tokens={self.max_tokens}, tokens={len(self.tokens)}, done={self.future.done()})")

    # -- streaming ---------------------------------------------------------------------------

    def emit_token(self, token: int, logprob: Optional[tuple] = None, at: Optional[float] = None) -> None:
        """Record a committed token (stop tokens included); forward non-stop tokens as ``[token]``
        (with ``[logprob]``, its log-probability entry, when the job asked for them).

        A no-op once the job is cancelled. A raising ``token_callback`` cancels this job and fails
        its future with that exception; it never raises into the driver.
        """
        if self.cancel_requested():
            return
        token = int(token)
        self.tokens.append(token)
        self.token_times.append(time.perf_counter() if at is None else at)   # `at`: when the lane emitted it
        if self.token_callback is None or token in self.stop_token_ids:
            return
        try:
            if self.logprobs is None:
                self.token_callback([token])
            else:
                self.token_callback([token], [logprob])
        except Exception as exc:  # row-local: the cohort and its peers never see it
            self.consumer_failed(exc)

    def emit_checkpoint(self, checkpoint: RowCheckpoint) -> None:
        """The row's state after its first `checkpoint.tokens` tokens (a lane step's end) to
        ``checkpoint_callback``; a no-op once cancelled. A raising callback fails this job alone."""
        if self.checkpoint_callback is None or self.cancel_requested():
            return
        try:
            self.checkpoint_callback(checkpoint)
        except Exception as exc:
            self.consumer_failed(exc)

    def consumer_failed(self, exc: BaseException) -> None:
        """Whoever takes this job's tokens (a callback, its cohort's sink) raised `exc`: the job
        is cancelled and fails with it, alone."""
        self.callback_error = exc
        self.cancel_event.set()
        self._fail(exc)

    def emit_prefill(self, event: dict) -> None:
        """Forward a prefill progress event; callback errors are swallowed."""
        if self.prefill_callback is None:
            return
        try:
            self.prefill_callback(dict(event))
        except Exception:
            pass

    def mark_decode_started(self) -> None:
        """Stamp the start of this row's decode window (perf_counter; the first call wins)."""
        if self.decode_started_s is None:
            self.decode_started_s = time.perf_counter()

    # -- cancellation ------------------------------------------------------------------------

    def cancel(self) -> bool:
        """End the job early, from any thread: its future fails at once with ``cancel_error(job)``;
        a queued job never runs, an admitted row leaves its lane at the next cycle boundary.
        Returns False when the job had already finished."""
        if self.future.done():
            return False
        self.cancel_event.set()
        service = self._service
        if service is not None:
            service._on_job_cancelled(self)
        return self._fail(self._cancel_exception())

    @property
    def generation_mode(self) -> str:
        """"ar" (plain AR), "mtp" (always drafts) or "auto" (drafts where it pays)."""
        return "ar" if not self.speculative else ("auto" if self.adaptive else "mtp")

    def cancel_requested(self) -> bool:
        return self.cancel_event.is_set()

    def _cancel_exception(self) -> BaseException:
        if self.callback_error is not None:
            return self.callback_error
        try:
            exc = self.cancel_error(self)
        except Exception as err:  # a broken cancel_error must not leave the future hanging
            return MTPBatchCancelled(f"request {self.request_id} cancelled ({type(err).__name__}: {err})")
        if not isinstance(exc, BaseException):
            return MTPBatchCancelled(f"request {self.request_id} cancelled")
        return exc

    # -- resolution (first one wins) ---------------------------------------------------------

    def _claim(self) -> bool:
        with self._lock:
            if self._resolved:
                return False
            self._resolved = True
            self.completed_s = time.perf_counter()
            return True

    def _succeed(self, result: dict) -> bool:
        if not self._claim():
            return False
        self.completed_s = result.get("_completed_s", self.completed_s)
        self.future.set_result(result)
        return True

    def _fail(self, exc: BaseException) -> bool:
        if not self._claim():
            return False
        self.future.set_exception(exc)
        return True
