"""The cohort service of the ``mtp_batch`` lane: ``MTPBatchJob`` and ``MTPBatchGenerationService``.

Three stages (as in MTPLX's lane, with cohorts that never seal):

1. **Job creation.** One ``MTPBatchJob`` per request: prompt ids, budget, samplers, seed, stop ids,
   a ``token_callback`` that receives ``[token]`` per committed non-stop token, and the
   ``compatibility_key`` that decides which jobs may decode together.
2. **Admission into running lanes.** ``submit(job)`` queues the job for the one model-owner
   thread, which keeps one ``RunningLane`` per compatibility key: the job joins its key's lane at
   the next cycle boundary (a key with no lane first waits up to ``batch_wait_s`` for company).
   ``submit_cohort(jobs)`` takes jobs gathered upstream (the Ray ingress's ``@serve.batch``
   window) with no wait. A lane runs at the narrowest installed width that holds its rows (the
   one-row solo lane for a lone row; ``MTPLX_MTP_BATCH_FORCE_WIDTH`` pins the narrowest), widens
   when more rows want in and narrows when few remain; lanes of different keys take turns cycle
   by cycle. Numerics profile ``b1-exact`` runs every job serially through the solo runner, and a
   lone job with its own ``solo_runner`` runs through it.
3. **Decode window and statistics.** The lane calls ``job.mark_decode_started`` when the row takes
   its slot (after its own prefill) and stamps its ``terminal_perf_s``; ``_complete_lane_job``
   turns those into ``decode_elapsed_s``, ``decode_tok_s`` and the rest of the stats contract and
   merges the lane's truth (widest width, peak and mean occupancy, route) into
   ``job.request_observability``.

All MLX work (lane installation, prefill, decode) runs on the service's single model-owner thread:
MLX state is thread-affine. ``submit`` and ``cancel`` are safe from any thread; token callbacks and
result publication run on the owner thread, so a consumer on another thread must hand tokens over
itself (``AsyncTokenStream`` does that for an asyncio loop, e.g. in the Ray replica).

Deliberate differences from MTPLX: cohorts are not sealed (a row joins a running lane whenever a
slot is free, instead of waiting for the whole running cohort to drain), and a row's future
resolves **at that row's own terminal**, not after its cohort has drained, so a 3-token answer
never waits for a 500-token neighbour. The owner finalize runs each time a key's lane drains, and
its failure still poisons the service (the queue fails, later submits fail), but it cannot take
back results that were already published. Cancelled and errored rows fail at once.

Other choices worth knowing:

* ``completion_tokens = len(job.tokens)`` and ``result["tokens"]`` include a terminal stop token,
  as in MTPLX; ``result["_mtp_batch_stop_token_ids"]`` lets the caller strip it before detokenizing.
* A request that can never run (empty prompt, token id out of range, prompt + max_tokens over the
  context window) fails alone at ``submit`` instead of failing the lane it would have joined.
* ``job.cancel()`` fails the job's future at once wherever it is; a queued job never reaches MLX,
  an admitted row leaves its lane at the next cycle boundary (its slot takes the next waiting
  row) while its neighbours continue.
* An error inside a lane's step fails that lane's rows only; other keys' lanes keep running.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import math
import os
import secrets
import statistics
import threading
import time
import weakref
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable, Hashable, Iterable, Optional

from mtplx.api.rows import mtp_batch_compatibility_key  # noqa: F401  (the seed imports it from here)
from mtplx.runtime import release_free_heap
from mtplx.sampling import SamplerConfig

logger = logging.getLogger(__name__)
FORCE_WIDTH_ENV = "MTPLX_MTP_BATCH_FORCE_WIDTH"
MAX_COHORT_ROWS = 8                    # MTPLX's seal cap; here the default when no lane is installed
DEFAULT_WIDTHS = (3, 8)
DEFAULT_BATCH_WAIT_S = 0.02
IDLE_HEAP_RELEASE_S = 0.5              # idle this long after work, the owner returns free heap to the OS
NUMERICS = ("throughput", "b1-exact")
KV_BUDGET_ENV = "MTPLX_KV_BUDGET_GB"     # decode state all lanes may hold; default: half the memory
SOLO_ROUTE_ID = "mtp_b1_solo"
B1_EXACT_ROUTE_ID = "mtp_batch_b1_exact_serial"
MTP_DEPTH = 1


class MTPBatchCancelled(RuntimeError):
    """Default ``cancel_error``: the request was cancelled."""


class MTPBatchServiceClosed(RuntimeError):
    """The service was shut down (or poisoned); the job was not run."""


class MTPBatchOwnerFinalizeError(MTPBatchServiceClosed):
    """The owner finalize of a cohort failed: the service is poisoned."""


def _default_kv_budget() -> Optional[int]:
    """MTPLX_KV_BUDGET_GB, else half the machine's memory (None where it cannot be read)."""
    raw = os.environ.get(KV_BUDGET_ENV, "").strip()
    if raw:
        try:
            return int(float(raw) * 2**30)
        except ValueError:
            raise ValueError(f"{KV_BUDGET_ENV}={raw!r} is invalid: a number of GiB") from None
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    except (ValueError, OSError, AttributeError):
        return None


def row_state_bytes(model) -> tuple:
    """(bytes per KV position, fixed bytes) of one row's decode state, target and MTP head
    together, read off a two-token prefill: KV layers grow per position, recurrent (GDN) layers
    hold a fixed state per row."""
    from mtplx.engine.prefill import prefill

    cache, mtp_cache = model.make_cache(), model.make_mtp_cache()
    prefill(model, [0, 0], cache, mtp_cache)
    per_position = per_row = 0
    for layer in list(cache) + list(mtp_cache or []):
        keys = getattr(layer, "keys", None)
        if keys is not None:
            per_position += (keys.nbytes + layer.values.nbytes) // keys.shape[2]
        else:
            per_row += sum(a.nbytes for a in (layer.state or []) if a is not None)
    return per_position, per_row


def _checked_depths(depths) -> dict:
    from mtplx.engine.lane import DEPTHS, MAX_WIDTH

    out = {}
    for w, d in dict(depths or {}).items():
        if isinstance(d, bool) or int(d) != d or int(d) not in DEPTHS:
            raise ValueError(f"greedy_depths[{w}]={d!r} is invalid: a lane chains {DEPTHS} drafts")
        if isinstance(w, bool) or int(w) != float(w) or not 1 <= int(w) <= MAX_WIDTH:
            raise ValueError(f"greedy_depths has width {w!r}: widths are integers in [1, {MAX_WIDTH}]")
        out[int(w)] = int(d)
    return out


def _default_cancel_error(job: "MTPBatchJob") -> BaseException:
    return MTPBatchCancelled(f"request {job.request_id} cancelled")


def _failsafe(hook: Optional[Callable]) -> Optional[Callable]:
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


# ---------------------------------------------------------------------------------------------
# Jobs


class MTPBatchJob:
    """One request of the ``mtp_batch`` lane.

    Constructor fields follow MTPLX. ``solo_runner=None`` means the built-in solo MTP path
    (``generate_mtpk`` with this job's fields, streaming through ``emit_token``); otherwise it is a
    callable ``(job) -> result dict`` (or a ``GenerationResult``) used when the job runs alone.
    ``compatibility_key=None`` uses ``mtp_batch_compatibility_key(None)``: every job of any
    sampling settings shares one lane. ``seed=None`` draws a fresh seed (recorded in ``job.seed``).
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
                 adaptive: bool = True, prefill_group: Optional[Hashable] = None):
        self.request_id = str(request_id)
        self.prompt_ids = [int(t) for t in prompt_ids]
        self.max_tokens = max(1, int(max_tokens))
        self.sampler = sampler if sampler is not None else SamplerConfig()
        self.draft_sampler = draft_sampler
        self.seed = int(seed) if seed is not None else secrets.randbits(63)
        self.stop_token_ids = frozenset(int(t) for t in stop_token_ids)
        self.token_callback = token_callback
        # None: off; k >= 0: each streamed token comes with the target's (logprob, k alternatives),
        # as token_callback([token], [entry]) (lane rows only: b1-exact serves them in its one-row lane)
        self.logprobs = None if logprobs is None else int(logprobs)
        self.omit_speculative_bonus = bool(omit_speculative_bonus)
        self.speculative = bool(speculative)     # False: a lane row that decodes plain AR
        self.adaptive = bool(adaptive)           # speculative rows: MTP steps aside where it does not pay
        self.compatibility_key = compatibility_key if compatibility_key is not None else mtp_batch_compatibility_key(None)
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

        # runtime
        self.future: Future = Future()
        self.tokens: list[int] = []
        self.token_times: list[float] = []
        self.callback_error: Optional[BaseException] = None
        self.created_s = time.perf_counter()
        self.admitted_s: Optional[float] = None
        self.decode_started_s: Optional[float] = None
        self.completed_s: Optional[float] = None
        self._lock = threading.Lock()
        self._resolved = False
        self._service: Optional["MTPBatchGenerationService"] = None
        self._ready = False                       # submitted as a cohort: no gather wait

    def __repr__(self) -> str:
        return (f"MTPBatchJob(request_id={self.request_id!r}, prompt={len(self.prompt_ids)} tokens, "
                f"max_tokens={self.max_tokens}, tokens={len(self.tokens)}, done={self.future.done()})")

    # -- streaming ---------------------------------------------------------------------------

    def emit_token(self, token: int, logprob: Optional[tuple] = None) -> None:
        """Record a committed token (stop tokens included); forward non-stop tokens as ``[token]``
        (with ``[logprob]``, its log-probability entry, when the job asked for them).

        A no-op once the job is cancelled. A raising ``token_callback`` cancels this job and fails
        its future with that exception; it never raises into the driver.
        """
        if self.cancel_requested():
            return
        token = int(token)
        self.tokens.append(token)
        self.token_times.append(time.perf_counter())
        if self.token_callback is None or token in self.stop_token_ids:
            return
        try:
            if self.logprobs is None:
                self.token_callback([token])
            else:
                self.token_callback([token], [logprob])
        except Exception as exc:  # row-local: the cohort and its peers never see it
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
        """Cancel the job from any thread. Its future fails at once with ``cancel_error(job)``:
        a queued job never runs; an admitted row leaves its cohort at the driver's next cycle.
        Returns False when the job had already finished."""
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


# ---------------------------------------------------------------------------------------------
# Stats


def _valid_time(t, lo: float, hi: float) -> bool:
    return isinstance(t, (int, float)) and math.isfinite(t) and lo <= t <= hi


class _Cohort:
    """What the owner knows about one sealed cohort while it runs."""

    __slots__ = ("jobs", "real_width", "fixed_width", "route_id", "policy", "lane_name", "numerics",
                 "started_s")

    def __init__(self, jobs, real_width, fixed_width, route_id, policy, lane_name, numerics):
        self.jobs = jobs
        self.real_width = real_width
        self.fixed_width = fixed_width
        self.route_id = route_id
        self.policy = policy
        self.lane_name = lane_name
        self.numerics = numerics
        self.started_s = time.perf_counter()


def _build_result(job: MTPBatchJob, cohort: _Cohort, *, finish_reason: str, cycles: int,
                  accepted: int, rejected: int, terminal_perf_s: Optional[float],
                  cached_tokens: int, solo: bool, extra_stats: Optional[dict] = None,
                  depth: Optional[int] = None) -> dict:
    """The per-request result dict and its stats, from the job's own timestamps. `depth`: most
    drafts the row chained in a cycle (default: MTP_DEPTH for a speculative row)."""
    completed_s = time.perf_counter()
    decode_started_s = job.decode_started_s
    if not _valid_time(decode_started_s, cohort.started_s, completed_s):
        decode_started_s = cohort.started_s
    decode_ended_s = (terminal_perf_s if _valid_time(terminal_perf_s, decode_started_s, completed_s)
                      else completed_s)
    decode_elapsed_s = max(decode_ended_s - decode_started_s, 1e-9)
    request_elapsed_s = max(completed_s - job.created_s, 1e-9)
    admitted_s = job.admitted_s if job.admitted_s is not None else cohort.started_s
    n = len(job.tokens)
    prompt_tokens = len(job.prompt_ids)
    mode = job.generation_mode
    depth = (MTP_DEPTH if depth is None else int(depth)) if job.speculative else 0
    stats = dict(extra_stats or {})
    stats.update({
        "request_id": job.request_id,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": n,
        "cached_tokens": int(cached_tokens),
        "prompt_eval_time_s": decode_started_s - cohort.started_s,
        "prefill_wall_time_s": decode_started_s - cohort.started_s,
        "decode_elapsed_s": decode_elapsed_s,
        "decode_tok_s": n / decode_elapsed_s,
        "tok_s": n / decode_elapsed_s,
        "elapsed_s": completed_s - cohort.started_s,
        "request_elapsed_s": request_elapsed_s,
        "end_to_end_tok_s": n / request_elapsed_s,
        "queue_wait_s": admitted_s - job.created_s,
        "request_started_s": job.created_s,
        "mode": mode,
        "generation_mode": mode,
        "mtp_depth": depth,
        "requested_mtp_depth": depth,
        "speculative_depth": depth,
        "requested_speculative_depth": depth,
        "verify_calls": int(cycles),
        "target_verify_cycles": int(cycles),
        "accepted_drafts": int(accepted),
        "rejected_drafts": int(rejected),
        "row_accepted_drafts": int(accepted),
        "row_rejected_drafts": int(rejected),
        "acceptance_rate": accepted / max(accepted + rejected, 1),
        "scheduler_lane": cohort.lane_name,
        "scheduler_mode": "mtp_batch",
        "scheduler_policy": cohort.policy,
        "active_batch_size": cohort.real_width,
        "mtp_batch_real_width": cohort.real_width,
        "mtp_batch_fixed_width": cohort.fixed_width,
        "mtp_batch_route_id": cohort.route_id,
        "mtp_batch_numerics": cohort.numerics,
        "mtp_disabled_reason": stats.get("mtp_disabled_reason"),
        "repetition_stop_triggered": bool(stats.get("repetition_stop_triggered", False)),
        "finish_reason": finish_reason,
        "server_seed": job.seed,
    })
    # The sealed-width truth overrides whatever the caller estimated at submit time; then the
    # caller's observability is merged over the stats (later envelope stages re-apply it).
    obs = job.request_observability
    obs.update({"scheduler_policy": cohort.policy, "scheduler_lane": cohort.lane_name,
                "mtp_batch_fixed_width": cohort.fixed_width, "mtp_batch_real_width": cohort.real_width,
                "mtp_batch_route_id": cohort.route_id, "active_batch_size": cohort.real_width})
    stats.update(obs)
    return {
        "request_id": job.request_id,
        "tokens": list(job.tokens),
        "stats": stats,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": n,
        "cached_tokens": int(cached_tokens),
        "finish_reason": finish_reason,
        "elapsed_s": stats["elapsed_s"],
        "request_elapsed_s": request_elapsed_s,
        "tok_s": stats["decode_tok_s"],
        "end_to_end_tok_s": stats["end_to_end_tok_s"],
        "_token_times": list(job.token_times),
        "_generation_limits": dict(job.generation_limits),
        "_mtp_batch_stop_token_ids": sorted(job.stop_token_ids),
        "_mtp_batch_solo": solo,
        "_completed_s": completed_s,
    }


# ---------------------------------------------------------------------------------------------
# The service


class SoloCancelled(Exception):
    """Raised from a solo run's token callback to stop a job that was cancelled mid-decode."""


_LIVE_SERVICES: "weakref.WeakSet" = weakref.WeakSet()


@atexit.register
def _shutdown_live_services() -> None:
    """Stop owner threads before the interpreter finalizes: an MLX thread torn down during
    finalization aborts the process ("terminate called without an active exception")."""
    for service in list(_LIVE_SERVICES):
        try:
            service.shutdown(timeout_s=5)
        except Exception:
            pass


class _KeyLane:
    """One compatibility key's running lane in the service, and its unfinished jobs."""

    __slots__ = ("key", "running", "jobs", "serial")

    def __init__(self, key, running, serial: int = 0):
        self.key, self.running, self.jobs = key, running, []
        self.serial = serial   # which lane this is (lanes_started when it began): tells lanes with one label apart


# A running lane's counters, by the service stat they add up to (drained lanes are folded into the
# stats once; a snapshot adds the live lanes' current values).
_LANE_COUNTERS = {"cycles": "target_verify_cycles", "row_cycles": "lane_row_cycles",
                  "accepted": "accepted_draft_tokens", "rejected": "rejected_draft_tokens",
                  "admitted": "admissions", "shared_prefills": "shared_prefills", "widenings": "widenings",
                  "narrowings": "narrowings", "depth_switches": "depth_switches",
                  "cycle_s": "cycle_s", "prefill_s": "prefill_s", "graph_retraces": "graph_retraces",
                  "mtp_cycles": "mtp_cycles", "ar_steps": "ar_steps", "device_drafts": "device_drafts",
                  "draft_proposals": "draft_proposals", "draft_tokens": "draft_tokens"}


def _add_lane_counters(stats: dict, running) -> None:
    for attr, key in _LANE_COUNTERS.items():
        stats[key] += getattr(running, attr)
    stats["accepted_by_position"] = [a + b for a, b in zip(stats["accepted_by_position"], running.accepted_at)]
    hist = stats["fixed_width_histogram"]
    for w, c in dict(running.width_cycles).items():
        hist[str(w)] = hist.get(str(w), 0) + c


def lane_label(key) -> str:
    """A short, bounded name for a compatibility key (snapshots, logs): the model id of the key
    `mtp_batch_compatibility_key` makes; a caller's own key's parts, samplers by temperature."""
    parts = []
    for item in key if isinstance(key, tuple) else (key,):
        if isinstance(item, SamplerConfig):
            parts.append("greedy" if item.is_greedy else f"t{item.temperature:g}")
        elif isinstance(item, bool):
            parts.append("omit_bonus" if item else "")
        elif item is not None:
            parts.append(str(item))
    label = "/".join(p for p in parts if p)
    return label[:64] or "default"


def _by_route(lanes: list) -> dict:
    out: dict = {}
    for ln in lanes:
        agg = out.setdefault(ln["route"], {"lanes": 0, "live_rows": 0})
        agg["lanes"] += 1
        agg["live_rows"] += ln["live_rows"]
    return out


def lane_route(live_rows: int, greedy_rows: int) -> str:
    """A running lane's route now, by its live rows: "greedy" (every row greedy), "sampled",
    "mixed", or "idle"."""
    sampled = live_rows - greedy_rows
    return "mixed" if greedy_rows and sampled else "greedy" if greedy_rows else "sampled" if sampled else "idle"


class MTPBatchGenerationService:
    """Keeps one running lane per compatibility key on one model-owner thread (continuous
    admission): a submitted job joins its key's lane at the next cycle boundary, lanes of different
    keys take turns cycle by cycle, and each row resolves at its own end.

    ``lanes``: installed lanes (a mapping width -> lane, or an iterable of lanes); may be empty for
    ``numerics="b1-exact"``. A key's running lane runs at the narrowest installed width that holds
    its rows (width 1, the solo lane, for a lone row, unless a width is forced), widening when more
    rows want in and narrowing when few remain. ``owner_finalize(jobs) -> receipt``: runs on the
    owner thread each time a key's lane drains (with the jobs still in it); raising, or a receipt with ``cleared: False``,
    poisons the service. ``on_lane_step()``: runs on the owner thread after each lane step (one
    cycle of one key's lane), once every token of that step has reached its job's
    ``token_callback``; ``in_lane_step`` is True while a step runs (a consumer that groups a row's
    tokens by cycle waits for the hook instead of sending each token). ``running_lane_cls``: the
    running lane class (tests pass a subclass to force a fault). Use ``for_model`` to build one
    with its own lanes.
    """

    def __init__(self, model=None, lanes=None, *, batch_wait_s: float = DEFAULT_BATCH_WAIT_S,
                 numerics: Optional[str] = None, owner_finalize: Optional[Callable[[list], Any]] = None,
                 max_cohort_rows: Optional[int] = None, start: bool = True, session_bank=None,
                 running_lane_cls=None, kv_budget_bytes: Optional[int] = None,
                 on_lane_step: Optional[Callable[[], None]] = None, greedy_depths=None):
        self.model = model
        # A lane whose drafting rows are all greedy may chain more drafts at some widths (width ->
        # depth; 1 is the solo lane): a greedy row's tokens are the same at any depth. While a
        # sampled row drafts in it, the lane chains MTP_DEPTH at every width: a chain's depth
        # decides which draws a row makes, and a row's draws must not depend on its neighbours.
        self.greedy_depths = _checked_depths(greedy_depths)
        self._greedy_lanes: dict[int, Any] = {}    # width -> lane at greedy_depths[width] (not MTP_DEPTH)
        self._on_lane_step = _failsafe(on_lane_step)
        self.in_lane_step = False
        # Rows join lanes only while every lane's KV and recurrent state fits this budget; a row
        # that cannot fit even alone fails with KVBudgetError (see _kv_fits).
        self.kv_budget_bytes = int(kv_budget_bytes) if kv_budget_bytes is not None else _default_kv_budget()
        self._row_bytes: Optional[tuple] = None        # (bytes per KV position, fixed bytes per row)
        # Prompt-prefix reuse for jobs that bring no session hooks of their own (greedy output
        # is unchanged by reuse; see mtplx.engine.prefix_cache). Under a budget the bank holds only what
        # the lanes' decode state leaves, and yields it when rows need it.
        self.session_bank = session_bank
        if session_bank is not None and self.kv_budget_bytes is not None:
            session_bank.room = lambda: self.kv_budget_bytes - self._lanes_bytes()
        self.batch_wait_s = max(0.0, float(batch_wait_s))
        self._owner_finalize = owner_finalize
        self._max_rows_cap = int(max_cohort_rows) if max_cohort_rows is not None else None
        self._running_lane_cls = running_lane_cls
        raw = os.environ.get(FORCE_WIDTH_ENV, "").strip()
        try:
            self.forced_width: Optional[int] = int(raw) if raw else None
        except ValueError:
            raise ValueError(f"{FORCE_WIDTH_ENV}={raw!r} is invalid: must be an integer width") from None
        self._lanes: dict[int, Any] = {}
        self.refused_widths: dict[int, str] = {}   # width -> why its lane refused to install
        # a model without an MTP head serves every request as plain AR rows, and says why
        self.mtp_disabled_reason: Optional[str] = (
            (getattr(model, "mtp_disabled_reason", None) or "the model has no MTP head")
            if model is not None and getattr(model, "mtp", True) is None else None)
        self.numerics = numerics
        self._set_lanes(lanes or {})
        if self.numerics is None:
            self.numerics = "throughput"
        if self.numerics not in NUMERICS:
            raise ValueError(f"numerics={self.numerics!r} is invalid: choose one of {NUMERICS}")

        self._cond = threading.Condition()
        self._pending: deque[MTPBatchJob] = deque()
        self._active: set = set()
        self._running: dict = {}              # compatibility key -> _KeyLane (owner thread writes)
        self._turn = 0
        self._calls: deque = deque()
        self._closed_error: Optional[BaseException] = None
        self._stopping = False
        self._busy = False
        self._heap_dirty = False                # work ran since the last release_free_heap
        self._step_began_s = time.monotonic()   # when the owner began its current unit of work (watchdogs)
        self._thread: Optional[threading.Thread] = None
        self._owner_ident: Optional[int] = None
        from mtplx.engine.lane import DEPTHS

        self._stats = {
            "last_real_width": None, "last_fixed_width": None, "last_route_id": None,
            "last_error": None, "last_owner_finalize": None, "poisoned": None,
            "fixed_width_histogram": {},
            "target_verify_cycles": 0, "accepted_draft_tokens": 0, "rejected_draft_tokens": 0,
            "draft_proposals": 0, "draft_tokens": 0, "accepted_by_position": [0] * max(DEPTHS),
            "lane_row_cycles": 0, "graph_retraces": 0, "mtp_cycles": 0, "ar_steps": 0, "device_drafts": 0,
            "cycle_s": 0.0, "prefill_s": 0.0, "admissions": 0, "shared_prefills": 0, "lanes_started": 0,
            "widenings": 0, "narrowings": 0, "depth_switches": 0,
            "solo_runs": 0, "driver_errors": 0,
            "requests_submitted": 0, "requests_completed": 0, "requests_failed": 0,
            "requests_cancelled": 0, "completion_tokens": 0,
        }
        if start:
            self.start()

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def for_model(cls, model, widths: Iterable[int] = DEFAULT_WIDTHS,
                  batch_wait_s: float = DEFAULT_BATCH_WAIT_S, numerics: str = "throughput",
                  **kwargs) -> "MTPBatchGenerationService":
        """A running service with its own lanes, installed (and self-checked) on its owner thread.
        ``b1-exact`` installs no lane: every job runs through the solo path."""
        if numerics not in NUMERICS:
            raise ValueError(f"numerics={numerics!r} is invalid: choose one of {NUMERICS}")
        if "session_bank" not in kwargs and getattr(model, "mtp", None) is not None:
            from mtplx.scheduler.session_bank import SessionBank

            kwargs["session_bank"] = SessionBank(f"{model.model_id}:{model.fingerprint}")
        service = cls(model, {}, batch_wait_s=batch_wait_s, numerics=numerics, **kwargs)
        if service.mtp_disabled_reason is not None and numerics != "b1-exact":   # no head: plain AR lanes
            from mtplx.engine.lane import ar_lanes

            service.call_on_owner(lambda: service._set_lanes(ar_lanes(model, widths))).result()
        elif numerics != "b1-exact":
            try:
                service.install_lanes(widths).result()
            except BaseException:
                service.shutdown(timeout_s=5)
                raise
        return service

    def install_lanes(self, widths: Iterable[int]) -> Future:
        """Install lanes of these widths on the owner thread (adds to the installed set)."""
        widths = sorted({int(w) for w in widths})
        if not widths:
            raise ValueError("widths is empty: install at least one lane width")

        def install():
            from mtplx.engine.lane import (LaneSelfCheckError, install_a3b_mtp_batch_lane, measure_step_costs,
                                         solo_lane)

            lanes = dict(self._lanes)
            for w in widths:
                if w not in lanes:
                    try:
                        lanes[w] = install_a3b_mtp_batch_lane(self.model, w, numerics=self.numerics)
                    except LaneSelfCheckError as exc:    # rows that would run at w run narrower (solo at worst)
                        self.refused_widths[w] = str(exc)
                        logger.warning("MTP batch lane B%d refused: %s", w, exc)
            # deeper greedy lanes only where the width's own lane passed its self-check (the same
            # forwards at that width; the self-check injects single drafts at any depth)
            for w, d in sorted(self.greedy_depths.items()):
                if d != MTP_DEPTH and w not in self._greedy_lanes and (w == 1 or w in lanes):
                    lane = (solo_lane(self.model, d) if w == 1 else
                            install_a3b_mtp_batch_lane(self.model, w, numerics=self.numerics, selfcheck=False, depth=d))
                    if not lane.step_costs:
                        measure_step_costs(lane)
                    self._greedy_lanes[w] = lane
            self._set_lanes(lanes)
            return sorted(lanes)

        return self.call_on_owner(install)

    def _set_lanes(self, lanes) -> None:
        if not isinstance(lanes, dict):
            lanes = {lane.width: lane for lane in lanes}
        lanes = {int(w): lane for w, lane in lanes.items()}
        for w, lane in lanes.items():
            if getattr(lane, "width", w) != w:
                raise ValueError(f"lane {getattr(lane, 'route_id', lane)!r} has width {lane.width}, "
                                 f"installed under {w}")
        profiles = {getattr(lane, "numerics", None) for lane in lanes.values()} - {None}
        if len(profiles) > 1:
            raise ValueError(f"installed lanes disagree on the numerics profile: {sorted(profiles)}")
        if profiles:
            (profile,) = profiles
            if self.numerics is None:
                self.numerics = profile
            elif self.numerics != profile:
                raise ValueError(f"lanes are {profile!r} but the service was asked for {self.numerics!r}")
        if lanes and self.forced_width is not None and self.forced_width not in lanes:
            raise ValueError(f"{FORCE_WIDTH_ENV}={self.forced_width} is not an installed width "
                             f"{sorted(lanes)}")
        self._lanes = lanes

    @property
    def installed_widths(self) -> list:
        return sorted(self._lanes)

    @property
    def max_cohort_rows(self) -> int:
        """Most rows of one key that decode together: the widest installed lane (capped by
        ``max_cohort_rows`` when given)."""
        if self.numerics == "b1-exact" or not self._lanes:
            return self._max_rows_cap or MAX_COHORT_ROWS
        return min(self._max_rows_cap or max(self._lanes), max(self._lanes))

    def _lane_for_real_width(self, real_width: int):
        """(fixed_width, lane): the forced width if it fits, else the narrowest lane that fits."""
        if self.forced_width is not None and self.forced_width in self._lanes \
                and self.forced_width >= real_width:
            return self.forced_width, self._lanes[self.forced_width]
        for w in sorted(self._lanes):
            if w >= real_width:
                return w, self._lanes[w]
        raise ValueError(f"no installed lane fits a cohort of {real_width} rows "
                         f"(installed widths {self.installed_widths})")

    def _ladder(self, greedy: bool = False) -> list:
        """The widths a key's running lane may run at: from the forced width (or the one-row solo
        lane) up to the widest installed lane within ``max_cohort_rows``; for a lane of greedy
        rows, each at its ``greedy_depths`` depth where that lane is installed."""
        lanes = self._ladder_at_depth_1()
        if greedy and self.numerics != "b1-exact":
            lanes = [self._greedy_lanes.get(ln.width, ln) for ln in lanes]
        return lanes

    def _ladder_at_depth_1(self) -> list:
        from mtplx.engine.lane import solo_lane

        if self.numerics == "b1-exact":     # rows asking for logprobs: one at a time, in the one-row
            return [solo_lane(self.model)]  # lane the solo path decodes through (its numerics)
        lanes = [self._lanes[w] for w in sorted(self._lanes) if w <= self.max_cohort_rows]
        if self.forced_width is not None:
            return [ln for ln in lanes if ln.width >= self.forced_width]
        if lanes and lanes[0].width > 1:
            lanes.insert(0, solo_lane(lanes[0].model))
        if not lanes and self.refused_widths:           # every width refused: rows decode solo
            lanes = [solo_lane(self.model)]
        return lanes

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        with self._cond:
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._owner_main, name="mtplx-model-owner", daemon=True)
            self._thread.start()

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop admitting work, fail queued jobs, cancel active rows and wait for the owner thread.

        Raises RuntimeError when the owner did not finalize its active rows within ``timeout_s``.
        """
        with self._cond:
            if self._closed_error is None:
                self._closed_error = MTPBatchServiceClosed("MTP batch service is shut down")
            pending, self._pending = list(self._pending), deque()
            calls, self._calls = list(self._calls), deque()
            active = list(self._active)
            self._stopping = True
            self._cond.notify_all()
            thread = self._thread
        for job in pending:
            job._fail(MTPBatchServiceClosed("MTP batch service is shut down"))
        for fut, *_ in calls:
            if fut.set_running_or_notify_cancel():
                fut.set_exception(MTPBatchServiceClosed("MTP batch service is shut down"))
        for job in active:
            job.cancel()
        if thread is not None and thread.ident != threading.get_ident():
            thread.join(timeout_s)
            if thread.is_alive():
                raise RuntimeError("owner did not finalize active requests before shutdown")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    # -- submission --------------------------------------------------------------------------

    def submit(self, job: MTPBatchJob) -> Future:
        """Queue a job; it joins its key's running lane at the next cycle boundary. A key with no
        running lane first waits up to ``batch_wait_s`` for company. Returns ``job.future``."""
        self._enqueue([job], ready=False)
        return job.future

    def submit_cohort(self, jobs: Iterable[MTPBatchJob]) -> list:
        """Queue jobs gathered upstream (e.g. by ``@serve.batch``): no gather wait; each joins the
        running lane of its ``compatibility_key``. Returns the futures in the given order."""
        jobs = list(jobs)
        self._enqueue(jobs, ready=True)
        return [job.future for job in jobs]

    def _enqueue(self, jobs: list, ready: bool) -> None:
        for job in jobs:
            if not isinstance(job, MTPBatchJob):
                raise TypeError(f"submit expects MTPBatchJob, got {type(job).__name__}")
            if job._service is not None:
                raise ValueError(f"job {job.request_id!r} was already submitted")
        accepted = []
        for job in jobs:
            if self.mtp_disabled_reason is not None:
                job.speculative = False
            if self.session_bank is not None and job.session_restore is None and job.session_commit is None:
                job.session_restore, job.session_commit = self.session_bank.hooks(job.prompt_ids)
            job._service = self
            job._ready = ready
            job.future.add_done_callback(lambda f, j=job: self._count_outcome(j, f))
            error = self._admission_error(job)
            if error is not None:
                job._fail(error)
            else:
                accepted.append(job)
        with self._cond:
            self._stats["requests_submitted"] += len(jobs)
            closed = self._closed_error
            if closed is None:
                for job in accepted:
                    if not job.future.done():
                        self._pending.append(job)
                self._cond.notify_all()
        if closed is not None:
            for job in accepted:
                job._fail(type(closed)(str(closed)))

    def _admission_error(self, job: MTPBatchJob) -> Optional[BaseException]:
        if job.cancel_requested():
            return job._cancel_exception()
        if self.model is None:
            if not job.prompt_ids:
                return ValueError("prompt_ids is empty; a prompt needs at least one token")
            return None
        from mtplx.engine.prefill import check_request

        try:
            check_request(self.model, job.prompt_ids, job.max_tokens)
        except Exception as exc:
            return exc
        return None

    def rows_wanting(self, key) -> int:
        """Rows of this compatibility key that hold or want a lane slot: queued here, or live,
        prefilling or waiting in the key's running lane (for admission limits upstream)."""
        with self._cond:
            lane = self._running.get(key)
            return (sum(1 for j in self._pending if j.compatibility_key == key)
                    + (lane.running.demand if lane is not None else 0))

    def _on_job_cancelled(self, job: MTPBatchJob) -> None:
        with self._cond:
            try:
                self._pending.remove(job)
            except ValueError:
                pass
            self._cond.notify_all()    # an idle owner notices the cancel at once

    def _count_outcome(self, job: MTPBatchJob, fut: Future) -> None:
        with self._cond:
            self._active.discard(job)
            if fut.cancelled() or fut.exception() is not None:
                key = "requests_cancelled" if job.cancel_requested() else "requests_failed"
            else:
                key = "requests_completed"
                self._stats["completion_tokens"] += fut.result()["completion_tokens"]
            self._stats[key] += 1

    def call_on_owner(self, fn: Callable, *args, **kwargs) -> Future:
        """Run ``fn(*args, **kwargs)`` on the model-owner thread at the next cycle boundary (MLX
        work that is not a request: lane installation, warm-up, a health probe). Returns a Future."""
        fut: Future = Future()
        with self._cond:
            if self._closed_error is not None:
                fut.set_exception(type(self._closed_error)(str(self._closed_error)))
                return fut
            self._calls.append((fut, fn, args, kwargs))
            self._cond.notify_all()
        return fut

    # -- the owner thread --------------------------------------------------------------------

    def _owner_main(self) -> None:
        import mlx.core as mx

        try:
            self._owner_loop()
        finally:
            self._abandon_lanes()
            mx.clear_streams()   # MLX needs its per-thread streams torn down by the thread itself

    def _owner_loop(self) -> None:
        self._owner_ident = threading.get_ident()
        _LIVE_SERVICES.add(self)
        while True:
            with self._cond:
                self._busy = bool(self._running)
                idle_since = time.monotonic()
                while not self._stopping and not self._calls and not self._running:
                    taken, wait_s = self._take_ready_locked()
                    if taken:
                        break
                    if self._heap_dirty:
                        left = IDLE_HEAP_RELEASE_S - (time.monotonic() - idle_since)
                        if left <= 0:     # (10-20 ms: submitters need not wait for it)
                            self._heap_dirty = False
                            self._cond.release()
                            try:
                                release_free_heap()
                            finally:
                                self._cond.acquire()
                            continue
                        wait_s = left if wait_s is None else min(wait_s, left)
                    self._cond.wait(wait_s)
                else:
                    taken, _ = self._take_ready_locked()
                if self._stopping:
                    return
                self._busy = self._heap_dirty = True
                self._step_began_s = time.monotonic()
                calls, self._calls = list(self._calls), deque()
            for fut, fn, args, kwargs in calls:
                if not fut.set_running_or_notify_cancel():
                    continue
                try:
                    fut.set_result(fn(*args, **kwargs))
                except BaseException as exc:
                    fut.set_exception(exc)
            self._admit(taken)
            self._step_next_lane()

    def _take_ready_locked(self, head_key_only: bool = False) -> tuple:
        """Pending jobs that may join a lane now, and how long until more may (None: no limit).
        A job is ready when it came as a cohort, its key already runs, its key has a full lane's
        worth waiting, or its key's oldest job has waited ``batch_wait_s``."""
        dropped = [j for j in self._pending if j.cancel_requested() or j.future.done()]
        for job in dropped:
            self._pending.remove(job)
            job._fail(job._cancel_exception())
        if not self._pending or self._stopping:
            return [], None
        now = time.perf_counter()
        by_key: dict = {}
        for job in self._pending:
            by_key.setdefault(job.compatibility_key, []).append(job)
        if head_key_only:
            by_key = {self._pending[0].compatibility_key: by_key[self._pending[0].compatibility_key]}
        taken, wait_s = [], None
        for key, jobs in by_key.items():
            due = jobs[0].created_s + self.batch_wait_s
            if (self.numerics == "b1-exact" or key in self._running or head_key_only
                    or any(j._ready for j in jobs) or len(jobs) >= self.max_cohort_rows or now >= due):
                taken.extend(jobs)
            else:
                wait_s = due - now if wait_s is None else min(wait_s, due - now)
        for job in taken:
            self._pending.remove(job)
        return taken, wait_s

    def _admit(self, jobs: list) -> None:
        """Jobs leave the queue: b1-exact jobs and lone jobs with a solo runner run alone now;
        every other job joins its key's running lane (created on first use) once its decode
        state fits the budget; until then it stays first in the queue."""
        deferred = []
        for job in jobs:
            if self.numerics == "b1-exact" and job.logprobs is None:
                self._run_alone(job, b1_exact=True)      # (log-probabilities come from a lane: below)
                continue
            key = job.compatibility_key
            if job.solo_runner is not None and job.logprobs is None and key not in self._running \
                    and sum(1 for j in jobs if j.compatibility_key == key) == 1:
                self._run_alone(job, b1_exact=False)
                continue
            fits = self._kv_fits(job)
            if fits is None:
                continue                  # failed: it can never fit
            if not fits:                  # waits for rows to finish and free their state
                deferred.append(job)
                continue
            lane = self._running.get(key)
            if lane is None:
                from mtplx.engine.lane import RunningLane

                with self._cond:
                    self._stats["lanes_started"] += 1
                    lane = _KeyLane(key, (self._running_lane_cls or RunningLane)(
                        self._ladder(), greedy_ladder=self._ladder(greedy=True)), serial=self._stats["lanes_started"])
                    self._running[key] = lane
            try:
                lane.running.add(self._lane_request(job))
            except Exception as exc:      # a request the lane refuses fails alone
                job._fail(exc)
                continue
            lane.jobs.append(job)
            with self._cond:
                self._active.add(job)
            job.emit_prefill({"phase": "queued", "tokens_total": len(job.prompt_ids), "tokens_done": 0})
        if deferred:
            with self._cond:
                self._pending.extendleft(reversed(deferred))

    def _kv_fits(self, job: MTPBatchJob) -> Optional[bool]:
        """Whether every lane's decode state stays within ``kv_budget_bytes`` with this job in its
        key's lane (a lane holds width x its longest row's prompt + max_tokens of KV, whatever
        the others need). None when the job fails because it cannot fit even alone. A job that
        fits takes from the prefix bank what the rows now need."""
        if self.kv_budget_bytes is None or self.model is None:
            return True
        if self._row_bytes is None:
            self._row_bytes = row_state_bytes(self.model)
        need = self._row_need(job)
        alone = self._lane_bytes([need])
        if alone > self.kv_budget_bytes:
            from mtplx.engine.prefill import KVBudgetError

            job._fail(KVBudgetError(
                f"prompt ({len(job.prompt_ids)} tokens) + max_tokens ({job.max_tokens}) needs "
                f"{alone / 2**30:.2f} GiB of decode state, more than the server's budget of "
                f"{self.kv_budget_bytes / 2**30:.2f} GiB: lower max_tokens or shorten the prompt"))
            return None
        total = self._lanes_bytes(job)
        if total > self.kv_budget_bytes:
            return False
        if self.session_bank is not None:
            self.session_bank.shrink(self.kv_budget_bytes - total)
        return True

    def _lanes_bytes(self, job: Optional[MTPBatchJob] = None) -> int:
        """Every running lane's decode state, with `job` in its key's lane when given."""
        if self._row_bytes is None:               # measured at the first admission: no lane yet
            return 0
        key, extra = (job.compatibility_key, [self._row_need(job)]) if job is not None else (None, [])
        total = 0
        for lane_key, lane in list(self._running.items()):
            needs = [self._row_need(j) for j in lane.jobs if not j.future.done()]
            total += self._lane_bytes(needs + extra if lane_key == key else needs)
        if extra and key not in self._running:
            total += self._lane_bytes(extra)
        return total

    @staticmethod
    def _row_need(job: MTPBatchJob) -> int:
        from mtplx.engine.lane import DEPTHS

        return len(job.prompt_ids) + job.max_tokens + 1 + max(DEPTHS)    # a verify's positions at most

    def _lane_bytes(self, needs: list) -> int:
        """A lane's decode state for rows of these lengths: the narrowest width that holds them,
        every row's KV buffer as long as the longest (rounded to the buffer's growth step)."""
        from mtplx.models.cache import STEP

        if not needs:
            return 0
        ladder = sorted({getattr(lane, "width", 1) for lane in self._ladder()}) or [1]
        width = next((w for w in ladder if w >= len(needs)), ladder[-1])
        per_position, per_row = self._row_bytes
        return width * (-(-max(needs) // STEP) * STEP * per_position + per_row)

    def _step_next_lane(self) -> None:
        """One cycle of the next key's lane, round robin: no key runs to completion while another
        key's rows wait, and each lane admits its own rows at its own cycle boundaries."""
        lanes = list(self._running.values())
        if not lanes:
            return
        lane = lanes[self._turn % len(lanes)]
        self._turn += 1
        running = lane.running
        try:
            self.in_lane_step = True
            try:
                running.step()
            finally:
                self.in_lane_step = False
                if self._on_lane_step is not None:
                    self._on_lane_step()
        except Exception as exc:   # fails this lane's rows only; other keys keep running
            with self._cond:
                self._stats["driver_errors"] += 1
            self._record_error(exc)
            for job in lane.jobs:
                job._fail(exc)
            running.cancel_all()
            self._drain(lane)
            return
        if any(job.future.done() for job in lane.jobs):   # a lane under steady load never drains
            lane.jobs = [job for job in lane.jobs if not job.future.done()]
        if not running.has_work:
            self._drain(lane)

    def _drain(self, lane: _KeyLane) -> None:
        """The key's lane has no rows left: drop it (its buffers go with it) and finalize."""
        r = lane.running
        with self._cond:
            if self._running.get(lane.key) is lane:
                del self._running[lane.key]
            _add_lane_counters(self._stats, r)
            if r.cycles:    # the last lane (or solo run) that ended
                s = self._stats
                s["last_fixed_width"], s["last_route_id"], s["last_real_width"] = r.width, r.route_id, r.peak_rows
        for job in lane.jobs:   # nothing admitted may hang, whatever happened
            if not job.future.done():
                job._fail(job._cancel_exception() if job.cancel_requested() else
                          RuntimeError(f"request {job.request_id}: the lane ended without a result"))
        self._finalize(lane.jobs)

    def _abandon_lanes(self) -> None:
        """The owner is stopping: rows still in lanes end with the service's closed error."""
        closed = self._closed_error or MTPBatchServiceClosed("MTP batch service is shut down")
        for lane in list(self._running.values()):
            for job in lane.jobs:
                job._fail(type(closed)(str(closed)))
            lane.running.cancel_all()
        with self._cond:
            self._running.clear()

    def pump_once(self) -> bool:
        """Admit the head job's key (no gather wait) and run that lane until it drains, on the
        calling thread. For tests and for services built with ``start=False``; never call it
        while the owner thread runs."""
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError("pump_once is for a service without a running owner thread")
        with self._cond:
            taken, _ = self._take_ready_locked(head_key_only=True)
        self._admit(taken)
        while self._running:
            self._step_next_lane()
        return bool(taken)

    def _record_error(self, exc: BaseException) -> None:
        with self._cond:
            self._stats["last_error"] = f"{type(exc).__name__}: {exc}"

    def _finalize(self, jobs: list) -> None:
        """Owner finalize, once per drained lane; a failure poisons the service."""
        receipt, failure = None, None
        if self._owner_finalize is not None:
            try:
                receipt = self._owner_finalize(list(jobs))
                cleanup = receipt.get("mlx_cache_cleanup", receipt) if isinstance(receipt, dict) else None
                if isinstance(cleanup, dict) and cleanup.get("cleared") is False:
                    failure = f"receipt reports cleared=False: {receipt}"
            except Exception as exc:
                failure = f"{type(exc).__name__}: {exc}"
        else:
            receipt = {"owner_finalize": None}
        with self._cond:
            for job in jobs:
                self._active.discard(job)
            self._stats["last_owner_finalize"] = receipt if failure is None else {"error": failure}
            if failure is None:
                return
            message = f"MTP batch owner finalize failed: {failure}"
            self._stats["poisoned"] = message
            self._stats["last_error"] = message
            self._closed_error = MTPBatchOwnerFinalizeError(message)
            self._stopping = True
            pending, self._pending = list(self._pending), deque()
            calls, self._calls = list(self._calls), deque()
            self._cond.notify_all()
        for job in pending:
            job._fail(MTPBatchOwnerFinalizeError(message))
        for fut, *_ in calls:
            if fut.set_running_or_notify_cancel():
                fut.set_exception(MTPBatchOwnerFinalizeError(message))

    # -- lane rows ---------------------------------------------------------------------------

    def _lane_request(self, job: MTPBatchJob):
        from mtplx.engine.lane import A3BMTPBatchRequest

        def on_admit():
            job.admitted_s = time.perf_counter()
            job.emit_prefill({"phase": "started", "tokens_total": len(job.prompt_ids), "tokens_done": 0})

        def on_decode_start():
            job.mark_decode_started()
            job.emit_prefill({"phase": "completed", "tokens_total": len(job.prompt_ids),
                              "tokens_done": len(job.prompt_ids)})

        def on_terminal(reason, cycles):
            if reason == "cancelled":   # a cancelled row's future fails at once
                job._fail(job._cancel_exception())

        return A3BMTPBatchRequest(
            request_id=job.request_id, prompt_ids=tuple(job.prompt_ids), sampler=job.sampler,
            draft_sampler=job.draft_sampler, seed=job.seed, max_tokens=job.max_tokens,
            stop_token_ids=job.stop_token_ids, omit_speculative_bonus=job.omit_speculative_bonus,
            on_token=job.emit_token, logprobs=job.logprobs, on_admit=on_admit,
            on_decode_start=on_decode_start,
            on_terminal=on_terminal, on_result=lambda stream: self._complete_lane_job(job, stream),
            cancelled=job.cancel_requested, speculative=job.speculative, adaptive=job.adaptive,
            prefill_group=job.prefill_group,
            repetition_stop=bool(job.generation_limits.get("uncapped_repetition_stop_enabled", False)),
            session_restore=_failsafe(job.session_restore), session_commit=_failsafe(job.session_commit))

    def _complete_lane_job(self, job: MTPBatchJob, stream) -> None:
        """Resolve one lane row at its own terminal, from its final stream."""
        if stream.finish_reason == "cancelled" or job.cancel_requested():
            job._fail(job._cancel_exception())
            return
        w = stream.fixed_width
        if w <= 1:
            placement = _Cohort([job], 1, 1, SOLO_ROUTE_ID, "solo_mtp", "mtp_batch", self.numerics)
            with self._cond:
                self._stats["solo_runs"] += 1
        else:
            placement = _Cohort([job], stream.real_width, w, stream.route_id, f"fixed_mtp_batch_width_{w}",
                                "mtp_batch", self.numerics)
        placement.started_s = job.admitted_s if job.admitted_s is not None else placement.started_s
        extra = {"admitted_at_cycle": stream.admitted_at_cycle, "lane_mean_occupancy": round(stream.mean_occupancy, 3),
                 "mtp_disabled_reason": self.mtp_disabled_reason,
                 # how much of its decode drafted (generation_mode "auto" steps aside where MTP does not pay)
                 "speculated_cycles": stream.spec_cycles, "drafts_skipped": stream.drafts_skipped,
                 "speculated_cycle_share": round(stream.spec_cycles / max(stream.cycles, 1), 4),
                 "shared_prefill": stream.shared_prefill}
        if stream.repetition_stop is not None:   # the repeats already streamed; the result drops them
            cut = len(job.tokens) - stream.repetition_stop.trimmed_tokens
            del job.tokens[cut:], job.token_times[cut:]
            extra.update(stream.repetition_stop.stats())
        result = _build_result(
            job, placement, finish_reason=stream.finish_reason, cycles=stream.cycles,
            accepted=stream.accepted_drafts, rejected=stream.rejected_drafts,
            terminal_perf_s=stream.terminal_perf_s, cached_tokens=stream.cached_tokens, solo=w <= 1,
            extra_stats=extra, depth=stream.mtp_depth or None)
        job._succeed(result)

    # -- alone (b1-exact, or a lone job with its own solo runner) -------------------------------

    def _run_alone(self, job: MTPBatchJob, b1_exact: bool) -> None:
        job.admitted_s = time.perf_counter()
        with self._cond:
            self._active.add(job)
        try:
            self._run_solo(job, b1_exact)
        except BaseException as exc:  # a bug of ours: fail this job, keep the service alive
            self._record_error(exc)
            job._fail(exc)
        finally:
            if not job.future.done():
                job._fail(job._cancel_exception() if job.cancel_requested() else
                          RuntimeError(f"request {job.request_id}: the solo run ended without a result"))
            self._finalize([job])

    def _run_solo(self, job: MTPBatchJob, b1_exact: bool) -> None:
        if job.cancel_requested() or job.future.done():
            job._fail(job._cancel_exception())
            return
        if b1_exact:
            cohort = _Cohort([job], 1, 1, B1_EXACT_ROUTE_ID, "serial_b1_exact", "mtp_batch_b1_exact",
                             "b1-exact")
        else:
            cohort = _Cohort([job], 1, 1, SOLO_ROUTE_ID, "solo_mtp", "mtp_batch", self.numerics)
        with self._cond:
            self._stats["solo_runs"] += 1
            self._stats["last_fixed_width"] = 1
            self._stats["last_route_id"] = cohort.route_id
        job.emit_prefill({"phase": "started", "tokens_total": len(job.prompt_ids), "tokens_done": 0})
        try:
            if job.solo_runner is None:
                out = self._builtin_solo(job)
            else:
                out = job.solo_runner(job)
        except SoloCancelled:
            job._fail(job._cancel_exception())
            return
        except Exception as exc:  # solo failures stay local to the job
            self._record_error(exc)
            job._fail(exc)
            return
        if job.cancel_requested():
            job._fail(job._cancel_exception())
            return
        tokens, finish_reason, runner_stats, extra = _unpack_solo(out)
        if not job.tokens and tokens:       # a runner that did not stream through emit_token
            job.tokens = [int(t) for t in tokens]
        if job.decode_started_s is None:
            pe = runner_stats.get("prompt_eval_time_s")
            job.decode_started_s = (cohort.started_s + pe if isinstance(pe, (int, float)) and pe >= 0
                                    else cohort.started_s)
        job.emit_prefill({"phase": "completed", "tokens_total": len(job.prompt_ids),
                          "tokens_done": len(job.prompt_ids), "cached_tokens": 0})
        cycles = int(runner_stats.get("verify_calls", 0) or 0)
        accepted = int(runner_stats.get("accepted_drafts", 0) or 0)
        rejected = int(runner_stats.get("rejected_drafts", 0) or 0)
        with self._cond:
            self._stats["target_verify_cycles"] += cycles
            self._stats["accepted_draft_tokens"] += accepted
            self._stats["rejected_draft_tokens"] += rejected
            self._stats["draft_proposals"] += accepted + rejected      # depth 1: one draft a proposal
            self._stats["draft_tokens"] += accepted + rejected
            self._stats["accepted_by_position"][0] += accepted
            hist = self._stats["fixed_width_histogram"]
            hist["1"] = hist.get("1", 0) + cycles
        result = _build_result(job, cohort, finish_reason=finish_reason or "length", cycles=cycles,
                               accepted=accepted, rejected=rejected, terminal_perf_s=None,
                               cached_tokens=int(runner_stats.get("cached_tokens", 0) or 0), solo=True,
                               extra_stats={k: v for k, v in runner_stats.items()
                                            if k in ("acceptance_rate", "mean_tokens_per_verify")})
        for k, v in extra.items():
            result.setdefault(k, v)
        job._succeed(result)

    def _builtin_solo(self, job: MTPBatchJob):
        from mtplx.engine.decode import generate_mtpk

        if self.model is None:
            raise RuntimeError("the built-in solo MTP path needs the service's model "
                               "(pass model= or give the job a solo_runner)")

        def on_token(token):
            if job.cancel_requested():
                raise SoloCancelled()
            job.emit_token(token)
            if job.cancel_requested():   # the callback failed: stop decoding this job
                raise SoloCancelled()

        if not job.speculative:      # generation_mode "ar", or a model without an MTP head
            from mtplx.engine.decode import generate_ar

            return generate_ar(self.model, job.prompt_ids, max_tokens=job.max_tokens, sampler=job.sampler,
                               seed=job.seed, stop_token_ids=job.stop_token_ids, on_token=on_token)
        return generate_mtpk(self.model, job.prompt_ids, max_tokens=job.max_tokens, sampler=job.sampler,
                             draft_sampler=job.draft_sampler, depth=MTP_DEPTH, seed=job.seed,
                             stop_token_ids=job.stop_token_ids,
                             omit_speculative_bonus=job.omit_speculative_bonus, on_token=on_token,
                             session_restore=_failsafe(job.session_restore),
                             session_commit=_failsafe(job.session_commit))

    # -- introspection -----------------------------------------------------------------------

    def snapshot(self) -> dict:
        from mtplx.engine.lane import default_draft_draw

        with self._cond:
            s = dict(self._stats, fixed_width_histogram=dict(self._stats["fixed_width_histogram"]),
                     accepted_by_position=list(self._stats["accepted_by_position"]))
            for lane in self._running.values():
                _add_lane_counters(s, lane.running)
            lanes = [{"key": lane_label(k), "width": ln.running.width, "route_id": ln.running.route_id,
                      # rows of any sampling settings share the lane: its route is what its live rows are
                      "route": lane_route(ln.running.live_rows, ln.running.greedy_rows),
                      "depth": ln.running.lane.depth if ln.running.lane is not None else None,
                      "greedy_rows": ln.running.greedy_rows,
                      "depth_switches": ln.running.depth_switches,
                      "live_rows": ln.running.live_rows, "prefilling_rows": len(ln.running.admitting),
                      "waiting_rows": len(ln.running.waiting), "cycles": ln.running.cycles,
                      "mean_occupancy": round(ln.running.row_cycles / max(ln.running.cycles, 1), 3),
                      # the lane's own counters since it started (periodic summaries and metrics diff them)
                      "serial": ln.serial, "admitted": ln.running.admitted, "row_cycles": ln.running.row_cycles,
                      "accepted": ln.running.accepted, "rejected": ln.running.rejected,
                      # its step choice: the kind of its last step, counts by kind, the cost model at
                      # its width and its acceptance estimate (StepPolicy)
                      "step": ln.running.last_step, "mtp_cycles": ln.running.mtp_cycles,
                      "ar_steps": ln.running.ar_steps,
                      "step_policy": ln.running.policy.snapshot(ln.running.lane.step_costs
                                                                if ln.running.lane is not None else {})}
                     for k, ln in self._running.items()]
            return {
                "pending": len(self._pending),
                "active": len(self._active),
                "waiting_rows": len(self._pending) + sum(ln["waiting_rows"] + ln["prefilling_rows"] for ln in lanes),
                "lanes": lanes,
                # running lanes and their live rows by route: more lanes than models means rows split
                "lanes_by_route": _by_route(lanes),
                "pump_scheduled": bool(self._busy or self._pending or self._calls or self._running),
                "installed_widths": self.installed_widths,
                "refused_widths": {str(w): why for w, why in sorted(self.refused_widths.items())},
                # each installed lane's self-check: the dtype its parity was held to, the tolerance
                # (0: exact) and any divergence tolerated at a near-tie
                "selfchecks": {str(w): {k: getattr(lane, "selfcheck", {}).get(k) for k in
                                        ("ok", "dtype", "parity_tolerance", "tolerated_divergences", "skipped")
                                        if k in getattr(lane, "selfcheck", {})}
                               for w, lane in sorted(self._lanes.items())},
                # per installed width: compiled cycle graphs (True), eager (False), or why a lane whose
                # graph disagreed with its eager forward runs eagerly now (a3b_mtp_batch._CycleForwards)
                "compiled_graphs": {str(w): getattr(lane, "_graphs", {}).get("eager_since") or getattr(lane, "compiled", False)
                                    for w, lane in sorted(self._lanes.items())},
                "mtp_disabled_reason": self.mtp_disabled_reason,
                # admission by memory: the budget, and what one row's state costs (None until measured)
                "kv_budget_bytes": self.kv_budget_bytes,
                "kv_bytes_per_position": self._row_bytes[0] if self._row_bytes else None,
                "forced_width": self.forced_width,
                "numerics": self.numerics,
                "route_ids": {str(w): lane.route_id for w, lane in sorted(self._lanes.items())},
                "session_bank": self.session_bank.stats() if self.session_bank is not None else None,
                "config_fingerprints": {str(w): getattr(lane, "config_fingerprint", None)
                                        for w, lane in sorted(self._lanes.items())},
                "batch_wait_s": self.batch_wait_s,
                "max_cohort_rows": self.max_cohort_rows,
                "last_real_width": s["last_real_width"],
                "last_fixed_width": s["last_fixed_width"],
                "last_route_id": s["last_route_id"],
                "last_error": s["last_error"],
                "fixed_width_histogram": s["fixed_width_histogram"],
                "lane_cycles": s["target_verify_cycles"],
                "lane_row_cycles": s["lane_row_cycles"],
                "mean_lane_occupancy": round(s["lane_row_cycles"] / max(s["target_verify_cycles"], 1), 3),
                "admissions": s["admissions"],
                "shared_prefills": s["shared_prefills"],     # admissions that took a sibling's prefill (n > 1)
                # compiled cycle graphs traced again at a new shape (a KV buffer grew, which the
                # lane avoids by sizing a row's KV for prompt + max_tokens when it joins)
                "graph_retraces": s["graph_retraces"],
                "cycle_seconds_total": round(s["cycle_s"], 6),
                "prefill_seconds_total": round(s["prefill_s"], 6),
                "lanes_started": s["lanes_started"],
                "widenings": s["widenings"],
                # lanes moving between depth 1 and greedy_depths at one width, as sampled rows come and go
                "depth_switches": s["depth_switches"],
                "narrowings": s["narrowings"],
                "target_verify_cycles": s["target_verify_cycles"],
                # of the lanes' cycles: MTP cycles and plain AR steps (generation_mode "auto", AR rows)
                "mtp_cycles": s["mtp_cycles"],
                "ar_steps": s["ar_steps"],
                # sampled rows' drafts: drawn on the device (one wait a cycle) or on the host
                "draft_draw": default_draft_draw(),
                "device_drafts": s["device_drafts"],
                "accepted_draft_tokens": s["accepted_draft_tokens"],
                "rejected_draft_tokens": s["rejected_draft_tokens"],
                # chained drafts (greedy_depths): rows' drafting cycles, the drafts they proposed,
                # and accepted drafts by position in the chain (vLLM's spec-decode counters)
                "draft_proposals": s["draft_proposals"],
                "draft_tokens": s["draft_tokens"],
                "accepted_by_position": s["accepted_by_position"],
                "solo_runs": s["solo_runs"],
                "driver_errors": s["driver_errors"],
                "requests_submitted": s["requests_submitted"],
                "requests_completed": s["requests_completed"],
                "requests_failed": s["requests_failed"],
                "requests_cancelled": s["requests_cancelled"],
                "completion_tokens": s["completion_tokens"],
                "last_owner_finalize": s["last_owner_finalize"],
                "poisoned": s["poisoned"],
                "shut_down": self._closed_error is not None,
                "owner_alive": bool(self._thread is not None and self._thread.is_alive()),
                # seconds the owner has spent on its current cycle, prefill chunk or call (None
                # when idle): a watchdog's measure of a stuck model thread
                "owner_step_age_s": (round(time.monotonic() - self._step_began_s, 3) if self._busy else None),
            }


def _unpack_solo(out) -> tuple:
    """(tokens, finish_reason, stats, extra result keys) from a solo runner's return value."""
    if isinstance(out, dict):
        stats = dict(out.get("stats") or {})
        extra = {k: v for k, v in out.items() if k not in ("tokens", "stats", "finish_reason")}
        return list(out.get("tokens") or []), out.get("finish_reason") or stats.get("finish_reason"), \
            stats, extra
    tokens = getattr(out, "tokens", None)
    if tokens is None:
        raise TypeError(f"solo_runner returned {type(out).__name__}; expected a result dict or a "
                        f"GenerationResult")
    return list(tokens), getattr(out, "finish_reason", None), dict(getattr(out, "stats", {}) or {}), {}


# ---------------------------------------------------------------------------------------------
# Hand-over to an asyncio consumer (the Ray replica uses this; nothing here imports Ray)


_END = object()


class AsyncTokenStream:
    """A thread-safe ``token_callback`` whose tokens are consumed on an asyncio loop.

    Create it on the loop, pass ``stream.push`` as the job's ``token_callback``, ``bind`` the job's
    future, then ``async for tokens in stream`` (lists of ints, in commit order) ends when the
    future resolves; ``await stream.result()`` gives the result dict or raises its error::

        stream = AsyncTokenStream()
        job = MTPBatchJob(..., token_callback=stream.push)
        stream.bind(service.submit(job))
        async for toks in stream: ...
        result = await stream.result()

    If the loop has closed (the client went away), ``push`` raises, which cancels the job.
    """

    def __init__(self, loop: Optional[asyncio.AbstractEventLoop] = None):
        self.loop = loop or asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.future: Optional[Future] = None

    def push(self, tokens) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, [int(t) for t in tokens])

    def bind(self, future: Future) -> Future:
        self.future = future

        def done(_f):
            try:
                self.loop.call_soon_threadsafe(self.queue.put_nowait, _END)
            except RuntimeError:  # loop closed: nobody is listening
                pass

        future.add_done_callback(done)
        return future

    def __aiter__(self):
        return self._iterate()

    async def _iterate(self):
        if self.future is None:
            raise RuntimeError("bind(future) before iterating")
        while True:
            item = await self.queue.get()
            if item is _END:
                return
            yield item

    async def result(self) -> dict:
        if self.future is None:
            raise RuntimeError("bind(future) before awaiting the result")
        return await asyncio.wrap_future(self.future)


# ---------------------------------------------------------------------------------------------
# Benchmark: what the service costs on top of the driver


_BENCH_PROMPTS = (
    "def fibonacci(n):\n",
    "class Stack:\n    def __init__(self):\n",
    "import os\n\ndef list_files(path):\n",
    "def parse_args(argv):\n    parser = ",
    "for i in range(10):\n    if i % 2 == 0:\n",
    "def read_json(path):\n    with open(path) as f:\n",
    "class Point:\n    def __init__(self, x, y):\n",
    "def merge_sort(items):\n    if len(items) <= 1:\n",
)


def bench_service_overhead(model, n_prompts: int = 8, min_tokens: int = 128, max_tokens: int = 256,
                           rounds: int = 3, width: int = 8, batch_wait_s: float = DEFAULT_BATCH_WAIT_S,
                           service: Optional[MTPBatchGenerationService] = None) -> dict:
    """Aggregate tok/s of one greedy cohort through the service (``n_prompts`` concurrent submits)
    vs the driver called directly on the same cohort (on the same owner thread), median of
    ``rounds``, interleaved. Stop tokens are off so both arms decode the same token counts
    (budgets spread evenly over [min_tokens, max_tokens]). Returns a dict; ``overhead_pct`` is the
    aggregate tok/s lost through the service."""
    from mtplx.engine.lane import A3BMTPBatchRequest, generate_a3b_mtp_batch

    if not 2 <= n_prompts <= MAX_COHORT_ROWS:
        raise ValueError(f"n_prompts={n_prompts} must be in [2, {MAX_COHORT_ROWS}]")
    own = service is None
    if own:
        service = MTPBatchGenerationService.for_model(model, widths=(width,), batch_wait_s=batch_wait_s)
    greedy = SamplerConfig(temperature=0.0)
    prompts = [model.tokenizer.encode(_BENCH_PROMPTS[i % len(_BENCH_PROMPTS)]) for i in range(n_prompts)]
    step = (max_tokens - min_tokens) / max(n_prompts - 1, 1)
    budgets = [int(round(min_tokens + i * step)) for i in range(n_prompts)]
    total = sum(budgets)
    key = mtp_batch_compatibility_key(model.model_id, False, greedy, None)

    def direct():
        fixed_width, lane = service._lane_for_real_width(n_prompts)
        reqs = [A3BMTPBatchRequest(request_id=str(i), prompt_ids=tuple(p), sampler=greedy, seed=i,
                                   max_tokens=m) for i, (p, m) in enumerate(zip(prompts, budgets))]
        t0 = time.perf_counter()
        res = generate_a3b_mtp_batch(lane, reqs)
        wall = time.perf_counter() - t0
        return wall, [s.tokens for s in res.streams]

    def through_service():
        jobs = [MTPBatchJob(request_id=f"bench-{i}", prompt_ids=p, max_tokens=m, sampler=greedy,
                            seed=i, stop_token_ids=(), token_callback=lambda toks: None,
                            compatibility_key=key)
                for i, (p, m) in enumerate(zip(prompts, budgets))]
        t0 = time.perf_counter()
        futures = [service.submit(j) for j in jobs]
        results = [f.result() for f in futures]
        wall = time.perf_counter() - t0
        return wall, [r["tokens"] for r in results], results

    try:
        service.call_on_owner(direct).result()        # warm-up (allocations, caches)
        direct_walls, service_walls, same_tokens = [], [], True
        decode_tok_s = []
        for _ in range(rounds):
            d_wall, d_tokens = service.call_on_owner(direct).result()
            s_wall, s_tokens, results = through_service()
            direct_walls.append(d_wall)
            service_walls.append(s_wall)
            same_tokens &= d_tokens == s_tokens
            decode_tok_s.append(sum(r["stats"]["decode_tok_s"] for r in results))
        d_med, s_med = statistics.median(direct_walls), statistics.median(service_walls)
        direct_tps, service_tps = total / d_med, total / s_med
        return {
            "n_prompts": n_prompts, "budgets": budgets, "completion_tokens": total, "rounds": rounds,
            "fixed_width": service._lane_for_real_width(n_prompts)[0], "batch_wait_s": batch_wait_s,
            "direct_wall_s": direct_walls, "service_wall_s": service_walls,
            "direct_tok_s": direct_tps, "service_tok_s": service_tps,
            "overhead_pct": 100.0 * (1.0 - service_tps / direct_tps),
            "sum_row_decode_tok_s_median": statistics.median(decode_tok_s),
            "identical_tokens": bool(same_tokens),
            "service_snapshot": service.snapshot(),
        }
    finally:
        if own:
            service.shutdown()


__all__ = [
    "MTPBatchJob", "MTPBatchGenerationService", "MTPBatchCancelled", "MTPBatchServiceClosed",
    "MTPBatchOwnerFinalizeError", "AsyncTokenStream", "mtp_batch_compatibility_key",
    "bench_service_overhead", "FORCE_WIDTH_ENV",
]
