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

from pydantic import BaseModel, ConfigDict, Field, field_validator

from mtplx.api import openai as oa

# Anthropic error types by HTTP status (https://docs.anthropic.com/en/api/errors).
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
               429: "rate_limit_error", 500: "api_error", 503: "overloaded_error", 529: "overloaded_error"}


REQUEST_ID_HEADER = "request-id"     # Anthropic's; its clients read it as a response's request id


def new_message_id() -> str:
    """A message id in Anthropic's form (msg_...); it is the request's id too."""
    return f"msg_{uuid.uuid4().hex}"


def error_body(exc: oa.OpenAIError) -> dict:
    """An error in Anthropic's shape: {"type": "error", "error": {"type", "message"}}."""
    return {"type": "error", "error": {"type": ERROR_TYPES.get(exc.status, "api_error"), "message": exc.message}}


# ----------------------------------------------------------------------------------------------
# Requests


class ContentBlock(BaseModel):
    """A content block; only text blocks are served (citations are ignored; a cache_control hint
    only changes how usage splits the prompt, see `MessagesRequest.sends_cache_control`)."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: Optional[str] = None


def _blocks_text(content: Union[str, List[ContentBlock]], param: str) -> str:
    if isinstance(content, str):
        return content
    pieces = []
    for j, block in enumerate(content):
        if block.type != "text" or block.text is None:
            raise oa.invalid_request(f"Content block type {block.type!r} is not supported (text blocks only: no "
                                     f"images, documents, tool use or thinking)", param=f"{param}.{j}.type",
                                     code="unsupported_content")
        pieces.append(block.text)
    return "".join(pieces)


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["user", "assistant"]
    content: Union[str, List[ContentBlock]]


class _MessagesPrompt(BaseModel):
    """The fields that make the prompt (shared by /v1/messages and /v1/messages/count_tokens). A
    field this server does not know is refused with a 400 naming it, as on the OpenAI routes."""

    model_config = ConfigDict(extra="forbid")
    model: str
    messages: List[Message] = Field(min_length=1)
    system: Union[str, List[ContentBlock], None] = None
    tools: Optional[list] = None
    tool_choice: Optional[dict] = None
    thinking: Optional[dict] = None

    def checks(self) -> None:
        for name in ("tools", "tool_choice", "thinking"):
            if getattr(self, name):
                raise oa.invalid_request(f"{name} is not supported by this server", param=name,
                                         code="unsupported_value")

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
            out.append(oa.ChatMessage(role=m.role, content=_blocks_text(m.content, f"messages.{i}.content")))
        return out

    def encode(self, tokenizer) -> List[int]:
        """The prompt's token ids, through the model's chat template (as a chat completion's)."""
        prefill = self.continues_final_message
        return oa.encode_chat(tokenizer, self.chat_messages(), add_generation_prompt=not prefill,
                              continue_final_message=prefill)


class CountTokensRequest(_MessagesPrompt):
    pass


class Metadata(BaseModel):
    model_config = ConfigDict(extra="forbid")
    user_id: Optional[str] = None


class MessagesRequest(_MessagesPrompt):
    max_tokens: int = Field(ge=1, strict=True)
    stop_sequences: Optional[List[str]] = None
    stream: bool = False
    temperature: Optional[float] = Field(default=None, ge=0.0, le=1.0)
    top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(default=None, ge=0, strict=True)
    # accepted: bookkeeping, and a prompt-caching hint (the prefix cache is automatic; the hint only
    # asks for usage split into cache reads and uncached input)
    metadata: Optional[Metadata] = None
    service_tier: Optional[str] = None
    cache_control: Optional[dict] = None

    @field_validator("stop_sequences")
    @classmethod
    def _check_stops(cls, v):
        if v is None:
            return None
        if len(v) > oa.MAX_STOP_STRINGS:
            raise ValueError(f"at most {oa.MAX_STOP_STRINGS} stop sequences are allowed, got {len(v)}")
        if any(s == "" for s in v):
            raise ValueError("stop sequences must be non-empty strings")
        return v

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


def stop_reason(finish_reason: str, stop_sequence: Optional[str]) -> str:
    """Anthropic's stop_reason from the row's OpenAI finish_reason and the stop string it matched."""
    if finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if stop_sequence is not None else "end_turn"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """Anthropic's usage: input_tokens excludes the prompt tokens read from the prefix cache (the
    ingress passes cached tokens only when the request sent cache_control)."""
    cached = int(cached_tokens or 0)
    return {"input_tokens": int(prompt_tokens) - cached, "output_tokens": int(completion_tokens),
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


def message_response(msg_id: str, model: str, text: str, finish_reason: str, stop_sequence: Optional[str],
                     usage_: dict, stats: Optional[dict]) -> dict:
    return {"id": msg_id, "type": "message", "role": "assistant", "model": model,
            "content": [{"type": "text", "text": text}],
            "stop_reason": stop_reason(finish_reason, stop_sequence), "stop_sequence": stop_sequence,
            "usage": usage_, "mtplx_stats": stats}


def sse_event(name: str, data: dict) -> bytes:
    return f"event: {name}\ndata: ".encode() + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


class MessageStream:
    """The server-sent events of one streamed message: message_start, one text content block
    (content_block_start, content_block_delta..., content_block_stop), message_delta (stop reason
    and usage), message_stop; or an error event. message_start goes out before the prefix cache
    has answered, so both usages count the whole prompt as input (no cache reads): the two agree."""

    def __init__(self, msg_id: str, model: str, prompt_tokens: int):
        self.msg_id, self.model, self.prompt_tokens = msg_id, model, int(prompt_tokens)

    def start(self) -> bytes:
        message = {"id": self.msg_id, "type": "message", "role": "assistant", "model": self.model,
                   "content": [], "stop_reason": None, "stop_sequence": None,
                   "usage": usage(self.prompt_tokens, 0)}
        return (sse_event("message_start", {"type": "message_start", "message": message})
                + sse_event("content_block_start", {"type": "content_block_start", "index": 0,
                                                    "content_block": {"type": "text", "text": ""}}))

    def text(self, delta: str) -> bytes:
        return sse_event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                 "delta": {"type": "text_delta", "text": delta}})

    def finish(self, finish_reason: str, stop_sequence: Optional[str], output_tokens: int,
               stats: Optional[dict]) -> bytes:
        return (sse_event("content_block_stop", {"type": "content_block_stop", "index": 0})
                + sse_event("message_delta", {"type": "message_delta",
                                              "delta": {"stop_reason": stop_reason(finish_reason, stop_sequence),
                                                        "stop_sequence": stop_sequence},
                                              "usage": usage(self.prompt_tokens, output_tokens),
                                              "mtplx_stats": stats})
                + sse_event("message_stop", {"type": "message_stop"}))

    @staticmethod
    def error(exc: oa.OpenAIError) -> bytes:
        return sse_event("error", error_body(exc))
