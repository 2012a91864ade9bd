"""The OpenAI-compatible HTTP ingress (no MLX in this process).

Per request: parse and validate (pydantic, OpenAI-shaped 400s), apply the chat template and
tokenize, then enter the `@serve.batch` window as one row. Each window goes to one MTP replica as
a single streaming call (each row joins its key's running lane there), and that stream's
per-row token updates are demultiplexed back into the rows' own batch slots. Each request then
detokenizes incrementally, matches stop strings on the text, and answers as JSON or SSE.

Row-level cancellation: a client that disconnects, or a stop string that matches, cancels only that
row, with a call pinned (by `deployments.router`) to the replica that runs its cohort; a row whose
client left before its window closed is never sent. The cohort stream itself is never cancelled by
one row.

Before any of that: an optional API key (every route but /health), a server-made request id (a
client's own id is only echoed back), and a bound on the rows waiting here for a window (overload
is answered at once, 429/503 with Retry-After). Errors are OpenAI-shaped by class; an internal
failure reaches the client only as "internal error, request id X", its details go to the log.
"""

from __future__ import annotations

import asyncio
import contextvars
import hmac
import json
import os
import logging
import re
import secrets
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from ray import serve
from ray.serve.exceptions import BackPressureError
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse

import mtplx
from mtplx.api import anthropic
from mtplx.api import openai as oa
from mtplx.api.rows import mtp_batch_compatibility_key

from ._proc import freeze_startup_objects, renice_process, renice_serve_proxy
from .live_page import PAGE_HTML, PAGE_PATH
from .metrics import INGRESS_SERIES, make_metrics, record
from .router import PIN_KWARG, known_replicas

log = logging.getLogger("ray.serve")

SHIPPED_MODEL_DIR = Path(__file__).resolve().parents[1] / "mtplx" / "assets" / "mtplx-tiny-py"
_CANCEL_ROUTE = re.compile(r"^/v1/mtplx/cancel/(?P<rid>[^/]+)$")
CLIENT_REQUEST_ID_HEADER = "x-mtplx-request-id"          # a client's own id: metadata, echoed back
CLIENT_REQUEST_ID_ECHO = "x-mtplx-client-request-id"
_CLIENT_ID_OK = re.compile(r"^[\x21-\x7e]{1,128}$")     # printable ASCII, no spaces
OPEN_PATHS = ("/health", PAGE_PATH)                      # the only routes an API key does not guard (the live
                                                         # page holds no data; its snapshot calls carry the key)
ANTHROPIC_PREFIX = "/v1/messages"                        # routes that answer errors in Anthropic's shape


def resolve_model_dir(model_path: Optional[str]) -> Path:
    return Path(model_path).expanduser() if model_path else SHIPPED_MODEL_DIR


def load_model_metadata(model_dir: Path) -> dict:
    """What the ingress needs from the checkpoint without loading weights: context window,
    vocabulary size and the sampling defaults of generation_config.json."""
    cfg_path = model_dir / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{model_dir} has no config.json; pass an HF-layout model directory")
    cfg = json.loads(cfg_path.read_text())
    text_cfg = cfg.get("text_config") or {}
    max_context = cfg.get("max_position_embeddings") or text_cfg.get("max_position_embeddings") or 2048
    vocab = cfg.get("vocab_size") or text_cfg.get("vocab_size")
    defaults = {}
    gen_path = model_dir / "generation_config.json"
    if gen_path.is_file():
        gen = json.loads(gen_path.read_text())
        for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty"):
            if isinstance(gen.get(name), (int, float)) and not isinstance(gen.get(name), bool):
                defaults[name] = gen[name]
        if gen.get("do_sample") is False:
            defaults["temperature"] = 0.0
    return {"max_context": int(max_context), "vocab_size": int(vocab) if vocab else None,
            "sampler_defaults": defaults}


def load_api_keys(env_var: Optional[str], key_file: Optional[str]) -> List[bytes]:
    """API keys from an environment variable (comma or whitespace separated) and/or a file (one
    key per line, # comments). No keys: no authentication (the loopback bind is the guard)."""
    raw: List[str] = []
    if env_var and os.environ.get(env_var):
        raw += re.split(r"[,\s]+", os.environ[env_var])
    if key_file:
        path = Path(key_file).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"api_keys_file {str(path)!r} does not exist; create it (one key per line) "
                                    f"or remove api_keys_file from the config")
        raw += [line.split("#", 1)[0] for line in path.read_text().splitlines()]
    return [k.strip().encode() for k in raw if k.strip()]


def key_matches(presented: bytes, keys: List[bytes]) -> bool:
    """Constant-time comparison against every key (no early exit that would time which matched)."""
    found = False
    for key in keys:
        found |= hmac.compare_digest(presented, key)
    return found


def load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


def _detached(coro):
    """Run a coroutine as a task in an empty context. Handle calls made inside a request inherit
    that request's Serve context, internal request id included; several concurrent calls with the
    same id confuse replica routing (and our pinning router), so each call gets a fresh one."""
    return asyncio.get_running_loop().create_task(coro, context=contextvars.Context())


async def _call(handle, *args, timeout_s: float = 30.0, **kwargs):
    async def go():
        return await handle.remote(*args, **kwargs)

    return await asyncio.wait_for(_detached(go()), timeout=timeout_s)


class OpenAIIngress:
    """Serve deployment class (decorated in `deployments.app`)."""

    def __init__(self, replica, config: Optional[dict] = None):
        cfg = dict(config or {})
        self.niceness = cfg.get("niceness", 0)
        self._niceness_in_effect = renice_process(self.niceness)
        renice_serve_proxy(self.niceness)
        self._replica = replica
        self._replica_stream = replica.options(stream=True)
        self._replica_name = getattr(replica, "deployment_name", "MTPReplica")
        model_dir = resolve_model_dir(cfg.get("model_path"))
        self.model_dir = model_dir
        self.meta: Optional[dict] = None
        self.tokenizer = None
        self.token_bytes: Optional[oa.TokenBytes] = None      # each token's text and bytes, for logprobs
        self._model_lock = asyncio.Lock()
        source = cfg.get("tokenizer_source", "auto")
        if source == "local" or (source == "auto" and (model_dir / "config.json").is_file()):
            self._load_model_files(model_dir)
        # else: this node does not have the checkpoint (a head node without MLX, say): the
        # tokenizer and metadata files are fetched from a replica on first use.
        self.served_model = cfg.get("served_model_name") or model_dir.name
        self.model_aliases = {self.served_model, model_dir.name, str(model_dir), str(cfg.get("model_path") or "")}
        self.model_aliases.discard("")
        self.default_max_tokens = int(cfg.get("default_max_tokens", 512))
        self.default_mode = cfg.get("default_generation_mode", "auto")
        self.stop_wait_s = float(cfg.get("stop_wait_s", 2.0))
        self.max_body_bytes = int(cfg.get("max_body_bytes", 8 * 1024 * 1024))
        self.max_tokens_limit = cfg.get("max_tokens_limit")
        self._api_keys = load_api_keys(cfg.get("api_keys_env", "MTPLX_API_KEYS"), cfg.get("api_keys_file"))
        # Backpressure: rows admitted here but not yet sent to a replica are bounded; beyond that
        # a request is answered at once (429 or 503, Retry-After), never queued without bound.
        self.max_waiting_rows = int(cfg.get("max_waiting_rows", 256))
        self.retry_after_s = float(cfg.get("retry_after_s", 1.0))
        self.overload_status = int(cfg.get("overload_status", 429))
        self._waiting_rows = 0
        self._admitting = 0       # requests past the door whose rows are not waiting yet
        self.created = oa.now()
        self.max_batch_size = int(cfg.get("max_batch_size", 8))
        self.batch_wait_timeout_s = float(cfg.get("batch_wait_timeout_s", 0.02))
        self.max_concurrent_batches = int(cfg.get("max_concurrent_batches", 4))
        self._rows = serve.batch(max_batch_size=self.max_batch_size,
                                 batch_wait_timeout_s=self.batch_wait_timeout_s,
                                 max_concurrent_batches=self.max_concurrent_batches)(self._cohort_batch)
        # row request id -> replica id running its cohort (only while the cohort call runs)
        self._row_replica: Dict[str, str] = {}
        self._bg: set = set()
        self._stats = {"requests": 0, "batches": 0, "cohorts": 0, "batch_size_histogram": {},
                       "cohort_size_histogram": {}, "row_cancels": 0, "errors": 0, "rejected_overload": 0,
                       "rejected_unauthorized": 0, "rows_dropped_before_dispatch": 0}
        self._metrics = None
        if cfg.get("metrics", True):
            self._init_metrics()
        try:   # our panels in the Grafana that Ray provisions (Ray rewrites its files per session)
            from .grafana import provision

            provision(log=log)
        except Exception as exc:
            log.warning("mtplx: Grafana provisioning skipped: %s: %s", type(exc).__name__, exc)
        freeze_startup_objects()

    def _load_model_files(self, model_dir: Path) -> None:
        self.meta = load_model_metadata(model_dir)
        self.tokenizer = load_tokenizer(model_dir)
        self.token_bytes = oa.TokenBytes(self.tokenizer)

    async def _ensure_model(self) -> None:
        if self.tokenizer is not None:
            return
        async with self._model_lock:
            if self.tokenizer is not None:
                return
            import tempfile

            try:
                files = await _call(self._replica.model_files, timeout_s=120)
            except Exception:
                log.exception("mtplx ingress: fetching the tokenizer from a replica failed")
                raise oa.unavailable("no model replica is ready yet; retry shortly",
                                     retry_after_s=self.retry_after_s) from None
            local = Path(tempfile.mkdtemp(prefix="mtplx-tokenizer-"))
            for name, data in files.items():
                (local / Path(name).name).write_bytes(data)
            await asyncio.get_running_loop().run_in_executor(None, self._load_model_files, local)
            freeze_startup_objects()      # the tokenizer is long-lived too (a local one is frozen at start)
            log.info("mtplx ingress: tokenizer and metadata fetched from a replica into %s", local)

    def _init_metrics(self) -> None:
        self._metrics = make_metrics(INGRESS_SERIES, log)

    def _metric(self, name: str, value: float = 1, tags: Optional[dict] = None) -> None:
        record(self._metrics, name, value, tags)

    # ------------------------------------------------------------------------------------------
    # HTTP dispatch

    async def __call__(self, request: Request) -> Response:
        method, path = request.method, request.url.path
        root = request.scope.get("root_path") or ""
        if root and path.startswith(root):   # an app served under a route_prefix
            path = path[len(root):]
        path = path.rstrip("/") or "/"
        route = path
        # The server names every request; a client's own id is only metadata, echoed back.
        rid = oa.new_id({"/v1/chat/completions": "chatcmpl", "/v1/completions": "cmpl",
                         "/v1/messages": "msg"}.get(path, "req"))
        headers = {"x-mtplx-request-id": rid}
        client_id = request.headers.get(CLIENT_REQUEST_ID_HEADER)
        try:
            if client_id is not None:
                if not _CLIENT_ID_OK.match(client_id):
                    client_id = None
                    raise oa.invalid_request(f"The {CLIENT_REQUEST_ID_HEADER} header must be 1-128 printable "
                                             f"ASCII characters without spaces", param=CLIENT_REQUEST_ID_HEADER)
                headers[CLIENT_REQUEST_ID_ECHO] = client_id
            if path not in OPEN_PATHS:
                self._authorize(request)
            if (path.startswith("/v1/") or path in ("/tokenize", "/detokenize")) and self.tokenizer is None:
                await self._ensure_model()
            if path == "/v1/chat/completions":
                self._require(method, "POST", path)
                resp = await self._chat(request, rid, client_id)
            elif path == "/v1/messages":
                self._require(method, "POST", path)
                resp = await self._messages(request, rid, client_id)
            elif path == "/v1/messages/count_tokens":
                self._require(method, "POST", path)
                resp = await self._count_tokens(request)
            elif path == "/tokenize":
                self._require(method, "POST", path)
                resp = await self._tokenize(request)
            elif path == "/detokenize":
                self._require(method, "POST", path)
                resp = await self._detokenize(request)
            elif path == "/version":
                self._require(method, "GET", path)
                resp = JSONResponse({"version": mtplx.__version__})
            elif path == "/v1/completions":
                self._require(method, "POST", path)
                resp = await self._completions(request, rid, client_id)
            elif path == "/v1/models":
                self._require(method, "GET", path)
                resp = JSONResponse(oa.models_list([self.served_model], self.created, self.meta["max_context"]))
            elif path.startswith("/v1/models/"):
                self._require(method, "GET", path)
                name = path[len("/v1/models/"):]
                if name not in self.model_aliases:
                    raise oa.model_not_found(name, [self.served_model])
                resp = JSONResponse(oa.models_list([self.served_model], self.created,
                                                   self.meta["max_context"])["data"][0])
            elif path == "/health":
                self._require(method, "GET", path)
                resp = await self._health()
            elif path == "/v1/mtplx/snapshot":
                self._require(method, "GET", path)
                resp = JSONResponse(await self._snapshot())
            elif path == PAGE_PATH:
                self._require(method, "GET", path)
                resp = HTMLResponse(PAGE_HTML, headers={"Cache-Control": "no-store"})
            elif _CANCEL_ROUTE.match(path):
                self._require(method, "POST", path)
                route = "/v1/mtplx/cancel"
                resp = await self._cancel_endpoint(_CANCEL_ROUTE.match(path).group("rid"))
            else:
                route = "other"
                raise oa.route_not_found(method, path)
        except oa.OpenAIError as exc:
            body = anthropic.error_body(exc) if path.startswith(ANTHROPIC_PREFIX) else exc.body()
            resp = JSONResponse(body, status_code=exc.status, headers=exc.headers)
            if exc.status == 401:
                self._stats["rejected_unauthorized"] += 1
            elif exc.status in (429, 503) and exc.code == "server_overloaded":
                self._stats["rejected_overload"] += 1
        except Exception:  # a bug of ours: 500 in OpenAI's shape, details only in the log; keep serving
            log.exception("mtplx ingress: unhandled error on %s %s (request id %s)", method, path, rid)
            self._stats["errors"] += 1
            err = oa.internal_error(rid)
            body = anthropic.error_body(err) if path.startswith(ANTHROPIC_PREFIX) else err.body()
            resp = JSONResponse(body, status_code=err.status)
        for name, value in headers.items():
            resp.headers.setdefault(name, value)
        self._metric("requests", 1, {"route": route, "status": str(resp.status_code)})
        return resp

    def _authorize(self, request: Request) -> None:
        if not self._api_keys:
            return
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if not auth and request.headers.get("x-api-key"):   # how Anthropic's clients send a key
            scheme, token = "bearer", request.headers["x-api-key"]
        elif not auth:
            raise oa.unauthorized("You didn't provide an API key. Send it as 'Authorization: Bearer <key>' "
                                  "(or 'x-api-key: <key>').")
        if scheme.lower() != "bearer" or not token.strip():
            raise oa.unauthorized("The Authorization header must be 'Bearer <key>'.")
        if not key_matches(token.strip().encode(), self._api_keys):
            raise oa.unauthorized("Incorrect API key provided.")

    @staticmethod
    def _require(method: str, expected: str, path: str) -> None:
        if method != expected:
            raise oa.OpenAIError(f"Method {method} is not allowed on {path}; use {expected}", status=405,
                                 code="method_not_allowed")

    async def _body(self, request: Request) -> bytes:
        """The body, refused with 413 as soon as it passes the limit: a declared Content-Length
        before reading, a chunked (or lying) body while it is read."""
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

    def _too_large(self) -> oa.OpenAIError:
        return oa.OpenAIError(f"The request body exceeds the {self.max_body_bytes}-byte limit; send a smaller "
                              f"prompt", status=413, code="request_too_large")

    def _check_model(self, model: Optional[str]) -> None:
        if model and model not in self.model_aliases:
            raise oa.model_not_found(model, [self.served_model])

    # ------------------------------------------------------------------------------------------
    # Generation endpoints

    def _check_overload(self) -> None:
        """Refuse at once while the rows waiting here for a replica, with the requests admitted before
        them whose rows are not waiting yet, fill their bound."""
        waiting = self._waiting_rows + self._admitting
        if waiting >= self.max_waiting_rows:
            raise oa.overloaded(f"The server is overloaded ({waiting} requests waiting); retry after "
                                f"{self.retry_after_s:g} s", self.retry_after_s, status=self.overload_status)

    def _admit(self) -> "_Admission":
        """`_check_overload`, then hold a place in the bound until this request's rows wait. Taken once
        the body is read (a slow upload holds no place), before it is parsed and tokenized: with the
        check alone, every request of an opening burst passed it (no row waited yet) and the excess
        was refused only after its parse and tokenization, with the other refusals queued behind."""
        self._check_overload()
        return _Admission(self)

    async def _chat(self, request: Request, rid: str, client_id: Optional[str]) -> Response:
        t0 = time.perf_counter()
        self._check_overload()      # before the body is read
        body = await self._body(request)
        with self._admit() as place:
            req = oa.parse_request(oa.ChatCompletionRequest, body)
            self._check_model(req.model)
            size = sum(len(m.content) if isinstance(m.content, str) else 1024 for m in req.messages)
            prompt_ids = await self._off_loop(size, oa.encode_chat, self.tokenizer, req.messages)
            return await self._generate("chat", req, prompt_ids, t0, rid, client_id, place)

    async def _completions(self, request: Request, rid: str, client_id: Optional[str]) -> Response:
        t0 = time.perf_counter()
        self._check_overload()      # before the body is read
        body = await self._body(request)
        with self._admit() as place:
            req = oa.parse_request(oa.CompletionRequest, body)
            self._check_model(req.model)
            prompt = req.single_prompt()
            prompt_ids = await self._off_loop(len(prompt), oa.encode_prompt, self.tokenizer, prompt,
                                              self.meta["vocab_size"] or 2 ** 31)
            if not prompt_ids:
                raise oa.invalid_request("prompt encodes to zero tokens", param="prompt")
            return await self._generate("completion", req, prompt_ids, t0, rid, client_id, place)

    async def _messages(self, request: Request, rid: str, client_id: Optional[str]) -> Response:
        """Anthropic Messages, served as the chat completion it translates to (same cohorts, lanes
        and streaming; Anthropic's framing)."""
        t0 = time.perf_counter()
        self._check_overload()      # before the body is read
        body = await self._body(request)
        with self._admit() as place:
            msg = oa.parse_request(anthropic.MessagesRequest, body)
            self._check_model(msg.model)
            req = msg.to_chat_request()
            size = sum(len(m.content) if isinstance(m.content, str) else 1024 for m in req.messages)
            prompt_ids = await self._off_loop(size, msg.encode, self.tokenizer)
            return await self._generate("anthropic", req, prompt_ids, t0, rid, client_id, place)

    async def _count_tokens(self, request: Request) -> Response:
        req = oa.parse_request(anthropic.CountTokensRequest, await self._body(request))
        self._check_model(req.model)
        ids = await self._off_loop(sum(len(m.content) for m in req.messages), req.encode, self.tokenizer)
        return JSONResponse({"input_tokens": len(ids)})

    async def _tokenize(self, request: Request) -> Response:
        """vLLM's /tokenize: a prompt, or chat messages through the chat template."""
        req = oa.parse_tokenize_request(await self._body(request))
        self._check_model(req.model)
        if isinstance(req, oa.TokenizeChatRequest):
            size = sum(len(m.content) if isinstance(m.content, str) else 1024 for m in req.messages)
            ids = await self._off_loop(size, oa.encode_chat, self.tokenizer, req.messages, req.add_generation_prompt,
                                       req.continue_final_message, req.add_special_tokens)
        else:
            ids = await self._off_loop(len(req.prompt), lambda: list(
                self.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)))
        strs = self.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return JSONResponse(oa.tokenize_response(ids, self.meta["max_context"], strs))

    async def _detokenize(self, request: Request) -> Response:
        """vLLM's /detokenize: token ids to text (special tokens included)."""
        req = oa.parse_request(oa.DetokenizeRequest, await self._body(request))
        self._check_model(req.model)
        self._check_vocab(req.tokens, "tokens")
        text = await self._off_loop(len(req.tokens), lambda: self.tokenizer.decode(req.tokens))
        return JSONResponse({"prompt": text})

    def _check_vocab(self, ids: List[int], param: str) -> None:
        vocab = self.meta["vocab_size"] or 2 ** 31
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise oa.invalid_request(f"token id {bad[0]} in {param} is outside the vocabulary [0, {vocab})",
                                     param=param, code="invalid_value")

    @staticmethod
    async def _off_loop(size: int, fn, *args):
        """Small prompts are tokenized inline; long ones in a worker thread so that one big prompt
        does not stall every other request's stream on this event loop."""
        if size < 16384:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    def _make_row(self, req, prompt_ids: List[int], rid: str) -> dict:
        max_context = self.meta["max_context"]
        if len(prompt_ids) >= max_context:
            raise oa.context_length_exceeded(len(prompt_ids), 1, max_context, param="messages"
                                             if isinstance(req, oa.ChatCompletionRequest) else "prompt")
        max_tokens = req.requested_max_tokens
        limit = self.max_tokens_limit
        if max_tokens is None:
            max_tokens = min(self.default_max_tokens, max_context - len(prompt_ids), limit or max_context)
        elif limit is not None and max_tokens > limit:
            raise oa.invalid_request(f"{req.max_tokens_param}={max_tokens} is above this server's limit of "
                                     f"{limit} tokens per completion; ask for at most {limit}",
                                     param=req.max_tokens_param, code="invalid_value")
        elif len(prompt_ids) + max_tokens > max_context:
            raise oa.context_length_exceeded(len(prompt_ids), max_tokens, max_context, param=req.max_tokens_param)
        sampler = oa.sampler_from_request(req, self.meta["sampler_defaults"])
        mode = req.generation_mode or self.default_mode
        key = mtp_batch_compatibility_key(self.served_model)     # rows of any sampling share a lane
        seed = req.seed if req.seed is not None else secrets.randbits(63)
        if req.stop_token_ids:
            self._check_vocab(req.stop_token_ids, "stop_token_ids")
        return {
            "request_id": rid, "prompt_ids": list(prompt_ids), "max_tokens": int(max_tokens),
            "sampler": sampler, "draft_sampler": None, "seed": int(seed) % (2 ** 64),
            "generation_mode": mode, "omit_speculative_bonus": bool(req.omit_speculative_bonus),
            "session_id": req.session_id, "compatibility_key": key,
            # the row's stop set at the replica: the model's EOS (unless ignore_eos) and these
            "stop_token_ids": sorted(set(req.stop_token_ids or ())), "ignore_eos": bool(req.ignore_eos),
            "logprobs": req.requested_logprobs,      # None, or the alternatives per token (0-20)
        }

    async def _generate(self, kind: str, req, prompt_ids: List[int], t0: float, rid: str,
                        client_id: Optional[str], place: "_Admission") -> Response:
        row = self._make_row(req, prompt_ids, rid)
        row["http_received_at"] = time.time() - (time.perf_counter() - t0)
        self._stats["requests"] += 1
        if req.requested_rows > 1:
            return await self._generate_choices(kind, req, row, t0, client_id, place)
        run = _RowRun(self, row, req, kind, t0, client_id)
        place.hand_over([run])
        if req.stream:
            first = await run.start()   # errors before the first token still get a status code
            return StreamingResponse(run.sse(first), media_type="text/event-stream",
                                     headers={"cache-control": "no-cache"})
        body = await run.complete()
        return JSONResponse(body)

    @property
    def max_choices(self) -> int:
        """The most choices (n) one request may ask for: its rows must fit one batch window (so
        that they reach one replica together and share one prefill) and the rows waiting here."""
        return min(self.max_batch_size, self.max_waiting_rows)

    async def _generate_choices(self, kind: str, req, row: dict, t0: float, client_id: Optional[str],
                                place: "_Admission") -> Response:
        """n > 1 (or best_of > 1): rows of one prefill group, row i sampling with seed + i; the
        replica's lane prefills the prompt once for all of them. best_of > n: the n rows of highest
        cumulative log-probability are the choices (vLLM's semantics; the rows report their
        log-probabilities whether or not the client asked for them)."""
        n, m = req.requested_n, req.requested_rows
        if m > self.max_choices:
            param = "n" if m == n else "best_of"
            raise oa.invalid_request(f"{param}={m} is above this server's limit of {self.max_choices} rows per "
                                     f"request (its batch window holds {self.max_batch_size} rows)",
                                     param=param, code="invalid_value")
        rid = row["request_id"]
        logprobs = row["logprobs"] if row["logprobs"] is not None or m == n else 0
        # each row its own id (a stop string cancels its row only); a cancel of rid reaches the group
        rows = [dict(row, request_id=f"{rid}-{i}", seed=(row["seed"] + i) % (2 ** 64), prefill_group=rid,
                     logprobs=logprobs) for i in range(m)]
        runs = [_RowRun(self, r, req, kind, t0, client_id) for r in rows]
        for run in runs:
            run.rid = rid        # the response's id
        place.hand_over(runs)
        try:
            if req.stream:
                firsts = await asyncio.gather(*(run.start() for run in runs))
                return StreamingResponse(_choices_sse(runs, firsts), media_type="text/event-stream",
                                         headers={"cache-control": "no-cache"})
            bodies = await asyncio.gather(*(run.complete() for run in runs))
        except BaseException:
            for run in runs:
                if not run.finished:
                    run._depart()
            raise
        chosen = sorted(range(m), key=lambda i: -runs[i].cumulative_logprob)[:n] if m > n else list(range(n))
        body = dict(bodies[chosen[0]])
        body["choices"] = [dict(bodies[i]["choices"][0], index=k) for k, i in enumerate(chosen)]
        body["usage"], body["mtplx_stats"] = _choices_usage_and_stats(runs, chosen)
        return JSONResponse(body)

    # Rows waiting here for a replica (the backpressure bound): counted from admission until their
    # batch starts or they end, whichever comes first; each row is counted once.

    def _row_waits(self, row: dict) -> None:
        row["waiting_here"] = True
        self._waiting_rows += 1

    def _row_leaves_wait(self, row: dict) -> None:
        if row.pop("waiting_here", False):
            self._waiting_rows -= 1

    # ------------------------------------------------------------------------------------------
    # The batch window: one call per batch, split into cohorts, demultiplexed per row

    async def _cohort_batch(self, rows: List[dict]):
        n = len(rows)
        now = time.time()
        live = []
        queue: asyncio.Queue = asyncio.Queue()
        for slot, row in enumerate(rows):
            row["batch_started_at"] = now
            self._row_leaves_wait(row)
            if row.get("departed"):   # its client left (or it was cancelled) before dispatch: drop it
                self._stats["rows_dropped_before_dispatch"] += 1
                queue.put_nowait((slot, ("error", {"kind": "cancelled"})))
            else:
                live.append(slot)
        self._stats["batches"] += 1
        hist = self._stats["batch_size_histogram"]
        hist[str(n)] = hist.get(str(n), 0) + 1
        # The whole window goes to one replica as one call; there each row joins the running lane
        # of its compatibility key (the one place rows are grouped by key).
        tasks = [_detached(self._drive_cohort([rows[i] for i in live], live, queue))] if live else []
        finished: set = set()
        try:
            while len(finished) < n:
                items = [await queue.get()]
                while not queue.empty():
                    items.append(queue.get_nowait())
                out: List[Any] = [[] for _ in range(n)]
                ended = []
                for slot, event in items:
                    if slot in finished:
                        continue
                    out[slot].append(event)
                    if event[0] in ("final", "error"):
                        finished.add(slot)
                        ended.append(slot)
                yield out
                if ended:
                    # End those callers' streams now (they await it right after their final event),
                    # not when the whole batch ends.
                    yield [StopAsyncIteration if slot in ended else [] for slot in range(n)]
        finally:
            for t in tasks:
                if not t.done():
                    t.cancel()

    async def _drive_cohort(self, rows: List[dict], slots: List[int], queue: asyncio.Queue) -> None:
        self._stats["cohorts"] += 1
        hist = self._stats["cohort_size_histogram"]
        hist[str(len(rows))] = hist.get(str(len(rows)), 0) + 1
        self._metric("cohorts")
        self._metric("cohort_size", len(rows))
        done: set = set()
        error: Optional[dict] = None
        try:
            stream = self._replica_stream.run_cohort.remote(rows)
            async for msg in stream:
                if "replica" in msg:
                    for row in rows:
                        rid = row["request_id"]
                        self._row_replica[rid] = msg["replica"]
                        if row.get("departed"):   # cancelled while its call was on the way
                            self._send_cancel(rid, msg["replica"])
                    continue
                logprobs = msg.get("lp") or {}
                for i, toks in (msg.get("t") or {}).items():
                    if i not in done:
                        queue.put_nowait((slots[i], ("tokens", toks, logprobs.get(i))))
                for i, fin in (msg.get("f") or {}).items():
                    if i in done:
                        continue
                    done.add(i)
                    if "error" in fin:
                        queue.put_nowait((slots[i], ("error", fin["error"])))
                    else:
                        queue.put_nowait((slots[i], ("final", fin)))
        except asyncio.CancelledError:
            error = {"kind": "unavailable", "message": "the server is shutting down; retry"}
            raise
        except BackPressureError as exc:
            error = {"kind": "overloaded", "retry_after_s": self.retry_after_s,
                     "message": "The model replicas' queues are full; retry later"}
            log.warning("mtplx ingress: replica queue full for rows %s: %s",
                        [r["request_id"] for r in rows], exc)
        except Exception:
            log.exception("mtplx ingress: the cohort stream of rows %s failed", [r["request_id"] for r in rows])
            error = {"kind": "unavailable",
                     "message": "The model replica serving this request failed; retry (a new replica is starting)"}
        finally:
            for i, row in enumerate(rows):
                self._row_replica.pop(row["request_id"], None)
                if i not in done:
                    queue.put_nowait((slots[i], ("error", error or {
                        "kind": "internal", "message": "the replica ended the cohort without a result"})))

    # ------------------------------------------------------------------------------------------
    # Row cancellation

    def cancel_row(self, row: dict, reason: str) -> None:
        """Cancel one row wherever it is (fire and forget; never the whole cohort). The mark on the
        row is all the state there is: a row not yet in a batch is dropped at dispatch, a row whose
        cohort call has not reached its replica is cancelled when the replica answers, and after
        its cohort ended the mark is simply never read."""
        if row.get("departed"):
            return
        row["departed"] = True
        self._stats["row_cancels"] += 1
        self._metric("cancels", 1, {"reason": reason})
        replica_id = self._row_replica.get(row["request_id"])
        if replica_id is not None:
            self._send_cancel(row["request_id"], replica_id)

    def _send_cancel(self, rid: str, replica_id: Optional[str]) -> None:
        async def send():
            try:
                kwargs = {PIN_KWARG: replica_id} if replica_id else {}
                await _call(self._replica.cancel, rid, timeout_s=30, **kwargs)
            except Exception as exc:
                log.warning("mtplx ingress: cancel of %s failed: %s", rid, exc)

        task = _detached(send())
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

    async def _fan_out(self, method: str, timeout_s: float = 10.0) -> Dict[str, Any]:
        """Call `method` on every live replica (pinned); one unpinned call if none is known yet."""
        ids = known_replicas(self._replica_name)
        handle = getattr(self._replica, method)
        if not ids:
            res = await _call(handle, timeout_s=timeout_s)
            return {res.get("replica_id", "unknown"): res}
        calls = [_call(handle, timeout_s=timeout_s, **{PIN_KWARG: r}) for r in ids]
        results = await asyncio.gather(*calls, return_exceptions=True)
        out = {}
        for rid, res in zip(ids, results):
            if isinstance(res, BaseException):
                log.warning("mtplx ingress: %s on replica %s failed: %s: %s", method, rid, type(res).__name__, res)
                res = {"ok": False, "error": "the replica did not answer"}
            out[rid] = res
        return out

    # ------------------------------------------------------------------------------------------
    # Operations endpoints

    async def _health(self) -> Response:
        try:
            replicas = await self._fan_out("health", timeout_s=10)
        except Exception as exc:
            log.warning("mtplx ingress: health: no model replica answered: %s: %s", type(exc).__name__, exc)
            err = oa.unavailable("no model replica answered", retry_after_s=self.retry_after_s)
            return JSONResponse({**err.body(), "status": "unavailable"}, status_code=503, headers=err.headers)
        ok = any(isinstance(r, dict) and r.get("ok") for r in replicas.values())
        body = {"status": "ok" if ok else "unavailable", "model": self.served_model,
                "max_context": (self.meta or {}).get("max_context"), "ingress": {"mlx_imported": _mlx_imported(),
                                                                     "niceness": self._niceness_in_effect,
                                                                     # a restarted proxy starts at Ray's 15 again
                                                                     "proxy_niceness": renice_serve_proxy(self.niceness)},
                "replicas": replicas}
        return JSONResponse(body, status_code=200 if ok else 503)

    async def _snapshot(self) -> dict:
        try:
            replicas = await self._fan_out("snapshot", timeout_s=10)
        except Exception as exc:
            log.warning("mtplx ingress: snapshot: no model replica answered: %s: %s", type(exc).__name__, exc)
            raise oa.unavailable("no model replica answered", retry_after_s=self.retry_after_s) from None
        # time: the server's clock when it answered, so rates between two snapshots need no client clock
        return {"model": self.served_model, "time": time.time(), "ingress": self.ingress_snapshot(),
                "replicas": replicas}

    def ingress_snapshot(self) -> dict:
        s = dict(self._stats)
        s.update({"max_batch_size": self.max_batch_size, "batch_wait_timeout_s": self.batch_wait_timeout_s,
                  "max_concurrent_batches": self.max_concurrent_batches,
                  "rows_in_flight": len(self._row_replica), "rows_waiting": self._waiting_rows,
                  "requests_admitting": self._admitting,
                  "max_waiting_rows": self.max_waiting_rows,
                  "batch_size_histogram": dict(self._stats["batch_size_histogram"]),
                  "cohort_size_histogram": dict(self._stats["cohort_size_histogram"])})
        return s

    async def _cancel_endpoint(self, rid: str) -> Response:
        replica_id = self._row_replica.get(rid)
        if replica_id is not None:
            n = await _call(self._replica.cancel, rid, timeout_s=10, **{PIN_KWARG: replica_id})
        else:  # maybe in flight through another ingress replica: ask every model replica
            res = await self._fan_out_cancel(rid)
            n = sum(v for v in res if isinstance(v, int))
        if not n:
            raise oa.OpenAIError(f"No request {rid!r} is in flight", status=404, type="not_found_error",
                                 param="request_id", code="request_not_found")
        return JSONResponse({"request_id": rid, "cancelled": True, "rows": n})

    async def _fan_out_cancel(self, rid: str) -> list:
        ids = known_replicas(self._replica_name)
        if not ids:
            return [await _call(self._replica.cancel, rid, timeout_s=10)]
        calls = [_call(self._replica.cancel, rid, timeout_s=10, **{PIN_KWARG: r}) for r in ids]
        return await asyncio.gather(*calls, return_exceptions=True)


def _mlx_imported() -> bool:
    import sys

    return "mlx.core" in sys.modules or "mlx" in sys.modules


class _Admission:
    """A request's place in the ingress's waiting bound, from the door until its rows wait for a
    batch (`hand_over`) or it fails (leaving the `with` block); released once."""

    def __init__(self, ingress: OpenAIIngress):
        self.ing = ingress
        self.held = True
        ingress._admitting += 1

    def hand_over(self, runs: List["_RowRun"]) -> None:
        """The rows take the place over: they count as waiting from now (no await in between)."""
        for run in runs:
            run._start_pump()
        self.release()

    def release(self) -> None:
        if self.held:
            self.held = False
            self.ing._admitting -= 1

    def __enter__(self) -> "_Admission":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class _RowRun:
    """One request's life after admission: events from its batch slot -> text -> OpenAI objects."""

    def __init__(self, ingress: OpenAIIngress, row: dict, req, kind: str, t0: float,
                 client_id: Optional[str] = None):
        self.ing = ingress
        self.row = row
        self.client_id = client_id
        self.req = req
        self.kind = kind
        self.t0 = t0
        self.rid = row["request_id"]
        self.created = oa.now()
        self.model = ingress.served_model
        self.detok = oa.IncrementalDetokenizer(ingress.tokenizer)
        self.stops = oa.StopStringMatcher(req.stop_strings())
        self.logprobs = req.requested_logprobs         # None, or the alternatives per token
        self._lp_tokens: List[int] = []                # tokens (and entries) not yet sent with text
        self._lp_entries: list = []
        self._text_offset = 0                          # completions' text_offset of the next token
        self.cumulative_logprob = 0.0                  # of the tokens received with entries (best_of)
        self.n_tokens = 0
        self.finished = False
        self.final: Optional[dict] = None
        self.finish_reason: Optional[str] = None
        self.first_text_s: Optional[float] = None
        self.first_tokens_at: Optional[float] = None
        self._queue: Optional[asyncio.Queue] = None
        self._pump_task: Optional[asyncio.Task] = None
        self.usage: Optional[dict] = None               # set when the stream's finish chunk is built
        self.stats: Optional[dict] = None

    # -- events ----------------------------------------------------------------------------------
    #
    # A pump task reads this row's batch slot (the @serve.batch generator) into a queue; the
    # request handler reads the queue. When the client goes away the row is marked departed and
    # the pump is cancelled: a row still waiting for its batch is never sent (Serve drops cancelled
    # callers, and the batch skips departed rows), a row already at a replica is cancelled there.

    def _start_pump(self) -> None:
        self._queue = asyncio.Queue()
        self.ing._row_waits(self.row)
        self._pump_task = task = asyncio.get_running_loop().create_task(self._pump())
        self.ing._bg.add(task)
        task.add_done_callback(self.ing._bg.discard)

    async def _pump(self) -> None:
        try:
            async for update in self.ing._rows(self.row):
                if update:
                    self._queue.put_nowait(update)
        except Exception as exc:
            self._queue.put_nowait(exc)
        finally:
            if "batch_started_at" not in self.row:   # Serve dropped it from its batch (its client left)
                self.ing._stats["rows_dropped_before_dispatch"] += 1
                self.ing._row_leaves_wait(self.row)
            self._queue.put_nowait(_END)

    def _depart(self) -> None:
        """The client went away: cancel this row only, wherever it is, and stop listening."""
        self.ing.cancel_row(self.row, "disconnect")
        if self._pump_task is not None and not self._pump_task.done():
            self._pump_task.cancel()

    async def _next_update(self, timeout: Optional[float] = None) -> list:
        if self._queue is None:
            self._start_pump()
        item = await (self._queue.get() if timeout is None else asyncio.wait_for(self._queue.get(), timeout))
        if item is _END:
            self._queue.put_nowait(_END)
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            log.error("mtplx ingress: the batch of request %s failed", self.rid, exc_info=item)
            raise oa.internal_error(self.rid)
        return item

    async def updates(self):
        """Yields text deltas; on return `self.final` / `self.finish_reason` are set.
        Raises OpenAIError for a failed row."""
        while not self.finished:
            try:
                update = await self._next_update()
            except StopAsyncIteration:
                log.error("mtplx ingress: the batch of request %s ended without a result for it", self.rid)
                raise oa.internal_error(self.rid) from None
            for event in update:
                if self.finished:
                    break
                text = self._apply(event)
                if text:
                    yield text
            if self.stops.stopped:
                return   # after a stop string the caller drains the cancelled row (bounded)

    def _apply(self, event) -> str:
        kind, payload = event[0], event[1]
        if kind == "tokens":
            if self.first_tokens_at is None:
                self.first_tokens_at = time.time()
            if self.stops.stopped:
                return ""
            if self.logprobs is not None:
                if event[2] is None or len(event[2]) != len(payload):   # a bug of ours, never a short answer
                    log.error("mtplx ingress: request %s asked for logprobs; the replica sent %s entries for %d "
                              "tokens", self.rid, None if event[2] is None else len(event[2]), len(payload))
                    raise oa.internal_error(self.rid)
                return self._apply_with_logprobs(payload, event[2])
            if event[2]:      # a best_of row: entries the client did not ask for
                self.cumulative_logprob += sum(e[0] for e in event[2])
            self.n_tokens += len(payload)
            text = self.stops.push(self.detok.push(payload))
            if self.stops.stopped:
                self.ing.cancel_row(self.row, "stop_string")
            return text
        if kind == "final":
            self.finished = True
            self.final = payload
            tail = "" if self.stops.stopped else self.stops.push(self.detok.flush())
            tail += self.stops.flush()
            self.finish_reason = "stop" if self.stops.stopped else oa.openai_finish_reason(payload.get("finish_reason"))
            return tail
        # error
        self.finished = True
        raise self._row_error(payload)

    def _apply_with_logprobs(self, tokens: List[int], entries: list) -> str:
        """Tokens with their log-probability entries; one at a time where stop strings may end the
        row mid-message, so that the entries stop at the token that completed one."""
        if not self.stops.stops:      # nothing can stop mid-message: one detokenizer pass
            self.n_tokens += len(tokens)
            self._lp_tokens.extend(tokens)
            self._lp_entries.extend(entries)
            self.cumulative_logprob += sum(e[0] for e in entries)
            return self.detok.push(tokens)
        text = ""
        for token, entry in zip(tokens, entries):
            self.n_tokens += 1
            self._lp_tokens.append(token)
            self._lp_entries.append(entry)
            self.cumulative_logprob += entry[0]
            text += self.stops.push(self.detok.push([token]))
            if self.stops.stopped:
                self.ing.cancel_row(self.row, "stop_string")
                break
        return text

    def _take_logprobs(self) -> Optional[dict]:
        """The `logprobs` of the tokens received since the last call (None when not asked for)."""
        if self.logprobs is None:
            return None
        tokens, entries = self._lp_tokens, self._lp_entries
        self._lp_tokens, self._lp_entries = [], []
        if self.kind == "chat":
            return oa.chat_logprobs(tokens, entries, self.logprobs, self.ing.token_bytes)
        out = oa.completion_logprobs(tokens, entries, self.logprobs, self.ing.token_bytes, self._text_offset)
        self._text_offset += sum(len(t) for t in out["tokens"])
        return out

    def _row_error(self, payload: dict) -> oa.OpenAIError:
        """A row's error event (from the replica or the cohort driver) as the client's error. Only
        messages written for clients pass through; an internal failure says only that it was one."""
        kind, msg = payload.get("kind"), payload.get("message", "")
        if kind == "capacity":
            return oa.invalid_request(msg, param=self.req.max_tokens_param, code="context_length_exceeded")
        if kind == "overloaded":
            return oa.overloaded(msg, payload.get("retry_after_s") or self.ing.retry_after_s,
                                 status=self.ing.overload_status)
        if kind in ("unavailable", "cancelled"):
            return oa.unavailable(msg or "the model replica is unavailable; retry",
                                  retry_after_s=payload.get("retry_after_s") or self.ing.retry_after_s)
        log.error("mtplx ingress: request %s failed at the replica (the replica log has the details)", self.rid)
        return oa.internal_error(self.rid)

    async def _drain_after_stop(self) -> None:
        """After a stop string: wait (bounded) for the cancelled row's final (it carries stats)."""
        deadline = time.perf_counter() + self.ing.stop_wait_s
        try:
            while not self.finished:
                remaining = deadline - time.perf_counter()
                if remaining <= 0:
                    break
                update = await self._next_update(timeout=remaining)
                for event in update:
                    if event[0] == "final":
                        self.finished, self.final = True, event[1]
                    elif event[0] == "error":
                        self.finished = True
        except (asyncio.TimeoutError, StopAsyncIteration):
            pass
        except oa.OpenAIError:
            pass
        self.finished = True
        self.finish_reason = "stop"

    @property
    def stop_reason(self):
        """As vLLM reports it: the stop string or the requested stop token id that ended the row;
        None for an EOS token, a budget, or no stop at all."""
        if self.stops.matched is not None:
            return self.stops.matched
        token = (self.final or {}).get("stop_token_id")
        return token if token is not None and token in (self.req.stop_token_ids or ()) else None

    def _usage_and_stats(self):
        fin = self.final or {}
        prompt_tokens = fin.get("prompt_tokens", len(self.row["prompt_ids"]))
        completion = self.n_tokens if self.stops.stopped else fin.get("completion_tokens", self.n_tokens)
        stats = dict(fin.get("stats") or {})
        stats["http_ttft_s"] = (self.first_text_s - self.t0) if self.first_text_s else None
        stats["http_elapsed_s"] = time.perf_counter() - self.t0
        stats.update(self._timeline(stats))
        stats["request_id"] = self.rid
        if self.client_id is not None:
            stats["client_request_id"] = self.client_id
        if self.stops.stopped:
            stats["stop_string_matched"] = True
        # the client sees OpenAI's reason everywhere; the engine's (e.g. "cancelled") stays beside it
        stats["engine_finish_reason"] = fin.get("finish_reason")
        stats["finish_reason"] = self.finish_reason
        build = anthropic.usage if self.kind == "anthropic" else oa.usage
        return build(prompt_tokens, completion, fin.get("cached_tokens", 0)), stats

    def _timeline(self, stats: dict) -> dict:
        """Where a request's time to first token went (wall clock deltas across processes)."""
        t_http, t_batch = self.row.get("http_received_at"), self.row.get("batch_started_at")
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

    def _mark_text(self) -> None:
        if self.first_text_s is None:
            self.first_text_s = time.perf_counter()
            self.ing._metric("ttft", self.first_text_s - self.t0, {"route": self.kind})

    # -- non-streaming -----------------------------------------------------------------------------

    async def complete(self) -> dict:
        pieces = []
        try:
            async for text in self.updates():
                self._mark_text()
                pieces.append(text)
            if self.stops.stopped and not self.final:
                await self._drain_after_stop()
        finally:
            if not self.finished:   # the client went away (task cancelled) or we failed
                self._depart()
        self.usage, self.stats = usage, stats = self._usage_and_stats()
        text = "".join(pieces)
        if self.kind == "anthropic":
            return anthropic.message_response(self.rid, self.model, text, self.finish_reason, self.stops.matched,
                                              usage, stats)
        build = oa.chat_response if self.kind == "chat" else oa.completion_response
        return build(self.rid, self.created, self.model, text, self.finish_reason, usage, stats, self.stop_reason,
                     self._take_logprobs())

    # -- streaming ---------------------------------------------------------------------------------

    async def start(self):
        """Wait for the first text (or the end); errors raise here, before any byte is sent."""
        self._iter = self.updates().__aiter__()
        try:
            return await self._iter.__anext__()
        except StopAsyncIteration:
            return None
        except BaseException:
            if not self.finished:
                self._depart()
            raise

    def _chunk(self, text: Optional[str], finish_reason: Optional[str] = None, role: bool = False, **extra):
        stop_reason = self.stop_reason if finish_reason else None
        logprobs = None if role else self._take_logprobs()
        if self.kind == "chat":
            delta = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            chunk = oa.chat_chunk(self.rid, self.created, self.model, delta, finish_reason, stop_reason, logprobs,
                                  **extra)
        else:
            chunk = oa.completion_chunk(self.rid, self.created, self.model, text or "", finish_reason, stop_reason,
                                        logprobs, **extra)
        if self.req.include_usage:
            chunk["usage"] = None
        return chunk

    async def chunks(self, first: Optional[str]):
        """The row's stream chunks up to its finish chunk (then `self.usage`, `self.stats` are
        set); a failure ends them with the error's body (a dict with "error")."""
        try:
            if self.kind == "chat":
                yield self._chunk("", role=True)
            if first:
                self._mark_text()
                yield self._chunk(first)
            try:
                if first is not None:
                    async for text in self._iter:
                        self._mark_text()
                        yield self._chunk(text)
                if self.stops.stopped and not self.final:
                    await self._drain_after_stop()
            except oa.OpenAIError as exc:
                yield exc.body()
                return
            self.usage, self.stats = self._usage_and_stats()
            final = self._chunk(None if self.kind == "chat" else "", self.finish_reason, mtplx_stats=self.stats)
            if self.kind == "chat":
                final["choices"][0]["delta"] = {}
            yield final
        finally:
            if not self.finished:   # disconnect mid-stream: cancel this row only
                self._depart()

    async def sse(self, first: Optional[str]):
        if self.kind == "anthropic":
            async for data in self._anthropic_sse(first):
                yield data
            return
        async for chunk in self.chunks(first):
            yield oa.sse(chunk)
            if "error" in chunk:
                yield oa.SSE_DONE
                return
        if self.req.include_usage:
            yield oa.sse(oa.usage_chunk(self.rid, self.created, self.model, self.stream_object, self.usage,
                                        self.stats))
        yield oa.SSE_DONE

    @property
    def stream_object(self) -> str:
        return "chat.completion.chunk" if self.kind == "chat" else "text_completion"

    async def _anthropic_sse(self, first: Optional[str]):
        """The same row as `sse`, framed as Anthropic's message stream events."""
        events = anthropic.MessageStream(self.rid, self.model, len(self.row["prompt_ids"]))
        try:
            yield events.start()
            if first:
                self._mark_text()
                yield events.text(first)
            try:
                if first is not None:
                    async for text in self._iter:
                        self._mark_text()
                        yield events.text(text)
                if self.stops.stopped and not self.final:
                    await self._drain_after_stop()
            except oa.OpenAIError as exc:
                yield events.error(exc)
                return
            usage, stats = self._usage_and_stats()
            yield events.finish(self.finish_reason, self.stops.matched, usage, stats)
        finally:
            if not self.finished:   # disconnect mid-stream: cancel this row only
                self._depart()


def _choices_usage_and_stats(runs: List[_RowRun], chosen: Optional[List[int]] = None):
    """usage and mtplx_stats of a request of several rows (`chosen`: the rows returned, in order;
    all by default): the prompt counted once, every row's completion summed; the first choice's
    stats with each choice's own under "choices", and how many rows took the shared prefill rather
    than their own ("shared_prefill_rows"); with best_of, each row's cumulative log-probability."""
    chosen = list(range(len(runs))) if chosen is None else chosen
    usages, stats = [run.usage for run in runs], [run.stats for run in runs]
    completion = sum(u["completion_tokens"] for u in usages)
    usage = oa.usage(usages[0]["prompt_tokens"], completion,
                     usages[0].get("prompt_tokens_details", {}).get("cached_tokens", 0))
    merged = dict(stats[chosen[0]], n=len(chosen), choices=[stats[i] for i in chosen],
                  shared_prefill_rows=sum(bool(s.get("shared_prefill")) for s in stats))
    if len(chosen) < len(runs):
        merged.update(best_of=len(runs), cumulative_logprobs=[run.cumulative_logprob for run in runs],
                      chosen_rows=chosen)
    return usage, merged


async def _choices_sse(runs: List[_RowRun], firsts: list):
    """The streams of an n > 1 request's choices, interleaved as their chunks come (each chunk
    carries its choice's index); one usage chunk at the end when asked for."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, run, first):
        try:
            async for chunk in run.chunks(first):
                for choice in chunk.get("choices", ()):
                    choice["index"] = i
                queue.put_nowait(chunk)
        finally:
            queue.put_nowait(None)

    tasks = [asyncio.get_running_loop().create_task(pump(i, run, first))
             for i, (run, first) in enumerate(zip(runs, firsts))]
    try:
        ended = 0
        while ended < len(runs):
            chunk = await queue.get()
            if chunk is None:
                ended += 1
                continue
            yield oa.sse(chunk)
            if "error" in chunk:
                yield oa.SSE_DONE
                return
        run = runs[0]
        if run.req.include_usage:
            usage, stats = _choices_usage_and_stats(runs)
            yield oa.sse(oa.usage_chunk(run.rid, run.created, run.model, run.stream_object, usage, stats))
        yield oa.SSE_DONE
    finally:
        for t in tasks:      # the client went away (or a choice failed): the others' rows end too
            if not t.done():
                t.cancel()


_END = object()
