"""OpenAI protocol for the HTTP front door: request models, response and log-probability shapes.
Errors are `mtplx.api.errors`', the bounds a request is parsed against `mtplx.api.limits`' (both
re-exported here: the ingress reads the protocol as `oa.`). A row's tokens as text, stop strings
included, are `mtplx.api.text`'s.

No MLX here: the Ray Serve ingress imports this module, and the ingress must never load MLX
(`tests/test_http.py` checks it). Only pydantic, numpy-free stdlib and `mtplx.sampling`
(numpy only) are used.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Iterable, List, Literal, Optional, Sequence, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from mtplx.api.errors import from_validation_error, invalid_request
from mtplx.api.limits import (MAX_TOP_LOGPROBS, NO_LIMITS, BoundedRequest, RequestLimits, check_rows,
                              check_stop_strings, check_token_count, check_token_ids, check_top_k, check_top_p,
                              request_limits)
from mtplx.api.text import TokenBytes
from mtplx.end import CANCELLED, EOS, GRAMMAR_COMPLETE, LENGTH, REPETITION, STOP_STRING, STOP_TOKEN, End
from mtplx.sampling import SamplerConfig


# ----------------------------------------------------------------------------------------------
# Request models


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: Optional[str] = None


class FunctionCallIn(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: Union[str, dict] = "{}"


class ToolCallIn(BaseModel):
    """A past assistant turn's tool call, as OpenAI returned it (arguments a JSON string)."""

    model_config = ConfigDict(extra="ignore")
    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, List[ContentPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[List[ToolCallIn]] = None         # assistant turns
    tool_call_id: Optional[str] = None                    # tool turns
    reasoning_content: Optional[str] = None               # assistant turns (the template drops past reasoning)
    reasoning: Optional[str] = None                       # newer vLLM's name for it

    @model_validator(mode="after")
    def _content_required(self):
        # Only an assistant turn may come without content (it made tool calls, say).
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content (a string or a list of text parts)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return self

    def template_dict(self, index: int) -> dict:
        """The message as the chat template reads it."""
        out = {"role": "system" if self.role == "developer" else self.role, "content": self.text(index)}
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.function.name, "arguments": c.function.arguments}}
                                 for c in self.tool_calls]
        reasoning = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if reasoning is not None:
            out["reasoning_content"] = reasoning
        return out

    def text(self, index: int) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        pieces = []
        for j, part in enumerate(self.content):
            if part.type != "text" or part.text is None:
                raise invalid_request(
                    f"Content part type {part.type!r} is not supported (text only; no vision or audio)",
                    param=f"messages.{index}.content.{j}.type", code="unsupported_content")
            pieces.append(part.text)
        return "".join(pieces)


class SamplingFields(BoundedRequest):
    """The sampling and text fields every generation route shares (chat, completions, responses):
    OpenAI's, vLLM's extensions and mtplx's. A field this server does not know is refused (as
    OpenAI does), never silently dropped. Every number has a range, checked here."""

    model_config = ConfigDict(extra="forbid")

    model: Optional[str] = None
    temperature: Optional[float] = Field(default=None, ge=0.0, le=2.0, strict=True)
    top_p: Optional[float] = Field(default=None, ge=0.0, le=1.0, strict=True)       # 0: the heaviest token only (greedy)
    top_k: Optional[int] = Field(default=None, ge=-1, strict=True)     # -1 / 0: off; >= the vocabulary: off
    min_p: Optional[float] = Field(default=None, ge=0.0, le=1.0, strict=True)
    presence_penalty: Optional[float] = Field(default=None, ge=-2.0, le=2.0, strict=True)
    frequency_penalty: Optional[float] = Field(default=None, ge=-2.0, le=2.0, strict=True)
    seed: Optional[int] = Field(default=None, strict=True)
    # vLLM's text controls (mtplx.api.text): special tokens left out of the text (their default,
    # true), and whether a decoder may space adjacent special tokens (no effect with fast tokenizers)
    skip_special_tokens: bool = Field(default=True, strict=True)
    spaces_between_special_tokens: bool = Field(default=True, strict=True)
    # mtplx extensions
    generation_mode: Optional[Literal["auto", "mtp", "ar"]] = None
    omit_speculative_bonus: bool = False

    @field_validator("top_p")
    @classmethod
    def _check_top_p(cls, v):
        return check_top_p(v)

    @field_validator("top_k")
    @classmethod
    def _check_top_k(cls, v):
        return check_top_k(v)

    @field_validator("seed")
    @classmethod
    def _check_seed(cls, v):
        if v is not None and not (-(2 ** 63) <= v < 2 ** 64):
            raise ValueError("seed must fit in 64 bits")
        return v


class _GenerationFields(SamplingFields):
    """Fields shared by chat and completions requests (plus the mtplx extensions)."""

    max_tokens: Optional[int] = Field(default=None, ge=1, strict=True)
    stop: Union[str, List[str], None] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    # choices: rows of one lane after one shared prefill; choice i samples with seed + i
    n: Optional[int] = Field(default=None, ge=1, strict=True)
    user: Optional[str] = None
    # OpenAI bookkeeping fields with no effect on generation: accepted, not acted on
    metadata: Optional[dict] = None
    store: Optional[bool] = None
    service_tier: Optional[str] = None
    logit_bias: Optional[dict] = None
    # vLLM's sampling extensions: stop_token_ids and ignore_eos act on the row's stop set;
    # min_tokens holds that set and the stop strings back until the row has that many tokens;
    # include_stop_str_in_output keeps a matched stop string in the text; repetition_penalty
    # is accepted only at its no-op value (see checks)
    stop_token_ids: Optional[List[Annotated[int, Field(ge=0, strict=True)]]] = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = Field(default=False, strict=True)
    min_tokens: int = Field(default=0, ge=0, strict=True)
    repetition_penalty: Optional[float] = Field(default=None, gt=0.0, strict=True)
    # structured output (mtplx.api.output_plan): OpenAI's response_format, vLLM's structured_outputs;
    # vLLM's deprecated guided_* fields are refused with the name of their replacement
    response_format: Optional[dict] = None
    structured_outputs: Optional[Any] = None
    guided_json: Optional[Any] = None
    guided_regex: Optional[Any] = None
    guided_choice: Optional[Any] = None
    guided_grammar: Optional[Any] = None
    guided_json_object: Optional[Any] = None
    guided_decoding_backend: Optional[Any] = None
    guided_whitespace_pattern: Optional[Any] = None
    # vLLM's: the prefix cache is partitioned by it (and by the caller's API key)
    cache_salt: Optional[str] = Field(default=None, min_length=1, max_length=1024)

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v):
        if v is None:
            return None
        return check_stop_strings([v] if isinstance(v, str) else list(v))

    @field_validator("max_tokens")
    @classmethod
    def _check_max_tokens(cls, v, info: ValidationInfo):
        return check_token_count(v, "max_tokens", request_limits(info))

    @field_validator("min_tokens")
    @classmethod
    def _check_min_tokens(cls, v, info: ValidationInfo):
        return check_token_count(v, "min_tokens", request_limits(info))

    @field_validator("stop_token_ids")
    @classmethod
    def _check_stop_token_ids(cls, v, info: ValidationInfo):
        return v if v is None else check_token_ids(v, "stop_token_ids", request_limits(info))

    def common_checks(self) -> None:
        if self.requested_rows > 1:
            check_rows(self.requested_rows, "n" if self.requested_rows == self.requested_n else "best_of",
                       self._limits)
        if self.logit_bias:
            raise invalid_request("logit_bias is not supported", param="logit_bias", code="unsupported_value")
        if self.stream_options is not None and not self.stream:
            raise invalid_request("stream_options is only allowed when stream is true",
                                  param="stream_options")
        if self.repetition_penalty is not None and self.repetition_penalty != 1.0:
            raise invalid_request(f"repetition_penalty={self.repetition_penalty:g} is not supported; use "
                                  f"presence_penalty / frequency_penalty, and send 1.0 or omit it",
                                  param="repetition_penalty", code="unsupported_value")

    @property
    def requested_n(self) -> int:
        return self.n or 1

    @property
    def requested_rows(self) -> int:
        return self.requested_n

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def stop_strings(self) -> List[str]:
        return list(self.stop or [])


class ChatCompletionRequest(_GenerationFields):
    messages: List[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1, strict=True)
    # tools and thinking (validated into an OutputPlan by mtplx.api.output_plan)
    tools: Optional[Any] = None
    tool_choice: Optional[Any] = None
    parallel_tool_calls: Optional[bool] = None
    functions: Optional[Any] = None          # legacy: refused, use tools
    function_call: Optional[Any] = None      # legacy: refused, use tool_choice
    chat_template_kwargs: Optional[dict] = None
    reasoning_effort: Optional[Literal["none", "minimal", "low", "medium", "high"]] = None
    thinking_budget: Optional[int] = Field(default=None, ge=0, strict=True)    # mtplx: thinking tokens before </think>
    logprobs: Optional[bool] = Field(default=None, strict=True)
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS, strict=True)

    @field_validator("max_completion_tokens", "thinking_budget")
    @classmethod
    def _check_token_counts(cls, v, info: ValidationInfo):
        return check_token_count(v, info.field_name, request_limits(info))

    @property
    def requested_logprobs(self) -> Optional[int]:
        """Alternatives per token asked for (0: the chosen token's log-probability only); None: off."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def checks(self) -> None:
        if self.top_logprobs is not None and not self.logprobs:
            raise invalid_request("top_logprobs requires logprobs: true", param="top_logprobs")
        self.common_checks()
        for legacy, current in (("functions", "tools"), ("function_call", "tool_choice")):
            if getattr(self, legacy) is not None:
                raise invalid_request(f"{legacy} is the deprecated form of function calling and is not supported; "
                                      f"use {current}", param=legacy, code="unsupported_value")
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise invalid_request("max_tokens and max_completion_tokens disagree; send one",
                                  param="max_completion_tokens")

    @property
    def requested_max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @property
    def prompt_param(self) -> str:
        """The field the prompt came from (a context-length error names it)."""
        return "messages"


class CompletionRequest(_GenerationFields):
    prompt: Union[str, List[int], List[str], List[List[int]]]
    # vLLM's: a text prompt gets the tokenizer's special tokens (Gemma's BOS, without which it
    # degenerates), as mlx-lm's server and vLLM encode completions; token-id prompts are as sent
    add_special_tokens: bool = Field(default=True, strict=True)
    echo: bool = False
    best_of: Optional[int] = Field(default=None, ge=1, strict=True)
    suffix: Optional[str] = None
    logprobs: Optional[int] = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS, strict=True)

    @property
    def requested_logprobs(self) -> Optional[int]:
        """Alternatives per token asked for (0: the chosen token's log-probability only); None: off."""
        return self.logprobs

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt_shape(cls, v):
        def ids(x):
            return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

        if isinstance(v, str) or ids(v) or (isinstance(v, list) and all(isinstance(p, str) or ids(p) for p in v)):
            return v
        raise ValueError("prompt must be a string, a list of token ids (integers), or a list of those")

    @field_validator("prompt")
    @classmethod
    def _check_prompt_ids(cls, v, info: ValidationInfo):
        if isinstance(v, list):
            for ids in ([v] if all(isinstance(t, int) for t in v) else [p for p in v if isinstance(p, list)]):
                check_token_ids(ids, "prompt", request_limits(info))
        return v

    def checks(self) -> None:
        self.common_checks()
        if self.echo:
            raise invalid_request("echo is not supported", param="echo", code="unsupported_value")
        if self.best_of is not None and self.best_of < self.requested_n:
            raise invalid_request(f"best_of={self.best_of} must be at least n={self.requested_n}", param="best_of")
        if self.best_of is not None and self.best_of > self.requested_n and self.stream:
            raise invalid_request("best_of above n cannot be streamed (the best choices are known only at the end)",
                                  param="best_of", code="unsupported_value")
        if self.suffix:
            raise invalid_request("suffix is not supported", param="suffix", code="unsupported_value")

    @property
    def requested_max_tokens(self) -> Optional[int]:
        return self.max_tokens

    @property
    def requested_rows(self) -> int:
        """Rows generated: best_of (the n of highest cumulative log-probability are returned), or n."""
        return self.best_of or self.requested_n

    @property
    def max_tokens_param(self) -> str:
        return "max_tokens"

    @property
    def prompt_param(self) -> str:
        return "prompt"

    def single_prompt(self) -> Union[str, List[int]]:
        p = self.prompt
        if isinstance(p, str):
            return p
        if not p:
            raise invalid_request("prompt is empty", param="prompt")
        if all(isinstance(x, int) and not isinstance(x, bool) for x in p):
            return list(p)
        if len(p) != 1:
            raise invalid_request(f"batched prompts ({len(p)}) are not supported: send one prompt per request",
                                  param="prompt", code="unsupported_value")
        return p[0]


class TokenizeCompletionRequest(BoundedRequest):
    """vLLM's POST /tokenize, prompt form."""

    model_config = ConfigDict(extra="forbid")
    model: Optional[str] = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(BoundedRequest):
    """vLLM's POST /tokenize, chat form: the messages through the model's chat template."""

    model_config = ConfigDict(extra="forbid")
    model: Optional[str] = None
    messages: List[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool = False
    tools: Optional[Any] = None                     # listed by the template, as a chat completion's
    chat_template_kwargs: Optional[dict] = None     # enable_thinking

    def checks(self) -> None:
        if self.add_generation_prompt and self.continue_final_message:
            raise invalid_request("continue_final_message and add_generation_prompt cannot both be true; "
                                  "send add_generation_prompt: false to continue the final message",
                                  param="continue_final_message")


class DetokenizeRequest(BoundedRequest):
    """vLLM's POST /detokenize."""

    model_config = ConfigDict(extra="forbid")
    model: Optional[str] = None
    tokens: List[Annotated[int, Field(ge=0, strict=True)]]

    @field_validator("tokens")
    @classmethod
    def _check_tokens(cls, v, info: ValidationInfo):
        return check_token_ids(v, "tokens", request_limits(info))


class _TokenizeForm(BaseModel):
    """Which form a /tokenize body is: only whether it has "messages" (pydantic's parser, whose
    nesting limit answers a 400, reads it; Python's `json` would raise RecursionError)."""

    model_config = ConfigDict(extra="ignore")
    messages: Any = None


def parse_tokenize_request(raw: bytes, limits: RequestLimits = NO_LIMITS
                           ) -> Union[TokenizeCompletionRequest, TokenizeChatRequest]:
    """A /tokenize body is the chat form when it has "messages", the prompt form otherwise."""
    try:
        chat = raw and _TokenizeForm.model_validate_json(raw).messages is not None
    except ValidationError:
        chat = False                    # not a JSON object: the prompt form's parse says why
    return parse_request(TokenizeChatRequest if chat else TokenizeCompletionRequest, raw, limits)


def parse_request(cls, raw: bytes, limits: RequestLimits = NO_LIMITS):
    """Validate a JSON body into `cls` against `limits` (the served model's and this server's
    bounds), raising OpenAIError(400) naming the field on failure."""
    if not raw:
        raise invalid_request("The request body is empty; send a JSON object", code="invalid_json")
    try:
        req = cls.model_validate_json(raw, context=limits)
    except ValidationError as exc:
        raise from_validation_error(exc, raw) from None
    req.checks()
    return req


def sampler_from_request(req: SamplingFields, defaults: Optional[dict] = None,
                         vocab_size: Optional[int] = None) -> SamplerConfig:
    """SamplerConfig from the request; omitted fields take the model's / mtplx defaults. top_p 0
    keeps only the heaviest token: greedy decoding. top_k -1 (vLLM's "off") and, as vLLM reads
    it, a top_k at or above the vocabulary size keep every token: top_k 0."""
    values = dict(defaults or {})
    for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty"):
        v = getattr(req, name)
        if v is not None:
            values[name] = v
    if req.top_p == 0:
        values["temperature"] = 0.0
        values["top_p"] = 1.0
    top_k = values.get("top_k", 0)
    if top_k == -1 or (vocab_size and top_k >= vocab_size):
        values["top_k"] = 0
    try:
        return SamplerConfig(**values)
    except ValueError as exc:
        msg = str(exc)
        param = None
        if msg.startswith("SamplerConfig."):
            param = msg[len("SamplerConfig."):].split("=", 1)[0]
        raise invalid_request(msg, param=param, code="invalid_value") from None
    except TypeError as exc:
        raise invalid_request(str(exc)) from None


# ----------------------------------------------------------------------------------------------
# Prompts


def render_chat(tokenizer, messages: List[ChatMessage], add_generation_prompt: bool = True,
                continue_final_message: bool = False, template_kwargs: Optional[dict] = None) -> str:
    """The messages through the model's chat template; `continue_final_message` leaves the last
    (assistant) turn open, so the completion continues it. `template_kwargs`: `tools` (OpenAI's
    function-tool dicts) and `enable_thinking`, when the request has them."""
    convo = [m.template_dict(i) for i, m in enumerate(messages)]
    try:
        return tokenizer.apply_chat_template(convo, add_generation_prompt=add_generation_prompt, tokenize=False,
                                             continue_final_message=continue_final_message,
                                             **(template_kwargs or {}))
    except Exception as exc:  # jinja errors (e.g. role order rules of a template)
        raise invalid_request(f"messages could not be rendered with the model's chat template: {exc}",
                              param="messages") from None


def encode_chat(tokenizer, messages: List[ChatMessage], add_generation_prompt: bool = True,
                continue_final_message: bool = False, add_special_tokens: bool = False,
                template_kwargs: Optional[dict] = None) -> List[int]:
    text = render_chat(tokenizer, messages, add_generation_prompt, continue_final_message, template_kwargs)
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def encode_prompt(tokenizer, prompt: Union[str, List[int]], add_special_tokens: bool = True) -> List[int]:
    """A completion's prompt as token ids (ids were checked against the vocabulary at parse)."""
    if isinstance(prompt, str):
        if prompt == "":
            raise invalid_request("prompt is empty", param="prompt")
        return list(tokenizer.encode(prompt, add_special_tokens=add_special_tokens))
    return list(prompt)


# ----------------------------------------------------------------------------------------------
# Responses


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {
        "prompt_tokens": int(prompt_tokens),
        "completion_tokens": int(completion_tokens),
        "total_tokens": int(prompt_tokens) + int(completion_tokens),
        "prompt_tokens_details": {"cached_tokens": int(cached_tokens or 0)},
    }


# The finish reasons this server reports: OpenAI's ("content_filter" never happens here;
# "tool_calls" when the answer's tool calls were parsed, see deployments.ingress.formats), and
# vLLM's "abort" for a row cancelled through the cancel route (it did not finish: OpenAI has no
# word for that, and "stop" would say it had).
FINISH_REASONS = ("stop", "length", "tool_calls", "abort")
ABORT = "abort"

# A row's End as OpenAI's finish_reason: every kind of stop is "stop" (a stop token or string, a
# grammar complete, a literal-repetition stop); a row that did not finish is "abort".
FINISH_REASON_OF_END = {EOS: "stop", STOP_TOKEN: "stop", STOP_STRING: "stop", LENGTH: "length",
                        GRAMMAR_COMPLETE: "stop", REPETITION: "stop", CANCELLED: ABORT}


def vllm_stop_reason(end: End) -> Union[int, str, None]:
    """vLLM's stop_reason: the stop string, or the requested stop token id, that ended the row;
    None for any other end (EOS included)."""
    if end.kind == STOP_STRING:
        return end.string
    return end.token if end.kind == STOP_TOKEN else None


def chat_response(rid: str, created: int, model: str, text: Optional[str], finish_reason: str, usage_: dict,
                  stats: Optional[dict], stop_reason: Union[int, str, None] = None,
                  logprobs: Optional[dict] = None, message_extra: Optional[dict] = None) -> dict:
    """`message_extra`: `tool_calls` and `reasoning_content` of a parsed answer."""
    return {
        "id": rid, "object": "chat.completion", "created": created, "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text, **(message_extra or {})},
                     "logprobs": logprobs, "finish_reason": finish_reason, "stop_reason": stop_reason}],
        "usage": usage_, "system_fingerprint": None, "mtplx_stats": stats,
    }


def chat_chunk(rid: str, created: int, model: str, delta: dict, finish_reason: Optional[str] = None,
               stop_reason: Union[int, str, None] = None, logprobs: Optional[dict] = None, **extra) -> dict:
    chunk = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
             "system_fingerprint": None,
             "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason,
                          "stop_reason": stop_reason}]}
    chunk.update(extra)
    return chunk


def completion_response(rid: str, created: int, model: str, text: str, finish_reason: str, usage_: dict,
                        stats: Optional[dict], stop_reason: Union[int, str, None] = None,
                        logprobs: Optional[dict] = None) -> dict:
    return {
        "id": rid, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
                     "stop_reason": stop_reason}],
        "usage": usage_, "system_fingerprint": None, "mtplx_stats": stats,
    }


def completion_chunk(rid: str, created: int, model: str, text: str, finish_reason: Optional[str] = None,
                     stop_reason: Union[int, str, None] = None, logprobs: Optional[dict] = None,
                     **extra) -> dict:
    chunk = {"id": rid, "object": "text_completion", "created": created, "model": model,
             "system_fingerprint": None,
             "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
                          "stop_reason": stop_reason}]}
    chunk.update(extra)
    return chunk


def usage_chunk(rid: str, created: int, model: str, obj: str, usage_: dict, stats: Optional[dict]) -> dict:
    """The extra last chunk of stream_options.include_usage: empty choices, usage set."""
    return {"id": rid, "object": obj, "created": created, "model": model, "system_fingerprint": None,
            "choices": [], "usage": usage_, "mtplx_stats": stats}


def tokenize_response(ids: List[int], max_model_len: int, token_strs: Optional[List[str]] = None) -> dict:
    """vLLM's /tokenize answer."""
    return {"count": len(ids), "max_model_len": int(max_model_len), "tokens": list(ids), "token_strs": token_strs}


def models_list(model_ids: Iterable[str], created: int, max_context: Optional[int] = None) -> dict:
    data = []
    for mid in model_ids:
        entry = {"id": mid, "object": "model", "created": created, "owned_by": "mtplx"}
        if max_context:
            entry["max_model_len"] = int(max_context)
        data.append(entry)
    return {"object": "list", "data": data}


# ----------------------------------------------------------------------------------------------
# Log probabilities in OpenAI's shapes. The engine reports, per emitted token and parallel to the
# token stream, (logprob, [(alt_id, alt_logprob), ...]): the target's log-softmax at that token and
# its top alternatives, heaviest first.


def chat_logprobs(tokens: Sequence[int], entries: Sequence[tuple], top: int, token_bytes: TokenBytes) -> dict:
    """A chat choice's (or chunk's) `logprobs`: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    def item(token_id, logprob):
        text, raw = token_bytes(token_id)
        return {"token": text, "logprob": float(logprob), "bytes": list(raw)}

    content = []
    for token_id, (logprob, alts) in zip(tokens, entries):
        content.append({**item(token_id, logprob), "top_logprobs": [item(a, lp) for a, lp in list(alts)[:top]]})
    return {"content": content, "refusal": None}


def completion_logprobs(tokens: Sequence[int], entries: Sequence[tuple], top: int, token_bytes: TokenBytes,
                        text_offset: int = 0) -> dict:
    """A completion choice's (or chunk's) legacy `logprobs`: tokens, token_logprobs, top_logprobs
    (the chosen token and up to `top` alternatives) and text_offset (each token's start in the
    completion text, counting the tokens' own texts, from `text_offset`)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, (logprob, alts) in zip(tokens, entries):
        text = token_bytes(token_id)[0]
        out["tokens"].append(text)
        out["token_logprobs"].append(float(logprob))
        alternatives = {token_bytes(a)[0]: float(lp) for a, lp in list(alts)[:top]}
        alternatives.setdefault(text, float(logprob))
        out["top_logprobs"].append(alternatives)
        out["text_offset"].append(text_offset)
        text_offset += len(text)
    return out


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def now() -> int:
    return int(time.time())
