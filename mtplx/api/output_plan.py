"""What a request asks of its answer beyond plain text (`OutputPlan`): a thinking section, tools in
the prompt and tool calls parsed from the answer, and the row's constraint (a JSON schema, a
regular expression, a choice, a Lark grammar, a forced tool call, a thinking budget), built from
the request's fields and carried to the replica in `RowSpec.constraint`.

OpenAI's chat and completions: `response_format` ({"type": "json_object"} or {"type":
"json_schema", "json_schema": {"name", "schema", "strict"}}) and vLLM's `structured_outputs`
({"json" | "regex" | "choice" | "grammar" | "json_object"}); chat also `tools`, `tool_choice`,
`parallel_tool_calls`, `chat_template_kwargs.enable_thinking`, `reasoning_effort` and the mtplx
extension `thinking_budget`. Anthropic's Messages build theirs in `mtplx.api.anthropic` with
`assemble`. A field that cannot be served is a 400 naming it; whether a grammar compiles for the
model's tokenizer is checked at the ingress (`param` and `parts` name the field to blame).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence, Tuple

from mtplx.api import openai as oa
from mtplx.api.errors import client_json, invalid_request
from mtplx.api.limits import DEFAULT_MAX_TOOL_CALLS
from mtplx.api.tools import ToolChoice, ToolSpec, openai_tool_choice, openai_tools, tool_call_constraint
from mtplx.structured import (Constraint, ConstraintError, choice_grammar, json_object_grammar, json_schema_grammar,
                              lark_grammar, regex_grammar)

THINK_START = "<think>"
THINK_END = "</think>"
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")
THINKING_OFF_EFFORTS = ("none", "minimal")
STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object")
# vLLM's deprecated names and what replaces each
GUIDED_FIELDS = {"guided_json": "structured_outputs.json", "guided_regex": "structured_outputs.regex",
                 "guided_choice": "structured_outputs.choice", "guided_grammar": "structured_outputs.grammar",
                 "guided_json_object": "structured_outputs.json_object",
                 "guided_decoding_backend": "nothing (this server has one grammar engine, llguidance)",
                 "guided_whitespace_pattern": "nothing (JSON is generated compact)"}


@dataclass(frozen=True)
class OutputPlan:
    """`thinking`: the prompt opens a thinking section and the answer's text up to `</think>` is
    reasoning. `tools`: listed in the prompt; `parse_tools`: the answer is read for tool calls.
    `constraint`: the row's (None: free). `param`, `schema`: the field the constraint came from
    and its JSON schema, for errors; `parts`: (constraint, param, schema) of each piece, checked
    one by one to name the one at fault when the whole does not compile. `max_tool_calls`: the
    calls one answer may make (1 without parallel calls); a forced choice's grammar ends the
    answer there, the parser drops an unforced answer's further calls."""

    thinking: bool = False
    tools: Tuple[ToolSpec, ...] = ()
    parse_tools: bool = False
    constraint: Optional[Constraint] = None
    param: Optional[str] = None
    schema: Any = None
    parts: tuple = ()
    max_tool_calls: int = DEFAULT_MAX_TOOL_CALLS

    @property
    def tool_names(self) -> Tuple[str, ...]:
        """The functions the request offered: a call to any other is not returned as a call."""
        return tuple(t.name for t in self.tools)

    @property
    def template_kwargs(self) -> dict:
        """What the chat template is given besides the messages."""
        kwargs = {}
        if self.tools:
            kwargs["tools"] = [t.template_entry() for t in self.tools]
        if self.thinking:
            kwargs["enable_thinking"] = True
        return kwargs

    @property
    def parses(self) -> bool:
        """The answer's text is split (reasoning, content, tool calls), not returned as is."""
        return self.thinking or self.parse_tools


PLAIN = OutputPlan()


def _built(builder, value, param: str, kind: str, schema=None) -> tuple:
    """(Constraint, param, schema) from a builder; a builder's refusal is a 400 naming `param`."""
    try:
        return Constraint(builder(value), kind), param, schema
    except ConstraintError as exc:
        raise invalid_request(str(exc), param=param, code="invalid_schema" if schema is not None else
                              "invalid_value") from None
    except Exception as exc:     # llguidance's own refusal of what it was given
        raise invalid_request(f"{kind} cannot be enforced: {exc}", param=param, code="invalid_value") from None


def _schema_value(value, param: str):
    if isinstance(value, str):
        value = client_json(value, param, what="the JSON schema", code="invalid_schema")
    if value is True:
        value = {}
    if not isinstance(value, dict):
        raise invalid_request("a JSON schema must be an object", param=param, code="invalid_schema")
    return value


def _grammar_text(text: str) -> str:
    """A Lark grammar, or a GBNF one (llama.cpp's, as vLLM takes it) converted to Lark."""
    if "::=" in text:
        from llguidance.gbnf_to_lark import any_to_lark

        return lark_grammar(any_to_lark(text))
    return lark_grammar(text)


def response_format_constraint(rf: dict, param: str = "response_format") -> Optional[tuple]:
    """OpenAI's `response_format`: None for text."""
    kind = rf.get("type")
    if kind in (None, "text"):
        if kind is None:
            raise invalid_request("response_format needs a type", param=f"{param}.type")
        return None
    if kind == "json_object":
        return _built(lambda _: json_object_grammar(), None, param, "json_object")
    if kind != "json_schema":
        raise invalid_request(f"response_format type {kind!r} is not supported (text, json_object, "
                              f"json_schema)", param=f"{param}.type", code="unsupported_value")
    spec = rf.get("json_schema")
    if not isinstance(spec, dict):
        raise invalid_request("response_format of type json_schema needs \"json_schema\": {\"name\", "
                              "\"schema\"}", param=f"{param}.json_schema")
    where = f"{param}.json_schema.schema"
    schema = _schema_value(spec.get("schema", {}), where)
    return _built(json_schema_grammar, schema, where, "json_schema", schema)


def structured_outputs_constraint(so) -> tuple:
    """vLLM's `structured_outputs`: exactly one of json, regex, choice, grammar, json_object."""
    if not isinstance(so, dict):
        raise invalid_request("structured_outputs must be an object", param="structured_outputs")
    unknown = sorted(set(so) - set(STRUCTURED_OUTPUT_KINDS))
    if unknown:
        raise invalid_request(f"structured_outputs.{unknown[0]} is not supported; send one of "
                              f"{list(STRUCTURED_OUTPUT_KINDS)}", param=f"structured_outputs.{unknown[0]}",
                              code="unsupported_value")
    given = [k for k in STRUCTURED_OUTPUT_KINDS if so.get(k) not in (None, False)]
    if len(given) != 1:
        raise invalid_request(f"structured_outputs needs exactly one of {list(STRUCTURED_OUTPUT_KINDS)}, got "
                              f"{given or 'none'}", param="structured_outputs")
    kind = given[0]
    value, param = so[kind], f"structured_outputs.{kind}"
    if kind == "json":
        schema = _schema_value(value, param)
        return _built(json_schema_grammar, schema, param, "json_schema", schema)
    if kind == "json_object":
        return _built(lambda _: json_object_grammar(), None, param, "json_object")
    if kind == "choice":
        return _built(choice_grammar, value, param, "choice")
    if not isinstance(value, str) or not value:
        raise invalid_request(f"{param} must be a non-empty string", param=param)
    return _built(regex_grammar if kind == "regex" else _grammar_text, value, param,
                  "regex" if kind == "regex" else "grammar")


def text_format_constraint(fmt, param: str = "text.format") -> Optional[tuple]:
    """The Responses API's `text.format`: {"type": "text"} (None), {"type": "json_object"}, or
    {"type": "json_schema", "name", "schema", "strict", "description"} (flat, not nested under
    "json_schema" as chat's response_format is)."""
    if not isinstance(fmt, dict):
        raise invalid_request("text.format must be an object with a type", param=param)
    kind = fmt.get("type")
    known = {"text": {"type"}, "json_object": {"type"},
             "json_schema": {"type", "name", "schema", "strict", "description"}}
    if kind not in known:
        raise invalid_request(f"text.format type {kind!r} is not supported (text, json_object, json_schema)",
                              param=f"{param}.type", code="unsupported_value")
    extra = sorted(set(fmt) - known[kind])
    if extra:
        raise invalid_request(f"Unrecognized text.format field: {extra[0]}", param=f"{param}.{extra[0]}",
                              code="unknown_parameter")
    if kind == "text":
        return None
    if kind == "json_object":
        return _built(lambda _: json_object_grammar(), None, param, "json_object")
    if "schema" not in fmt:
        raise invalid_request("text.format of type json_schema needs a schema", param=f"{param}.schema",
                              code="missing_required_parameter")
    schema = _schema_value(fmt["schema"], f"{param}.schema")
    return _built(json_schema_grammar, schema, f"{param}.schema", "json_schema", schema)


ANTHROPIC_EFFORTS = ("low", "medium", "high", "xhigh", "max")


def output_config_constraint(oc) -> Optional[tuple]:
    """Anthropic's `output_config`: `format` {"type": "json_schema", "schema"} constrains the
    answer (what `client.messages.parse(output_format=Model)` sends); `effort` is accepted and has
    no effect (thinking is turned on by `thinking`)."""
    if oc is None:
        return None
    if not isinstance(oc, dict):
        raise invalid_request("output_config must be an object", param="output_config")
    unknown = sorted(set(oc) - {"format", "effort"})
    if unknown:
        raise invalid_request(f"output_config.{unknown[0]} is not supported", param=f"output_config.{unknown[0]}",
                              code="unsupported_value")
    if oc.get("effort") is not None and oc["effort"] not in ANTHROPIC_EFFORTS:
        raise invalid_request(f"output_config.effort must be one of {list(ANTHROPIC_EFFORTS)}",
                              param="output_config.effort")
    fmt = oc.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise invalid_request("output_config.format must be {\"type\": \"json_schema\", \"schema\": {...}}",
                              param="output_config.format.type", code="unsupported_value")
    where = "output_config.format.schema"
    if "schema" not in fmt:
        raise invalid_request("output_config.format needs a schema", param=where)
    schema = _schema_value(fmt["schema"], where)
    return _built(json_schema_grammar, schema, where, "json_schema", schema)


def refuse_guided_fields(req) -> None:
    """vLLM's guided_* fields are gone (vLLM deprecated them): a 400 naming the replacement."""
    for name, replacement in GUIDED_FIELDS.items():
        if getattr(req, name, None) is not None:
            raise invalid_request(f"{name} is not supported (vLLM deprecated the guided_* fields); use "
                                  f"{replacement}", param=name, code="unsupported_value")


def structured_constraint(req) -> Optional[tuple]:
    """The constraint of `response_format` or `structured_outputs` (not both), or None."""
    refuse_guided_fields(req)
    rf, so = req.response_format, req.structured_outputs
    if so is not None and rf is not None and rf.get("type", "text") != "text":
        raise invalid_request("response_format and structured_outputs both constrain the answer; send one",
                              param="structured_outputs")
    if so is not None:
        return structured_outputs_constraint(so)
    return response_format_constraint(rf) if rf is not None else None


def chat_thinking(req) -> Tuple[bool, Optional[int]]:
    """(thinking on, budget) from `chat_template_kwargs.enable_thinking` (first), then
    `reasoning_effort` (none / minimal: off; low / medium / high: on); `thinking_budget` turns
    thinking on unless it was turned off. Off by default."""
    kwargs = req.chat_template_kwargs or {}
    unknown = sorted(set(kwargs) - {"enable_thinking", "thinking"})
    if unknown:
        raise invalid_request(f"chat_template_kwargs.{unknown[0]} is not used by this model's chat template "
                              f"(it takes enable_thinking)", param=f"chat_template_kwargs.{unknown[0]}",
                              code="unsupported_value")
    flag = kwargs.get("enable_thinking", kwargs.get("thinking"))
    if flag is not None and not isinstance(flag, bool):
        raise invalid_request("chat_template_kwargs.enable_thinking must be true or false",
                              param="chat_template_kwargs.enable_thinking")
    effort = getattr(req, "reasoning_effort", None)
    if flag is None and effort is not None:
        flag = effort not in THINKING_OFF_EFFORTS
    budget = getattr(req, "thinking_budget", None)
    if budget is not None:
        if flag is False:
            raise invalid_request("thinking_budget needs thinking; it is turned off by this request",
                                  param="thinking_budget")
        flag = True
    return bool(flag), budget


def assemble(thinking: bool, budget: Optional[int], tools: Sequence[ToolSpec], choice: ToolChoice,
             structured: Optional[tuple] = None) -> OutputPlan:
    """The plan of a chat answer: tools in the prompt unless the choice is "none", parsed unless
    it is; a forced choice's grammar (which no response format may share); the constraint gated
    on `</think>` when thinking (then a budget alone is a constraint too)."""
    prompt_tools = tuple(tools) if choice.mode != "none" else ()
    constraint, param, schema, parts = None, None, None, ()
    if choice.forced:
        if structured is not None:
            raise invalid_request("a forced tool call and a structured response format cannot both constrain "
                                  "the answer; send one", param="tool_choice")
        constraint, parts = tool_call_constraint(tools, choice, after_thinking=thinking)
        param = "tools"
    elif structured is not None:
        constraint, param, schema = structured
    if thinking and constraint is not None:
        constraint = constraint.with_thinking(THINK_END, budget)
    elif thinking and budget is not None:
        constraint = Constraint(None, "thinking", THINK_END, budget)
    return OutputPlan(thinking, prompt_tools, bool(prompt_tools), constraint, param, schema, tuple(parts),
                      choice.calls_allowed if prompt_tools else DEFAULT_MAX_TOOL_CALLS)


def for_chat(req: oa.ChatCompletionRequest) -> OutputPlan:
    tools = openai_tools(req.tools)
    choice = openai_tool_choice(req.tool_choice, tools, req.parallel_tool_calls, req._limits.tool_calls)
    thinking, budget = chat_thinking(req)
    return assemble(thinking, budget, tools, choice, structured_constraint(req))


def for_tokenize(req: oa.TokenizeChatRequest) -> OutputPlan:
    """The chat form of /tokenize: the prompt a chat completion with these tools and
    chat_template_kwargs decodes from."""
    thinking, _ = chat_thinking(req)
    return OutputPlan(thinking=thinking, tools=tuple(openai_tools(req.tools)))


def for_completion(req: oa.CompletionRequest) -> OutputPlan:
    structured = structured_constraint(req)
    if structured is None:
        return PLAIN
    constraint, param, schema = structured
    return OutputPlan(constraint=constraint, param=param, schema=schema)
