"""`OpenAIIngress`, the Serve deployment class: its routes and their handlers (see the package's
docstring for a request's path). Errors are OpenAI-shaped by class (Anthropic-shaped on
/v1/messages routes); an internal failure reaches the client only as "internal error, request id
X", its details go to the log."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import secrets
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import List, Optional

from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Router

import mtplx
from mtplx.api import anthropic
from mtplx.api import openai as oa
from mtplx.api import output_plan, responses
from mtplx.api.errors import (OpenAIError, context_length_exceeded, internal_error, invalid_request, model_not_found,
                              unavailable)
from mtplx.api.limits import DEFAULT_MAX_TOOL_CALLS, RequestLimits
from mtplx.api.openapi import document as openapi_document
from mtplx.api.output_plan import PLAIN, OutputPlan
from mtplx.api.rows import RowSpec
from mtplx.api.text import TokenBytes
from mtplx.structured import Constraint

from .._proc import freeze_startup_objects, renice_process, renice_serve_proxy
from ..live_page import PAGE_HTML, PAGE_PATH
from ..metrics import INGRESS_SERIES, make_metrics, record
from .admission import Admission, WaitingBound
from .auth import BrowserGuard, auth_summary, authorize, cache_partition, caller_digest, load_api_keys
from .constraints import ConstraintChecker
from ..router import DEFAULT_LOAD_FACTOR, SESSION_HEADER, session_key
from .dispatch import DEFAULT_FAILOVER_TIMEOUT_S, ReplicaDispatcher, call
from .formats import AnthropicFormat, ChatFormat, CompletionFormat, choices_response, choices_sse
from .model_files import load_model_metadata, load_tokenizer, resolve_model_dir
from .pending import PendingRow
from .response_store import DEFAULT_STORE_PATH, ActorStoreClient, LocalStoreClient
from .responses import ResponsesFormat
from .routes import IngressRoute, RequestContext, match, request_id, route_path
from .row_stream import RowStream

log = logging.getLogger("ray.serve")

_SSE_HEADERS = {"cache-control": "no-cache"}

# The ingress's settings when its config leaves them out; `deployments.app.AppArgs` takes its
# defaults from here, so each has one.
INGRESS_DEFAULTS = {
    "niceness": 0, "tokenizer_source": "auto", "default_max_tokens": 512, "default_generation_mode": "auto",
    "max_body_bytes": 8 * 1024 * 1024, "api_keys_env": "MTPLX_API_KEYS",
    "max_waiting_rows": 256, "retry_after_s": 1.0, "overload_status": 429, "max_batch_size": 8,
    "batch_wait_timeout_s": 0.01, "max_concurrent_batches": 64, "metrics": True, "allowed_hosts": (),
    "max_tool_calls": DEFAULT_MAX_TOOL_CALLS, "responses_store": "sqlite", "responses_store_path": DEFAULT_STORE_PATH,
    "responses_store_max_age_s": 30 * 24 * 3600.0, "routing": "affinity", "affinity_load_factor": DEFAULT_LOAD_FACTOR,
    "failover_timeout_s": DEFAULT_FAILOVER_TIMEOUT_S,
}
# Work on a request's prompt (parse, chat template, tokenize) below this size runs on the event
# loop: a thread hop would cost more. Above it, in `PROMPT_THREADS` threads, so that one large
# request does not stall every other request's stream. Sizes: body bytes, prompt characters, and
# TEMPLATE_COST_PER_MESSAGE per message (a message costs the chat template ~0.14 ms here).
INLINE_WORK = 16384
TEMPLATE_COST_PER_MESSAGE = 512
PROMPT_THREADS = 2
# Unauthenticated /health (keys set): liveness only, from a replica check made at most this often.
LIVENESS_TTL_S = 2.0
CONTENT_TYPES = ("application/json",)
OPENAPI_PATH = "/openapi.json"


class OpenAIIngress:
    """Serve deployment class (decorated in `deployments.app`)."""

    def __init__(self, replica, config: Optional[dict] = None):
        cfg = {**INGRESS_DEFAULTS, **(config or {})}
        self.niceness = cfg["niceness"]
        self._niceness_in_effect = renice_process(self.niceness)
        renice_serve_proxy(self.niceness)
        self._replica = replica
        model_dir = resolve_model_dir(cfg.get("model_path"))
        self.model_dir = model_dir
        self.meta: Optional[dict] = None
        self.tokenizer = None
        self.token_bytes: Optional[TokenBytes] = None      # each token's text and bytes, for logprobs
        self._model_lock = asyncio.Lock()
        source = cfg["tokenizer_source"]
        if source == "local" or (source == "auto" and (model_dir / "config.json").is_file()):
            self._load_model_files(model_dir)
        # else: this node does not have the checkpoint (a head node without MLX, say): the
        # tokenizer and metadata files are fetched from a replica on first use.
        self.served_model = cfg.get("served_model_name") or model_dir.name
        self.model_aliases = {self.served_model, model_dir.name, str(model_dir), str(cfg.get("model_path") or "")}
        self.model_aliases.discard("")
        self.default_max_tokens = int(cfg["default_max_tokens"])
        self.default_mode = cfg["default_generation_mode"]
        self.max_body_bytes = int(cfg["max_body_bytes"])
        self.max_tokens_limit = cfg.get("max_tokens_limit")
        self.max_tool_calls = int(cfg["max_tool_calls"])
        self._api_keys = load_api_keys(cfg["api_keys_env"], cfg.get("api_keys_file"))
        auth_on, auth_line = auth_summary(self._api_keys, cfg["api_keys_env"], cfg.get("api_keys_file"))
        (log.info if auth_on else log.warning)(auth_line)
        self.guard = BrowserGuard(cfg["allowed_hosts"], keys_configured=bool(self._api_keys))
        self._prompt_pool = ThreadPoolExecutor(PROMPT_THREADS, thread_name_prefix="mtplx-prompt")
        self._liveness: Optional[tuple] = None            # (checked at, ok) of the last replica check
        self._liveness_check: Optional[asyncio.Future] = None
        self.bound = WaitingBound(cfg["max_waiting_rows"], cfg["retry_after_s"],
                                  cfg["overload_status"])
        self.created = oa.now()
        self.max_batch_size = int(cfg["max_batch_size"])
        self.batch_wait_timeout_s = float(cfg["batch_wait_timeout_s"])
        self.max_concurrent_batches = int(cfg["max_concurrent_batches"])
        self._stats = {"requests": 0, "batches": 0, "cohorts": 0, "batch_size_histogram": {},
                       "cohort_size_histogram": {}, "row_cancels": 0, "errors": 0,
                       "rejected_overload": 0, "rejected_unauthorized": 0, "rows_dropped_before_dispatch": 0,
                       "replica_health_checks": 0, "replica_failures": 0, "rows_moved": 0, "row_moves_failed": 0}
        self._metrics = make_metrics(INGRESS_SERIES, log) if cfg["metrics"] else None
        self.dispatch = ReplicaDispatcher(
            replica, self.bound, self._stats, self._metric, retry_after_s=self.bound.retry_after_s,
            max_batch_size=self.max_batch_size, batch_wait_timeout_s=self.batch_wait_timeout_s,
            max_concurrent_batches=self.max_concurrent_batches, routing=cfg["routing"],
            load_factor=cfg["affinity_load_factor"], failover_timeout_s=cfg["failover_timeout_s"])
        self.constraints = ConstraintChecker()
        self.responses_store = self._open_store(cfg)
        self._router = self._routes()
        self._openapi_doc: Optional[dict] = None
        try:   # our panels in the Grafana that Ray provisions (Ray rewrites its files per session)
            from ..grafana import provision

            provision(log=log)
        except Exception as exc:
            log.warning("mtplx: Grafana provisioning skipped: %s: %s", type(exc).__name__, exc)
        freeze_startup_objects()

    def _routes(self) -> Router:
        R = IngressRoute
        rr = responses.ResponsesRequest
        return Router(routes=[
            R("/v1/chat/completions", self._chat, "POST", needs_model=True, new_id=request_id("chatcmpl"),
              summary="OpenAI chat completion", bodies=(oa.ChatCompletionRequest,), streams=True),
            R("/v1/completions", self._completions, "POST", needs_model=True, new_id=request_id("cmpl"),
              summary="OpenAI text completion", bodies=(oa.CompletionRequest,), streams=True),
            R("/v1/messages", self._messages, "POST", needs_model=True, new_id=anthropic.new_message_id,
              summary="Anthropic message", bodies=(anthropic.MessagesRequest,), streams=True),
            R("/v1/messages/count_tokens", self._count_tokens, "POST", needs_model=True,
              summary="Anthropic token count", bodies=(anthropic.CountTokensRequest,)),
            R("/v1/responses", self._responses, "POST", needs_model=True, new_id=responses.new_response_id,
              summary="OpenAI response (stored unless store is false)", bodies=(rr,), streams=True),
            R("/v1/responses/{response_id}", self._stored_response, "GET", tag="/v1/responses/{id}",
              summary="A stored response"),
            R("/v1/responses/{response_id}", self._delete_response, "DELETE", tag="/v1/responses/{id}",
              summary="Delete a stored response"),
            R("/tokenize", self._tokenize, "POST", needs_model=True, summary="vLLM's tokenize (prompt or chat)",
              bodies=(oa.TokenizeCompletionRequest, oa.TokenizeChatRequest)),
            R("/detokenize", self._detokenize, "POST", needs_model=True, summary="vLLM's detokenize",
              bodies=(oa.DetokenizeRequest,)),
            R("/version", self._version, "GET", summary="The server's version"),
            R("/v1/models", self._models, "GET", needs_model=True, summary="The served model"),
            R("/v1/models/{model:path}", self._model, "GET", needs_model=True, tag="/v1/models/{model}",
              summary="One served model"),
            R("/health", self._health, "GET", open=True, summary="Liveness (details with a key)"),
            R("/v1/mtplx/snapshot", self._snapshot_route, "GET", summary="Ingress and replica stats"),
            R(PAGE_PATH, self._page, "GET", open=True,     # holds no data; its snapshot calls carry the key
              summary="The live stats page (HTML)"),
            R("/v1/mtplx/cancel/{rid}", self._cancel, "POST", tag="/v1/mtplx/cancel",
              summary="Cancel a request in flight"),
            R(OPENAPI_PATH, self._openapi, "GET", open=True, summary="This document"),
        ])

    @staticmethod
    def _open_store(cfg: dict):
        """The responses store: the SQLite file at `responses_store_path`, opened here (`sqlite`:
        the replicas of one machine share it) or by one actor every replica calls (`actor`:
        several machines). None: responses are not stored."""
        path = cfg["responses_store_path"]
        if not path:
            log.info("mtplx ingress: no responses store (responses_store_path is null): store is ignored")
            return None
        client = ActorStoreClient if cfg["responses_store"] == "actor" else LocalStoreClient
        return client(path, cfg["responses_store_max_age_s"])

    def _load_model_files(self, model_dir: Path) -> None:
        self.meta = load_model_metadata(model_dir)
        self.tokenizer = load_tokenizer(model_dir)
        self.token_bytes = TokenBytes(self.tokenizer)
        # the most characters one token can stand for (its byte-level piece has a character per
        # byte): a prompt of N characters is at least N / this many tokens
        self.longest_token_chars = max((len(piece) for piece in self.tokenizer.get_vocab()), default=1) or 1

    async def _ensure_model(self) -> None:
        if self.tokenizer is not None:
            return
        async with self._model_lock:
            if self.tokenizer is not None:
                return
            try:
                files = await call(self._replica.model_files, timeout_s=120)
            except Exception:
                log.exception("mtplx ingress: fetching the tokenizer from a replica failed")
                raise unavailable("no model replica is ready yet; retry shortly",
                                  retry_after_s=self.bound.retry_after_s) from None
            local = Path(tempfile.mkdtemp(prefix="mtplx-tokenizer-"))
            for name, data in files.items():
                (local / Path(name).name).write_bytes(data)
            await asyncio.get_running_loop().run_in_executor(None, self._load_model_files, local)
            freeze_startup_objects()      # the tokenizer is long-lived too (a local one is frozen at start)
            log.info("mtplx ingress: tokenizer and metadata fetched from a replica into %s", local)

    def _metric(self, name: str, value: float = 1, tags: Optional[dict] = None) -> None:
        record(self._metrics, name, value, tags)

    # ------------------------------------------------------------------------------------------
    # HTTP dispatch

    async def __call__(self, request: Request) -> Response:
        method, path = request.method, route_path(request)
        found = match(self._router, method, path)
        # The server names every request; a client's own id is only metadata, echoed back.
        ctx = RequestContext(rid=(found.known.new_id if found.known else request_id("req"))(), path=path,
                             params=found.params)
        try:
            resp = await self._handle(request, found, ctx)
        except OpenAIError as exc:
            resp = ctx.error_response(exc)
            if exc.status == 401:
                self._stats["rejected_unauthorized"] += 1
            elif exc.status in (429, 503) and exc.code == "server_overloaded":
                self._stats["rejected_overload"] += 1
        except Exception:  # a bug of ours: 500 in the route's shape, details only in the log; keep serving
            log.exception("mtplx ingress: unhandled error on %s %s (request id %s)", method, path, ctx.rid)
            self._stats["errors"] += 1
            resp = ctx.error_response(internal_error(ctx.rid))
        for name, value in ctx.headers().items():
            resp.headers.setdefault(name, value)
        self._metric("requests", 1, {"route": found.tag, "status": str(resp.status_code)})
        return resp

    async def _handle(self, request: Request, found, ctx: RequestContext) -> Response:
        ctx.read_client_id(request)
        ctx.read_session(request, SESSION_HEADER)
        self.guard.check(request)
        if found.open:     # served without a key; a valid one still says who calls (/health's details)
            try:
                ctx.caller, ctx.authenticated = caller_digest(authorize(request, self._api_keys)), True
            except OpenAIError:
                pass
        else:
            ctx.caller, ctx.authenticated = caller_digest(authorize(request, self._api_keys)), True
        route = found.raise_unless_found(request.method, ctx.path)
        if route.needs_model:
            await self._ensure_model()
        return await route.endpoint(request, ctx)

    async def _body(self, request: Request) -> bytes:
        """The body, refused with 415 unless it is JSON (a declared Content-Type other than JSON: a
        browser page can post text/plain or a form cross-origin without asking first), and with 413
        as soon as it passes the limit: a declared Content-Length before reading, a chunked (or
        lying) body while it is read."""
        content_type = request.headers.get("content-type")
        if content_type is not None:
            media = content_type.split(";", 1)[0].strip().lower()
            if media not in CONTENT_TYPES and not media.endswith("+json"):
                raise OpenAIError(f"Content-Type {content_type[:100]!r} is not supported; send the body as "
                                  f"JSON with Content-Type: application/json", status=415,
                                  param="content-type", code="unsupported_media_type")
        length = request.headers.get("content-length")
        if length and length.isdigit() and int(length) > self.max_body_bytes:
            raise self._too_large()
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                raise self._too_large()
            chunks.append(chunk)
        return b"".join(chunks)

    def _too_large(self) -> OpenAIError:
        return OpenAIError(f"The request body exceeds the {self.max_body_bytes}-byte limit; send a smaller "
                           f"prompt", status=413, code="request_too_large")

    def _check_model(self, model: Optional[str]) -> None:
        if model and model not in self.model_aliases:
            raise model_not_found(model, [self.served_model])

    async def _admitted_body(self, request: Request) -> bytes:
        self.bound.check()      # before the body is read
        return await self._body(request)

    # ------------------------------------------------------------------------------------------
    # Generation endpoints

    async def _chat(self, request: Request, ctx: RequestContext) -> Response:
        t0 = time.perf_counter()
        body = await self._admitted_body(request)
        with self.bound.admit() as place:
            req = await self._parse(oa.ChatCompletionRequest, body)
            self._check_model(req.model)
            plan = output_plan.for_chat(req)
            self._check_prompt_chars(_messages_chars(req.messages), "messages")
            prompt_ids = await self._off_loop(_messages_size(req.messages), partial(
                oa.encode_chat, self.tokenizer, req.messages, template_kwargs=plan.template_kwargs))
            return await self._generate(ChatFormat, req, prompt_ids, t0, ctx, place, plan=plan)

    async def _completions(self, request: Request, ctx: RequestContext) -> Response:
        t0 = time.perf_counter()
        body = await self._admitted_body(request)
        with self.bound.admit() as place:
            req = await self._parse(oa.CompletionRequest, body)
            self._check_model(req.model)
            plan = output_plan.for_completion(req)
            prompt = req.single_prompt()
            if isinstance(prompt, str):
                self._check_prompt_chars(len(prompt), "prompt")
            prompt_ids = await self._off_loop(len(prompt), oa.encode_prompt, self.tokenizer, prompt,
                                              req.add_special_tokens)
            if not prompt_ids:
                raise invalid_request("prompt encodes to zero tokens", param="prompt")
            return await self._generate(CompletionFormat, req, prompt_ids, t0, ctx, place, plan=plan)

    async def _messages(self, request: Request, ctx: RequestContext) -> Response:
        """Anthropic Messages, served as the chat completion it translates to (same cohorts, lanes
        and streaming; Anthropic's framing)."""
        t0 = time.perf_counter()
        body = await self._admitted_body(request)
        with self.bound.admit() as place:
            msg = await self._parse(anthropic.MessagesRequest, body)
            self._check_model(msg.model)
            req = await self._off_loop(_messages_size(msg.messages), msg.to_chat_request)
            self._check_prompt_chars(_messages_chars(req.messages), "messages")
            prompt_ids = await self._off_loop(_messages_size(req.messages), msg.encode, self.tokenizer)
            answer = partial(AnthropicFormat, cache_split=msg.sends_cache_control)
            return await self._generate(answer, req, prompt_ids, t0, ctx, place, route=AnthropicFormat.name,
                                        plan=msg.output_plan())

    async def _responses(self, request: Request, ctx: RequestContext) -> Response:
        """OpenAI's Responses API, served as the chat completion of its conversation (a stored
        response it continues, then its input), answered and kept as a response."""
        t0 = time.perf_counter()
        body = await self._admitted_body(request)
        with self.bound.admit() as place:
            req = await self._parse(responses.ResponsesRequest, body)
            self._check_model(req.model)
            previous = await self._previous_response(req.previous_response_id, ctx)
            turn = responses.prepare_turn(req, previous and previous.context, previous and previous.response["output"])
            messages = turn.messages()
            self._check_prompt_chars(_messages_chars(messages), "input")
            prompt_ids = await self._off_loop(_messages_size(messages), partial(
                oa.encode_chat, self.tokenizer, messages, template_kwargs=turn.plan.template_kwargs))
            answer = partial(ResponsesFormat, turn=turn, store=self.responses_store, owner=ctx.caller or "")
            return await self._generate(answer, req.chat_request(messages), prompt_ids, t0, ctx, place,
                                        route=ResponsesFormat.name, plan=turn.plan)

    async def _previous_response(self, response_id: Optional[str], ctx: RequestContext):
        if response_id is None:
            return None
        if self.responses_store is None:
            raise invalid_request("previous_response_id needs the responses store, which this server runs "
                                  "without (responses_store_path is null)", param="previous_response_id",
                                  code="unsupported_value")
        found = await self.responses_store.get(ctx.caller or "", response_id)
        if found is None:
            raise OpenAIError(f"Previous response with id {response_id!r} not found.", status=404,
                              param="previous_response_id", code="previous_response_not_found")
        return found

    def _stored(self, ctx: RequestContext) -> str:
        response_id = ctx.params["response_id"]
        if self.responses_store is None:
            raise OpenAIError("This server stores no responses (responses_store_path is null)", status=404,
                              param="response_id", code="not_found")
        return response_id

    async def _stored_response(self, request: Request, ctx: RequestContext) -> Response:
        response_id = self._stored(ctx)
        found = await self.responses_store.get(ctx.caller or "", response_id)
        if found is None:
            raise _response_not_found(response_id)
        return JSONResponse(found.response)

    async def _delete_response(self, request: Request, ctx: RequestContext) -> Response:
        response_id = self._stored(ctx)
        if not await self.responses_store.delete(ctx.caller or "", response_id):
            raise _response_not_found(response_id)
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    async def _parse(self, cls, body: bytes):
        """`body` as a `cls` request, against this server's `request_limits` (off the loop when
        large: a body of many small messages takes pydantic ~30 us a message)."""
        return await self._off_loop(len(body), oa.parse_request, cls, body, self.request_limits)

    def _check_prompt_chars(self, chars: int, param: str) -> None:
        """The early size check, before the chat template and the tokenizer run: a prompt of this
        many characters is at least chars / longest_token_chars tokens; beyond the context window
        it is refused without that work."""
        at_least = math.ceil(chars / self.longest_token_chars)
        if at_least >= self.meta["max_context"]:
            raise OpenAIError(
                f"This model's maximum context length is {self.meta['max_context']} tokens; the prompt's "
                f"{chars} characters are at least {at_least} tokens. Please reduce the prompt.",
                status=400, param=param, code="context_length_exceeded")

    async def _off_loop(self, size: int, fn, *args):
        """Small work inline; large work (`INLINE_WORK`) in the prompt threads, so that one large
        request does not stall every other request's stream on this event loop."""
        if size < INLINE_WORK:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._prompt_pool, partial(fn, *args))

    async def _generate(self, answer, req, prompt_ids: List[int], t0: float, ctx: RequestContext,
                        place: Admission, route: Optional[str] = None, plan: OutputPlan = PLAIN) -> Response:
        """One request's rows, from its spec to its answer in format `answer` (a format class).
        `plan`: the answer's constraint (checked here: a grammar that does not compile is a 400)
        and how its text is read (thinking, tool calls)."""
        await self.constraints.check(plan, self.tokenizer, self.meta["vocab_size"])
        spec = self._row_spec(req, prompt_ids, ctx, plan.constraint)
        received_at = time.time() - (time.perf_counter() - t0)
        self._stats["requests"] += 1
        rows = self._choice_rows(req, spec) if req.requested_rows > 1 else [spec]
        session = session_key(ctx.session, getattr(req, "user", None), ctx.caller)
        formats = [answer(RowStream(self, PendingRow(s, received_at, session=session), req, response_id=ctx.rid,
                                    t0=t0, client_id=ctx.client_id, route=route or answer.name, plan=plan))
                   for s in rows]
        place.hand_over(f.run for f in formats)
        if len(formats) > 1:
            return await self._choices(formats, req)
        (fmt,) = formats
        if req.stream:
            await fmt.run.start()   # errors before the first token still get a status code
            return StreamingResponse(fmt.sse(), media_type="text/event-stream", headers=_SSE_HEADERS)
        return JSONResponse(await fmt.response())

    def _row_spec(self, req, prompt_ids: List[int], ctx: RequestContext,
                  constraint: Optional[Constraint] = None) -> RowSpec:
        """The row this request decodes as (its n > 1 choices are copies of it): the caller owns
        it (only its key may cancel it), and its prompt is cached in the caller's partition."""
        seed = req.seed if req.seed is not None else secrets.randbits(63)
        max_tokens, min_tokens = self._max_tokens(req, len(prompt_ids)), getattr(req, "min_tokens", 0)
        if min_tokens > max_tokens:
            raise invalid_request(f"min_tokens={min_tokens} is above this request's max_tokens={max_tokens}; "
                                  f"ask for at most {max_tokens}", param="min_tokens")
        return RowSpec(
            request_id=ctx.rid, model=self.served_model, prompt_ids=tuple(prompt_ids),
            max_tokens=max_tokens, min_tokens=min_tokens,
            sampler=oa.sampler_from_request(req, self.meta["sampler_defaults"], self.meta["vocab_size"]),
            seed=int(seed) % (2 ** 64),
            generation_mode=req.generation_mode or self.default_mode,
            omit_speculative_bonus=bool(req.omit_speculative_bonus),
            # the row's stop set at the replica: the model's EOS (unless ignore_eos) and these
            stop_token_ids=tuple(sorted(set(req.stop_token_ids or ()))), ignore_eos=bool(req.ignore_eos),
            stop_strings=tuple(req.stop_strings()), skip_special_tokens=bool(req.skip_special_tokens),
            logprobs=req.requested_logprobs, constraint=constraint, owner=ctx.caller,
            cache_salt=cache_partition(ctx.caller, getattr(req, "cache_salt", None)))

    def _max_tokens(self, req, n_prompt: int) -> int:
        """The row's budget: the request's (within this server's limit and the context window), or
        the default that fits."""
        max_context, limit = self.meta["max_context"], self.max_tokens_limit
        if n_prompt >= max_context:
            raise context_length_exceeded(n_prompt, 1, max_context, param=req.prompt_param)
        max_tokens = req.requested_max_tokens
        if max_tokens is None:
            return int(min(self.default_max_tokens, max_context - n_prompt, limit or max_context))
        if limit is not None and max_tokens > limit:
            raise invalid_request(f"{req.max_tokens_param}={max_tokens} is above this server's limit of "
                                  f"{limit} tokens per completion; ask for at most {limit}",
                                  param=req.max_tokens_param, code="invalid_value")
        if n_prompt + max_tokens > max_context:
            raise context_length_exceeded(n_prompt, max_tokens, max_context, param=req.max_tokens_param)
        return int(max_tokens)

    @property
    def max_choices(self) -> int:
        """The most choices (n) one request may ask for: its rows must fit one batch window (so
        that they reach one replica together and share one prefill) and the rows waiting here."""
        return min(self.max_batch_size, self.bound.max_waiting_rows)

    @property
    def request_limits(self) -> RequestLimits:
        """What a request is parsed against: the model's vocabulary and context window (from its
        files), the rows one request may ask for and the tool calls one answer may make."""
        return RequestLimits(vocab_size=self.meta["vocab_size"], max_context=self.meta["max_context"],
                             max_rows=self.max_choices, max_tool_calls=self.max_tool_calls)

    def _choice_rows(self, req, spec: RowSpec) -> List[RowSpec]:
        """n > 1 (or best_of > 1): rows of one prefill group, row i sampling with seed + i; the
        replica's lane prefills the prompt once for all of them. Each row has its own id (a stop
        string ends its row only); a cancel of the request's id reaches the group. best_of > n:
        every row reports log-probabilities, whether or not the client asked, to rank them.
        (`request_limits` bounded n and best_of where the request was parsed.)"""
        n, m = req.requested_n, req.requested_rows
        logprobs = spec.logprobs if spec.logprobs is not None or m == n else 0
        return [dataclasses.replace(spec, request_id=f"{spec.request_id}-{i}", seed=(spec.seed + i) % (2 ** 64),
                                    prefill_group=spec.request_id, logprobs=logprobs) for i in range(m)]

    async def _choices(self, formats, req) -> Response:
        try:
            if req.stream:
                await asyncio.gather(*(f.run.start() for f in formats))
                return StreamingResponse(choices_sse(formats), media_type="text/event-stream", headers=_SSE_HEADERS)
            return JSONResponse(await choices_response(formats, req.requested_n))
        except BaseException:
            for f in formats:
                f.run.close()
            raise

    # ------------------------------------------------------------------------------------------
    # Token endpoints

    async def _count_tokens(self, request: Request, ctx: RequestContext) -> Response:
        req = await self._parse(anthropic.CountTokensRequest, await self._body(request))
        self._check_model(req.model)
        ids = await self._off_loop(_messages_size(req.messages), req.encode, self.tokenizer)
        return JSONResponse({"input_tokens": len(ids)})

    async def _tokenize(self, request: Request, ctx: RequestContext) -> Response:
        """vLLM's /tokenize: a prompt, or chat messages through the chat template."""
        body = await self._body(request)
        req = await self._off_loop(len(body), oa.parse_tokenize_request, body, self.request_limits)
        self._check_model(req.model)
        if isinstance(req, oa.TokenizeChatRequest):
            ids = await self._off_loop(_messages_size(req.messages), oa.encode_chat, self.tokenizer, req.messages,
                                       req.add_generation_prompt, req.continue_final_message, req.add_special_tokens,
                                       output_plan.for_tokenize(req).template_kwargs)
        else:
            ids = await self._off_loop(len(req.prompt), lambda: list(
                self.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)))
        strs = self.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return JSONResponse(oa.tokenize_response(ids, self.meta["max_context"], strs))

    async def _detokenize(self, request: Request, ctx: RequestContext) -> Response:
        """vLLM's /detokenize: token ids to text (special tokens included)."""
        req = await self._parse(oa.DetokenizeRequest, await self._body(request))
        self._check_model(req.model)
        text = await self._off_loop(len(req.tokens), lambda: self.tokenizer.decode(req.tokens))
        return JSONResponse({"prompt": text})

    # ------------------------------------------------------------------------------------------
    # Models, version, operations

    async def _models(self, request: Request, ctx: RequestContext) -> Response:
        return JSONResponse(oa.models_list([self.served_model], self.created, self.meta["max_context"]))

    async def _model(self, request: Request, ctx: RequestContext) -> Response:
        name = ctx.params["model"]
        if name not in self.model_aliases:
            raise model_not_found(name, [self.served_model])
        return JSONResponse(oa.models_list([self.served_model], self.created, self.meta["max_context"])["data"][0])

    async def _openapi(self, request: Request, ctx: RequestContext) -> Response:
        """Every route and every field this server accepts (mtplx.api.openapi), from its routes."""
        if self._openapi_doc is None:
            self._openapi_doc = openapi_document([r.operation() for r in self._router.routes], mtplx.__version__,
                                                 description="OpenAI- and Anthropic-compatible MTP serving")
        return JSONResponse(self._openapi_doc)

    async def _version(self, request: Request, ctx: RequestContext) -> Response:
        return JSONResponse({"version": mtplx.__version__})

    async def _page(self, request: Request, ctx: RequestContext) -> Response:
        return HTMLResponse(PAGE_HTML, headers={"Cache-Control": "no-store"})

    async def _health(self, request: Request, ctx: RequestContext) -> Response:
        """Liveness for anyone (load balancers): {"status"}, 200 or 503. With keys set, the details
        (versions, BLAS, replica ids, CPUs, processes) need one; without a key the status comes from
        a replica check made at most every LIVENESS_TTL_S, whoever asks how often."""
        if not ctx.authenticated:
            ok = await self._liveness_ok()
            return JSONResponse({"status": "ok" if ok else "unavailable"}, status_code=200 if ok else 503)
        try:
            replicas = await self._replica_health()
        except Exception as exc:
            log.warning("mtplx ingress: health: no model replica answered: %s: %s", type(exc).__name__, exc)
            err = unavailable("no model replica answered", retry_after_s=self.bound.retry_after_s)
            return JSONResponse({**err.body(), "status": "unavailable"}, status_code=503, headers=err.headers)
        ok = self._liveness[1]
        ingress = {"mlx_imported": "mlx.core" in sys.modules or "mlx" in sys.modules,
                   "niceness": self._niceness_in_effect,
                   # a restarted proxy starts at Ray's 15 again
                   "proxy_niceness": renice_serve_proxy(self.niceness)}
        body = {"status": "ok" if ok else "unavailable", "model": self.served_model,
                "max_context": (self.meta or {}).get("max_context"), "ingress": ingress, "replicas": replicas}
        return JSONResponse(body, status_code=200 if ok else 503)

    async def _replica_health(self) -> dict:
        """Every replica's health (one RPC each), remembered as the liveness status."""
        self._stats["replica_health_checks"] += 1
        try:
            replicas = await self.dispatch.fan_out("health", timeout_s=10)
        except Exception:
            self._liveness = (time.monotonic(), False)
            raise
        self._liveness = (time.monotonic(), any(isinstance(r, dict) and r.get("ok") for r in replicas.values()))
        return replicas

    async def _liveness_ok(self) -> bool:
        """Whether a model replica serves: the last check's answer while it is younger than
        LIVENESS_TTL_S, else one new check that every caller meanwhile waits on. A new check also
        sets a restarted Serve proxy's niceness again (as the detailed /health does)."""
        if self._liveness is not None and time.monotonic() - self._liveness[0] < LIVENESS_TTL_S:
            return self._liveness[1]
        if self._liveness_check is None or self._liveness_check.done():
            async def check() -> bool:
                renice_serve_proxy(self.niceness)
                try:
                    await self._replica_health()
                except Exception as exc:
                    log.warning("mtplx ingress: health: no model replica answered: %s: %s", type(exc).__name__, exc)
                return self._liveness[1]

            self._liveness_check = asyncio.ensure_future(check())
        return await asyncio.shield(self._liveness_check)

    async def _snapshot_route(self, request: Request, ctx: RequestContext) -> Response:
        try:
            replicas = await self.dispatch.fan_out("snapshot", timeout_s=10)
        except Exception as exc:
            log.warning("mtplx ingress: snapshot: no model replica answered: %s: %s", type(exc).__name__, exc)
            raise unavailable("no model replica answered", retry_after_s=self.bound.retry_after_s) from None
        # time: the server's clock when it answered, so rates between two snapshots need no client clock
        return JSONResponse({"model": self.served_model, "time": time.time(), "ingress": self.ingress_snapshot(),
                             "replicas": replicas})

    def ingress_snapshot(self) -> dict:
        s = dict(self._stats)
        s.update({"max_batch_size": self.max_batch_size, "batch_wait_timeout_s": self.batch_wait_timeout_s,
                  "max_concurrent_batches": self.max_concurrent_batches,
                  "rows_in_flight": len(self.dispatch.row_replica), "rows_waiting": self.bound.waiting_rows,
                  "requests_admitting": self.bound.admitting, "max_waiting_rows": self.bound.max_waiting_rows,
                  "batch_size_histogram": dict(self._stats["batch_size_histogram"]),
                  "cohort_size_histogram": dict(self._stats["cohort_size_histogram"]),
                  "routing": self.dispatch.policy.snapshot()})
        return s

    async def _cancel(self, request: Request, ctx: RequestContext) -> Response:
        rid = ctx.params["rid"]
        n = await self.dispatch.cancel_request(rid, owner=ctx.caller)     # another key's request: not found
        if not n:
            raise OpenAIError(f"No request {rid!r} is in flight", status=404, type="not_found_error",
                              param="request_id", code="request_not_found")
        return JSONResponse({"request_id": rid, "cancelled": True, "rows": n})


def _response_not_found(response_id: str) -> OpenAIError:
    """Another key's response is not found either (the store is partitioned by caller)."""
    return OpenAIError(f"Response with id {response_id!r} not found.", status=404, type="invalid_request_error",
                       param="response_id", code="response_not_found")


def _messages_chars(messages) -> int:
    """The characters of the messages' text (OpenAI's or Anthropic's content: a string, or parts
    and blocks with text)."""
    total = 0
    for m in messages:
        if isinstance(m.content, str):
            total += len(m.content)
        elif m.content:
            total += sum(len(getattr(part, "text", None) or "") for part in m.content)
    return total


def _messages_size(messages) -> int:
    """A chat prompt's size for `_off_loop`: its characters, and the chat template's work per message."""
    return _messages_chars(messages) + TEMPLATE_COST_PER_MESSAGE * len(messages)
