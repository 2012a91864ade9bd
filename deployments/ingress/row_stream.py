"""One row's life after admission: events from its batch slot -> tokens -> text, with its stop
strings and log-probabilities, and how the row ended: the engine's `End`, carried here from the
replica unchanged. The replica ends a row on a stop string (it matches them on the row's text as
it decodes); the text here is matched the same way, token by token, only to hold back what may
begin a stop string and to cut the text at the one that ended the row.

What a client is told about a row lines up with its text: every token it returns is counted in
usage and has (when asked for) one log-probability entry, in order; the token that ended the row
(EOS or a requested stop token id) is none of these (the replica does not stream it). With stop
strings the tokens are matched one by one, so a row stopped by one counts the tokens up to and
including the one that completed it (the row's last).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import List, Optional, Tuple, Union

from mtplx.api import openai as oa
from mtplx.api.errors import OpenAIError, internal_error, invalid_request, overloaded, unavailable
from mtplx.api.output_plan import PLAIN, OutputPlan
from mtplx.api.text import IncrementalDetokenizer, StopStringMatcher
from mtplx.end import CANCELLED, STOP_STRING, End

from .pending import PendingRow

log = logging.getLogger("ray.serve")

_END = object()


@dataclass(frozen=True)
class RowResult:
    """What a finished row reports: usage counts, how it ended, and its stats."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    end: End                               # how it ended (an error raises instead)
    finish_reason: str                     # OpenAI's, of `end`
    stop_reason: Union[int, str, None]     # vLLM's, of `end`: the stop string or requested stop token id
    stats: dict


class RowStream:
    """A row's text deltas (`start`, then `texts`), log-probabilities (`take_logprobs`) and result
    (`result`). A pump task reads the row's batch slot into a queue; when the client goes away
    (`close` before the end) the row is ended at the ingress and the pump is cancelled. `ingress`:
    the `OpenAIIngress` (its tokenizer, dispatcher, waiting bound, settings and metrics). `plan`:
    how the answer's text is read (thinking, tool calls), for the formats."""

    def __init__(self, ingress, row: PendingRow, req, *, response_id: str, t0: float,
                 client_id: Optional[str], route: str, plan: OutputPlan = PLAIN):
        self.ing = ingress
        self.row = row
        self.spec = row.spec
        self.req = req
        self.plan = plan
        self.rid = response_id
        self.t0 = t0
        self.client_id = client_id
        self.route = route
        self.created = oa.now()
        self.model = ingress.served_model
        self.detok = IncrementalDetokenizer(ingress.tokenizer, req.skip_special_tokens)
        self.stops = StopStringMatcher(req.stop_strings(), req.include_stop_str_in_output)
        # each returned token's text and bytes in its log-probability entry, as the text has it
        self.token_bytes = ingress.token_bytes.shown(req.skip_special_tokens)
        self.logprobs = req.requested_logprobs         # None, or the alternatives per token the client wants
        self._lp_tokens: List[int] = []                # returned tokens (and entries) not yet formatted
        self._lp_entries: list = []
        self.cumulative_logprob = 0.0                  # of the returned tokens (best_of ranks rows by it)
        self.n_tokens = 0                              # tokens returned
        self.finished = False
        self.final: Optional[dict] = None
        self.first_text_s: Optional[float] = None
        self.first_tokens_at: Optional[float] = None
        self._queue: Optional[asyncio.Queue] = None
        self._pump_task: Optional[asyncio.Task] = None
        self._iter = None
        self._first: Optional[str] = None
        self._result: Optional[RowResult] = None

    # -- the batch slot ----------------------------------------------------------------------------

    def start_pump(self) -> None:
        self._queue = asyncio.Queue()
        self.ing.bound.row_waits(self.row)
        self._pump_task = self.ing.dispatch.spawn(self._pump())

    async def _pump(self) -> None:
        try:
            async for update in self.ing.dispatch.rows(self.row):
                if update:
                    self._queue.put_nowait(update)
        except Exception as exc:
            self._queue.put_nowait(exc)
        finally:
            if self.row.batch_started_at is None:   # Serve dropped it from its batch (its client left)
                self.ing.dispatch.dropped_unsent(self.row)
            self._queue.put_nowait(_END)

    def close(self) -> None:
        """The reader is done. Before the row's end that means its client went away: end this row
        only, wherever it is, and stop listening."""
        if self.finished:
            return
        self.ing.dispatch.cancel_row(self.row)
        if self._pump_task is not None and not self._pump_task.done():
            self._pump_task.cancel()

    async def _next_update(self) -> list:
        item = await self._queue.get()
        if item is _END:
            self._queue.put_nowait(_END)
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            log.error("mtplx ingress: the batch of request %s failed", self.rid, exc_info=item)
            raise internal_error(self.rid)
        return item

    # -- text --------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Wait for the first text (or the end): errors raise here, before any byte is sent."""
        self._iter = self._updates().__aiter__()
        try:
            self._first = await self._iter.__anext__()
        except StopAsyncIteration:
            self._first = None
        except BaseException:
            self.close()
            raise

    async def texts(self):
        """The row's text deltas from the first to the end (after `start`); raises OpenAIError for a
        failed row. When it returns, the row has ended and `result()` is ready."""
        if self._first:
            self._mark_text()
            yield self._first
        async for text in self._iter:
            self._mark_text()
            yield text

    async def text(self) -> str:
        """The whole text (non-streaming); the row is ended, or closed on failure."""
        try:
            await self.start()
            return "".join([piece async for piece in self.texts()])
        finally:
            self.close()

    async def _updates(self):
        while not self.finished:
            try:
                update = await self._next_update()
            except StopAsyncIteration:
                log.error("mtplx ingress: the batch of request %s ended without a result for it", self.rid)
                raise internal_error(self.rid) from None
            for event in update:
                if self.finished:
                    break
                text = self._on_event(event)
                if text:
                    yield text

    def _on_event(self, event: tuple) -> str:
        kind = event[0]
        if kind == "tokens":
            return self._on_tokens(event[1], event[2])
        self.finished = True
        if kind == "final":
            self.final = event[1]
            if self.stops.stopped:
                return ""
            return self.stops.push(self.detok.flush()) + self.stops.flush()
        raise self._row_error(event[1])

    def _on_tokens(self, tokens: List[int], entries: Optional[list]) -> str:
        if self.first_tokens_at is None:
            self.first_tokens_at = time.time()
        if self.stops.stopped:
            return ""
        if self.spec.logprobs is not None and (entries is None or len(entries) != len(tokens)):
            # a bug of ours, never a short answer
            log.error("mtplx ingress: request %s asked for logprobs; the replica sent %s entries for %d tokens",
                      self.rid, None if entries is None else len(entries), len(tokens))
            raise internal_error(self.rid)
        if not self.stops.stops:      # nothing can end the row mid-message: one detokenizer pass
            self._returned(tokens, entries)
            return self.detok.push(tokens)
        text = ""
        for k, token in enumerate(tokens):
            self._returned([token], entries[k:k + 1] if entries else None)
            text += self.stops.push(self.detok.push([token]), armed=self.n_tokens >= self.spec.min_tokens)
            if self.stops.stopped:    # the row's last token: its replica ended it here
                break
        return text

    def _returned(self, tokens: List[int], entries: Optional[list]) -> None:
        """Tokens the client is told about: counted, and their entries kept in order."""
        self.n_tokens += len(tokens)
        if entries:
            self.cumulative_logprob += sum(e[0] for e in entries)
            if self.logprobs is not None:
                self._lp_tokens.extend(tokens)
                self._lp_entries.extend(entries)

    def take_logprobs(self) -> Tuple[List[int], list]:
        """The returned tokens and their entries since the last call."""
        out = self._lp_tokens, self._lp_entries
        self._lp_tokens, self._lp_entries = [], []
        return out

    def _row_error(self, payload: dict) -> OpenAIError:
        """A row's error event (from the replica or the cohort driver) as the client's error. Only
        messages written for clients pass through; an internal failure says only that it was one."""
        kind, msg = payload.get("kind"), payload.get("message", "")
        if kind == "capacity":
            return invalid_request(msg, param=self.req.max_tokens_param, code="context_length_exceeded")
        if kind == "overloaded":
            return overloaded(msg, payload.get("retry_after_s") or self.ing.bound.retry_after_s,
                              status=self.ing.bound.overload_status)
        if kind in ("unavailable", "cancelled"):
            return unavailable(msg or "the model replica is unavailable; retry",
                               retry_after_s=payload.get("retry_after_s") or self.ing.bound.retry_after_s)
        log.error("mtplx ingress: request %s failed at the replica (the replica log has the details)", self.rid)
        return internal_error(self.rid)

    def _mark_text(self) -> None:
        if self.first_text_s is None:
            self.first_text_s = time.perf_counter()
            self.ing._metric("ttft", self.first_text_s - self.t0, {"route": self.route})

    # -- the result --------------------------------------------------------------------------------

    def _end(self) -> End:
        """How the row ended: the End the engine decided; no final at all: cancelled."""
        if self.final is None:
            return End(CANCELLED)
        end = End.from_dict(self.final["end"])
        if self.stops.stopped != (end.kind == STOP_STRING):     # a bug of ours: say so, keep the engine's word
            log.error("mtplx ingress: request %s: the text here %s a stop string, the replica ended the row as %s",
                      self.rid, "matched" if self.stops.stopped else "matched no", end.kind)
        return end

    def result(self) -> RowResult:
        """The ended row's result (computed once)."""
        if self._result is None:
            fin, end = self.final or {}, self._end()
            finish_reason = oa.FINISH_REASON_OF_END[end.kind]
            self._result = RowResult(
                prompt_tokens=int(fin.get("prompt_tokens", len(self.spec.prompt_ids))),
                completion_tokens=self.n_tokens, cached_tokens=int(fin.get("cached_tokens") or 0), end=end,
                finish_reason=finish_reason, stop_reason=oa.vllm_stop_reason(end),
                stats=self._stats(fin, end, finish_reason))
        return self._result

    def _stats(self, fin: dict, end: End, finish_reason: str) -> dict:
        stats = dict(fin.get("stats") or {})
        stats["completion_tokens"] = self.n_tokens         # the count usage reports
        stats["http_ttft_s"] = (self.first_text_s - self.t0) if self.first_text_s else None
        stats["http_elapsed_s"] = time.perf_counter() - self.t0
        stats.update(self._timeline(stats))
        stats["request_id"] = self.rid
        if self.client_id is not None:
            stats["client_request_id"] = self.client_id
        if end.kind == STOP_STRING:
            stats["stop_string_matched"] = True
        if self.spec.constraint is not None:     # what constrained the row (json_schema, tool_call, thinking, ...)
            stats["constraint"] = self.spec.constraint.kind
        stats["cancelled"] = end.kind == CANCELLED
        # the client sees OpenAI's reason everywhere; the engine's stays beside it
        stats["engine_finish_reason"] = end.engine_reason if self.final is not None else None
        stats["finish_reason"] = finish_reason
        return stats

    def _timeline(self, stats: dict) -> dict:
        """Where a request's time to first token went (wall clock deltas across processes)."""
        t_http, t_batch = self.row.http_received_at, self.row.batch_started_at
        t_rep, t_first = stats.pop("replica_received_at", None), stats.pop("replica_first_token_at", None)
        out = {}
        if t_http and t_batch:
            out["http_batch_wait_s"] = t_batch - t_http
        if t_batch and t_rep:
            out["http_dispatch_s"] = t_rep - t_batch
        if t_rep and t_first:
            out["replica_first_token_s"] = t_first - t_rep
        if t_first and self.first_tokens_at:
            out["http_token_return_s"] = self.first_tokens_at - t_first
        return out
