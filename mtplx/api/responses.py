"""OpenAI's Responses API (`POST /v1/responses`; `GET` and `DELETE /v1/responses/{id}` read and
delete a stored one): the request model, the conversation it continues and adds to (input items,
`instructions`, `previous_response_id`) as the chat messages the model's template renders, its
output plan (tools, `text.format`, `reasoning`), and the response object, its output items and
its typed stream events, as the `openai` client's types define them.

A Responses request rides the chat path: the same template, rows, lanes and parsers (reasoning,
tool calls); only the framing differs. No MLX here (the ingress imports this module).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from mtplx.api import openai as oa
from mtplx.api import output_plan
from mtplx.api.errors import OpenAIError, invalid_request
from mtplx.api.limits import MAX_TOP_LOGPROBS, check_token_count, request_limits
from mtplx.api.parsing import ParsedAnswer
from mtplx.api.tools import responses_tool_choice, responses_tools
from mtplx.end import CANCELLED, EOS, GRAMMAR_COMPLETE, LENGTH, REPETITION, STOP_STRING, STOP_TOKEN

LOGPROBS_INCLUDE = "message.output_text.logprobs"
# what `include` may ask for: the output text's log-probabilities, and reasoning's encrypted
# content (there is none to give: reasoning items carry their text in the clear)
INCLUDABLE = (LOGPROBS_INCLUDE, "reasoning.encrypted_content")
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512
THINKING_OFF_EFFORTS = ("none", "minimal")
ITEM_ID_PREFIXES = {"message": "msg_", "function_call": "fc_", "function_call_output": "fco_", "reasoning": "rs_"}


def new_response_id() -> str:
    return "resp_" + uuid.uuid4().hex


def new_item_id(kind: str) -> str:
    return ITEM_ID_PREFIXES[kind] + uuid.uuid4().hex


# ----------------------------------------------------------------------------------------------
# The request


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: Optional[dict] = None
    verbosity: Optional[Literal["low", "medium", "high"]] = None


class ReasoningConfig(BaseModel):
    """`effort` turns thinking on (low, medium, high, xhigh) or off (none, minimal); a summary is
    never written (the reasoning item carries the reasoning text itself)."""

    model_config = ConfigDict(extra="forbid")
    effort: Optional[Literal["none", "minimal", "low", "medium", "high", "xhigh"]] = None
    summary: Optional[Literal["auto", "concise", "detailed"]] = None
    generate_summary: Optional[Literal["auto", "concise", "detailed"]] = None


class ResponsesStreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_obfuscation: Optional[bool] = None     # no effect: events are never padded


class ResponsesRequest(oa.SamplingFields):
    """POST /v1/responses. Every field is acted on or refused by name (`checks`); OpenAI's
    bookkeeping fields (`user`, `safety_identifier`, `service_tier`) are accepted, echoed and have
    no effect, `metadata` is stored with the response."""

    input: Union[str, List[dict]]
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = Field(default=None, ge=1, strict=True)
    max_tool_calls: Optional[int] = Field(default=None, ge=1, strict=True)
    text: Optional[TextConfig] = None
    tools: Optional[list] = None
    tool_choice: Union[str, dict, None] = None
    parallel_tool_calls: Optional[bool] = None
    reasoning: Optional[ReasoningConfig] = None
    store: Optional[bool] = None
    previous_response_id: Optional[str] = Field(default=None, min_length=1, max_length=256)
    stream: bool = False
    stream_options: Optional[ResponsesStreamOptions] = None
    include: Optional[List[str]] = None
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS, strict=True)
    metadata: Optional[Dict[str, str]] = None
    user: Optional[str] = None
    safety_identifier: Optional[str] = None
    service_tier: Optional[str] = None
    # the prefix cache's partition (with the caller's key), as chat's cache_salt
    prompt_cache_key: Optional[str] = Field(default=None, min_length=1, max_length=1024)
    prompt_cache_retention: Optional[Literal["in_memory", "24h"]] = None
    truncation: Optional[Literal["auto", "disabled"]] = None
    background: Optional[bool] = None
    conversation: Optional[Any] = None
    prompt: Optional[Any] = None

    @field_validator("max_output_tokens")
    @classmethod
    def _check_max_output_tokens(cls, v, info: ValidationInfo):
        return check_token_count(v, "max_output_tokens", request_limits(info))

    def checks(self) -> None:
        for name, (served, why) in _REFUSED.items():
            value = getattr(self, name)
            if value is not None and value not in served:
                raise invalid_request(f"{name}={value!r} is not supported: {why}", param=name,
                                      code="unsupported_value")
        if self.stream_options is not None and not self.stream:
            raise invalid_request("stream_options is only allowed when stream is true", param="stream_options")
        for i, value in enumerate(self.include or ()):
            if value not in INCLUDABLE:
                raise invalid_request(f"include {value!r} is not supported (only {list(INCLUDABLE)})",
                                      param=f"include.{i}", code="unsupported_value")
        self._check_metadata()
        bound = self._limits.tool_calls
        if self.max_tool_calls is not None and self.max_tool_calls > bound:
            raise invalid_request(f"max_tool_calls={self.max_tool_calls} is above this server's limit of {bound} "
                                  f"calls per answer", param="max_tool_calls", code="invalid_value")
        self.input_items()        # every item checked here, at parse
        plan = self.output_plan()
        if self.requested_logprobs is not None and plan.parses:
            raise invalid_request("log-probabilities are returned for plain text answers only (no tools, no "
                                  "reasoning)", param="include", code="unsupported_value")

    def _check_metadata(self) -> None:
        meta = self.metadata or {}
        if len(meta) > MAX_METADATA_PAIRS:
            raise invalid_request(f"metadata holds at most {MAX_METADATA_PAIRS} pairs", param="metadata")
        for key, value in meta.items():
            if len(key) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE:
                raise invalid_request(f"metadata keys are at most {MAX_METADATA_KEY} characters and values at "
                                      f"most {MAX_METADATA_VALUE}", param=f"metadata.{key[:MAX_METADATA_KEY]}")

    # -- what it asks for ---------------------------------------------------------------------------

    @property
    def stores(self) -> bool:
        """OpenAI's default: a response is stored unless `store: false`."""
        return self.store is not False

    @property
    def requested_logprobs(self) -> Optional[int]:
        if self.top_logprobs is None and LOGPROBS_INCLUDE not in (self.include or ()):
            return None
        return self.top_logprobs or 0

    @property
    def thinking(self) -> bool:
        effort = self.reasoning.effort if self.reasoning else None
        return effort is not None and effort not in THINKING_OFF_EFFORTS

    def input_items(self) -> List[dict]:
        """`input` as items in one shape (`normalize_item`), each with an id."""
        if isinstance(self.input, str):
            return [normalize_item({"type": "message", "role": "user", "content": self.input}, "input")]
        return [normalize_item(item, f"input.{i}") for i, item in enumerate(self.input)]

    def output_plan(self) -> output_plan.OutputPlan:
        tools = responses_tools(self.tools)
        choice = responses_tool_choice(self.tool_choice, tools, self.parallel_tool_calls,
                                       self.max_tool_calls or self._limits.tool_calls)
        fmt = self.text.format if self.text is not None else None
        structured = output_plan.text_format_constraint(fmt) if fmt is not None else None
        return output_plan.assemble(self.thinking, None, tools, choice, structured)

    def chat_request(self, messages: List[oa.ChatMessage]) -> "ResponsesChatRequest":
        """The chat request this one is served as: the conversation's messages, the same sampling,
        budget (`max_output_tokens`) and prefix-cache partition (`prompt_cache_key`)."""
        values = {name: getattr(self, name) for name in oa.SamplingFields.model_fields}
        logprobs = self.requested_logprobs
        values.update(messages=messages, max_tokens=self.max_output_tokens, stream=self.stream, user=self.user,
                      cache_salt=self.prompt_cache_key, logprobs=logprobs is not None or None,
                      top_logprobs=logprobs or None)
        return ResponsesChatRequest.model_validate(values, context=self._limits)

    def echo(self) -> dict:
        """The request's settings as a response object repeats them."""
        reasoning = self.reasoning or ReasoningConfig()
        text = {"format": (self.text.format if self.text and self.text.format else {"type": "text"})}
        if self.text is not None and self.text.verbosity is not None:
            text["verbosity"] = self.text.verbosity
        return {
            "instructions": self.instructions, "max_output_tokens": self.max_output_tokens,
            "max_tool_calls": self.max_tool_calls, "metadata": dict(self.metadata or {}),
            "parallel_tool_calls": self.parallel_tool_calls is not False,
            "previous_response_id": self.previous_response_id,
            "reasoning": {"effort": reasoning.effort, "summary": reasoning.summary or reasoning.generate_summary},
            "store": self.stores, "temperature": self.temperature, "text": text,
            "tool_choice": self.tool_choice if self.tool_choice is not None else ("auto" if self.tools else "none"),
            "tools": [dict(t, strict=t.get("strict")) for t in (self.tools or [])],
            "top_p": self.top_p, "top_logprobs": self.top_logprobs, "truncation": "disabled", "user": self.user,
            "safety_identifier": self.safety_identifier, "prompt_cache_key": self.prompt_cache_key,
            "service_tier": self.service_tier or "default", "background": False,
        }


# fields served at these values only: (the values, why others are refused)
_REFUSED = {
    "background": ((False,), "responses run in the foreground only"),
    "conversation": ((), "conversations are not stored; continue with previous_response_id"),
    "prompt": ((), "stored prompt templates are not supported; send input and instructions"),
    "truncation": (("disabled",), "a conversation longer than the context window is refused, never cut"),
    "prompt_cache_retention": (("in_memory",), "the prefix cache lives in memory only"),
}


class ResponsesChatRequest(oa.ChatCompletionRequest):
    """A Responses request as the chat request the ingress serves: errors name its own fields."""

    @property
    def max_tokens_param(self) -> str:
        return "max_output_tokens"

    @property
    def prompt_param(self) -> str:
        return "input"


# ----------------------------------------------------------------------------------------------
# Input items


def _field(item: dict, key: str, kind, param: str, required: bool = True):
    value = item.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, kind):
        what = "a string" if kind is str else f"{kind}"
        raise invalid_request(f"{item.get('type', 'an item')} item needs {key} ({what})", param=f"{param}.{key}",
                              code="missing_required_parameter" if value is None else "invalid_value")
    return value


def _parts_text(content, param: str, kinds=("input_text", "output_text")) -> str:
    """A message's content: a string, or text parts; images, files and audio are refused by name."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid_request("content must be a string or a list of text parts", param=param)
    pieces = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "refusal" and isinstance(part.get("refusal"), str):
            pieces.append(part["refusal"])
            continue
        if kind not in kinds or not isinstance(part.get("text"), str):
            raise invalid_request(f"content part type {kind!r} is not supported (text only; no images, files or "
                                  f"audio)", param=f"{param}.{j}.type", code="unsupported_content")
        pieces.append(part["text"])
    return "".join(pieces)


def _message(item: dict, param: str) -> dict:
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise invalid_request(f"a message's role must be user, system, developer or assistant, got {role!r}",
                              param=f"{param}.role")
    if "content" not in item:
        raise invalid_request("a message needs content", param=f"{param}.content",
                              code="missing_required_parameter")
    text = _parts_text(item["content"], f"{param}.content")
    kind = "output_text" if role == "assistant" else "input_text"
    return {"type": "message", "role": role, "content": [{"type": kind, "text": text}]}


def _function_call(item: dict, param: str) -> dict:
    arguments = item.get("arguments", "{}")
    if isinstance(arguments, dict):
        arguments = json.dumps(arguments, ensure_ascii=False)
    if not isinstance(arguments, str):
        raise invalid_request("a function_call's arguments must be a JSON string", param=f"{param}.arguments")
    return {"type": "function_call", "call_id": _field(item, "call_id", str, param),
            "name": _field(item, "name", str, param), "arguments": arguments}


def _function_call_output(item: dict, param: str) -> dict:
    output = item.get("output")
    if output is None:
        raise invalid_request("a function_call_output needs output", param=f"{param}.output",
                              code="missing_required_parameter")
    return {"type": "function_call_output", "call_id": _field(item, "call_id", str, param),
            "output": _parts_text(output, f"{param}.output", ("input_text", "output_text"))}


def _reasoning(item: dict, param: str) -> dict:
    content = item.get("content") or []
    if not isinstance(content, list):
        raise invalid_request("a reasoning item's content must be a list", param=f"{param}.content")
    text = _parts_text(content, f"{param}.content", ("reasoning_text",))
    return {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": text}]}


_ITEM_READERS = {"message": _message, "function_call": _function_call,
                 "function_call_output": _function_call_output, "reasoning": _reasoning}


def normalize_item(item, param: str) -> dict:
    """An input item (or an output item sent back) in one shape: a message {role, content: [one
    text part]}, a function_call {call_id, name, arguments}, a function_call_output {call_id,
    output}, or a reasoning item {content: [reasoning_text]}; its id kept or made. Item fields
    other than these (status, annotations, ...) are read past; other item types are refused."""
    if not isinstance(item, dict):
        raise invalid_request("an input item must be an object", param=param)
    kind = item.get("type", "message" if "role" in item else None)
    reader = _ITEM_READERS.get(kind)
    if reader is None:
        raise invalid_request(f"input item type {kind!r} is not supported (message, function_call, "
                              f"function_call_output, reasoning)", param=f"{param}.type", code="unsupported_value")
    out = reader(item, param)
    item_id = item.get("id")
    out["id"] = item_id if isinstance(item_id, str) and item_id else new_item_id(kind)
    return out


def chat_messages(instructions: Optional[str], items: List[dict]) -> List[oa.ChatMessage]:
    """The conversation as chat messages: `instructions` as the system message, then each item;
    function calls join the assistant turn before them (or make one), a reasoning item's text
    goes with the assistant turn after it."""
    out: List[oa.ChatMessage] = []
    if instructions:
        out.append(oa.ChatMessage(role="system", content=instructions))
    reasoning: Optional[str] = None
    for item in items:
        kind = item["type"]
        if kind == "reasoning":
            reasoning = (reasoning or "") + item["content"][0]["text"]
        elif kind == "function_call_output":
            out.append(oa.ChatMessage(role="tool", content=item["output"], tool_call_id=item["call_id"]))
        elif kind == "function_call":
            call = oa.ToolCallIn(id=item["call_id"], function=oa.FunctionCallIn(name=item["name"],
                                                                                  arguments=item["arguments"]))
            if out and out[-1].role == "assistant" and reasoning is None:
                out[-1].tool_calls = (out[-1].tool_calls or []) + [call]
            else:
                out.append(oa.ChatMessage(role="assistant", content=None, tool_calls=[call],
                                          reasoning_content=reasoning))
                reasoning = None
        else:
            text = item["content"][0]["text"]
            extra = {"reasoning_content": reasoning} if item["role"] == "assistant" else {}
            out.append(oa.ChatMessage(role=item["role"], content=text, **extra))
            reasoning = None if item["role"] == "assistant" else reasoning
    return out


@dataclass
class Turn:
    """One request's conversation: `history`, the items of the response it continues (its
    context and its output), then `items`, this request's own input."""

    request: ResponsesRequest
    history: List[dict]
    items: List[dict]
    plan: output_plan.OutputPlan

    @property
    def context(self) -> List[dict]:
        return self.history + self.items

    def messages(self) -> List[oa.ChatMessage]:
        messages = chat_messages(self.request.instructions, self.context)
        if not messages:
            raise invalid_request("input is empty and there are no instructions", param="input")
        return messages


def prepare_turn(req: ResponsesRequest, previous_context: Optional[List[dict]] = None,
                 previous_output: Optional[List[dict]] = None) -> Turn:
    """The turn of `req`, continuing a stored response (its context and output) when it names one."""
    history = list(previous_context or [])
    history += [normalize_item(item, "previous_response_id") for item in (previous_output or [])]
    return Turn(req, history, req.input_items(), req.output_plan())


# ----------------------------------------------------------------------------------------------
# The response


def usage(input_tokens: int, output_tokens: int, cached_tokens: int, reasoning_tokens: int) -> dict:
    """`cache_write_tokens` is not counted here (0): the prefix cache banks prompts on its own."""
    return {"input_tokens": int(input_tokens),
            "input_tokens_details": {"cached_tokens": int(cached_tokens or 0), "cache_write_tokens": 0},
            "output_tokens": int(output_tokens), "output_tokens_details": {"reasoning_tokens": int(reasoning_tokens)},
            "total_tokens": int(input_tokens) + int(output_tokens)}


# A row's End as a response's status: completed, incomplete (its budget ran out, for the reason
# INCOMPLETE_REASON gives) or cancelled (through the cancel route); a row that fails is an error event
STATUS_OF_END = {EOS: "completed", STOP_TOKEN: "completed", STOP_STRING: "completed", LENGTH: "incomplete",
                 GRAMMAR_COMPLETE: "completed", REPETITION: "completed", CANCELLED: "cancelled"}
INCOMPLETE_REASON = {LENGTH: "max_output_tokens"}


def response_object(rid: str, created_at: float, model: str, echo: dict, status: str, output: List[dict],
                    usage_: Optional[dict] = None, stats: Optional[dict] = None,
                    incomplete_reason: Optional[str] = None) -> dict:
    done = status not in ("in_progress", "queued")
    return {"id": rid, "object": "response", "created_at": created_at, "status": status,
            "completed_at": time.time() if status == "completed" else None, "error": None,
            "incomplete_details": {"reason": incomplete_reason} if incomplete_reason else None, "model": model,
            "output": output, "usage": usage_ if done else None, **echo, "mtplx_stats": stats}


def message_item(text: str, status: str, logprobs: Optional[list] = None, item_id: Optional[str] = None) -> dict:
    return {"id": item_id or new_item_id("message"), "type": "message", "role": "assistant", "status": status,
            "content": [output_text_part(text, logprobs)]}


def output_text_part(text: str, logprobs: Optional[list] = None) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def reasoning_item(text: str, status: str = "completed", item_id: Optional[str] = None) -> dict:
    return {"id": item_id or new_item_id("reasoning"), "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "encrypted_content": None, "status": status}


def function_call_item(call_id: str, name: str, arguments: str, status: str, item_id: Optional[str] = None) -> dict:
    return {"id": item_id or new_item_id("function_call"), "type": "function_call", "call_id": call_id,
            "name": name, "arguments": arguments, "status": status}


def output_items(parsed: Optional[ParsedAnswer], text: str, status: str, logprobs: Optional[list] = None) -> list:
    """A whole answer's output: a reasoning item (its text, when thinking wrote any), a message
    (unless it is blank beside function calls), the function calls it returns."""
    if parsed is None:
        return [message_item(text, status, logprobs)]
    items = [reasoning_item(parsed.reasoning)] if parsed.reasoning else []
    if (parsed.content or "").strip() or not parsed.tool_calls:
        items.append(message_item(parsed.content or "", status))
    items += [function_call_item(c.id, c.name, c.arguments, "completed") for c in parsed.tool_calls]
    return items


# ----------------------------------------------------------------------------------------------
# The stream


class ResponseEvents:
    """A streamed response's typed events (dicts; `sequence_number` counts them from 0) from a
    parsed answer's events (`mtplx.api.parsing`; ("content", text) for an answer not parsed):
    `start`, `push` as the text comes, `close` at its end, then `terminal` with the final
    response. Items open and close as the answer moves between reasoning, text and calls;
    `output` holds the closed ones."""

    def __init__(self, response: dict):
        self.response = response           # the in-progress response object
        self.sequence = 0
        self.output: List[dict] = []
        self._open: Optional[dict] = None
        self._text: List[str] = []
        self._logprobs: list = []

    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def start(self) -> List[dict]:
        return [self._event("response.created", response=self.response),
                self._event("response.in_progress", response=self.response)]

    def push(self, events: list, logprobs: Optional[list] = None) -> List[dict]:
        out: List[dict] = []
        for ev in events:
            if ev[0] == "reasoning":
                out += self._reasoning(ev[1])
            elif ev[0] == "content":
                out += self._content(ev[1], logprobs)
                logprobs = None
            elif ev[0] == "call":
                out += self._open_item(function_call_item(ev[2], ev[3], "", "in_progress"))
            else:
                out += self._arguments(ev[2])
        return out

    def _where(self) -> dict:
        return {"item_id": self._open["id"], "output_index": len(self.output)}

    def _open_item(self, item: dict) -> List[dict]:
        out = self.close("completed")
        self._open, self._text, self._logprobs = item, [], []
        out.append(self._event("response.output_item.added", output_index=len(self.output), item=dict(item)))
        part = {"message": output_text_part(""), "reasoning": {"type": "reasoning_text", "text": ""}}.get(item["type"])
        if part is not None:
            out.append(self._event("response.content_part.added", **self._where(), content_index=0, part=part))
        return out

    def _reasoning(self, text: str) -> List[dict]:
        out = [] if self._is_open("reasoning") else self._open_item(reasoning_item("", "in_progress"))
        self._text.append(text)
        return out + [self._event("response.reasoning_text.delta", **self._where(), content_index=0, delta=text)]

    def _content(self, text: str, logprobs: Optional[list]) -> List[dict]:
        out = [] if self._is_open("message") else self._open_item(message_item("", "in_progress", []))
        self._text.append(text)
        self._logprobs += logprobs or []
        return out + [self._event("response.output_text.delta", **self._where(), content_index=0, delta=text,
                                  logprobs=list(logprobs or []))]

    def _arguments(self, fragment: str) -> List[dict]:
        if not self._is_open("function_call"):
            return []
        self._text.append(fragment)
        return [self._event("response.function_call_arguments.delta", **self._where(), delta=fragment)]

    def _is_open(self, kind: str) -> bool:
        return self._open is not None and self._open["type"] == kind

    def close(self, status: str) -> List[dict]:
        """The open item's done events (`status`: completed, or incomplete when the answer ended in
        it); it joins `output`."""
        item, self._open = self._open, None
        if item is None:
            return []
        text, where = "".join(self._text), {"item_id": item["id"], "output_index": len(self.output)}
        if item["type"] == "message":
            item = message_item(text, status, self._logprobs, item["id"])
            out = [self._event("response.output_text.done", **where, content_index=0, text=text,
                               logprobs=self._logprobs),
                   self._event("response.content_part.done", **where, content_index=0, part=item["content"][0])]
        elif item["type"] == "reasoning":
            item = reasoning_item(text, "completed", item["id"])
            out = [self._event("response.reasoning_text.done", **where, content_index=0, text=text),
                   self._event("response.content_part.done", **where, content_index=0, part=item["content"][0])]
        else:
            item = function_call_item(item["call_id"], item["name"], text, status, item["id"])
            out = [self._event("response.function_call_arguments.done", **where, name=item["name"], arguments=text)]
        self.output.append(item)
        return out + [self._event("response.output_item.done", output_index=where["output_index"], item=item)]

    def terminal(self, response: dict) -> dict:
        """The last event: response.completed, or response.incomplete (its budget ran out, or it
        was cancelled through the cancel route)."""
        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
        return self._event(kind, response=response)

    def error(self, exc: OpenAIError) -> dict:
        return self._event("error", code=exc.code, message=exc.message, param=exc.param)


def sse(event: dict) -> bytes:
    """An event as OpenAI frames it: its type as the SSE event name."""
    return f"event: {event['type']}\n".encode() + oa.sse(event)
