"""Tool calls that survive limits and bad model output (chat, Anthropic, Responses):
- an answer cut by its budget returns its complete calls, `finish_reason: "length"` (Anthropic
  `max_tokens`, Responses `incomplete`), and no tool-call markup as content: the cut call is
  dropped (named in `mtplx_stats.dropped_tool_calls`); a stream that announced it closes its
  arguments so that they parse;
- a call to a function the request did not offer is not a call, and not content either;
- calls past the bound (`parallel_tool_calls: false`: one; the app's `max_tool_calls`, or the
  Responses request's own below it) are ended by the grammar of a forced choice, dropped from an
  unforced answer.

The parser and the grammar in-process; the answers through the session's served app with the real
clients and the shipped model (the grammar of `structured_outputs.choice` makes the model write an
exact answer: an unknown function's call, two calls where one is allowed). Greedy throughout."""

from __future__ import annotations

import asyncio
import json

import pytest

from conftest import TEST_API_KEY

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

RAY_MARK = pytest.mark.ray
MODEL = "mtplx-tiny-py"
USER = [{"role": "user", "content": "def add(a, b):"}]
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                  "required": ["city", "days"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_SCHEMA}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
UNKNOWN = '<tool_call>\n{"name": "rm_rf", "arguments": {"path": "/"}}\n</tool_call>'


def _feed(parser, text: str, step: int = 5) -> list:
    events = []
    for i in range(0, len(text), step):
        events += parser.push(text[i:i + step])
    return events


# ------------------------------------------------------------------------------------------------
# The parser (no Ray)


def test_a_cut_call_is_dropped_whole_and_closed_in_a_stream():
    from mtplx.api.parsing import OutputParser

    text = "Sure.\n" + CALL + "\n" + CALL[:70]       # the second call cut inside its arguments
    parser = OutputParser(thinking=False, tools=True, names=["get_weather"])
    events = _feed(parser, text) + parser.flush(cut=True)
    result = parser.result()
    assert [json.loads(c.arguments) for c in result.tool_calls] == [{"city": "Paris", "days": 2}]
    assert result.content == "Sure.\n" and "<tool_call>" not in result.content
    (dropped,) = result.dropped_calls
    assert (dropped.name, dropped.reason, dropped.index) == ("get_weather", "truncated", 1)
    assert dropped.arguments == CALL[CALL.index('{"city'):70]
    # the stream announced both; each call's fragments join to valid JSON (the cut one closed)
    streamed = {}
    for ev in events:
        if ev[0] == "args":
            streamed[ev[1]] = streamed.get(ev[1], "") + ev[2]
    assert [ev[1] for ev in events if ev[0] == "call"] == [0, 1]
    assert json.loads(streamed[0]) == {"city": "Paris", "days": 2} and json.loads(streamed[1]) == {"city": "Paris", "da": None}
    # cut before its name was read (the issue's `<tool_call>\n{"name": "r`): nothing announced, nothing as content
    for cut in ('<tool_call>\n{"name": "r', "<tool_call>\n", "<tool_", "<"):
        parser = OutputParser(thinking=False, tools=True, names=["get_weather"])
        events = _feed(parser, cut) + parser.flush(cut=True)
        result = parser.result()
        assert result.tool_calls == [] and result.content == "" and not [e for e in events if e[0] != "reasoning"]
    # an answer that ends on "<" without being cut keeps it: it may be text
    parser = OutputParser(thinking=False, tools=True)
    assert parser.parse("a <", cut=False).content == "a <"


def test_calls_to_functions_not_offered_and_past_the_bound_are_dropped():
    from mtplx.api.parsing import OutputParser

    clock = CALL.replace("get_weather", "get_time")
    text = UNKNOWN + "\n" + CALL + "\n" + clock + "\n" + CALL + "\n"
    parser = OutputParser(thinking=False, tools=True, names=["get_weather", "get_time"], max_calls=2)
    events = _feed(parser, text, 3) + parser.flush()
    result = parser.result()
    assert [c.name for c in result.tool_calls] == ["get_weather", "get_time"] and result.content == ""
    assert [(d.name, d.reason) for d in result.dropped_calls] == [("rm_rf", "unknown_function"),
                                                                  ("get_weather", "over_limit")]
    assert [ev[3] for ev in events if ev[0] == "call"] == ["get_weather", "get_time"]    # never announced
    assert all(ev[1] in (0, 1) for ev in events if ev[0] == "args")
    # arguments that are not an object: not a call
    parser = OutputParser(thinking=False, tools=True, names=["f"])
    result = parser.parse('<tool_call>\n{"name": "f", "arguments": [1, 2]}\n</tool_call>')
    assert result.tool_calls == [] and [d.reason for d in result.dropped_calls] == ["invalid_arguments"]


def _json_objects():
    leaves = st.one_of(st.none(), st.booleans(), st.integers(-10 ** 6, 10 ** 6),
                       st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=8))
    values = st.recursive(leaves, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                          st.dictionaries(st.text(max_size=5), inner, max_size=3)),
                          max_leaves=12)
    return st.dictionaries(st.text(max_size=6), values, max_size=4)


@settings(max_examples=150, derandomize=True, deadline=None)
@given(_json_objects(), st.sampled_from([(", ", ": "), (",", ":")]), st.booleans())
def test_close_json_completes_any_cut_object(obj, separators, ascii_only):
    from mtplx.api.parsing import close_json

    text = json.dumps(obj, separators=separators, ensure_ascii=ascii_only)
    for cut in range(len(text) + 1):
        prefix = text[:cut]
        assert isinstance(json.loads(prefix + close_json(prefix)), dict), prefix


def test_the_grammar_of_a_forced_choice_ends_at_the_bound(tokenizer_llg):
    import llguidance

    from mtplx.api import openai as oa
    from mtplx.api import output_plan
    from mtplx.api.limits import RequestLimits

    llg = tokenizer_llg

    def plan(max_calls, **fields):
        body = {"messages": USER, "tools": [WEATHER], "tool_choice": "required", **fields}
        req = oa.parse_request(oa.ChatCompletionRequest, json.dumps(body).encode(),
                               RequestLimits(max_tool_calls=max_calls))
        return output_plan.for_chat(req)

    def accepts(p, calls):
        matcher = llguidance.LLMatcher(llg, p.constraint.grammar, log_level=0)
        return matcher.consume_tokens(llg.tokenize_str("\n".join([CALL] * calls))) and matcher.is_accepting()

    three = plan(3)
    assert three.max_tool_calls == 3 and accepts(three, 3) and not accepts(three, 4)
    assert not accepts(plan(3, parallel_tool_calls=False), 2) and accepts(plan(3, parallel_tool_calls=False), 1)
    default = plan(None)
    assert default.max_tool_calls == 16 and accepts(default, 16) and not accepts(default, 17)


@pytest.fixture(scope="module")
def tokenizer_llg():
    from deployments.ingress.model_files import SHIPPED_MODEL_DIR, load_tokenizer
    from mtplx.structured import grammar_tokenizer

    return grammar_tokenizer(load_tokenizer(SHIPPED_MODEL_DIR), 4096)


class _ScriptedRun:
    """A row's text as given (what the Anthropic format reads from a RowStream)."""

    def __init__(self, plan, pieces, end_kind):
        from deployments.ingress.row_stream import RowResult
        from mtplx.api.openai import FINISH_REASON_OF_END
        from mtplx.end import End

        self.plan, self.pieces, self.rid, self.model = plan, pieces, "msg_1", MODEL
        self.spec = type("Spec", (), {"prompt_ids": (1, 2, 3)})()
        self._result = RowResult(3, 40, 0, End(end_kind), FINISH_REASON_OF_END[end_kind], None, {})

    async def texts(self):
        for piece in self.pieces:
            yield piece

    async def text(self):
        return "".join(self.pieces)

    def result(self):
        return self._result

    def close(self):
        pass


def test_anthropic_tool_use_follows_the_same_rules():
    """Anthropic's format over a scripted answer: a call to a function not offered is no tool_use
    block, a cut call is dropped from the body and closed in the stream, `max_tokens`."""
    from anthropic.types import RawMessageStreamEvent
    from pydantic import TypeAdapter

    from deployments.ingress.formats import AnthropicFormat
    from mtplx.api import output_plan
    from mtplx.api.tools import ToolChoice, anthropic_tools

    tools = anthropic_tools([{"name": "get_weather", "input_schema": WEATHER_SCHEMA}])
    plan = output_plan.assemble(False, None, tools, ToolChoice("auto", max_calls=16))
    text = UNKNOWN + "\n" + CALL + "\n" + CALL[:60]
    pieces = [text[i:i + 9] for i in range(0, len(text), 9)]
    body = asyncio.run(AnthropicFormat(_ScriptedRun(plan, pieces, "length")).response())
    assert [b["type"] for b in body["content"]] == ["tool_use"] and body["stop_reason"] == "max_tokens"
    assert body["content"][0]["input"] == {"city": "Paris", "days": 2}
    assert [(d["name"], d["reason"]) for d in body["mtplx_stats"]["dropped_tool_calls"]] == [
        ("rm_rf", "unknown_function"), ("get_weather", "truncated")]

    async def stream():
        return b"".join([chunk async for chunk in AnthropicFormat(_ScriptedRun(plan, pieces, "length")).sse()])

    adapter = TypeAdapter(RawMessageStreamEvent)
    events = [json.loads(line[6:]) for line in asyncio.run(stream()).decode().splitlines() if line.startswith("data: ")]
    for event in events:
        adapter.validate_python(event)
    inputs = {}
    for e in events:
        if e["type"] == "content_block_delta":
            inputs[e["index"]] = inputs.get(e["index"], "") + e["delta"]["partial_json"]
    starts = [e["content_block"]["name"] for e in events if e["type"] == "content_block_start"]
    assert starts == ["get_weather", "get_weather"] and [json.loads(v) for v in inputs.values()] == [
        {"city": "Paris", "days": 2}, {"city": "P"}]
    assert events[-2]["delta"]["stop_reason"] == "max_tokens"


# ------------------------------------------------------------------------------------------------
# Through the served app


def _required(client, max_tokens: int, **extra):
    return client.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER], tool_choice="required",
                                          max_tokens=max_tokens, temperature=0, **extra)


def _inside_second_call(client) -> int:
    """A budget that ends the answer inside its second call's arguments (the greedy answer's
    tokens, from their log-probability entries)."""
    r = _required(client, 200, logprobs=True)
    texts = [e.token for e in r.choices[0].logprobs.content]
    text = "".join(texts)
    second = text.index('"arguments": ', text.index('"arguments": ') + 1) + len('"arguments": ') + 3
    return next(k for k in range(len(texts)) if len("".join(texts[:k])) > second)


@RAY_MARK
def test_chat_answer_cut_by_max_tokens_returns_its_complete_calls(client):
    full = _required(client, 200).choices[0].message.tool_calls
    assert len(full) >= 3, full         # the shipped model keeps calling: the budget cuts it
    for max_tokens in (10, 20, 30, 60, 90, _inside_second_call(client)):
        r = _required(client, max_tokens)
        choice = r.choices[0]
        assert choice.finish_reason == "length", choice
        assert choice.message.content in (None, "") and "<tool_call>" not in (choice.message.content or "")
        calls = choice.message.tool_calls or []
        assert [(c.function.name, c.function.arguments) for c in calls] == [
            (c.function.name, c.function.arguments) for c in full[:len(calls)]]
        dropped = r.model_extra["mtplx_stats"].get("dropped_tool_calls") or []
        assert [d["reason"] for d in dropped] in ([], ["truncated"]), dropped
    # the first call cut: no call, no markup (the 10-30 tokens)
    first = _required(client, 12).choices[0]
    assert not first.message.tool_calls and not first.message.content


@RAY_MARK
def test_chat_stream_cut_by_max_tokens_closes_its_last_call(client):
    budget = _inside_second_call(client)
    chunks = list(_required(client, budget, stream=True))
    args, names = {}, {}
    for c in chunks:
        for d in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            if d.function.name:
                names[d.index] = d.function.name
            args[d.index] = args.get(d.index, "") + (d.function.arguments or "")
    assert len(args) == 2 and all(isinstance(json.loads(a), dict) for a in args.values()), args
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    stats = chunks[-1].model_extra["mtplx_stats"]
    (dropped,) = stats["dropped_tool_calls"]
    assert dropped["reason"] == "truncated" and dropped["index"] == max(args)
    body = _required(client, budget).choices[0].message
    assert [c.function.arguments for c in body.tool_calls] == [args[0]]
    with client.chat.completions.stream(model=MODEL, messages=USER, tools=[WEATHER], tool_choice="required",
                                        max_tokens=budget, temperature=0) as stream:
        kinds = [event.type for event in stream]      # (its get_final_completion refuses any "length" answer)
        snapshot = stream.current_completion_snapshot
    assert kinds.count("tool_calls.function.arguments.done") == 2
    assert [c.function.arguments for c in snapshot.choices[0].message.tool_calls] == [args[i] for i in sorted(args)]


@RAY_MARK
def test_chat_calls_not_offered_or_past_one_are_not_returned(client):
    """The model writes exactly what `structured_outputs.choice` allows, with the tools parsed
    (auto): a call of a function the request did not offer, or a second call without parallel
    calls."""
    def answer(text, **extra):
        return client.chat.completions.create(
            model=MODEL, messages=USER, tools=[WEATHER], max_tokens=200, temperature=0,
            extra_body={"structured_outputs": {"choice": [text]}}, **extra)

    r = answer("Let me see.\n" + UNKNOWN)
    msg = r.choices[0].message
    assert not msg.tool_calls and msg.content == "Let me see.\n" and r.choices[0].finish_reason == "stop"
    assert r.model_extra["mtplx_stats"]["dropped_tool_calls"] == [
        {"name": "rm_rf", "reason": "unknown_function", "arguments": '{"path": "/"}', "index": None}]
    streamed = list(client.chat.completions.create(
        model=MODEL, messages=USER, tools=[WEATHER], max_tokens=80, temperature=0, stream=True,
        extra_body={"structured_outputs": {"choice": [UNKNOWN]}}))
    assert not any(c.choices and c.choices[0].delta.tool_calls for c in streamed)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == ""
    two = answer(CALL + "\n" + CALL, parallel_tool_calls=False)
    assert len(two.choices[0].message.tool_calls) == 1 and two.choices[0].finish_reason == "tool_calls"
    assert [d["reason"] for d in two.model_extra["mtplx_stats"]["dropped_tool_calls"]] == ["over_limit"]


@RAY_MARK
def test_forced_calls_end_at_the_bound(client, serve_app):
    """A forced choice with parallel calls ends after the app's max_tool_calls (16), or the
    Responses request's own: the answer finishes as a tool-calling one, not at its budget."""
    import anthropic

    ac = anthropic.Anthropic(base_url=serve_app.base, api_key=TEST_API_KEY, max_retries=0, timeout=120)
    m = ac.messages.create(model=MODEL, messages=USER, max_tokens=900, extra_body={"temperature": 0},
                           tools=[{"name": "get_weather", "input_schema": WEATHER_SCHEMA}], tool_choice={"type": "any"})
    assert m.stop_reason == "tool_use" and [b.type for b in m.content] == ["tool_use"] * 16, m.stop_reason
    r = client.responses.create(model=MODEL, input="weather?", max_tool_calls=2, tool_choice="required",
                                tools=[{"type": "function", "name": "get_weather", "parameters": WEATHER_SCHEMA}],
                                max_output_tokens=200, temperature=0)
    assert r.status == "completed" and [o.type for o in r.output] == ["function_call"] * 2


@RAY_MARK
def test_anthropic_answer_cut_by_max_tokens(serve_app, client):
    """The same prompt as chat's (the template lists the same tool): the same cut."""
    import anthropic

    ac = anthropic.Anthropic(base_url=serve_app.base, api_key=TEST_API_KEY, max_retries=0, timeout=120)
    kw = dict(model=MODEL, messages=USER, max_tokens=_inside_second_call(client), extra_body={"temperature": 0},
              tools=[{"name": "get_weather", "input_schema": WEATHER_SCHEMA}], tool_choice={"type": "any"})
    m = ac.messages.create(**kw)
    assert m.stop_reason == "max_tokens" and m.content and all(b.type == "tool_use" for b in m.content), m
    with ac.messages.stream(**kw) as stream:
        final = stream.get_final_message()         # the client parses every block's input JSON
    assert final.stop_reason == "max_tokens" and len(final.content) == len(m.content) + 1
    assert [b.input for b in final.content[:-1]] == [b.input for b in m.content]
