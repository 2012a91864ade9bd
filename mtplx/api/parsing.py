"""Reading an answer's text as it streams: the reasoning before `</think>`, the content, and the
tool calls written as `<tool_call>` blocks (`mtplx.api.tools`), with each call's arguments
streamed as their text arrives. Text that may be the start of a marker is held back until the
next piece decides it; nothing is ever taken back. Plain Python, no MLX.

Events (tuples), in order:
  ("reasoning", text)            thinking text
  ("content", text)              answer text outside tool calls
  ("call", index, id, name)      a tool call starts
  ("args", index, fragment)      more of that call's arguments (their JSON text, as written)
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Callable, List, Optional

from mtplx.api.tools import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, new_call_id

THINK_START = "<think>"
THINK_END = "</think>"
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')


def _held_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker` (held back: it may be the marker)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ReasoningSplitter:
    """Thinking on: the text up to the first `</think>` is reasoning (an opening `<think>` the
    model writes itself is dropped), the rest is the answer, its leading whitespace stripped."""

    def __init__(self):
        self.answering = False
        self._buf = ""
        self._opening = True        # an opening <think> may still come
        self._strip = True          # the answer's leading whitespace is dropped

    def push(self, text: str) -> list:
        if self.answering:
            return self._answer(text)
        buf = self._buf + text
        if self._opening:
            head = buf.lstrip()
            if THINK_START.startswith(head) and len(head) < len(THINK_START):
                self._buf = buf
                return []
            self._opening = False
            if head.startswith(THINK_START):
                buf = head[len(THINK_START):]
        at = buf.find(THINK_END)
        if at >= 0:
            self.answering, self._buf = True, ""
            out = [("reasoning", buf[:at])] if at else []
            return out + self._answer(buf[at + len(THINK_END):])
        keep = _held_suffix(buf, THINK_END)
        self._buf = buf[len(buf) - keep:] if keep else ""
        reasoning = buf[:len(buf) - keep]
        return [("reasoning", reasoning)] if reasoning else []

    def _answer(self, text: str) -> list:
        if self._strip:
            text = text.lstrip()
            self._strip = not text
        return [("answer", text)] if text else []

    def flush(self) -> list:
        out, self._buf = self._buf, ""
        return [("reasoning", out)] if out and not self.answering else []


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""
    raw: str = ""               # the block's text as written (an unusable call is returned as content)
    complete: bool = False      # its arguments ended and are a JSON object

    def finish(self) -> None:
        try:
            self.complete = isinstance(json.loads(self.arguments), dict)
        except (ValueError, RecursionError):     # the model's text: not JSON, or nested past the parser
            self.complete = False


class _ValueScanner:
    """Where a JSON value ends in text that arrives in pieces (strings and nesting tracked)."""

    def __init__(self):
        self.started = self.in_string = self.escape = False
        self.depth = 0
        self.primitive = False

    def feed(self, text: str) -> int:
        """How much of `text` belongs to the value (leading whitespace included); -1: all of it
        and the value has not ended."""
        for i, ch in enumerate(text):
            if not self.started:
                if ch.isspace():
                    continue
                self.started = True
                self.primitive = ch not in "{[\""
                self.in_string = ch == '"'
                self.depth = 1 if ch in "{[" else 0
                continue
            if self._ends_at(ch):
                return i + (0 if self.primitive else 1)
        return -1

    def _ends_at(self, ch: str) -> bool:
        if self.primitive:
            return ch in ",}] \t\r\n"
        if self.in_string:
            if self.escape:
                self.escape = False
            elif ch == "\\":
                self.escape = True
            elif ch == '"':
                self.in_string = False
                return self.depth == 0
            return False
        if ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            return self.depth == 0
        return False


class ToolCallParser:
    """Tool-call blocks out of answer text. A block whose header (`{"name": ..., "arguments": `)
    is read starts a call and its arguments stream from then on; a block in another shape is
    read whole at its `</tool_call>`; a block that is not a call stays content. Whitespace
    between and after calls is dropped."""

    def __init__(self, new_id: Callable[[], str] = new_call_id):
        self.new_id = new_id
        self.calls: List[ToolCall] = []
        self.mode = "text"           # text | header | args | tail
        self._buf = ""
        self._pending_ws = ""        # whitespace after a call, kept until text follows it
        self._scan: Optional[_ValueScanner] = None

    def push(self, text: str) -> list:
        self._buf += text
        out: list = []
        while self._buf:
            before = (self.mode, len(self._buf))
            getattr(self, "_" + self.mode)(out)
            if (self.mode, len(self._buf)) == before:
                break                # waiting for more text
        return out

    def _content(self, out: list, text: str) -> None:
        if not text:
            return
        if self.calls:
            if not text.strip():
                self._pending_ws += text
                return
            text, self._pending_ws = self._pending_ws + text, ""
        out.append(("content", text))

    def _text(self, out: list) -> None:
        at = self._buf.find(TOOL_CALL_OPEN)
        if at >= 0:
            self._content(out, self._buf[:at])
            self._buf, self.mode, self._pending_ws = self._buf[at + len(TOOL_CALL_OPEN):], "header", ""
            return
        keep = _held_suffix(self._buf, TOOL_CALL_OPEN)
        self._content(out, self._buf[:len(self._buf) - keep])
        self._buf = self._buf[len(self._buf) - keep:]

    def _header(self, out: list) -> None:
        m = _HEADER.match(self._buf)
        if m is not None:
            try:
                name = json.loads(m.group(1))
            except ValueError:         # not a JSON string after all: the block is read whole
                name = None
            call = self._start(out, name, TOOL_CALL_OPEN + self._buf[:m.end()])
            if call is not None:
                self._buf, self.mode, self._scan = self._buf[m.end():], "args", _ValueScanner()
                return
        end = self._buf.find(TOOL_CALL_CLOSE)
        if end >= 0:
            block, self._buf, self.mode = self._buf[:end], self._buf[end + len(TOOL_CALL_CLOSE):], "text"
            self._whole_block(out, block, closed=True)

    def _start(self, out: list, name, raw: str) -> Optional[ToolCall]:
        if not isinstance(name, str):
            return None
        call = ToolCall(self.new_id(), name, raw=raw)
        self.calls.append(call)
        out.append(("call", len(self.calls) - 1, call.id, call.name))
        return call

    def _whole_block(self, out: list, block: str, closed: bool) -> None:
        """A block read whole: a call if it is {"name", "arguments"}, else content."""
        raw = TOOL_CALL_OPEN + block + (TOOL_CALL_CLOSE if closed else "")
        try:
            obj = json.loads(block)
        except (ValueError, RecursionError):
            obj = None
        args = obj.get("arguments", obj.get("parameters")) if isinstance(obj, dict) else None
        call = self._start(out, obj.get("name"), raw) if isinstance(args, (dict, str)) else None
        if call is None:
            self._content(out, raw)
            return
        call.arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        out.append(("args", len(self.calls) - 1, call.arguments))
        call.finish()

    def _args(self, out: list) -> None:
        call = self.calls[-1]
        used = self._scan.feed(self._buf)
        piece = self._buf if used < 0 else self._buf[:used]
        self._buf = "" if used < 0 else self._buf[used:]
        fragment = piece.lstrip() if not call.arguments else piece
        call.raw += piece
        if fragment:
            call.arguments += fragment
            out.append(("args", len(self.calls) - 1, fragment))
        if used >= 0:
            self.mode = "tail"
            call.finish()

    def _tail(self, out: list) -> None:
        end = self._buf.find(TOOL_CALL_CLOSE)
        if end < 0:
            return
        self.calls[-1].raw += self._buf[:end + len(TOOL_CALL_CLOSE)]
        self._buf, self.mode = self._buf[end + len(TOOL_CALL_CLOSE):], "text"

    def flush(self) -> list:
        """The end of the answer: held text is content, a block cut short stays as far as it got."""
        out: list = []
        buf, self._buf = self._buf, ""
        if self.mode == "text":
            self._content(out, buf)
        elif self.mode == "header":
            self._whole_block(out, buf, closed=False)
        elif self.calls:
            self.calls[-1].raw += buf
            if self.mode == "args":
                self.calls[-1].finish()
        self.mode = "text"
        return out


@dataclass
class ParsedAnswer:
    reasoning: Optional[str]
    content: Optional[str]
    tool_calls: List[ToolCall] = field(default_factory=list)


class OutputParser:
    """The reasoning splitter (thinking on) feeding the tool-call parser (tools parsed); what
    neither applies to is content. `result()` after `flush()`: the whole answer, with calls cut
    short or not a JSON object returned as content instead."""

    def __init__(self, thinking: bool, tools: bool, new_id: Callable[[], str] = new_call_id):
        self.splitter = ReasoningSplitter() if thinking else None
        self.tools = ToolCallParser(new_id) if tools else None
        self._reasoning: List[str] = []
        self._content: List[str] = []

    def push(self, text: str) -> list:
        parts = self.splitter.push(text) if self.splitter else [("answer", text)]
        return self._route(parts)

    def flush(self) -> list:
        events = self._route(self.splitter.flush()) if self.splitter else []
        if self.tools is not None:
            events += self._record(self.tools.flush())
        return events

    def _route(self, parts: list) -> list:
        events = []
        for kind, text in parts:
            if kind == "reasoning":
                events.append(("reasoning", text))
            elif self.tools is not None:
                events += self.tools.push(text)
            else:
                events.append(("content", text))
        return self._record(events)

    def _record(self, events: list) -> list:
        for ev in events:
            if ev[0] == "reasoning":
                self._reasoning.append(ev[1])
            elif ev[0] == "content":
                self._content.append(ev[1])
        return events

    def parse(self, text: str) -> "ParsedAnswer":
        """A whole answer at once (a response that is not streamed)."""
        self.push(text)
        self.flush()
        return self.result()

    @property
    def calls(self) -> List[ToolCall]:
        return self.tools.calls if self.tools is not None else []

    def result(self) -> ParsedAnswer:
        calls = [c for c in self.calls if c.complete]
        content = "".join(self._content) + "".join(c.raw for c in self.calls if not c.complete)
        reasoning = "".join(self._reasoning) if self.splitter is not None else None
        return ParsedAnswer(reasoning, content, calls)


# ----------------------------------------------------------------------------------------------
# A parsed answer in OpenAI's chat shapes


def openai_message_fields(parsed: ParsedAnswer) -> tuple:
    """(content, extra message fields) of a parsed answer: `reasoning_content` when thinking,
    `tool_calls` [{id, type, function {name, arguments}}] when calls were made; with calls, blank
    content is null."""
    extra = {}
    if parsed.reasoning is not None:
        extra["reasoning_content"] = parsed.reasoning or None
    if parsed.tool_calls:
        extra["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                               for c in parsed.tool_calls]
    content = parsed.content
    if parsed.tool_calls and not (content or "").strip():
        content = None
    return content, extra


def openai_delta(events: list) -> Optional[dict]:
    """A chat chunk's delta from a piece's events (None: nothing to say yet): reasoning_content
    and content text, and tool_calls entries by index, the first of a call carrying its id, type
    and name, later ones `function.arguments` fragments."""
    delta: dict = {}
    for ev in events:
        if ev[0] in ("reasoning", "content"):
            key = "reasoning_content" if ev[0] == "reasoning" else "content"
            delta[key] = delta.get(key, "") + ev[1]
        elif ev[0] == "call":
            delta.setdefault("tool_calls", []).append(
                {"index": ev[1], "id": ev[2], "type": "function", "function": {"name": ev[3], "arguments": ""}})
        else:
            calls = delta.setdefault("tool_calls", [])
            if calls and calls[-1]["index"] == ev[1]:
                calls[-1]["function"]["arguments"] += ev[2]
            else:
                calls.append({"index": ev[1], "function": {"arguments": ev[2]}})
    return delta or None
