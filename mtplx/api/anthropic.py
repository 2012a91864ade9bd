"""Anthropic Messages protocol (`POST /v1/messages`, `POST /v1/messages/count_tokens`): request
models, their translation into the chat-completions request the ingress already serves, and the
response, streaming event and error shapes.

A Messages request rides the same path as a chat completion: the model's chat template, the same
row in the same cohorts and running lanes, the same streaming machinery; only the framing differs.
Like `mtplx.api.openai`, no MLX here (the ingress imports this module).
"""

from __future__ import annotations

import json
import uuid
from typing import List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationInfo, field_validator

from mtplx.api import limits
from mtplx.api import openai as oa
from mtplx.api import output_plan
from mtplx.api.errors import OpenAIError, invalid_request
from mtplx.api.parsing import ParsedAnswer
from mtplx.api.tools import anthropic_tool_choice, anthropic_tools
from mtplx.end import CANCELLED, EOS, GRAMMAR_COMPLETE, LENGTH, REPETITION, STOP_STRING, STOP_TOKEN, End

# Anthropic error types by HTTP status (https://docs.anthropic.com/en/api/errors).
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large", 415: "invalid_request_error",
               429: "rate_limit_error", 500: "api_error", 503: "overloaded_error", 529: "overloaded_error"}


REQUEST_ID_HEADER = "request-id"     # Anthropic's; its clients read it as a response's request id


def new_message_id() -> str:
    """A message id in Anthropic's form (msg_...); it is the request's id too."""
    return f"msg_{uuid.uuid4().hex}"


def error_body(exc: OpenAIError) -> dict:
    """An error in Anthropic's shape: {"type": "error", "error": {"type", "message"}}; a refused
    field is named at the start of the message ("tools.0.input_schema: ..."), as Anthropic does."""
    message = exc.message
    if exc.param and exc.status == 400 and not message.startswith(exc.param):
        message = f"{exc.param}: {message}"
    return {"type": "error", "error": {"type": ERROR_TYPES.get(exc.status, "api_error"), "message": message}}


# ----------------------------------------------------------------------------------------------
# Requests


class ContentBlock(BaseModel):
    """A content block: text; tool_use (assistant turns) and tool_result (user turns); thinking
    (assistant turns; the template drops past reasoning). Citations are ignored; a cache_control
    hint only changes how usage splits the prompt (see `MessagesRequest.sends_cache_control`)."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: Optional[str] = None


def _blocks_text(content: Union[str, List[ContentBlock]], param: str, allowed=("text",)) -> str:
    """The text of a turn's text blocks; blocks of the `allowed` kinds other than text are skipped
    (the caller reads them), any other kind is refused by name."""
    if isinstance(content, str):
        return content
    pieces = []
    for j, block in enumerate(content):
        if block.type not in allowed or (block.type == "text" and block.text is None):
            raise invalid_request(f"Content block type {block.type!r} is not supported here (text, and tool_use "
                                  f"/ thinking in assistant turns, tool_result in user turns; no images or "
                                  f"documents)", param=f"{param}.{j}.type", code="unsupported_content")
        if block.type == "text":
            pieces.append(block.text)
    return "".join(pieces)


def _field(block: ContentBlock, name: str, kind, param: str):
    value = (block.model_extra or {}).get(name)
    if not isinstance(value, kind):
        raise invalid_request(f"a {block.type} block needs {name}", param=f"{param}.{name}")
    return value


def _tool_result_text(block: ContentBlock, param: str) -> str:
    content = (block.model_extra or {}).get("content", "")
    if isinstance(content, list):
        try:
            content = [ContentBlock.model_validate(b) for b in content]
        except Exception:
            raise invalid_request("tool_result content must be a string or text blocks",
                                  param=f"{param}.content") from None
    elif not isinstance(content, str):
        raise invalid_request("tool_result content must be a string or text blocks", param=f"{param}.content")
    text = _blocks_text(content, f"{param}.content")
    return f"Error: {text}" if (block.model_extra or {}).get("is_error") else text


def _user_turn(content, param: str) -> List[oa.ChatMessage]:
    """A user turn: its tool_result blocks as tool messages (in order), then its text."""
    if isinstance(content, str):
        return [oa.ChatMessage(role="user", content=content)]
    out = []
    for j, block in enumerate(content):
        if block.type == "tool_result":
            where = f"{param}.{j}"
            out.append(oa.ChatMessage(role="tool", content=_tool_result_text(block, where),
                                      tool_call_id=_field(block, "tool_use_id", str, where)))
    text = _blocks_text(content, param, ("text", "tool_result"))
    if text or not out:
        out.append(oa.ChatMessage(role="user", content=text))
    return out


def _assistant_turn(content, param: str) -> oa.ChatMessage:
    """An assistant turn: text, tool_use blocks as tool calls, thinking as reasoning."""
    if isinstance(content, str):
        return oa.ChatMessage(role="assistant", content=content)
    calls, reasoning = [], []
    for j, block in enumerate(content):
        where = f"{param}.{j}"
        if block.type == "tool_use":
            calls.append({"id": _field(block, "id", str, where), "type": "function",
                          "function": {"name": _field(block, "name", str, where),
                                       "arguments": json.dumps(_field(block, "input", dict, where), ensure_ascii=False)}})
        elif block.type == "thinking":
            reasoning.append((block.model_extra or {}).get("thinking") or "")
    text = _blocks_text(content, param, ("text", "tool_use", "thinking", "redacted_thinking"))
    return oa.ChatMessage(role="assistant", content=text, tool_calls=calls or None,
                          reasoning_content="".join(reasoning) if reasoning else None)


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["user", "assistant"]
    content: Union[str, List[ContentBlock]]


class _MessagesPrompt(limits.BoundedRequest):
    """The fields that make the prompt (shared by /v1/messages and /v1/messages/count_tokens). A
    field this server does not know is refused with a 400 naming it, as on the OpenAI routes."""

    model_config = ConfigDict(extra="forbid")
    model: str
    messages: List[Message] = Field(min_length=1)
    system: Union[str, List[ContentBlock], None] = None
    tools: Optional[list] = None
    tool_choice: Optional[dict] = None
    thinking: Optional[dict] = None
    output_config: Optional[dict] = None     # format: a JSON schema for the answer (structured outputs)
    _plan: Optional[output_plan.OutputPlan] = PrivateAttr(default=None)

    def checks(self) -> None:
        self.output_plan()      # tools, tool_choice and thinking are validated here

    def _thinking(self) -> tuple:
        """(on, budget) of `thinking`: {"type": "enabled", "budget_tokens": N} (below max_tokens;
        the answer follows the reasoning), {"type": "adaptive"} (on, no budget) or {"type":
        "disabled"}."""
        t = self.thinking
        if t is None:
            return False, None
        kind = t.get("type")
        if kind not in ("enabled", "adaptive", "disabled") or set(t) - {"type", "budget_tokens", "display"}:
            raise invalid_request("thinking must be {\"type\": \"enabled\", \"budget_tokens\": N}, "
                                  "{\"type\": \"adaptive\"} or {\"type\": \"disabled\"}", param="thinking")
        if kind != "enabled":
            return kind == "adaptive", None
        budget = t.get("budget_tokens")
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
            raise invalid_request("thinking.budget_tokens must be a non-negative integer",
                                  param="thinking.budget_tokens")
        try:
            limits.check_token_count(budget, "thinking.budget_tokens", self._limits)
        except ValueError as exc:
            raise invalid_request(str(exc), param="thinking.budget_tokens", code="invalid_value") from None
        max_tokens = getattr(self, "max_tokens", None)
        if max_tokens is not None and budget >= max_tokens:
            raise invalid_request(f"thinking.budget_tokens ({budget}) must be below max_tokens ({max_tokens})",
                                  param="thinking.budget_tokens")
        return True, budget

    def output_plan(self) -> output_plan.OutputPlan:
        """Tools in the prompt, calls parsed (and forced by a grammar for tool_choice any / tool),
        thinking split off and budgeted (mtplx.api.output_plan)."""
        if self._plan is None:
            tools = anthropic_tools(self.tools)
            choice = anthropic_tool_choice(self.tool_choice, tools, self._limits.tool_calls)
            thinking, budget = self._thinking()
            if thinking and self.continues_final_message:
                raise invalid_request("thinking cannot be combined with a final assistant turn (a prefill): the "
                                      "answer would start inside it, not in a thinking section", param="thinking")
            structured = output_plan.output_config_constraint(self.output_config)
            self._plan = output_plan.assemble(thinking, budget, tools, choice, structured)
        return self._plan

    @property
    def continues_final_message(self) -> bool:
        """A final assistant turn is a prefill: the answer continues it (and does not repeat it)."""
        return self.messages[-1].role == "assistant"

    def chat_messages(self) -> List[oa.ChatMessage]:
        out = []
        if self.system is not None:
            system = _blocks_text(self.system, "system")
            if system:
                out.append(oa.ChatMessage(role="system", content=system))
        for i, m in enumerate(self.messages):
            param = f"messages.{i}.content"
            if m.role == "user":
                out += _user_turn(m.content, param)
            else:
                out.append(_assistant_turn(m.content, param))
        return out

    def encode(self, tokenizer) -> List[int]:
        """The prompt's token ids, through the model's chat template (as a chat completion's)."""
        prefill = self.continues_final_message
        return oa.encode_chat(tokenizer, self.chat_messages(), add_generation_prompt=not prefill,
                              continue_final_message=prefill, template_kwargs=self.output_plan().template_kwargs)


class CountTokensRequest(_MessagesPrompt):
    pass


class Metadata(BaseModel):
    model_config = ConfigDict(extra="forbid")
    user_id: Optional[str] = None


class MessagesRequest(_MessagesPrompt):
    max_tokens: int = Field(ge=1, strict=True)
    stop_sequences: Optional[List[str]] = None
    stream: bool = False
    temperature: Optional[float] = Field(default=None, ge=0.0, le=1.0, strict=True)
    top_p: Optional[float] = Field(default=None, ge=0.0, le=1.0, strict=True)
    top_k: Optional[int] = Field(default=None, ge=0, strict=True)
    # accepted: bookkeeping, and a prompt-caching hint (the prefix cache is automatic; the hint only
    # asks for usage split into cache reads and uncached input)
    metadata: Optional[Metadata] = None
    service_tier: Optional[str] = None
    cache_control: Optional[dict] = None

    @field_validator("stop_sequences")
    @classmethod
    def _check_stops(cls, v):
        return v if v is None else limits.check_stop_strings(v)

    @field_validator("max_tokens")
    @classmethod
    def _check_max_tokens(cls, v, info: ValidationInfo):
        return limits.check_token_count(v, "max_tokens", limits.request_limits(info))

    @field_validator("top_p")
    @classmethod
    def _check_top_p(cls, v):
        return limits.check_top_p(v)

    @field_validator("top_k")
    @classmethod
    def _check_top_k(cls, v):
        return limits.check_top_k(v)

    def to_chat_request(self) -> oa.ChatCompletionRequest:
        """The chat-completions request this one is served as (same sampling, budget and stops)."""
        return oa.ChatCompletionRequest(
            model=self.model, messages=self.chat_messages(), max_tokens=self.max_tokens,
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            stop=list(self.stop_sequences) if self.stop_sequences else None, stream=self.stream,
            user=self.metadata.user_id if self.metadata else None)

    @property
    def sends_cache_control(self) -> bool:
        """Whether the request marks anything for prompt caching (top level, system or a message
        block): only then is usage split into cache reads and uncached input, as Anthropic's is."""
        blocks = [b for m in self.messages if not isinstance(m.content, str) for b in m.content]
        if self.system is not None and not isinstance(self.system, str):
            blocks += self.system
        return bool(self.cache_control) or any(
            (b.model_extra or {}).get("cache_control") for b in blocks)


# ----------------------------------------------------------------------------------------------
# Responses


# A row's End as Anthropic's stop_reason. A row that did not finish (cancelled through the cancel
# route) keeps vLLM's "abort": Anthropic has no word for it.
STOP_REASON_OF_END = {EOS: "end_turn", STOP_TOKEN: "end_turn", STOP_STRING: "stop_sequence", LENGTH: "max_tokens",
                      GRAMMAR_COMPLETE: "end_turn", REPETITION: "end_turn", CANCELLED: oa.ABORT}


def stop_reason(end: End, tool_use: bool = False) -> str:
    """Anthropic's stop_reason of a row's End; an answer that made tool calls and ended its turn
    says "tool_use"."""
    reason = STOP_REASON_OF_END[end.kind]
    return "tool_use" if tool_use and reason == "end_turn" else reason


def stop_sequence(end: End) -> Optional[str]:
    """Anthropic's stop_sequence: the stop string that ended the row (None for any other end)."""
    return end.string if end.kind == STOP_STRING else None


def content_blocks(parsed: ParsedAnswer) -> List[dict]:
    """A parsed answer's content: a thinking block (thinking on), a text block (unless blank
    beside tool calls), tool_use blocks."""
    blocks = []
    if parsed.reasoning is not None:
        blocks.append({"type": "thinking", "thinking": parsed.reasoning, "signature": ""})
    if (parsed.content or "").strip() or not parsed.tool_calls:
        blocks.append({"type": "text", "text": parsed.content or ""})
    for call in parsed.tool_calls:
        blocks.append({"type": "tool_use", "id": call.id, "name": call.name, "input": json.loads(call.arguments)})
    return blocks


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """Anthropic's usage: input_tokens excludes the prompt tokens read from the prefix cache (the
    ingress passes cached tokens only when the request sent cache_control)."""
    cached = int(cached_tokens or 0)
    return {"input_tokens": int(prompt_tokens) - cached, "output_tokens": int(completion_tokens),
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


def message_response(msg_id: str, model: str, text: str, end: End, usage_: dict, stats: Optional[dict],
                     parsed: Optional[ParsedAnswer] = None) -> dict:
    """`parsed`: the answer read for thinking and tool calls (None: one text block of `text`)."""
    content = [{"type": "text", "text": text}] if parsed is None else content_blocks(parsed)
    tool_use = parsed is not None and bool(parsed.tool_calls)
    return {"id": msg_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop_reason(end, tool_use), "stop_sequence": stop_sequence(end),
            "usage": usage_, "mtplx_stats": stats}


def sse_event(name: str, data: dict) -> bytes:
    return f"event: {name}\ndata: ".encode() + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


class MessageStream:
    """The server-sent events of one streamed message: message_start, its content blocks
    (content_block_start, content_block_delta..., content_block_stop), message_delta (stop reason
    and usage), message_stop; or an error event. message_start goes out before the prefix cache
    has answered, so both usages count the whole prompt as input (no cache reads): the two agree.

    A plain answer is one text block, opened at the start. A `parsed` answer (thinking, tools)
    opens its blocks as its parts arrive (`events`): thinking (thinking_delta), text
    (text_delta), tool_use (input {}, then input_json_delta fragments of the arguments)."""

    def __init__(self, msg_id: str, model: str, prompt_tokens: int, parsed: bool = False):
        self.msg_id, self.model, self.prompt_tokens = msg_id, model, int(prompt_tokens)
        self.parsed = parsed
        self.index = -1 if parsed else 0     # the open block
        self.block: Optional[str] = None if parsed else "text"
        self.tool_use = False

    def start(self) -> bytes:
        message = {"id": self.msg_id, "type": "message", "role": "assistant", "model": self.model,
                   "content": [], "stop_reason": None, "stop_sequence": None,
                   "usage": usage(self.prompt_tokens, 0)}
        out = sse_event("message_start", {"type": "message_start", "message": message})
        return out if self.parsed else out + self._block_start({"type": "text", "text": ""})

    def _block_start(self, block: dict) -> bytes:
        return sse_event("content_block_start", {"type": "content_block_start", "index": self.index,
                                                 "content_block": block})

    def _delta(self, delta: dict) -> bytes:
        return sse_event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def _open(self, kind: str, block: dict, new: bool = False) -> bytes:
        if self.block == kind and not new:
            return b""
        out = self._close()
        self.index, self.block = self.index + 1, kind
        return out + self._block_start(block)

    def _close(self) -> bytes:
        if self.block is None:
            return b""
        self.block = None
        return sse_event("content_block_stop", {"type": "content_block_stop", "index": self.index})

    def text(self, delta: str) -> bytes:
        return self._delta({"type": "text_delta", "text": delta})

    def events(self, events: list) -> bytes:
        """A parsed answer's events (mtplx.api.parsing) as block events."""
        out = b""
        for ev in events:
            if ev[0] == "reasoning":
                out += self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                out += self._delta({"type": "thinking_delta", "thinking": ev[1]})
            elif ev[0] == "content":
                out += self._open("text", {"type": "text", "text": ""}) + self.text(ev[1])
            elif ev[0] == "call":
                self.tool_use = True
                out += self._open("tool_use", {"type": "tool_use", "id": ev[2], "name": ev[3], "input": {}}, new=True)
            else:
                out += self._delta({"type": "input_json_delta", "partial_json": ev[2]})
        return out

    def finish(self, end: End, output_tokens: int, stats: Optional[dict]) -> bytes:
        opened = b"" if self.index >= 0 else self._open("text", {"type": "text", "text": ""})
        delta = {"stop_reason": stop_reason(end, self.tool_use), "stop_sequence": stop_sequence(end)}
        return (opened + self._close()
                + sse_event("message_delta", {"type": "message_delta", "delta": delta,
                                              "usage": usage(self.prompt_tokens, output_tokens),
                                              "mtplx_stats": stats})
                + sse_event("message_stop", {"type": "message_stop"}))

    @staticmethod
    def error(exc: OpenAIError) -> bytes:
        return sse_event("error", error_body(exc))
