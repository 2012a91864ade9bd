"""Tools (function calling) for the chat routes: tool definitions and tool choices as OpenAI and
Anthropic send them, validated into one shape (`ToolSpec`, `ToolChoice`), and the grammar that
forces a tool call when the choice requires one.

The wire format is the chat template's (Qwen3 / Hermes style, plain text on the shipped model):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call, parallel calls separated by a newline. Plain Python, no MLX (the ingress
imports this module); grammars are llguidance's, built by `mtplx.structured`.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import List, Optional, Sequence

from mtplx.api.errors import invalid_request
from mtplx.api.limits import DEFAULT_MAX_TOOL_CALLS
from mtplx.structured import Constraint, ConstraintError, json_schema_grammar, lark_grammar

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
MAX_TOOLS = 128
MAX_TOOL_NAME = 256
EMPTY_PARAMETERS = {"type": "object", "properties": {}}
# The JSON of a forced call is written as the chat template writes a past call: ", " and ": ".
CALL_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def new_call_id(prefix: str = "call_") -> str:
    """A tool call's id: OpenAI's call_..., Anthropic's toolu_..."""
    return prefix + uuid.uuid4().hex[:24]


@dataclass(frozen=True)
class ToolSpec:
    """One function tool. `param`: the request field its parameters schema came from (errors
    name it: "tools.0.function.parameters", "tools.0.input_schema")."""

    name: str
    description: Optional[str]
    parameters: dict
    param: str

    def template_entry(self) -> dict:
        """The tool as the chat template lists it (OpenAI's function-tool form)."""
        fn = {"name": self.name}
        if self.description:
            fn["description"] = self.description
        fn["parameters"] = self.parameters
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolChoice:
    """`mode`: "none" (tools left out of the prompt, nothing parsed), "auto" (the answer is parsed
    for calls), "required" (at least one call, forced by a grammar) or "named" (a call of `name`,
    forced). `parallel`: several calls allowed, at most `max_calls` (the server's bound, or the
    request's own below it)."""

    mode: str = "auto"
    name: Optional[str] = None
    parallel: bool = True
    max_calls: int = DEFAULT_MAX_TOOL_CALLS

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")

    @property
    def calls_allowed(self) -> int:
        """The most calls one answer may make: a forced choice's grammar ends the answer there, an
        unforced answer's further calls are dropped."""
        return self.max_calls if self.parallel else 1


def _check_name(name, param: str, seen: set) -> str:
    if not isinstance(name, str) or not name.strip():
        raise invalid_request("a tool needs a name (a non-empty string)", param=param)
    if len(name) > MAX_TOOL_NAME:
        raise invalid_request(f"tool name is longer than {MAX_TOOL_NAME} characters", param=param)
    if name in seen:
        raise invalid_request(f"two tools are named {name!r}; tool names must be unique", param=param)
    seen.add(name)
    return name


def _check_schema(schema, param: str) -> dict:
    if schema is None:
        return dict(EMPTY_PARAMETERS)
    if not isinstance(schema, dict):
        raise invalid_request("a tool's parameters must be a JSON schema object", param=param)
    return schema


def _check_list(raw, param: str) -> list:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise invalid_request("tools must be a list", param=param)
    if len(raw) > MAX_TOOLS:
        raise invalid_request(f"at most {MAX_TOOLS} tools are allowed, got {len(raw)}", param=param)
    return raw


_OPENAI_FUNCTION_KEYS = {"name", "description", "parameters", "strict"}


def openai_tools(raw) -> List[ToolSpec]:
    """OpenAI's `tools`: function tools only ({"type": "function", "function": {name,
    description, parameters, strict}}); a malformed entry is a 400 naming its place."""
    out, seen = [], set()
    for i, tool in enumerate(_check_list(raw, "tools")):
        where = f"tools.{i}"
        if not isinstance(tool, dict):
            raise invalid_request("a tool must be an object", param=where)
        if tool.get("type") != "function":
            raise invalid_request(f"tool type {tool.get('type')!r} is not supported; only \"function\" tools are",
                                  param=f"{where}.type", code="unsupported_value")
        extra = sorted(set(tool) - {"type", "function"})
        if extra:
            raise invalid_request(f"Unrecognized tool field: {extra[0]}", param=f"{where}.{extra[0]}")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise invalid_request("Missing required parameter: a function tool needs \"function\"",
                                  param=f"{where}.function", code="missing_required_parameter")
        extra = sorted(set(fn) - _OPENAI_FUNCTION_KEYS)
        if extra:
            raise invalid_request(f"Unrecognized function field: {extra[0]}", param=f"{where}.function.{extra[0]}")
        out.append(_function_spec(fn, f"{where}.function", seen))
    return out


def _function_spec(fn: dict, where: str, seen: set) -> ToolSpec:
    """A function tool's name, description and parameters schema (`where`: the path of the object
    that holds them: chat's `function`, the Responses API's tool itself)."""
    name = _check_name(fn.get("name"), f"{where}.name", seen)
    description = fn.get("description")
    if description is not None and not isinstance(description, str):
        raise invalid_request("a tool's description must be a string", param=f"{where}.description")
    params = _check_schema(fn.get("parameters"), f"{where}.parameters")
    return ToolSpec(name, description, params, f"{where}.parameters")


def _mode_choice(raw: str, tools: Sequence[ToolSpec], parallel: bool, max_calls: int) -> ToolChoice:
    """A tool_choice given as a string (OpenAI's chat and Responses alike)."""
    if raw not in ("none", "auto", "required"):
        raise invalid_request(f"tool_choice {raw!r} is not one of 'none', 'auto', 'required' or a named "
                              f"function", param="tool_choice")
    if raw == "required" and not tools:
        raise invalid_request("tool_choice 'required' needs tools", param="tool_choice")
    return ToolChoice(raw if tools else "none", parallel=parallel, max_calls=max_calls)


def openai_tool_choice(raw, tools: Sequence[ToolSpec], parallel: Optional[bool],
                       max_calls: int = DEFAULT_MAX_TOOL_CALLS) -> ToolChoice:
    """OpenAI's `tool_choice`: "none", "auto" (the default with tools), "required", or
    {"type": "function", "function": {"name"}}; `parallel_tool_calls` (default true), at most
    `max_calls` calls an answer."""
    parallel = True if parallel is None else bool(parallel)
    if raw is None:
        return ToolChoice("auto" if tools else "none", parallel=parallel, max_calls=max_calls)
    if isinstance(raw, str):
        return _mode_choice(raw, tools, parallel, max_calls)
    fn = raw.get("function") if isinstance(raw, dict) and raw.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise invalid_request("tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", "
                              "\"function\": {\"name\": ...}}", param="tool_choice")
    return ToolChoice("named", _known(name, tools, "tool_choice"), parallel, max_calls)


_RESPONSES_FUNCTION_KEYS = {"type", "name", "description", "parameters", "strict"}


def responses_tools(raw) -> List[ToolSpec]:
    """The Responses API's `tools`: function tools, flat ({"type": "function", "name",
    "description", "parameters", "strict"}); built-in tools (web search, file search, ...) are
    refused by name."""
    out, seen = [], set()
    for i, tool in enumerate(_check_list(raw, "tools")):
        where = f"tools.{i}"
        if not isinstance(tool, dict):
            raise invalid_request("a tool must be an object", param=where)
        if tool.get("type") != "function":
            raise invalid_request(f"tool type {tool.get('type')!r} is not supported; only \"function\" tools are",
                                  param=f"{where}.type", code="unsupported_value")
        extra = sorted(set(tool) - _RESPONSES_FUNCTION_KEYS)
        if extra:
            raise invalid_request(f"Unrecognized tool field: {extra[0]}", param=f"{where}.{extra[0]}")
        out.append(_function_spec(tool, where, seen))
    return out


def responses_tool_choice(raw, tools: Sequence[ToolSpec], parallel: Optional[bool], max_calls: int) -> ToolChoice:
    """The Responses API's `tool_choice`: "none", "auto" (the default with tools), "required", or
    {"type": "function", "name"}; `parallel_tool_calls` (default true)."""
    parallel = True if parallel is None else bool(parallel)
    if raw is None:
        return ToolChoice("auto" if tools else "none", parallel=parallel, max_calls=max_calls)
    if isinstance(raw, str):
        return _mode_choice(raw, tools, parallel, max_calls)
    if not isinstance(raw, dict) or raw.get("type") != "function" or not isinstance(raw.get("name"), str) \
            or set(raw) - {"type", "name"}:
        raise invalid_request("tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", "
                              "\"name\": ...} (function tools only)", param="tool_choice")
    return ToolChoice("named", _known(raw["name"], tools, "tool_choice.name"), parallel, max_calls)


def _known(name: str, tools: Sequence[ToolSpec], param: str) -> str:
    if name not in {t.name for t in tools}:
        raise invalid_request(f"tool_choice names the tool {name!r}, which is not among the request's tools "
                              f"{[t.name for t in tools]}", param=param)
    return name


_ANTHROPIC_TOOL_KEYS = {"name", "description", "input_schema", "type", "cache_control"}


def anthropic_tools(raw) -> List[ToolSpec]:
    """Anthropic's `tools`: client tools ({name, description, input_schema}); server tools (web
    search and the like) are refused by name."""
    out, seen = [], set()
    for i, tool in enumerate(_check_list(raw, "tools")):
        where = f"tools.{i}"
        if not isinstance(tool, dict):
            raise invalid_request("a tool must be an object", param=where)
        if tool.get("type") not in (None, "custom"):
            raise invalid_request(f"tool type {tool.get('type')!r} is not supported; only client tools "
                                  f"(name, description, input_schema) are", param=f"{where}.type",
                                  code="unsupported_value")
        extra = sorted(set(tool) - _ANTHROPIC_TOOL_KEYS)
        if extra:
            raise invalid_request(f"Unrecognized tool field: {extra[0]}", param=f"{where}.{extra[0]}")
        name = _check_name(tool.get("name"), f"{where}.name", seen)
        if "input_schema" not in tool:
            raise invalid_request("Missing required parameter: a tool needs input_schema",
                                  param=f"{where}.input_schema", code="missing_required_parameter")
        description = tool.get("description")
        if description is not None and not isinstance(description, str):
            raise invalid_request("a tool's description must be a string", param=f"{where}.description")
        params = _check_schema(tool["input_schema"], f"{where}.input_schema")
        out.append(ToolSpec(name, description, params, f"{where}.input_schema"))
    return out


def anthropic_tool_choice(raw, tools: Sequence[ToolSpec], max_calls: int = DEFAULT_MAX_TOOL_CALLS) -> ToolChoice:
    """Anthropic's `tool_choice`: {"type": "auto" | "any" | "tool" (with "name") | "none",
    "disable_parallel_tool_use": bool}; at most `max_calls` calls an answer."""
    if raw is None:
        return ToolChoice("auto" if tools else "none", max_calls=max_calls)
    if not isinstance(raw, dict):
        raise invalid_request("tool_choice must be an object with a type", param="tool_choice")
    kind, parallel = raw.get("type"), not raw.get("disable_parallel_tool_use", False)
    extra = sorted(set(raw) - {"type", "name", "disable_parallel_tool_use"})
    if extra:
        raise invalid_request(f"Unrecognized tool_choice field: {extra[0]}", param=f"tool_choice.{extra[0]}")
    if kind not in ("auto", "any", "tool", "none"):
        raise invalid_request(f"tool_choice.type {kind!r} is not one of 'auto', 'any', 'tool', 'none'",
                              param="tool_choice.type")
    if kind in ("any", "tool") and not tools:
        raise invalid_request(f"tool_choice {kind!r} needs tools", param="tool_choice")
    if kind == "tool":
        if not isinstance(raw.get("name"), str):
            raise invalid_request("tool_choice of type 'tool' needs a name", param="tool_choice.name")
        return ToolChoice("named", _known(raw["name"], tools, "tool_choice.name"), parallel, max_calls)
    mode = {"auto": "auto", "any": "required", "none": "none"}[kind]
    return ToolChoice(mode if tools else "none", parallel=parallel, max_calls=max_calls)


# ----------------------------------------------------------------------------------------------
# The grammar of a forced call


def _rebase_refs(node, base: str):
    """A copy of a schema whose local references ("#...") point into it where it now sits
    (`base`, a JSON pointer of the combined schema)."""
    if isinstance(node, dict):
        return {k: (base + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#") else _rebase_refs(v, base))
                for k, v in node.items()}
    if isinstance(node, list):
        return [_rebase_refs(x, base) for x in node]
    return node


def call_schema(tools: Sequence[ToolSpec]) -> dict:
    """The JSON schema of one call's object: {"name": <a tool's name>, "arguments": <that tool's
    parameters>}, any of `tools`. Each tool's schema sits under $defs (its own references
    rebased), so that schemas with $defs and $ref keep working."""
    defs, options = {}, []
    for i, tool in enumerate(tools):
        key = f"tool{i}"
        defs[key] = _rebase_refs(tool.parameters, f"#/$defs/{key}")
        options.append({"type": "object", "properties": {"name": {"const": tool.name},
                                                         "arguments": {"$ref": f"#/$defs/{key}"}},
                        "required": ["name", "arguments"], "additionalProperties": False})
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, "$defs": defs, "x-guidance": CALL_JSON_STYLE}


def tool_call_lark(tools: Sequence[ToolSpec], max_calls: int, after_thinking: bool = False) -> str:
    """The Lark grammar of a forced answer: one tool-call block, or up to `max_calls` of them
    separated by a newline (the grammar, and so the answer, ends after the last). After a thinking
    section the answer may open with up to two newlines (as the template writes `</think>\\n\\n`)."""
    calls = f'call ("\\n" call){{0,{max_calls - 1}}}' if max_calls > 1 else "call"
    lead = '"\\n"{0,2} ' if after_thinking else ""
    return (f"start: {lead}{calls}\n"
            f'call: "{TOOL_CALL_OPEN}\\n" body "\\n{TOOL_CALL_CLOSE}"\n'
            f"body: %json {json.dumps(call_schema(tools))}\n")


def tool_call_constraint(tools: Sequence[ToolSpec], choice: ToolChoice, after_thinking: bool = False) -> tuple:
    """(Constraint of kind "tool_call", [(a tool's own JSON-schema constraint, its param, its
    schema)]) for a forced choice: the parts name the tool whose schema fails when the whole
    grammar does not compile. A keyword the grammar engine cannot enforce is a 400 naming the
    tool's field."""
    allowed = [t for t in tools if choice.mode == "required" or t.name == choice.name]
    parts = []
    for tool in allowed:
        try:
            parts.append((Constraint(json_schema_grammar(tool.parameters), "json_schema"), tool.param, tool.parameters))
        except ConstraintError as exc:
            raise invalid_request(str(exc), param=tool.param, code="invalid_schema") from None
        except Exception as exc:      # llguidance's own refusal of the schema
            raise invalid_request(f"json_schema cannot be enforced: {exc}", param=tool.param,
                                  code="invalid_schema") from None
    try:
        grammar = lark_grammar(tool_call_lark(allowed, choice.calls_allowed, after_thinking))
    except Exception as exc:
        raise invalid_request(f"the tool-call grammar cannot be built: {exc}", param="tools") from None
    return Constraint(grammar, "tool_call"), parts
