"""OpenAI's Responses API: the request's conversation as the chat messages the template renders,
its refusals (in-process ingress, no Ray), its stream events checked against the `openai`
client's own types, and, through the session's served app with the real `openai` client:
`responses.create`, `responses.stream`, `responses.parse` with a pydantic model, function calling
over two turns through `previous_response_id` (the second turn reading the first's prompt from the
prefix cache), reasoning items and their tokens, GET and DELETE partitioned by API key, and the
store shared with another process's store object on the same file.

Greedy throughout: a response's text is exactly the chat completion's of the same conversation."""

from __future__ import annotations

import asyncio
import json

import pytest
from pydantic import BaseModel, Field, TypeAdapter

from conftest import TEST_API_KEY

RAY_MARK = pytest.mark.ray
MODEL = "mtplx-tiny-py"
PROMPT = "def add(a, b):"
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                  "required": ["city", "days"], "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather forecast",
           "parameters": WEATHER_SCHEMA, "strict": True}
# long enough that a conversation's prompt passes the prefix cache's first 256-token block
INSTRUCTIONS = "You write small, correct Python functions and call tools when asked. " * 30
OTHER_KEY = "second-key-for-rotation"


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=120)


def _request(**fields):
    from mtplx.api import responses
    from mtplx.api.openai import parse_request

    return parse_request(responses.ResponsesRequest, json.dumps({"model": MODEL, **fields}).encode())


# ------------------------------------------------------------------------------------------------
# The conversation (no Ray)


def test_input_items_become_the_templates_messages(model):
    """Messages, function calls and their outputs, reasoning and instructions render as the chat
    turns they are; output items sent back as input read as the same conversation."""
    from mtplx.api import responses
    from mtplx.api.openai import ChatMessage, encode_chat

    req = _request(instructions="Be brief.", input=[
        {"role": "user", "content": "weather?"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "think"}]},
        {"type": "message", "role": "assistant", "status": "completed", "id": "msg_1",
         "content": [{"type": "output_text", "text": "Checking.", "annotations": [], "logprobs": []}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}',
         "status": "completed", "id": "fc_1"},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": {"city": "Rome"}},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "rain"}]},
        {"role": "user", "content": [{"type": "input_text", "text": "and "}, {"type": "input_text", "text": "Oslo?"}]}])
    turn = responses.prepare_turn(req)
    chat = [m.model_dump(exclude_none=True) for m in turn.messages()]
    assert chat == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "think", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
        {"role": "tool", "content": "rain", "tool_call_id": "call_2"},
        {"role": "user", "content": "and Oslo?"}]
    assert [i["id"] for i in turn.items][1:4] == ["rs_1", "msg_1", "fc_1"] and turn.items[0]["id"].startswith("msg_")
    assert turn.items[4]["id"].startswith("fc_") and turn.items[5]["id"].startswith("fco_")
    # a string input is one user message; a continuation puts the stored context and output first
    first = responses.prepare_turn(_request(input="hi", instructions="Be brief."))
    assert [m.role for m in first.messages()] == ["system", "user"]
    output = [responses.message_item("hello", "completed")]
    second = responses.prepare_turn(_request(input="more"), first.context, output)
    assert [(m.role, m.content) for m in second.messages()] == [("user", "hi"), ("assistant", "hello"),
                                                                 ("user", "more")]
    ids = encode_chat(model.tokenizer, second.messages())
    assert ids == encode_chat(model.tokenizer, [ChatMessage(role="user", content="hi"),
                                                ChatMessage(role="assistant", content="hello"),
                                                ChatMessage(role="user", content="more")])


def test_requests_build_their_plans_and_chat_requests():
    req = _request(input=PROMPT, max_output_tokens=9, temperature=0, top_p=0.5, prompt_cache_key="tenant",
                   tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, reasoning={"effort": "low"})
    plan = req.output_plan()
    assert plan.thinking and plan.parse_tools and plan.constraint.kind == "tool_call" and plan.max_tool_calls == 1
    assert plan.tool_names == ("get_weather",)
    from mtplx.api import responses

    chat = req.chat_request(responses.prepare_turn(req).messages())
    assert (chat.max_tokens, chat.temperature, chat.top_p, chat.cache_salt) == (9, 0, 0.5, "tenant")
    assert chat.max_tokens_param == "max_output_tokens" and chat.prompt_param == "input"
    assert _request(input="x", tools=[WEATHER], max_tool_calls=3).output_plan().max_tool_calls == 3
    fmt = _request(input="x", text={"format": {"type": "json_schema", "name": "p", "schema": WEATHER_SCHEMA,
                                               "strict": True}}).output_plan()
    assert fmt.constraint.kind == "json_schema" and fmt.param == "text.format.schema"
    assert _request(input="x", text={"format": {"type": "json_object"}}).output_plan().constraint.kind == "json_object"
    assert _request(input="x", reasoning={"effort": "minimal"}).output_plan().thinking is False
    assert _request(input="x", include=["message.output_text.logprobs"], top_logprobs=3).requested_logprobs == 3


class _UnreachedReplica:
    def options(self, **_):
        return self


@pytest.fixture(scope="module")
def ingress(tmp_path_factory):
    from deployments.ingress import OpenAIIngress

    keys = tmp_path_factory.mktemp("keys") / "api_keys"
    keys.write_text("responses-key\n")
    store = tmp_path_factory.mktemp("store") / "responses.sqlite3"
    return OpenAIIngress(_UnreachedReplica(), {"metrics": False, "niceness": None, "api_keys_file": str(keys),
                                               "api_keys_env": None, "responses_store_path": str(store)})


def _call(ingress, method: str, path: str, body=None):
    from starlette.requests import Request

    raw = b"" if body is None else json.dumps(body).encode()

    async def receive():
        return {"type": "http.request", "body": raw, "more_body": False}

    scope = {"type": "http", "method": method, "path": path, "root_path": "", "query_string": b"",
             "headers": [(b"content-type", b"application/json"), (b"authorization", b"Bearer responses-key")]}
    resp = asyncio.run(ingress(Request(scope, receive)))
    return resp.status_code, json.loads(resp.body)


REFUSALS = [
    ({"frobnicate": 1}, "frobnicate", "unknown_parameter"),
    ({"background": True}, "background", "unsupported_value"),
    ({"truncation": "auto"}, "truncation", "unsupported_value"),
    ({"prompt_cache_retention": "24h"}, "prompt_cache_retention", "unsupported_value"),
    ({"conversation": "conv_1"}, "conversation", "unsupported_value"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt", "unsupported_value"),
    ({"include": ["file_search_call.results"]}, "include.0", "unsupported_value"),
    ({"stream_options": {"include_obfuscation": False}}, "stream_options", None),
    ({"max_output_tokens": 0}, "max_output_tokens", "invalid_value"),
    ({"max_output_tokens": 10 ** 6}, "max_output_tokens", "invalid_value"),
    ({"max_tool_calls": 10 ** 4}, "max_tool_calls", "invalid_value"),
    ({"temperature": 3}, "temperature", "invalid_value"),
    ({"top_logprobs": 21}, "top_logprobs", "invalid_value"),
    ({"reasoning": {"effort": "extreme"}}, "reasoning.effort", "invalid_value"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type", "unsupported_value"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema", "missing_required_parameter"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "strng"}}}}, "text.format.schema",
     "invalid_schema"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type", "unsupported_value"),
    ({"tools": [dict(WEATHER, defer_loading=True)]}, "tools.0.defer_loading", None),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name", None),
    ({"tools": [WEATHER], "tool_choice": {"type": "allowed_tools", "tools": []}}, "tool_choice", None),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input.0.type", "unsupported_value"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.content.0.type",
     "unsupported_content"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input.0.role", None),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input.0.call_id",
     "missing_required_parameter"),
    ({"input": [], "instructions": None}, "input", None),
    ({"include": ["message.output_text.logprobs"], "tools": [WEATHER]}, "include", "unsupported_value"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", None),
    ({"previous_response_id": "resp_missing"}, "previous_response_id", "previous_response_not_found"),
]


@pytest.mark.parametrize("fields,param,code", REFUSALS, ids=[p for _, p, _ in REFUSALS])
def test_refusals_name_the_field(ingress, fields, param, code):
    status, body = _call(ingress, "POST", "/v1/responses", {"model": MODEL, "input": PROMPT, **fields})
    assert status == (404 if param == "previous_response_id" else 400), body
    err = body["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    assert code is None or err["code"] == code, err


def test_stored_routes_answer_404_in_openais_shape(ingress):
    for method in ("GET", "DELETE"):
        status, body = _call(ingress, method, "/v1/responses/resp_nope")
        assert status == 404 and body["error"]["code"] == "response_not_found" and "resp_nope" in body["error"]["message"]
    status, body = _call(ingress, "PUT", "/v1/responses/resp_nope")
    assert status == 405 and body["error"]["code"] == "method_not_allowed"


# ------------------------------------------------------------------------------------------------
# The stream's events are the client's types


def test_stream_events_validate_as_the_clients_types():
    """Every event a stream sends (reasoning, text, calls, a call cut and closed) validates as the
    `openai` client's ResponseStreamEvent, and the items close in order."""
    from openai.types.responses import Response, ResponseStreamEvent

    from mtplx.api import responses
    from mtplx.api.parsing import OutputParser

    adapter = TypeAdapter(ResponseStreamEvent)
    echo = _request(input="x", tools=[WEATHER], reasoning={"effort": "low"}).echo()
    base = responses.response_object("resp_1", 1.0, MODEL, echo, "in_progress", [])
    events = responses.ResponseEvents(base)
    parser = OutputParser(thinking=True, tools=True, names=["get_weather"])
    text = ('plan</think>\n\nOK.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}'
            '\n</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Ro')
    out = events.start()
    for piece in (text[i:i + 7] for i in range(0, len(text), 7)):
        out += events.push(parser.push(piece))
    out += events.push(parser.flush(cut=True)) + events.close("incomplete")
    final = responses.response_object("resp_1", 1.0, MODEL, echo, "incomplete", events.output,
                                      responses.usage(5, 40, 0, 3), {}, "max_output_tokens")
    out.append(events.terminal(final))
    for event in out:
        adapter.validate_python(event)
    Response.model_validate(final)
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    kinds = [e["type"] for e in out]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    assert [i["type"] for i in events.output] == ["reasoning", "message", "function_call", "function_call"]
    assert events.output[0]["content"][0]["text"] == "plan" and events.output[1]["content"][0]["text"] == "OK.\n"
    assert json.loads(events.output[2]["arguments"]) == {"city": "Paris", "days": 2}
    cut = events.output[3]
    assert cut["status"] == "incomplete" and json.loads(cut["arguments"]) == {"city": "Ro"}
    assert kinds.count("response.output_item.done") == 4


# ------------------------------------------------------------------------------------------------
# Through the served app, with the openai client


def _chat_text(client, **extra):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=16,
                                       temperature=0, **extra)
    return r.choices[0].message.content, r.usage


@RAY_MARK
def test_create_get_and_delete(client, serve_app):
    import openai

    r = client.responses.create(model=MODEL, input=PROMPT, max_output_tokens=16, temperature=0,
                                metadata={"run": "t1"})
    text, usage = _chat_text(client)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL
    assert r.output_text == text and "<|im_start|>" not in r.output_text       # the chat completion's, no special token
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    (message,) = r.output
    assert message.type == "message" and message.id.startswith("msg_") and message.status == "incomplete"
    assert (r.usage.input_tokens, r.usage.output_tokens) == (usage.prompt_tokens, 16)
    assert r.usage.total_tokens == usage.prompt_tokens + 16 and r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.max_output_tokens == 16 and r.temperature == 0 and r.store is True and r.metadata == {"run": "t1"}
    assert r.model_extra["mtplx_stats"]["stored"] is True
    # stored: read back exactly, by this key only
    got = client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump()
    other = openai.OpenAI(base_url=serve_app.api, api_key=OTHER_KEY, max_retries=0, timeout=60)
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError) as exc:
        other.responses.create(model=MODEL, input="more", previous_response_id=r.id, max_output_tokens=4)
    assert exc.value.body["param"] == "previous_response_id"
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    # store: false keeps nothing
    unstored = client.responses.create(model=MODEL, input=PROMPT, max_output_tokens=2, temperature=0, store=False)
    assert unstored.store is False and "stored" not in unstored.model_extra["mtplx_stats"]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.BadRequestError) as exc:
        client.responses.create(model=MODEL, input=PROMPT, extra_body={"frobnicate": 1})
    assert exc.value.body["code"] == "unknown_parameter" and exc.value.body["param"] == "frobnicate"


@RAY_MARK
def test_stream_with_the_clients_helper(client):
    text, _ = _chat_text(client)
    raw = list(client.responses.create(model=MODEL, input=PROMPT, max_output_tokens=16, temperature=0, stream=True))
    kinds = [e.type for e in raw]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in raw] == list(range(len(raw)))
    deltas = [e.delta for e in raw if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == text and raw[-1].response.output[0].content[0].text == text
    assert raw[-1].response.usage.output_tokens == 16
    # the helper: a completed response (a schema's grammar ends it) parsed into the model
    with client.responses.stream(model=MODEL, input=PROMPT, max_output_tokens=128, temperature=0,
                                 text_format=Person) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_response()
    assert events[-1] == "response.completed" and final.status == "completed"
    assert isinstance(final.output_parsed, Person)
    assert client.responses.retrieve(final.id).output_text == final.output_text


@RAY_MARK
def test_parse_with_a_pydantic_model(client):
    r = client.responses.parse(model=MODEL, input=PROMPT, text_format=Person, max_output_tokens=128, temperature=0)
    assert r.status == "completed" and isinstance(r.output_parsed, Person), r
    assert r.model_extra["mtplx_stats"]["constraint"] == "json_schema"
    chat = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": PROMPT}],
                                         response_format=Person, max_tokens=128, temperature=0)
    assert r.output_parsed == chat.choices[0].message.parsed
    obj = client.responses.create(model=MODEL, input=PROMPT, text={"format": {"type": "json_object"}},
                                  max_output_tokens=16, temperature=0)    # (the tiny model writes one long number)
    assert obj.model_extra["mtplx_stats"]["constraint"] == "json_object" and obj.output_text.startswith("{")


@RAY_MARK
def test_function_calling_over_two_turns(client):
    """Turn 1 calls the tool (forced, one call); turn 2 sends its output through
    previous_response_id: the stored conversation continues (instructions are the request's own,
    as OpenAI's: they do not carry over), and its prompt's first block comes from the prefix
    cache."""
    import openai

    first = client.responses.create(model=MODEL, instructions=INSTRUCTIONS, input="What is the weather in Paris?",
                                    tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
                                    max_output_tokens=96, temperature=0)
    assert first.status == "completed"
    (call,) = [o for o in first.output if o.type == "function_call"]
    assert call.call_id.startswith("call_") and call.id.startswith("fc_") and call.name == "get_weather"
    assert set(json.loads(call.arguments)) == {"city", "days"} and call.status == "completed"
    assert first.usage.input_tokens > 256
    second = client.responses.create(model=MODEL, previous_response_id=first.id, tools=[WEATHER],
                                     instructions=INSTRUCTIONS,
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": "sunny"}], max_output_tokens=8, temperature=0)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= 256, second.usage
    # the same conversation sent whole gives the same answer
    whole = client.responses.create(model=MODEL, instructions=INSTRUCTIONS, tools=[WEATHER], input=[
        {"role": "user", "content": "What is the weather in Paris?"}, *[o.model_dump() for o in first.output],
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}], max_output_tokens=8,
        temperature=0, store=False)
    assert whole.output_text == second.output_text and whole.usage.input_tokens == second.usage.input_tokens
    # a parsed tool (the client's pydantic helper) in a stream
    tool = openai.pydantic_function_tool(Person, name="person")
    with client.responses.stream(model=MODEL, input="Who?", tools=[tool], tool_choice="required",
                                 parallel_tool_calls=False, max_output_tokens=96, temperature=0) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    (parsed_call,) = final.output
    assert isinstance(parsed_call.parsed_arguments, Person)


@RAY_MARK
def test_reasoning_items_and_their_tokens(client):
    r = client.responses.create(model=MODEL, input=PROMPT, reasoning={"effort": "high"}, max_output_tokens=24,
                                temperature=0)
    reasoning = [o for o in r.output if o.type == "reasoning"]
    assert reasoning and reasoning[0].content[0].text and reasoning[0].id.startswith("rs_")
    assert 0 < r.usage.output_tokens_details.reasoning_tokens <= r.usage.output_tokens == 24
    assert r.reasoning.effort == "high"
    off = client.responses.create(model=MODEL, input=PROMPT, reasoning={"effort": "minimal"}, max_output_tokens=4,
                                  temperature=0)
    assert [o.type for o in off.output] == ["message"] and off.usage.output_tokens_details.reasoning_tokens == 0
    # logprobs of a plain answer: one entry per token, their texts joined are the text
    lp = client.responses.create(model=MODEL, input=PROMPT, max_output_tokens=8, temperature=0, top_logprobs=2,
                                 include=["message.output_text.logprobs"])
    entries = lp.output[0].content[0].logprobs
    assert len(entries) == 8 and "".join(e.token for e in entries) == lp.output_text
    assert all(len(e.top_logprobs) == 2 for e in entries)


@RAY_MARK
def test_the_store_is_one_file_every_replica_shares(client, serve_app):
    """What the served ingress stores, another store object on the same file reads, and what one
    writes there, the served ingress serves: every ingress replica of the machine sees one store."""
    from deployments.ingress.auth import caller_digest
    from deployments.ingress.response_store import ResponseStore, StoredResponse

    r = client.responses.create(model=MODEL, input=PROMPT, max_output_tokens=4, temperature=0)
    owner = caller_digest(TEST_API_KEY.encode())
    store = ResponseStore(serve_app.store_path)
    try:
        found = store.get(owner, r.id)
        assert found is not None and found.response["output"][0]["content"][0]["text"] == r.output_text
        assert [i["type"] for i in found.context] == ["message"] and store.get("someone-else", r.id) is None
        body = dict(found.response, id="resp_written_elsewhere")
        store.put(StoredResponse(body["id"], owner, found.created_at, body, found.context))
    finally:
        store.close()
    assert client.responses.retrieve("resp_written_elsewhere").output_text == r.output_text
    more = client.responses.create(model=MODEL, input="more", previous_response_id="resp_written_elsewhere",
                                   max_output_tokens=2, temperature=0)
    assert more.usage.input_tokens > r.usage.input_tokens + r.usage.output_tokens
