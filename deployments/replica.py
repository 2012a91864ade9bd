"""The MTP replica: owns one MLX model and its `MTPBatchGenerationService`.

The ingress sends the rows of each `@serve.batch` window here as one streaming call
(`run_cohort`, a list of `mtplx.api.rows.RowSpec`). The replica turns the rows into
`MTPBatchJob`s, submits them together
(`service.submit_cohort`) and streams back, per wake-up of its event loop, the tokens every row
committed since the last message, each live row's checkpoint after them (its state at its lane
step's end: what the ingress needs to resume the row on another replica should this one go
away), the final result of each row that ended, and the prefix-cache events the ingress has not
seen (`deployments.prefix_index`). Token callbacks run on the service's model-owner thread; they
only append to a locked buffer and wake the loop (at most one wake-up in flight), so a cohort
costs about one Ray stream item per decode cycle.

MLX is imported inside `__init__` only: importing this module (the app builder does) stays light.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from functools import partial
from typing import Any, AsyncIterator, Dict, List, Optional

from ray import serve

from mtplx.api.rows import RowCheckpoint, RowSpec, mtp_batch_compatibility_key
from mtplx.api.text import StopStringWatch
from mtplx.end import CANCELLED, End
from mtplx.structured import GRAMMAR_MEMORY, holding_back
from mtplx.scheduler.config import DEFAULT_BATCH_WAIT_S, DEFAULT_SAMPLED_DEPTH, DEFAULT_WIDTHS, GREEDY_DEPTHS_BY_COST

from .metrics import REPLICA_SERIES, CohortMonitor, error_label, finish_reason_label, make_metrics, record
from .prefix_index import PrefixCacheLog

log = logging.getLogger("ray.serve")

URGENT_TOKENS = 4   # a row's first tokens skip the stream grouping delay

# The replica's settings' defaults (`deployments.app.AppArgs` uses these; the scheduler's own are
# in mtplx.scheduler.config)
DEFAULT_STREAM_INTERVAL_MS = 0.0
DEFAULT_MAX_WAITING_ROWS_PER_KEY = 64
DEFAULT_RETRY_AFTER_S = 1.0
DEFAULT_WATCHDOG_S = 120.0
DEFAULT_SUMMARY_INTERVAL_S = 10.0
DEFAULT_NICENESS = 0


MODEL_METADATA_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                        "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt",
                        "tokenizer.model", "chat_template.jinja", "chat_template.json")


class RowCancelled(RuntimeError):
    """A cohort row was cancelled (client gone, stop string matched, or the cancel endpoint)."""


class ReplicaOverloaded(RuntimeError):
    """A row was refused: its key already has as many waiting rows as the replica allows."""


def _replica_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside Serve (direct construction in a test or the bench)
        return f"local-{os.getpid()}"


def _rss_bytes() -> Optional[int]:
    """This process's resident memory now (Linux); its peak on other systems."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import resource
        import sys

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(peak if sys.platform == "darwin" else peak * 1024)


def _node_id() -> Optional[str]:
    """The Ray node this replica runs on; None outside Ray (a direct construction in a test or the
    bench: asking Ray's runtime context there would start a local Ray in that process)."""
    try:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    except Exception:
        return None


class _CohortBuffer:
    """A cohort's sink: the owner thread hands it each lane step phase's news of the cohort's rows
    in one call (`__call__`; a cycle's draft and bonus tokens go out together, with the row's
    checkpoint after them), and each row's outcome (`push_final`); the event loop takes what
    piled up (`take`)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._lock = threading.Lock()
        self.row_of: Dict[int, int] = {}              # id(job) -> its row in the cohort
        self._tokens: Dict[int, List[int]] = {}
        self._logprobs: Dict[int, list] = {}          # row -> entries parallel to its tokens (if asked)
        self._checkpoints: Dict[int, RowCheckpoint] = {}
        self._finals: Dict[int, Any] = {}
        self.first_token_at: Dict[int, float] = {}   # row -> wall clock of its first token
        self.sent: Dict[int, int] = {}               # row -> tokens already handed to the stream
        self._wake_pending = False
        self._urgent_pending = False
        self.event = asyncio.Event()
        self.urgent_event = asyncio.Event()   # a row's first tokens or its end: no grouping delay

    def _wake_locked(self, urgent: bool = False) -> None:
        if urgent and not self._urgent_pending:
            self._urgent_pending = self._wake_pending = True
            self._call_soon(self._set_both)
        elif not self._wake_pending:
            self._wake_pending = True
            self._call_soon(self.event.set)

    def _call_soon(self, fn) -> None:
        try:
            self._loop.call_soon_threadsafe(fn)
        except RuntimeError:  # loop closed: the cohort call is gone
            pass

    def _set_both(self) -> None:
        self.event.set()
        self.urgent_event.set()

    def __call__(self, news: list) -> None:
        """One lane step phase's `RowNews` of this cohort's rows (on the owner thread). A message
        never carries a row's tokens past its checkpoint: tokens without one drop an older one."""
        now, urgent = time.time(), False
        with self._lock:
            for n in news:
                row = self.row_of[id(n.job)]
                if n.tokens:
                    self.first_token_at.setdefault(row, now)
                    pending = self._tokens.setdefault(row, [])
                    pending.extend(n.tokens)
                    if n.logprobs:
                        self._logprobs.setdefault(row, []).extend(n.logprobs)
                    urgent = urgent or self.sent.get(row, 0) + len(pending) <= URGENT_TOKENS
                    if n.checkpoint is None:
                        self._checkpoints.pop(row, None)
                if n.checkpoint is not None:
                    self._checkpoints[row] = n.checkpoint
            if news:
                self._wake_locked(urgent=urgent)

    def push_final(self, row: int, outcome) -> None:
        with self._lock:
            self._finals[row] = outcome
            self._wake_locked(urgent=True)

    def urgent(self) -> bool:
        """True when the buffer holds a row's end, or tokens of a row that has sent fewer than
        URGENT_TOKENS so far (its first visible text may need several: special tokens, a UTF-8
        character split over byte tokens)."""
        with self._lock:
            return bool(self._finals) or any(self.sent.get(r, 0) < URGENT_TOKENS for r in self._tokens)

    def take(self):
        """(tokens, log-probability entries, finals, checkpoints) handed over since the last take."""
        with self._lock:
            tokens, self._tokens = self._tokens, {}
            logprobs, self._logprobs = self._logprobs, {}
            finals, self._finals = self._finals, {}
            checkpoints, self._checkpoints = self._checkpoints, {}
            for r, toks in tokens.items():
                self.sent[r] = self.sent.get(r, 0) + len(toks)
            self._wake_pending = False
            self._urgent_pending = False
            self.event.clear()
            self.urgent_event.clear()
        return tokens, logprobs, finals, checkpoints


def _cancel_keys(job) -> set:
    """The ids a cancel finds a job by: its own, and its request's (the rows of n > 1 choices)."""
    return {job.request_id} | ({job.prefill_group} if job.prefill_group is not None else set())


def _public_result(result: dict) -> dict:
    """The part of a service result dict the ingress needs (no token list: it was streamed), its
    End as the engine decided it, in its plain form."""
    stats = dict(result.get("stats") or {})
    return {
        "finish_reason": result["finish_reason"],
        "end": result["end"].as_dict(),
        "prompt_tokens": int(result.get("prompt_tokens", 0)),
        "completion_tokens": int(result.get("completion_tokens", 0)),
        "cached_tokens": int(result.get("cached_tokens", 0) or 0),
        "stats": stats,
    }


def _partial_result(job, generation_mode: str) -> dict:
    """Usage and timing of a row that ended without a service result (cancelled)."""
    now = time.perf_counter()
    n = len(job.tokens)
    started = job.decode_started_s or job.admitted_s or job.created_s
    decode_s = max(now - started, 1e-9)
    end = End(CANCELLED)
    reason = end.finish_reason
    return {
        "finish_reason": reason,
        "end": end.as_dict(),
        "prompt_tokens": len(job.prompt_ids),
        "completion_tokens": n,
        "cached_tokens": 0,
        "stats": {
            "request_id": job.request_id, "prompt_tokens": len(job.prompt_ids), "completion_tokens": n,
            "decode_elapsed_s": decode_s, "decode_tok_s": n / decode_s,
            "request_elapsed_s": now - job.created_s, "finish_reason": reason,
            "generation_mode": generation_mode, "cancelled": True, "server_seed": job.seed,
        },
    }


class MTPReplica:
    """Serve deployment class (decorated in `deployments.app`); see the module docstring."""

    def __init__(self, model_path: Optional[str] = None, widths=DEFAULT_WIDTHS, greedy_depths=None,
                 sampled_depth: int = DEFAULT_SAMPLED_DEPTH,
                 batch_wait_s: float = DEFAULT_BATCH_WAIT_S, stream_interval_ms: float = DEFAULT_STREAM_INTERVAL_MS,
                 blas_threads: Optional[int] = None, numerics: str = "throughput", warmup: bool = True,
                 niceness: Optional[int] = DEFAULT_NICENESS,
                 max_waiting_rows_per_key: int = DEFAULT_MAX_WAITING_ROWS_PER_KEY,
                 retry_after_s: float = DEFAULT_RETRY_AFTER_S, watchdog_s: float = DEFAULT_WATCHDOG_S,
                 summary_interval_s: float = DEFAULT_SUMMARY_INTERVAL_S, metrics: bool = True,
                 engine: Optional[dict] = None, replica_cpus: Optional[int] = None):
        """Settings as in `deployments.app.AppArgs` (`greedy_depths=None`: chosen by measured cost).
        `engine`: the engine's settings the config gives (`ENGINE_SETTINGS` of AppArgs: force_width,
        draft_draw, compiled, overlap, device_judging, run_ahead, context_drafts, kv_budget_gb, repetition_stop),
        None for unset: unset ones come from this process's environment, else the defaults
        (`mtplx.engine.settings.EngineSettings`, built here once and passed down)."""
        from ._proc import freeze_startup_objects, keep_node_off, pin_replica_cpus, renice_process

        self.niceness = renice_process(niceness)   # before the BLAS and owner threads exist: they inherit it
        pinned = pin_replica_cpus(replica_cpus)    # every thread now; the owner thread and later ones inherit it
        self.cpus = pinned[0] if pinned else None
        if pinned and pinned[1]:
            keep_node_off(pinned[1])
        # BLAS threads (CPU backend): 1 by default. OpenBLAS's extra threads spin while they wait,
        # taking the core the model owner's Python (and the ingress and proxy) needs (README: what
        # it measured); raise it on nodes with cores to spare, and measure. Set through OpenBLAS's own call:
        # this process loaded it already (importing this package imports mtplx) under Ray's
        # OMP_NUM_THREADS, so the environment would not change it. None: no OpenBLAS to set
        # (macOS, or MTPLX_BLAS=off).
        import mtplx
        from mtplx.engine.repetition import RepetitionLimits
        from mtplx.engine.settings import EngineSettings
        from mtplx.runtime import set_blas_threads
        from mtplx.server import mtp_batch

        self._mtplx = mtplx
        self.blas_threads = set_blas_threads(int(blas_threads) if blas_threads else 1)
        self._mtp_batch = mtp_batch
        engine = dict(engine or {})
        stop = engine.pop("repetition_stop", None)
        self.engine_settings = EngineSettings.from_environ(
            os.environ, **engine, repetition_limits=RepetitionLimits(**stop) if stop is not None else None,
            repetition_stop_all=True if stop is not None else None)
        t0 = time.perf_counter()
        self.model = mtplx.load_model(os.path.expanduser(model_path) if model_path else None)
        self.service = mtp_batch.MTPBatchGenerationService.for_model(
            self.model, widths=tuple(int(w) for w in widths), batch_wait_s=float(batch_wait_s),
            numerics=numerics,
            greedy_depths=GREEDY_DEPTHS_BY_COST if greedy_depths is None else greedy_depths,
            sampled_depth=sampled_depth,
            settings=self.engine_settings)
        self.load_s = time.perf_counter() - t0
        # the prefix bank's events, numbered, for the ingresses' routers (deployments.prefix_index)
        from mtplx.engine.prefill import PREFILL_CHUNK

        self.cache_log = PrefixCacheLog(PREFILL_CHUNK)
        if self.service.session_bank is not None:
            self.service.session_bank.on_change = self.cache_log.on_change
        self.replica_id = _replica_id()
        self.node_id = _node_id()
        self.stream_interval_s = max(0.0, float(stream_interval_ms) / 1000.0)
        # Backpressure: beyond its widest lane, a key holds at most this many waiting rows; more
        # are refused at once (the ingress answers 429/503 with Retry-After).
        self.max_waiting_rows_per_key = int(max_waiting_rows_per_key)
        self.retry_after_s = float(retry_after_s)
        self.watchdog_s = float(watchdog_s)   # check_health fails when one owner step runs longer
        self.summary_interval_s = float(summary_interval_s)   # cohort summaries in the replica log (0: none)
        self._jobs: Dict[str, list] = {}
        self._owners: Dict[str, Optional[str]] = {}     # a live row's id -> its caller's key digest (RowSpec.owner)
        self._cohorts_started = 0
        self._overload_rejections = 0
        self._stream_messages = 0
        self._rows = {"finished": 0, "prefix_hits": 0, "prompt_tokens": 0, "cached_tokens": 0,
                      "resumed": 0, "resumed_tokens": 0, "checkpoints": 0}
        if warmup:
            self._warmup()
        self._metrics, self._monitor = None, None
        if metrics:
            self._init_metrics()
        log.info("mtplx replica %s: %s loaded in %.2fs, lanes %s", self.replica_id, self.model.model_id,
                 self.load_s, self.service.installed_widths)
        freeze_startup_objects()

    # -- setup -----------------------------------------------------------------------------------

    def _warmup(self) -> None:
        """One tiny cohort at every width a running lane may take, so the first requests do not
        pay first-call costs (graph compilation)."""
        from mtplx.sampling import SamplerConfig

        greedy = SamplerConfig(temperature=0.0)
        key = mtp_batch_compatibility_key(self.model.model_id)   # each width's cohort ends before the next
        prompt = list(self.model.tokenizer.encode("def f(x):\n", add_special_tokens=False)) or [1]
        try:
            for width in [1] + self.service.installed_widths:
                jobs = [self._mtp_batch.MTPBatchJob(request_id=f"warmup-{width}-{i}", prompt_ids=prompt,
                                                    max_tokens=4, sampler=greedy, seed=i, compatibility_key=key)
                        for i in range(width)]
                for f in self.service.submit_cohort(jobs):
                    f.result(timeout=120)
        except Exception as exc:  # warm-up is best effort
            log.warning("mtplx replica warm-up failed: %s", exc)

    def _init_metrics(self) -> None:
        self._metrics = make_metrics(REPLICA_SERIES, log)
        self._monitor = CohortMonitor(self.service.snapshot, self._metrics, log, self.summary_interval_s,
                                      name=f"mtplx replica {self.replica_id}").start()

    def _observe(self, name: str, value: float, tags: Optional[dict] = None) -> None:
        record(self._metrics, name, value, tags)

    # -- calls from the ingress -----------------------------------------------------------------

    async def info(self, **_pin) -> dict:
        m = self.model
        return {
            "replica_id": self.replica_id, "model_id": m.model_id, "model_path": str(m.path),
            "max_context": m.max_context, "vocab_size": m.vocab_size,
            "eos_token_ids": sorted(m.eos_token_ids), "mtp": m.mtp is not None,
            "mtp_disabled_reason": m.mtp_disabled_reason,
            "installed_widths": self.service.installed_widths, "greedy_depths": self.service.ladder.greedy_depths,
            "sampled_depth": self.service.ladder.sampled_depth,
            "load_s": self.load_s,
            "blas_threads": self.blas_threads,
        }

    async def model_files(self, **_pin) -> Dict[str, bytes]:
        """The checkpoint's small metadata files (config, generation config, tokenizer), for an
        ingress on a node without the checkpoint."""
        out = {}
        for name in MODEL_METADATA_FILES:
            path = self.model.path / name
            if path.is_file() and path.stat().st_size <= 64 * 1024 * 1024:
                out[name] = path.read_bytes()
        return out

    async def run_cohort(self, rows: List[RowSpec], cache_seen: Optional[Dict[str, int]] = None,
                         **_routing) -> AsyncIterator[dict]:
        """Stream one cohort. Messages: first {"replica": id}; then {"t": {row: [tokens]},
        "lp": {row: [log-probability entries]}, "c": {row: RowCheckpoint after its tokens so far},
        "f": {row: result | {"error": ...}}} until every row has its final entry; any message may
        carry "pc", the prefix-cache events after `cache_seen[this replica]` (how far the caller
        has read them; absent: from the start). `_routing`: the router's keywords."""
        buf = _CohortBuffer(asyncio.get_running_loop())
        started, received_at = time.perf_counter(), time.time()
        seen = [(cache_seen or {}).get(self.replica_id, -1)]
        jobs = [self._job(row, buf) for row in rows]
        for i, (job, row) in enumerate(zip(jobs, rows)):
            buf.row_of[id(job)] = i
            self._owners[job.request_id] = row.owner
            for key in _cancel_keys(job):
                self._jobs.setdefault(key, []).append(job)
            job.future.add_done_callback(lambda f, i=i: buf.push_final(i, f))
        self._cohorts_started += 1
        self._observe("cohorts", 1, {"generation_mode": rows[0].generation_mode if rows else "auto"})
        self._observe("width", len(jobs))
        self._rows["resumed"] += sum(1 for row in rows if row.resume_tokens)
        self._rows["resumed_tokens"] += sum(len(row.resume_tokens) for row in rows)
        try:
            yield self._with_cache_events({"replica": self.replica_id}, seen)
            self.service.submit_cohort(self._admit_within_limits(jobs))
            async for msg in self._stream(buf, rows, jobs, started, received_at):
                yield self._with_cache_events(msg, seen)
        finally:
            self._release(buf, jobs)

    def _with_cache_events(self, msg: dict, seen: list) -> dict:
        """`msg` with the prefix-cache events its stream has not passed on yet (`seen[0]`: the
        last it did)."""
        update = self.cache_log.since(seen[0])
        if update is not None:
            msg["pc"] = update
            seen[0] = update["seq"] if "reset" in update else update["from"] + len(update["events"]) - 1
        return msg

    def _job(self, row: RowSpec, buf: "_CohortBuffer"):
        """The scheduler's job for a row of a cohort: its news goes to the cohort's buffer; the
        model's EOS joins the row's own stop tokens unless it ignores EOS; a `min_tokens` row's
        constraint holds those stops back until then; its stop strings are watched on its text
        (detokenized as its client's text is), so its row ends in the step that completed one."""
        eos = frozenset() if row.ignore_eos else self.model.eos_token_ids
        stops = eos | frozenset(row.stop_token_ids)
        # an EOS id the request also asked for ends the row as that requested stop (vLLM reports it
        # as the stop_reason)
        unrequested_eos = eos - frozenset(row.stop_token_ids)
        job = self._mtp_batch.MTPBatchJob(
            request_id=row.request_id, prompt_ids=row.prompt_ids, max_tokens=row.max_tokens,
            sampler=row.sampler, draft_sampler=row.draft_sampler, seed=row.seed,
            stop_token_ids=stops, eos_token_ids=unrequested_eos,
            sink=buf, logprobs=row.logprobs,
            compatibility_key=row.compatibility_key, speculative=row.speculative, adaptive=row.adaptive,
            cancel_error=lambda job: RowCancelled(f"request {job.request_id} cancelled"),
            omit_speculative_bonus=row.omit_speculative_bonus, prefill_group=row.prefill_group,
            constraint=holding_back(row.constraint, stops, row.min_tokens), cache_salt=row.cache_salt,
            request_observability={"replica_id": self.replica_id},
            resume_tokens=row.resume_tokens, checkpoint=row.checkpoint,
            stop_text=(partial(StopStringWatch, self.model.tokenizer, row.stop_strings, row.skip_special_tokens,
                               row.min_tokens) if row.stop_strings else None))
        bank = self.service.session_bank     # the row's prompt is looked up and banked in its caller's partition
        if bank is not None:
            job.session_restore, job.session_commit = bank.job_hooks(job)
        return job

    async def _stream(self, buf: "_CohortBuffer", rows: List[RowSpec], jobs: list, started: float,
                      received_at: float) -> AsyncIterator[dict]:
        """The cohort's messages, one per wake-up of the buffer, until every row has ended."""
        open_rows = set(range(len(jobs)))
        first_token_seen: set = set()
        last_sent = 0.0
        while open_rows:
            await buf.event.wait()
            if self.stream_interval_s and not buf.urgent():
                # Group updates: at most one message per interval, except that a row's first
                # tokens and a row's end go out at once (time to first token, prompt finals).
                delay = last_sent + self.stream_interval_s - time.perf_counter()
                if delay > 0:
                    try:
                        await asyncio.wait_for(buf.urgent_event.wait(), delay)
                    except asyncio.TimeoutError:
                        pass
            tokens, logprobs, finals, checkpoints = buf.take()
            last_sent = time.perf_counter()
            for i in set(tokens) - first_token_seen:
                first_token_seen.add(i)
                self._observe("ttft", last_sent - started)
            msg: Dict[str, Any] = {"t": tokens} if tokens else {}
            if logprobs:
                msg["lp"] = logprobs
            if checkpoints:
                msg["c"] = checkpoints
                self._rows["checkpoints"] += len(checkpoints)
            if finals:
                msg["f"] = {i: self._final(jobs[i], rows[i].generation_mode, fut) for i, fut in finals.items()}
                for i, fin in msg["f"].items():
                    if "stats" in fin:
                        fin["stats"].update(replica_received_at=received_at,
                                            replica_first_token_at=buf.first_token_at.get(i))
                open_rows.difference_update(finals)
            if msg:
                self._stream_messages += 1
                yield msg

    def _release(self, buf: "_CohortBuffer", jobs: list) -> None:
        """The cohort call ended (normally, or cancelled because the ingress went away): no row
        may keep decoding for nobody."""
        for job in jobs:
            if not job.future.done():
                job.cancel()
            self._owners.pop(job.request_id, None)
            for key in _cancel_keys(job):
                lst = self._jobs.get(key)
                if lst is not None and job in lst:
                    lst.remove(job)
                if lst == []:
                    self._jobs.pop(key, None)

    def _admit_within_limits(self, jobs: list) -> list:
        """The jobs that fit their key's bound on waiting rows; the others fail at once with
        `ReplicaOverloaded` (their callers answer 429/503 with Retry-After)."""
        room: Dict[Any, int] = {}
        admitted = []
        for job in jobs:
            key = job.compatibility_key
            if key not in room:
                room[key] = (self.service.max_cohort_rows + self.max_waiting_rows_per_key
                             - self.service.rows_wanting(key))
            if room[key] > 0:
                room[key] -= 1
                admitted.append(job)
            else:
                self._overload_rejections += 1
                job._fail(ReplicaOverloaded(
                    f"The server is overloaded (more than {self.max_waiting_rows_per_key} requests for this model "
                    f"wait for a slot); retry after {self.retry_after_s:g} s"))
        return admitted

    def _final(self, job, mode: str, fut) -> dict:
        """A row's final entry: its result, a cancelled row's partial result, or its error."""
        exc = fut.exception()
        if exc is None:
            out = _public_result(fut.result())
            self._observe_row(out)
            return out
        if job.cancel_requested():
            self._observe("finished", 1, {"finish_reason": finish_reason_label(End(CANCELLED))})
            return _partial_result(job, mode)
        error = self._error_class(job, exc)
        self._observe("finished", 1, {"finish_reason": error_label(error["kind"])})
        return {"error": error}

    def _observe_row(self, out: dict) -> None:
        """A finished row's request series (once per row, on the event loop)."""
        st, n = out["stats"], out["completion_tokens"]
        prompt, cached = out["prompt_tokens"], out["cached_tokens"]
        self._observe("finished", 1, {"finish_reason": finish_reason_label(End.from_dict(out["end"]))})
        self._observe("prompt_tokens", prompt)
        self._observe("generation_tokens", n)
        self._observe("prefill_tokens", max(0, prompt - cached))
        self._observe("prefix_queries", prompt)
        self._observe("prefix_hits", cached)
        self._observe("prefix_requests", 1, {"hit": "true" if cached else "false"})
        rows = self._rows
        rows["finished"] += 1
        rows["prefix_hits"] += bool(cached)
        rows["prompt_tokens"] += prompt
        rows["cached_tokens"] += cached
        if st.get("request_elapsed_s"):
            self._observe("e2e", float(st["request_elapsed_s"]))
        if n > 1 and st.get("decode_elapsed_s"):
            self._observe("tpot", float(st["decode_elapsed_s"]) / (n - 1))
        if st.get("decode_tok_s"):
            self._observe("decode_tok_s", float(st["decode_tok_s"]))
        accepted = int(st.get("accepted_drafts") or 0)
        # proposals: the cycles it drafted in (a chain of 1-3 drafts each); the solo path drafts one
        proposals = st.get("speculated_cycles") or accepted + int(st.get("rejected_drafts") or 0)
        if proposals:   # rows that drafted (an auto row's plain AR steps draft nothing and do not count)
            self._observe("accept_length", 1 + accepted / proposals)

    def _error_class(self, job, exc: BaseException) -> dict:
        """A failed row's error event, by class. Only messages written for clients leave this
        process; anything else is a bug of ours, logged here with the request id."""
        from mtplx.engine.prefill import CapacityError

        if isinstance(exc, ReplicaOverloaded):
            return {"kind": "overloaded", "message": str(exc), "retry_after_s": self.retry_after_s}
        if isinstance(exc, CapacityError):
            return {"kind": "capacity", "message": str(exc)}
        if isinstance(exc, self._mtp_batch.MTPBatchServiceClosed):
            log.error("mtplx replica %s: request %s refused, the service is closed: %s", self.replica_id,
                      job.request_id, exc)
            # the row itself is fine: the ingress resumes it on another replica from what it streamed
            return {"kind": "unavailable", "retry_after_s": self.retry_after_s, "resumable": True,
                    "message": "This model replica is shutting down or failed; retry (a new replica is starting)"}
        log.error("mtplx replica %s: request %s failed", self.replica_id, job.request_id,
                  exc_info=(type(exc), exc, exc.__traceback__))
        return {"kind": "internal"}

    async def cancel(self, request_id: str, owner: Optional[str] = None, **_pin) -> int:
        """Cancel every row with this request id on this replica; returns how many were live.
        `owner` (a client's cancel, with API keys set): only the rows that caller's key created
        (another key's are not found); None: the ingress's own cancels (a client gone), or no keys
        set."""
        jobs = [j for j in list(self._jobs.get(request_id, ()))
                if owner is None or self._owners.get(j.request_id) == owner]
        return sum(1 for job in jobs if job.cancel())

    async def snapshot(self, **_pin) -> dict:
        snap = self.service.snapshot()
        snap.update({"replica_id": self.replica_id, "node_id": self.node_id, "model_id": self.model.model_id,
                     "cohort_calls": self._cohorts_started, "stream_messages": self._stream_messages,
                     "rss_bytes": _rss_bytes(), "mlx_memory": self._mlx_memory(), "pid": os.getpid(),
                     "prefix_cache": self._prefix_cache_stats(), "resumed_rows": self._rows["resumed"],
                     "resumed_tokens": self._rows["resumed_tokens"], "checkpoints_sent": self._rows["checkpoints"],
                     "live_requests": len({j.request_id for lst in self._jobs.values() for j in lst}), "overload_rejections": self._overload_rejections,
                     "max_waiting_rows_per_key": self.max_waiting_rows_per_key,
                     # structured output: what the live rows' grammars hold, and llguidance's bounds
                     "grammar": GRAMMAR_MEMORY.stats(),
                     # tokens/s over the last 5 s (None without metrics or before two samples)
                     "decode_tok_s_5s": self._monitor.decode_tok_s() if self._monitor is not None else None})
        return snap

    def _prefix_cache_stats(self) -> dict:
        """This replica's prefix-cache hit rates over the rows it finished: of its requests (a
        row with any cached token is a hit) and of their prompt tokens; and its event log."""
        r = self._rows
        return {"requests": r["finished"], "requests_hit": r["prefix_hits"],
                "request_hit_rate": r["prefix_hits"] / r["finished"] if r["finished"] else None,
                "prompt_tokens": r["prompt_tokens"], "cached_tokens": r["cached_tokens"],
                "token_hit_rate": r["cached_tokens"] / r["prompt_tokens"] if r["prompt_tokens"] else None,
                **self.cache_log.stats()}

    async def record_autoscaling_stats(self) -> Dict[str, float]:
        """Serve's custom autoscaling metrics (`deployments.autoscaling`): the rows this replica
        holds (decoding, prefilling, waiting) and the lane slots its widest lane offers."""
        snap = self.service.snapshot()
        live = sum(ln["live_rows"] for ln in snap["lanes"])
        return {"rows": float(live + snap["waiting_rows"]), "waiting_rows": float(snap["waiting_rows"]),
                "live_rows": float(live), "lane_slots": float(self.service.max_cohort_rows)}

    @staticmethod
    def _mlx_memory() -> dict:
        import mlx.core as mx

        return {"active_bytes": mx.get_active_memory(), "cache_bytes": mx.get_cache_memory(),
                "peak_bytes": mx.get_peak_memory()}

    async def health(self, **_pin) -> dict:
        snap = self.service.snapshot()
        return {"replica_id": self.replica_id, "model_id": self.model.model_id,
                "ok": self._unhealthy(snap) is None,
                "runtime": self._mtplx.runtime_info(), "blas_threads": self.blas_threads,
                "niceness": self.niceness, "cpus": self.cpus,
                "installed_widths": snap.get("installed_widths"),
                "numerics": snap.get("numerics"), "poisoned": bool(snap.get("poisoned"))}
        # /health is open to anyone who can reach the port: no error texts here (the snapshot,
        # behind the API key, has last_error)

    def _unhealthy(self, snap: dict) -> Optional[str]:
        if snap.get("poisoned") or snap.get("shut_down"):
            return f"MTP batch service unusable: {snap.get('poisoned') or 'shut down'}"
        if not snap.get("owner_alive", True):
            return "MTP batch model-owner thread died"
        age = snap.get("owner_step_age_s")
        if age is not None and age > self.watchdog_s:
            return (f"MTP batch model-owner thread stuck: one step has run {age:.0f} s "
                    f"(watchdog_s={self.watchdog_s:g})")
        return None

    def check_health(self) -> None:
        """Serve's health check: a poisoned or dead service, or a model thread stuck in one step
        longer than `watchdog_s`, makes the replica unhealthy; Serve replaces it."""
        problem = self._unhealthy(self.service.snapshot())
        if problem is not None:
            log.error("mtplx replica %s unhealthy: %s", self.replica_id, problem)
            raise RuntimeError(problem)

    def __del__(self):
        monitor = getattr(self, "_monitor", None)
        if monitor is not None:
            monitor.stop()
        try:
            self.service.shutdown(timeout_s=5)
        except Exception:
            pass
