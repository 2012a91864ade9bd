"""Structured output, tool calls and thinking at the API: the shipped chat template's rendering of
tools, calls, tool responses and thinking; the answer parsers (tool-call blocks with arguments
streamed as they arrive, the reasoning split); the constraints a request builds; the refusals,
each naming its field (in-process ingress, no Ray); and, through the session's served app, the
real `openai` client's structured-output and tool helpers and the `anthropic` client's tool use,
streamed and not, with thinking split off under a budget.

Greedy throughout (the tiny Python model decides nothing sensible, but under a grammar what it
writes is valid, and under a budget it closes its thinking)."""

from __future__ import annotations

import asyncio
import json
import random
import re
from typing import Literal

import pytest
from pydantic import BaseModel, Field

import process_state
from conftest import TEST_API_KEY

RAY_MARK = pytest.mark.ray
MODEL = "mtplx-tiny-py"
USER = [{"role": "user", "content": "def add(a, b):"}]
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                  "required": ["city", "days"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather forecast",
                                            "parameters": WEATHER_SCHEMA}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"]}}}
# The template before tools and thinking: today's conversations must render exactly as it did
OLD_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
                "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=120)


class Verdict(BaseModel):
    """(The anthropic client moves length bounds into descriptions: no free strings here.)"""

    ok: bool
    level: Literal["low", "high"]


class GetWeather(BaseModel):
    city: str = Field(max_length=10)
    days: int = Field(ge=1, le=7)


@pytest.fixture(scope="module")
def tokenizer():
    from deployments.ingress.model_files import SHIPPED_MODEL_DIR, load_tokenizer

    return load_tokenizer(SHIPPED_MODEL_DIR)


@pytest.fixture(scope="module")
def llg(tokenizer):
    from mtplx.structured import grammar_tokenizer

    return grammar_tokenizer(tokenizer, 4096)


def _chat(**fields):
    from mtplx.api import openai as oa

    return oa.parse_request(oa.ChatCompletionRequest, json.dumps({"messages": USER, **fields}).encode())


# ------------------------------------------------------------------------------------------------
# The chat template


def test_chat_template_keeps_todays_conversations_byte_identical(tokenizer):
    rng = random.Random(0)
    for _ in range(200):
        msgs = [{"role": rng.choice(["system", "user", "assistant"]),
                 "content": rng.choice(["", "hi", "def f():\n    pass\n", " x ", "\u00e9\u2192", "<think>"])}
                for _ in range(rng.randint(1, 5))]
        for add in (True, False):
            old = tokenizer.apply_chat_template(msgs, add_generation_prompt=add, tokenize=False,
                                                chat_template=OLD_TEMPLATE)
            assert tokenizer.apply_chat_template(msgs, add_generation_prompt=add, tokenize=False) == old
            assert tokenizer.apply_chat_template(msgs, add_generation_prompt=add, tokenize=False,
                                                 enable_thinking=False) == old


def test_chat_template_renders_tools_calls_responses_and_thinking(tokenizer):
    from mtplx.api.openai import ChatMessage, render_chat

    msgs = [ChatMessage(**m) for m in [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Lyon?"},
        {"role": "assistant", "content": None, "reasoning_content": "Two cities.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Paris", "days": 1}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": {"city": "Lyon", "days": 2}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "rain"}]}]]
    text = render_chat(tokenizer, msgs, template_kwargs={"tools": [WEATHER], "enable_thinking": True})
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert "<tools>\n" + json.dumps(WEATHER) + "\n</tools>" in text
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>' in text
    assert text.count("<|im_start|>system") == 1       # the system turn carries the tools
    # the call of the current turn keeps its reasoning; calls as blocks, one per line
    assert ("<|im_start|>assistant\n<think>\nTwo cities.\n</think>\n\n<tool_call>\n"
            '{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}\n</tool_call>\n<tool_call>\n'
            '{"name": "get_weather", "arguments": {"city": "Lyon", "days": 2}}\n</tool_call><|im_end|>\n') in text
    # consecutive tool messages: one user turn of tool responses
    assert ("<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n"
            "</tool_response><|im_end|>\n") in text
    assert text.endswith("<|im_start|>assistant\n<think>\n")
    # a later user turn: the past reasoning (field or <think> in the content) is dropped
    later = msgs + [ChatMessage(role="assistant", content="<think>\nold\n</think>\n\nSunny."),
                    ChatMessage(role="user", content="thanks")]
    text = render_chat(tokenizer, later)
    assert "Two cities." not in text and "old" not in text and "<|im_start|>assistant\nSunny.<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n") and "# Tools" not in text


# ------------------------------------------------------------------------------------------------
# Reading answers


def _feed(parser, text, cuts):
    events, pos = [], 0
    for cut in list(cuts) + [len(text)]:
        events += parser.push(text[pos:cut])
        pos = cut
    return events + parser.flush()


def test_tool_call_blocks_parse_whatever_the_pieces():
    from mtplx.api.parsing import OutputParser

    text = ('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa\\"}ris", "n": [1, {"a": "}"}]}}'
            '\n</tool_call>\n<tool_call>\n{"arguments": {}, "name": "get_time"}\n</tool_call>\n')
    rng = random.Random(1)
    for trial in range(300):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, 40))) if trial else []
        parser = OutputParser(thinking=False, tools=True, new_id=lambda: "call_x")
        events = _feed(parser, text, cuts)
        result = parser.result()
        assert result.content == "Checking.\n"
        assert [(c.name, json.loads(c.arguments)) for c in result.tool_calls] == [
            ("get_weather", {"city": 'Pa"}ris', "n": [1, {"a": "}"}]}), ("get_time", {})]
        streamed = {}
        for ev in events:
            if ev[0] == "args":
                streamed[ev[1]] = streamed.get(ev[1], "") + ev[2]
        assert [streamed[i] for i in (0, 1)] == [c.arguments for c in result.tool_calls]
        assert [ev[3] for ev in events if ev[0] == "call"] == ["get_weather", "get_time"]
        assert "".join(ev[1] for ev in events if ev[0] == "content") == "Checking.\n"


def test_tool_call_arguments_stream_before_the_block_ends():
    """The arguments go out as their text arrives: every piece of them is an event of its own."""
    from mtplx.api.parsing import OutputParser

    parser = OutputParser(thinking=False, tools=True)
    assert parser.push("<tool_") == []                        # may be a tool call: held back
    assert parser.push('call>\n{"name": "get_weather", "argu') == []
    call, *rest = parser.push('ments": {"ci')
    assert call[0] == "call" and call[2].startswith("call_") and call[3] == "get_weather"
    assert rest == [("args", 0, '{"ci')]
    assert parser.push('ty": "Paris"') == [("args", 0, 'ty": "Paris"')]
    assert parser.push("}}\n</tool") == [("args", 0, "}")]
    assert parser.push("_call>") == [] and parser.flush() == []
    assert [json.loads(c.arguments) for c in parser.result().tool_calls] == [{"city": "Paris"}]


def test_tool_call_arguments_fragments_are_incremental():
    from mtplx.api.parsing import OutputParser

    text = '<tool_call>\n{"name": "f", "arguments": {"a": "xyz", "b": [1, 2]}}\n</tool_call>'
    parser = OutputParser(thinking=False, tools=True)
    events = [ev for ch in text for ev in parser.push(ch)] + parser.flush()
    fragments = [ev[2] for ev in events if ev[0] == "args"]
    assert len(fragments) == len('{"a": "xyz", "b": [1, 2]}') and "".join(fragments) == '{"a": "xyz", "b": [1, 2]}'


def test_tool_blocks_that_are_not_calls_stay_content():
    """A closed block that is not a call is the model's text; a call cut short is dropped, never
    content (tests/test_tool_limits.py has the rest of what a cut or unusable call becomes)."""
    from mtplx.api.parsing import OutputParser

    text = "a <tool_call>\nnot json</tool_call> b"
    parser = OutputParser(thinking=False, tools=True)
    _feed(parser, text, [3, 9])
    assert parser.result().tool_calls == [] and parser.result().content == text
    parser = OutputParser(thinking=False, tools=True)
    _feed(parser, 'x <tool_call>\n{"name": "f", "arguments": {"a": [1,', [3, 9])
    result = parser.result()
    assert result.tool_calls == [] and result.content == "x " and [d.reason for d in result.dropped_calls] == ["truncated"]


def test_reasoning_splits_at_the_first_think_end():
    from mtplx.api.parsing import OutputParser

    text = "<think>\nfirst </thi\nnot yet\n</think>\n\n{\"a\": 1} </think> kept"
    rng = random.Random(2)
    for trial in range(200):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, 20))) if trial else []
        parser = OutputParser(thinking=True, tools=False)
        _feed(parser, text, cuts)
        result = parser.result()
        assert result.reasoning == "\nfirst </thi\nnot yet\n" and result.content == '{"a": 1} </think> kept'
    never = OutputParser(thinking=True, tools=False)
    _feed(never, "def f():\n    return 1", [4])
    assert never.result().reasoning == "def f():\n    return 1" and never.result().content == ""
    both = OutputParser(thinking=True, tools=True, new_id=lambda: "call_1")
    _feed(both, 'hmm</think>\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>', [5, 20])
    assert both.result().reasoning == "hmm" and [c.name for c in both.result().tool_calls] == ["f"]


def test_parser_takes_any_text_without_failing():
    """Whatever a model writes (markers cut anywhere, broken JSON, odd escapes): no exception, and
    every call returned has a JSON object for arguments."""
    from mtplx.api.parsing import OutputParser

    pieces = ["<tool_call>", "</tool_call>", "<think>", "</think>", '{"name": ', '"f"', '"\\x"', ', "arguments": ',
              "{", "}", "[", "]", '"', "\\", "\n", " ", "a", "1", ",", "<tool_", "</thi"]
    rng = random.Random(3)
    for _ in range(1500):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 24)))
        parser = OutputParser(thinking=rng.random() < 0.5, tools=True)
        _feed(parser, text, sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 6)))))
        assert all(isinstance(json.loads(c.arguments), dict) for c in parser.result().tool_calls)


def test_anthropic_stream_opens_a_block_per_part():
    from mtplx.api.anthropic import MessageStream
    from mtplx.end import End

    stream = MessageStream("msg_1", MODEL, 5, parsed=True)
    raw = stream.start() + stream.events([("reasoning", "r"), ("reasoning", "s"), ("content", "c"),
                                          ("call", 0, "toolu_1", "f"), ("args", 0, '{"a"'), ("args", 0, ": 1}"),
                                          ("call", 1, "toolu_2", "g"), ("args", 1, "{}")])
    raw += stream.finish(End("eos", token=2), 9, {})
    events = [json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: ")]
    shape = [(e["type"], e.get("index"), (e.get("content_block") or e.get("delta") or {}).get("type")) for e in events]
    assert shape == [("message_start", None, None),
                     ("content_block_start", 0, "thinking"), ("content_block_delta", 0, "thinking_delta"),
                     ("content_block_delta", 0, "thinking_delta"), ("content_block_stop", 0, None),
                     ("content_block_start", 1, "text"), ("content_block_delta", 1, "text_delta"),
                     ("content_block_stop", 1, None),
                     ("content_block_start", 2, "tool_use"), ("content_block_delta", 2, "input_json_delta"),
                     ("content_block_delta", 2, "input_json_delta"), ("content_block_stop", 2, None),
                     ("content_block_start", 3, "tool_use"), ("content_block_delta", 3, "input_json_delta"),
                     ("content_block_stop", 3, None), ("message_delta", None, None), ("message_stop", None, None)]
    assert events[8]["content_block"] == {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}
    assert events[-2]["delta"]["stop_reason"] == "tool_use"
    empty = MessageStream("msg_2", MODEL, 5, parsed=True)
    raw = empty.start() + empty.finish(End("length"), 4, {})
    assert b'"content_block_start","index":0,"content_block":{"type":"text"' in raw and b"max_tokens" in raw


def test_openai_deltas_carry_the_call_first_then_fragments():
    from mtplx.api.parsing import openai_delta

    assert openai_delta([]) is None
    delta = openai_delta([("reasoning", "r"), ("content", "c"), ("call", 0, "call_1", "f"), ("args", 0, "{"),
                          ("args", 0, "}"), ("call", 1, "call_2", "g")])
    assert delta == {"reasoning_content": "r", "content": "c", "tool_calls": [
        {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
        {"index": 1, "id": "call_2", "type": "function", "function": {"name": "g", "arguments": ""}}]}
    assert openai_delta([("args", 1, '"x"')]) == {"tool_calls": [{"index": 1, "function": {"arguments": '"x"'}}]}


# ------------------------------------------------------------------------------------------------
# What a request builds


def test_requests_build_their_constraints():
    from mtplx.api import output_plan
    from mtplx.api.openai import CompletionRequest, parse_request

    assert output_plan.for_chat(_chat()) == output_plan.PLAIN
    cases = [({"response_format": {"type": "json_object"}}, "json_object"),
             ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": WEATHER_SCHEMA}}},
              "json_schema"),
             ({"structured_outputs": {"json": WEATHER_SCHEMA}}, "json_schema"),
             ({"structured_outputs": {"regex": "[a-z]+"}}, "regex"),
             ({"structured_outputs": {"choice": ["yes", "no"]}}, "choice"),
             ({"structured_outputs": {"grammar": 'start: "a" | "b"'}}, "grammar"),
             ({"structured_outputs": {"grammar": 'root ::= "a" | "b"'}}, "grammar"),       # GBNF
             ({"tools": [WEATHER], "tool_choice": "required"}, "tool_call"),
             ({"tools": [WEATHER, CLOCK], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
              "tool_call")]
    for fields, kind in cases:
        plan = output_plan.for_chat(_chat(**fields))
        assert plan.constraint.kind == kind and plan.constraint.think_end is None and not plan.thinking, fields
    comp = parse_request(CompletionRequest, json.dumps({"prompt": "x", "structured_outputs": {"regex": "a+"}}).encode())
    assert output_plan.for_completion(comp).constraint.kind == "regex"
    # tools: auto parses without a constraint, none leaves them out of the prompt
    auto = output_plan.for_chat(_chat(tools=[WEATHER]))
    assert auto.parse_tools and auto.constraint is None and auto.template_kwargs["tools"] == [WEATHER]
    none = output_plan.for_chat(_chat(tools=[WEATHER], tool_choice="none", parallel_tool_calls=False))
    assert none == output_plan.PLAIN
    # thinking: the template opens it; a budget or a constraint starts after </think>
    for fields, on in [({"chat_template_kwargs": {"enable_thinking": True}}, True), ({"reasoning_effort": "low"}, True),
                       ({"reasoning_effort": "minimal"}, False),
                       ({"reasoning_effort": "high", "chat_template_kwargs": {"enable_thinking": False}}, False)]:
        plan = output_plan.for_chat(_chat(**fields))
        assert plan.thinking is on and plan.constraint is None and plan.template_kwargs.get("enable_thinking") == (
            True if on else None), fields
    budget = output_plan.for_chat(_chat(thinking_budget=16)).constraint
    assert (budget.grammar, budget.think_end, budget.think_budget) == (None, "</think>", 16)
    schema = output_plan.for_chat(_chat(reasoning_effort="medium", response_format={"type": "json_object"})).constraint
    assert schema.kind == "json_object" and schema.think_end == "</think>" and schema.think_budget is None


def test_forced_tool_call_grammar_takes_the_templates_format(llg):
    import llguidance

    from mtplx.api import output_plan

    def accepts(plan, text):
        matcher = llguidance.LLMatcher(llg, plan.constraint.grammar, log_level=0)
        return matcher.consume_tokens(llg.tokenize_str(text)) and matcher.is_accepting()

    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
    clock = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call>'
    required = output_plan.for_chat(_chat(tools=[WEATHER, CLOCK], tool_choice="required"))
    assert accepts(required, call) and accepts(required, clock) and accepts(required, call + "\n" + clock)
    assert not accepts(required, call.replace("get_weather", "get_wether"))
    assert not accepts(required, call.replace('"days": 2', '"days": 9'))             # the tool's own schema
    assert not accepts(required, call.replace('": ', '":'))                         # the template's spacing
    single = output_plan.for_chat(_chat(tools=[WEATHER, CLOCK], tool_choice="required", parallel_tool_calls=False))
    assert accepts(single, clock) and not accepts(single, call + "\n" + clock)
    named = output_plan.for_chat(_chat(tools=[WEATHER, CLOCK], tool_choice={"type": "function",
                                                                             "function": {"name": "get_time"}}))
    assert accepts(named, clock) and not accepts(named, call)
    # a pydantic-made schema ($defs and $ref) keeps working inside the call's schema
    import openai

    class Place(BaseModel):
        city: str

    class Trip(BaseModel):
        start: Place
        stops: list[Place]

    tool = openai.pydantic_function_tool(Trip)
    trip = output_plan.for_chat(_chat(tools=[tool], tool_choice="required"))
    assert accepts(trip, '<tool_call>\n{"name": "Trip", "arguments": {"start": {"city": "A"}, "stops": '
                         '[{"city": "B"}]}}\n</tool_call>')
    # after a thinking section the call may open with the template's blank line
    thinking = output_plan.for_chat(_chat(tools=[WEATHER], tool_choice="required", reasoning_effort="high"))
    assert thinking.constraint.think_end == "</think>" and accepts(thinking, "\n\n" + call)


def test_top_p_zero_decodes_greedy():
    from mtplx.api.openai import sampler_from_request

    sampler = sampler_from_request(_chat(top_p=0, temperature=0.8), {"temperature": 0.6, "top_p": 0.95})
    assert sampler.is_greedy and sampler.top_p == 1.0
    assert not sampler_from_request(_chat(top_p=0.5, temperature=0.8)).is_greedy


def test_anthropic_tool_turns_become_the_templates_messages(tokenizer):
    from mtplx.api import anthropic
    from mtplx.end import End
    from mtplx.api.openai import parse_request

    body = {"model": MODEL, "max_tokens": 64,
            "tools": [{"name": "get_weather", "description": "forecast", "input_schema": WEATHER_SCHEMA}],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
            "thinking": {"type": "enabled", "budget_tokens": 8},
            "messages": [{"role": "user", "content": "Weather?"},
                         {"role": "assistant", "content": [
                             {"type": "thinking", "thinking": "call it", "signature": ""},
                             {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                              "input": {"city": "Paris", "days": 1}}]},
                         {"role": "user", "content": [
                             {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                             {"type": "text", "text": "And tomorrow?"}]}]}
    req = parse_request(anthropic.MessagesRequest, json.dumps(body).encode())
    msgs = req.chat_messages()
    assert [m.role for m in msgs] == ["user", "assistant", "tool", "user"]
    assert msgs[1].tool_calls[0].function.arguments == '{"city": "Paris", "days": 1}'
    assert (msgs[2].content, msgs[2].tool_call_id, msgs[3].content) == ("sunny", "toolu_1", "And tomorrow?")
    plan = req.output_plan()
    assert plan.thinking and plan.constraint.kind == "tool_call" and plan.constraint.think_budget == 8
    text = tokenizer.decode(req.encode(tokenizer))
    assert '"name": "get_weather"' in text and "<tool_response>\nsunny\n</tool_response>" in text
    assert "call it" not in text and text.endswith("<|im_start|>assistant\n<think>\n")
    assert anthropic.stop_reason(End("eos", token=2), True) == "tool_use"
    assert anthropic.stop_reason(End("length"), True) == "max_tokens"


# ------------------------------------------------------------------------------------------------
# Refusals, each naming its field (the ingress in-process: these never reach a replica)


class _UnreachedReplica:
    def options(self, **_):
        return self


@pytest.fixture(scope="module")
def ingress(tmp_path_factory):
    from deployments.ingress import OpenAIIngress

    keys = tmp_path_factory.mktemp("keys") / "api_keys"
    keys.write_text("structured-key\n")
    with process_state.restored():          # a serving process freezes its startup heap
        yield OpenAIIngress(_UnreachedReplica(), {"metrics": False, "niceness": None, "api_keys_file": str(keys),
                                                  "api_keys_env": None})


def _post(ingress, path: str, body: dict):
    from starlette.requests import Request

    raw = json.dumps({"model": MODEL, **body}).encode()

    async def receive():
        return {"type": "http.request", "body": raw, "more_body": False}

    scope = {"type": "http", "method": "POST", "path": path, "root_path": "", "query_string": b"",
             "headers": [(b"content-type", b"application/json"), (b"authorization", b"Bearer structured-key")]}
    resp = asyncio.run(ingress(Request(scope, receive)))
    return resp.status_code, json.loads(resp.body)


def _schema_format(schema):
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


OPENAI_REFUSALS = [
    ({"response_format": _schema_format({"type": "object", "properties": {"a": {"not": {"type": "string"}}}})},
     "response_format.json_schema.schema", ["'not'", "/properties/a/not"]),
    ({"response_format": _schema_format({"type": "object", "properties": {"a": {"type": "strng"}}})},
     "response_format.json_schema.schema", ["strng", "/properties/a/type"]),
    ({"response_format": _schema_format({"properties": {"a": {"$ref": "#/$defs/gone"}}})},
     "response_format.json_schema.schema", ["/properties/a/$ref"]),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", []),
    ({"response_format": {"type": "xml"}}, "response_format.type", []),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex", ["regex"]),
    ({"structured_outputs": {"grammar": "start: missing_rule"}}, "structured_outputs.grammar", ["missing_rule"]),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", []),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", []),
    ({"structured_outputs": {"structural_tag": {}}}, "structured_outputs.structural_tag", []),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "structured_outputs", []),
    ({"guided_json": WEATHER_SCHEMA}, "guided_json", ["structured_outputs.json"]),
    ({"guided_regex": "a+"}, "guided_regex", ["structured_outputs.regex"]),
    ({"functions": [{"name": "f"}]}, "functions", ["tools"]),
    ({"function_call": "auto"}, "function_call", ["tool_choice"]),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", ["nope"]),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", []),
    ({"tool_choice": "required"}, "tool_choice", []),
    ({"tools": [{"type": "function"}]}, "tools.0.function", []),
    ({"tools": [{"type": "code_interpreter"}]}, "tools.0.type", []),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools.0.function.name", []),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools.0.function.parameters",
     []),
    ({"tools": [WEATHER, WEATHER]}, "tools.1.function.name", ["unique"]),
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "g", "parameters": {
        "type": "object", "properties": {"d": {"type": "string", "format": "weird"}}}}}], "tool_choice": "required"},
     "tools.1.function.parameters", ["weird", "/properties/d/format"]),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice", []),
    ({"chat_template_kwargs": {"foo": True}}, "chat_template_kwargs.foo", []),
    ({"chat_template_kwargs": {"enable_thinking": "yes"}}, "chat_template_kwargs.enable_thinking", []),
    ({"reasoning_effort": "extreme"}, "reasoning_effort", []),
    ({"thinking_budget": 8, "chat_template_kwargs": {"enable_thinking": False}}, "thinking_budget", []),
    ({"thinking_budget": -1}, "thinking_budget", []),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]}]}, "messages.0",
     []),
]


@pytest.mark.parametrize("fields,param,words", OPENAI_REFUSALS, ids=[p for _, p, _ in OPENAI_REFUSALS])
def test_openai_refusals_name_the_field(ingress, fields, param, words):
    status, body = _post(ingress, "/v1/chat/completions", {"messages": USER, "max_tokens": 8, **fields})
    assert status == 400, body
    err = body["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    assert all(w in err["message"] for w in words), err
    assert "Traceback" not in err["message"]


def test_completions_and_anthropic_refusals_name_the_field(ingress):
    status, body = _post(ingress, "/v1/completions", {"prompt": "x", "response_format": _schema_format({"type": 5})})
    assert status == 400 and body["error"]["param"] == "response_format.json_schema.schema", body
    msgs = {"max_tokens": 16, "messages": USER}
    tool = {"name": "get_weather", "input_schema": WEATHER_SCHEMA}
    for fields, where in [({"tools": [{"name": "t"}]}, "tools.0.input_schema"),
                          ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
                          ({"tools": [tool], "tool_choice": {"type": "tool", "name": "other"}}, "tool_choice.name"),
                          ({"tools": [tool], "tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
                          ({"tool_choice": {"type": "any"}}, "tool_choice"),
                          ({"thinking": {"type": "enabled", "budget_tokens": 16}}, "thinking.budget_tokens"),
                          ({"thinking": {"type": "on"}}, "thinking"),
                          ({"thinking": {"type": "adaptive"}, "messages": USER + [
                              {"role": "assistant", "content": "def"}]}, "thinking"),
                          ({"tools": [{"name": "t", "input_schema": {"type": "object", "properties": {
                              "a": {"type": "strng"}}}}], "tool_choice": {"type": "any"}},
                           "tools.0.input_schema"),
                          ({"messages": [{"role": "assistant", "content": [{"type": "tool_result", "content": "x"}]}]},
                           "messages.0.content.0.type"),
                          ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "strng"}}}},
                           "output_config.format.schema"),
                          ({"output_config": {"format": {"type": "xml"}}}, "output_config.format.type"),
                          ({"output_config": {"effort": "huge"}}, "output_config.effort")]:
        status, body = _post(ingress, "/v1/messages", {**msgs, **fields})
        assert status == 400 and body["type"] == "error", (fields, body)
        assert body["error"]["type"] == "invalid_request_error" and body["error"]["message"].startswith(where), body


def test_tokenize_renders_tools_and_thinking_as_chat_does(ingress, tokenizer):
    from mtplx.api.openai import ChatMessage, encode_chat

    status, body = _post(ingress, "/tokenize", {"messages": USER, "tools": [WEATHER],
                                                "chat_template_kwargs": {"enable_thinking": True}})
    assert status == 200, body
    kwargs = {"tools": [WEATHER], "enable_thinking": True}
    assert body["tokens"] == encode_chat(tokenizer, [ChatMessage(**m) for m in USER], template_kwargs=kwargs)
    assert tokenizer.decode(body["tokens"]).endswith("<think>\n") and "# Tools" in tokenizer.decode(body["tokens"])


# ------------------------------------------------------------------------------------------------
# Through the served app


def _args_valid(arguments: str, schema: dict) -> dict:
    import jsonschema

    value = json.loads(arguments)
    jsonschema.validate(value, schema)
    return value


@RAY_MARK
def test_openai_structured_output_helpers_and_fields(client):
    import jsonschema

    parsed = client.chat.completions.parse(model=MODEL, messages=USER, response_format=Person, max_tokens=64,
                                           temperature=0)
    choice = parsed.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Person), choice
    assert Person.model_validate_json(choice.message.content) == choice.message.parsed
    with client.chat.completions.stream(model=MODEL, messages=USER, response_format=Person, max_tokens=64,
                                        temperature=0) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].message.parsed == choice.message.parsed
    for extra, check in [({"structured_outputs": {"regex": "[a-z]{3,8}-[0-9]{2}"}},
                          lambda t: re.fullmatch("[a-z]{3,8}-[0-9]{2}", t)),
                         ({"structured_outputs": {"choice": ["yes", "no", "maybe"]}}, lambda t: t in ("yes", "no", "maybe")),
                         ({"structured_outputs": {"json": WEATHER_SCHEMA}},
                          lambda t: jsonschema.validate(json.loads(t), WEATHER_SCHEMA) is None)]:
        r = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=64, temperature=0, extra_body=extra)
        assert r.choices[0].finish_reason == "stop" and check(r.choices[0].message.content), (extra, r.choices[0])
    # completions: response_format, streamed
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER_SCHEMA, "strict": True}}
    text = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="x = ", max_tokens=64, temperature=0, stream=True, extra_body={"response_format": fmt})
        if c.choices)
    jsonschema.validate(json.loads(text), WEATHER_SCHEMA)


@RAY_MARK
def test_openai_required_tool_calls_streamed_and_not(client):
    import openai

    tool = openai.pydantic_function_tool(GetWeather, name="get_weather")
    schema = tool["function"]["parameters"]
    r = client.chat.completions.parse(model=MODEL, messages=USER, tools=[tool], tool_choice="required",
                                      parallel_tool_calls=False, max_tokens=96, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "get_weather"
    assert isinstance(call.function.parsed_arguments, GetWeather)
    arguments = _args_valid(call.function.arguments, schema)
    assert r.model_extra["mtplx_stats"]["finish_reason"] == "tool_calls"
    assert r.model_extra["mtplx_stats"]["constraint"] == "tool_call"
    # streamed: the call's id, type and name first, then its arguments in fragments, as they come
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=USER, tools=[tool], tool_choice={"type": "function", "function": {"name": "get_weather"}},
        parallel_tool_calls=False, max_tokens=96, temperature=0, stream=True))
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].id.startswith("call_") and deltas[0].type == "function" and deltas[0].function.name == "get_weather"
    assert all(d.index == 0 and d.id is None for d in deltas[1:])
    fragments = [d.function.arguments for d in deltas if d.function.arguments]
    assert len(fragments) > 2 and json.loads("".join(fragments)) == arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    with client.chat.completions.stream(model=MODEL, messages=USER, tools=[tool], tool_choice="required",
                                        parallel_tool_calls=False, max_tokens=96, temperature=0) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].message.tool_calls[0].function.parsed_arguments == call.function.parsed_arguments
    # tools with the default choice (auto): listed in the prompt, the answer read for calls
    auto = client.chat.completions.create(model=MODEL, messages=USER, tools=[tool], max_tokens=8, temperature=0)
    plain = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=1, temperature=0)
    assert auto.usage.prompt_tokens > plain.usage.prompt_tokens and auto.choices[0].finish_reason in ("stop", "length")
    # the conversation goes on: the call and its result, rendered by the template
    follow = client.chat.completions.create(model=MODEL, max_tokens=4, temperature=0, tools=[tool], messages=USER + [
        choice.message.model_dump(include={"role", "content", "tool_calls"}),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"}])
    assert follow.usage.prompt_tokens > r.usage.prompt_tokens


@RAY_MARK
def test_anthropic_tool_use_streamed_and_not(serve_app):
    import anthropic

    ac = anthropic.Anthropic(base_url=serve_app.base, api_key=TEST_API_KEY, max_retries=0, timeout=120)
    kw = dict(model=MODEL, messages=USER, max_tokens=96, extra_body={"temperature": 0},
              tools=[{"name": "get_weather", "description": "forecast", "input_schema": WEATHER_SCHEMA}],
              tool_choice={"type": "any", "disable_parallel_tool_use": True})
    m = ac.messages.create(**kw)
    assert m.stop_reason == "tool_use" and [b.type for b in m.content] == ["tool_use"], m
    block = m.content[0]
    assert block.id.startswith("toolu_") and block.name == "get_weather"
    _args_valid(json.dumps(block.input), WEATHER_SCHEMA)
    with ac.messages.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[0].input == block.input
    starts = [e for e in events if e.type == "content_block_start"]
    assert [s.content_block.type for s in starts] == ["tool_use"] and starts[0].content_block.input == {}
    partial = [e.delta.partial_json for e in events if e.type == "content_block_delta"
               and e.delta.type == "input_json_delta"]
    assert len(partial) > 2 and json.loads("".join(partial)) == block.input
    # the result goes back in a user turn; an Anthropic 400 names the field
    more = ac.messages.create(**dict(kw, max_tokens=4, tool_choice={"type": "auto"}, messages=USER + [
        {"role": "assistant", "content": [b.model_dump() for b in m.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id, "content": "sunny"}]}]))
    assert more.usage.input_tokens > m.usage.input_tokens
    with pytest.raises(anthropic.BadRequestError) as exc:
        ac.messages.create(**dict(kw, tool_choice={"type": "tool", "name": "nope"}))
    assert "tool_choice.name" in str(exc.value)
    # structured outputs: the client's parse helper (output_config.format)
    parsed = ac.messages.parse(model=MODEL, messages=USER, max_tokens=64, output_format=Verdict,
                               extra_body={"temperature": 0})
    assert parsed.stop_reason == "end_turn" and isinstance(parsed.parsed_output, Verdict), parsed


@RAY_MARK
def test_thinking_is_split_off_under_a_budget(client, serve_app):
    import anthropic
    import jsonschema

    thinking = {"chat_template_kwargs": {"enable_thinking": True}, "thinking_budget": 8}
    r = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=32, temperature=0, extra_body=thinking)
    message = r.choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert reasoning and message.content and "</think>" not in reasoning + message.content, message
    # streamed: reasoning deltas, then content deltas, the same texts
    chunks = list(client.chat.completions.create(model=MODEL, messages=USER, max_tokens=32, temperature=0,
                                                 stream=True, extra_body=thinking))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    streamed_reasoning = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    assert streamed_reasoning == reasoning and "".join(d.content or "" for d in deltas) == message.content
    first_content = next(i for i, d in enumerate(deltas) if d.content)
    assert not any((d.model_extra or {}).get("reasoning_content") for d in deltas[first_content:])
    # a schema applies after the thinking
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER_SCHEMA}}
    r = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=96, temperature=0,
                                       response_format=fmt, reasoning_effort="high", extra_body={"thinking_budget": 6})
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.model_extra["reasoning_content"]
    jsonschema.validate(json.loads(r.choices[0].message.content), WEATHER_SCHEMA)
    # Anthropic: a thinking block, then the text, streamed and not
    ac = anthropic.Anthropic(base_url=serve_app.base, api_key=TEST_API_KEY, max_retries=0, timeout=120)
    kw = dict(model=MODEL, messages=USER, max_tokens=32, extra_body={"temperature": 0},
              thinking={"type": "enabled", "budget_tokens": 8})
    m = ac.messages.create(**kw)
    assert [b.type for b in m.content] == ["thinking", "text"] and m.content[0].thinking == reasoning
    assert m.content[1].text == message.content
    with ac.messages.stream(**kw) as stream:
        kinds = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"] and final.content[0].thinking == reasoning
    assert kinds[0] == "thinking_delta" and kinds[-1] == "text_delta"

