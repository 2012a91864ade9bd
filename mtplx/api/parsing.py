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
from typing import Callable, List, Optional, Sequence

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
    name: Optional[str]
    arguments: str = ""         # as written (a cut call's without its closing)
    raw: str = ""               # the block's text as written
    complete: bool = False      # its arguments ended and are a JSON object
    truncated: bool = False     # the answer ended inside its arguments
    closing: str = ""           # what closed a cut call's arguments in the stream (`close_json`)
    index: Optional[int] = None     # its place among the calls the answer announced (None: never announced)

    def finish(self) -> None:
        try:
            self.complete = isinstance(json.loads(self.arguments), dict)
        except (ValueError, RecursionError):     # the model's text: not JSON, or nested past the parser
            self.complete = False


# Why a call the model wrote is not returned as a call (`DroppedCall.reason`)
TRUNCATED = "truncated"                   # the answer ended inside it (its budget ran out, say)
UNKNOWN_FUNCTION = "unknown_function"     # a function the request did not offer
OVER_LIMIT = "over_limit"                 # past the calls one answer may make
INVALID_ARGUMENTS = "invalid_arguments"   # its arguments are not a JSON object


@dataclass(frozen=True)
class DroppedCall:
    """A call the model wrote that the answer does not return (`mtplx_stats.dropped_tool_calls`):
    its name (None when cut before it), why, its arguments as far as written, and its index when
    a stream had announced it (then closed: `close_json`)."""

    name: Optional[str]
    reason: str
    arguments: str
    index: Optional[int] = None

    def as_dict(self) -> dict:
        return {"name": self.name, "reason": self.reason, "arguments": self.arguments, "index": self.index}


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


# ----------------------------------------------------------------------------------------------
# Closing a cut JSON value


_LITERALS = ("true", "false", "null")


class _JsonPrefix:
    """The state at the end of a JSON text cut anywhere: the open containers, and what the text
    expects next: "first_key" / "first_value" (just after `{` / `[`), "key" / "value" (after a
    comma or a colon), "colon" (after a key), "after" (a value ended)."""

    def __init__(self):
        self.stack: List[str] = []      # "{" / "[" of the open containers
        self.expect = "value"
        self.in_string = self.escape = False
        self.string_is_key = False
        self.unicode_left = 0           # hex digits a \u escape still needs
        self.atom = ""                  # a number or literal being written

    def feed(self, text: str) -> "_JsonPrefix":
        for ch in text:
            if self.in_string:
                self._string_char(ch)
            elif self.atom and (ch.isalnum() or ch in "+-."):
                self.atom += ch
            else:
                self.atom = ""
                self._structure(ch)
        return self

    def _string_char(self, ch: str) -> None:
        if self.unicode_left:
            self.unicode_left -= 1
        elif self.escape:
            self.escape, self.unicode_left = False, 4 if ch == "u" else 0
        elif ch == "\\":
            self.escape = True
        elif ch == '"':
            self.in_string = False
            self.expect = "colon" if self.string_is_key else "after"

    def _structure(self, ch: str) -> None:
        if ch.isspace():
            return
        if ch in "{[":
            self.stack.append(ch)
            self.expect = "first_key" if ch == "{" else "first_value"
        elif ch in "}]":
            if self.stack:
                self.stack.pop()
            self.expect = "after"
        elif ch == '"':
            self.in_string, self.string_is_key = True, self.expect in ("key", "first_key")
        elif ch == ":":
            self.expect = "value"
        elif ch == ",":
            self.expect = "key" if self.stack[-1:] == ["{"] else "value"
        else:
            self.atom, self.expect = ch, "after"

    def closing(self) -> str:
        """The shortest text that makes the prefix one complete JSON value."""
        out = self._close_string() + self._close_atom()
        out += {"colon": ": null", "value": "null", "key": '"": null'}.get(self.expect, "")
        return out + "".join("}" if c == "{" else "]" for c in reversed(self.stack))

    def _close_string(self) -> str:
        if not self.in_string:
            return ""
        self.expect = "colon" if self.string_is_key else "after"
        return "0" * self.unicode_left + ("\\" if self.escape else "") + '"'

    def _close_atom(self) -> str:
        atom = self.atom
        if not atom:
            return ""
        for literal in _LITERALS:
            if literal.startswith(atom):
                return literal[len(atom):]
        return "0" if atom[-1] in "+-.eE" else ""


def close_json(prefix: str) -> str:
    """What to append to `prefix`, the start of a JSON object cut anywhere (a tool call's
    arguments when the answer's budget ran out), so that the whole is valid JSON: open strings,
    numbers and literals finished, a key given a null value, containers closed. An empty prefix
    becomes "{}"."""
    if not prefix.strip():
        return "{}"
    return _JsonPrefix().feed(prefix).closing()


# ----------------------------------------------------------------------------------------------
# Tool calls out of the answer's text


class ToolCallParser:
    """Tool-call blocks out of answer text. A block whose header (`{"name": ..., "arguments": `)
    is read starts a call and its arguments stream from then on; a block in another shape is
    read whole at its `</tool_call>`; a closed block that is not a call stays content. Whitespace
    between and after calls is dropped.

    A call is returned only when the request offered its function (`names`; None: any) and the
    answer has made fewer than `max_calls`; other calls are read silently and dropped (never
    announced, never content). A call the answer ends inside is dropped too; if it had been
    announced, `flush` closes its arguments (`close_json`) so that a stream's JSON parses."""

    def __init__(self, new_id: Callable[[], str] = new_call_id, names: Optional[Sequence[str]] = None,
                 max_calls: Optional[int] = None):
        self.new_id = new_id
        self.names = None if names is None else frozenset(names)
        self.max_calls = max_calls
        self.calls: List[ToolCall] = []          # announced calls
        self.dropped: List[DroppedCall] = []
        self.mode = "text"           # text | header | args | tail
        self._buf = ""
        self._pending_ws = ""        # whitespace after a call, kept until text follows it
        self._scan: Optional[_ValueScanner] = None
        self._current: Optional[ToolCall] = None     # the call being read (announced or not)
        self._refused: Optional[str] = None          # why the current call is read silently

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
        if self.calls or self.dropped:
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
            if isinstance(name, str):
                self._start(out, name, TOOL_CALL_OPEN + self._buf[:m.end()])
                self._buf, self.mode, self._scan = self._buf[m.end():], "args", _ValueScanner()
                return
        end = self._buf.find(TOOL_CALL_CLOSE)
        if end >= 0:
            block, self._buf, self.mode = self._buf[:end], self._buf[end + len(TOOL_CALL_CLOSE):], "text"
            self._whole_block(out, block, closed=True)

    def _refusal(self, name: str) -> Optional[str]:
        if self.names is not None and name not in self.names:
            return UNKNOWN_FUNCTION
        if self.max_calls is not None and len(self.calls) >= self.max_calls:
            return OVER_LIMIT
        return None

    def _start(self, out: list, name: str, raw: str) -> ToolCall:
        """A call begins: announced (an event) unless refused, then read silently."""
        self._refused = self._refusal(name)
        call = self._current = ToolCall("", name, raw=raw)
        if self._refused is None:
            call.id, call.index = self.new_id(), len(self.calls)
            self.calls.append(call)
            out.append(("call", call.index, call.id, call.name))
        return call

    def _end_call(self) -> None:
        """The current call's block is over: a refused call is recorded as dropped."""
        call, self._current = self._current, None
        if call is not None and self._refused is not None:
            self.dropped.append(DroppedCall(call.name, self._refused, call.arguments))

    def _args_event(self, out: list, fragment: str) -> None:
        if self._refused is None and fragment:
            out.append(("args", self._current.index, fragment))

    def _whole_block(self, out: list, block: str, closed: bool) -> None:
        """A block read whole: a call if it is {"name", "arguments"}, else content (closed) or a
        cut call (not closed: the answer ended inside it)."""
        raw = TOOL_CALL_OPEN + block + (TOOL_CALL_CLOSE if closed else "")
        try:
            obj = json.loads(block)
        except (ValueError, RecursionError):
            obj = None
        args = obj.get("arguments", obj.get("parameters")) if isinstance(obj, dict) else None
        name = obj.get("name") if isinstance(obj, dict) else None
        if not isinstance(args, (dict, str)) or not isinstance(name, str):
            if closed:
                self._content(out, raw)
            else:
                self.dropped.append(DroppedCall(None, TRUNCATED, block.strip()))
            return
        call = self._start(out, name, raw)
        call.arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        self._args_event(out, call.arguments)
        call.finish()
        self._end_call()

    def _args(self, out: list) -> None:
        call = self._current
        used = self._scan.feed(self._buf)
        piece = self._buf if used < 0 else self._buf[:used]
        self._buf = "" if used < 0 else self._buf[used:]
        fragment = piece.lstrip() if not call.arguments else piece
        call.raw += piece
        call.arguments += fragment
        self._args_event(out, fragment)
        if used >= 0:
            self.mode = "tail"
            call.finish()

    def _tail(self, out: list) -> None:
        end = self._buf.find(TOOL_CALL_CLOSE)
        if end < 0:
            return
        self._current.raw += self._buf[:end + len(TOOL_CALL_CLOSE)]
        self._buf, self.mode = self._buf[end + len(TOOL_CALL_CLOSE):], "text"
        self._end_call()

    def flush(self, cut: bool = False) -> list:
        """The end of the answer. Held text is content (unless `cut`, the answer's budget ran out,
        and it is the start of a tool-call marker); a block cut short is dropped, and an announced
        call cut inside its arguments is closed with one last fragment."""
        out: list = []
        buf, self._buf = self._buf, ""
        if self.mode == "text":
            if not (cut and buf and TOOL_CALL_OPEN.startswith(buf)):
                self._content(out, buf)
        elif self.mode == "header":
            self._whole_block(out, buf, closed=False)
        elif self._current is not None:
            self._current.raw += buf
            if self.mode == "args":
                self._close_cut_call(out)
            self._end_call()
        self.mode = "text"
        return out

    def _close_cut_call(self, out: list) -> None:
        call = self._current
        call.complete, call.truncated = False, True
        if self._refused is None:
            call.closing = close_json(call.arguments)
            self._args_event(out, call.closing)

    def returned(self) -> List[ToolCall]:
        """The calls an answer returns: announced, complete, arguments a JSON object."""
        return [c for c in self.calls if c.complete]

    def all_dropped(self) -> List[DroppedCall]:
        """Every call the answer does not return: those read silently, then the announced ones
        that were cut or whose arguments are not a JSON object."""
        return self.dropped + [DroppedCall(c.name, TRUNCATED if c.truncated else INVALID_ARGUMENTS, c.arguments,
                                           c.index) for c in self.calls if not c.complete]


@dataclass
class ParsedAnswer:
    reasoning: Optional[str]
    content: Optional[str]
    tool_calls: List[ToolCall] = field(default_factory=list)
    dropped_calls: List[DroppedCall] = field(default_factory=list)


class OutputParser:
    """The reasoning splitter (thinking on) feeding the tool-call parser (tools parsed); what
    neither applies to is content. `result()` after `flush()`: the whole answer; a call cut
    short, not a JSON object, of a function not offered (`names`) or past `max_calls` is dropped
    (`ParsedAnswer.dropped_calls`), never content."""

    def __init__(self, thinking: bool, tools: bool, new_id: Callable[[], str] = new_call_id,
                 names: Optional[Sequence[str]] = None, max_calls: Optional[int] = None):
        self.splitter = ReasoningSplitter() if thinking else None
        self.tools = ToolCallParser(new_id, names, max_calls) if tools else None
        self._reasoning: List[str] = []
        self._content: List[str] = []

    @classmethod
    def for_plan(cls, plan, new_id: Callable[[], str] = new_call_id) -> Optional["OutputParser"]:
        """The parser of a request's answer (`mtplx.api.output_plan.OutputPlan`); None when its
        text is returned as is."""
        if not plan.parses:
            return None
        return cls(plan.thinking, plan.parse_tools, new_id, plan.tool_names, plan.max_tool_calls)

    def push(self, text: str) -> list:
        parts = self.splitter.push(text) if self.splitter else [("answer", text)]
        return self._route(parts)

    def flush(self, cut: bool = False) -> list:
        """The end of the answer (`cut`: its budget ran out)."""
        events = self._route(self.splitter.flush()) if self.splitter else []
        if self.tools is not None:
            events += self._record(self.tools.flush(cut))
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

    def parse(self, text: str, cut: bool = False) -> "ParsedAnswer":
        """A whole answer at once (a response that is not streamed)."""
        self.push(text)
        self.flush(cut)
        return self.result()

    @property
    def calls(self) -> List[ToolCall]:
        return self.tools.calls if self.tools is not None else []

    def result(self) -> ParsedAnswer:
        calls = self.tools.returned() if self.tools is not None else []
        dropped = self.tools.all_dropped() if self.tools is not None else []
        reasoning = "".join(self._reasoning) if self.splitter is not None else None
        return ParsedAnswer(reasoning, "".join(self._content), calls, dropped)


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
