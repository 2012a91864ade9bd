"""A corpus of bad requests: each must get a 4xx in OpenAI's error shape, and the server must answer
a good request identically before and after the whole corpus (tests/test_http.py runs it).

Each case: (name, method, path, body, headers, status, param). `body` is a dict/list (sent as JSON)
or bytes (sent as is); `param` is the expected `error.param` (None: not checked).
"""

from __future__ import annotations

MSGS = [{"role": "user", "content": "def add(a, b):"}]
CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
JSON = {"content-type": "application/json"}


def chat(**fields) -> dict:
    return {"model": "mtplx-tiny-py", "messages": MSGS, "max_tokens": 4, **fields}


def comp(**fields) -> dict:
    return {"model": "mtplx-tiny-py", "prompt": "def add(a, b):", "max_tokens": 4, **fields}


def _deep(n: int) -> bytes:
    return b'{"messages": ' + b"[" * n + b"]" * n + b"}"


CASES = [
    # JSON edge cases
    ("empty body", "POST", CHAT, b"", JSON, 400, None),
    ("not json", "POST", CHAT, b"{not json", JSON, 400, None),
    ("truncated json", "POST", CHAT, b'{"messages": [{"role": "user", "content": "x"}', JSON, 400, None),
    ("json null", "POST", CHAT, b"null", JSON, 400, None),
    ("json array", "POST", CHAT, [1, 2, 3], JSON, 400, None),
    ("json string", "POST", COMP, b'"just a string"', JSON, 400, None),
    ("NaN temperature", "POST", CHAT, b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}',
     JSON, 400, "temperature"),
    ("Infinity top_p", "POST", CHAT, b'{"messages": [{"role": "user", "content": "x"}], "top_p": Infinity}',
     JSON, 400, "top_p"),
    ("deep nesting", "POST", CHAT, _deep(5000), JSON, 400, None),
    # encodings
    ("utf-16 body", "POST", CHAT, '{"messages": [{"role": "user", "content": "x"}]}'.encode("utf-16"), JSON,
     400, None),
    ("invalid utf-8", "POST", CHAT, b'{"messages": [{"role": "user", "content": "\xff\xfe\xfd"}]}', JSON, 400, None),
    ("lone surrogate escape", "POST", CHAT, b'{"messages": [{"role": "user", "content": "\\ud800"}]}', JSON,
     400, None),
    # missing and wrong types
    ("no messages", "POST", CHAT, {"model": "mtplx-tiny-py"}, JSON, 400, "messages"),
    ("messages a string", "POST", CHAT, {"messages": "hello"}, JSON, 400, "messages"),
    ("empty messages", "POST", CHAT, {"messages": []}, JSON, 400, "messages"),
    ("user message without content", "POST", CHAT, {"messages": [{"role": "user"}]}, JSON, 400, "messages.0"),
    ("unknown role", "POST", CHAT, {"messages": [{"role": "robot", "content": "x"}]}, JSON, 400, "messages.0.role"),
    ("content a number", "POST", CHAT, {"messages": [{"role": "user", "content": 42}]}, JSON, 400, None),
    ("image content part", "POST", CHAT, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, JSON, 400, "messages.0.content.0.type"),
    ("max_tokens a string", "POST", CHAT, chat(max_tokens="ten"), JSON, 400, "max_tokens"),
    ("max_tokens a float", "POST", CHAT, chat(max_tokens=4.5), JSON, 400, "max_tokens"),
    ("seed a string", "POST", CHAT, chat(seed="7"), JSON, 400, "seed"),
    ("stop a number", "POST", CHAT, chat(stop=5), JSON, 400, "stop"),
    ("no prompt", "POST", COMP, {"model": "mtplx-tiny-py"}, JSON, 400, "prompt"),
    ("prompt an object", "POST", COMP, comp(prompt={"text": "x"}), JSON, 400, "prompt"),
    ("prompt of booleans", "POST", COMP, comp(prompt=[True, False]), JSON, 400, "prompt"),
    # out of range
    ("negative temperature", "POST", CHAT, chat(temperature=-1), JSON, 400, "temperature"),
    ("temperature above 2", "POST", CHAT, chat(temperature=2.5), JSON, 400, "temperature"),
    ("top_p negative", "POST", CHAT, chat(top_p=-0.1), JSON, 400, "top_p"),
    ("top_k below -1", "POST", CHAT, chat(top_k=-5), JSON, 400, "top_k"),
    ("min_p above 1", "POST", CHAT, chat(min_p=1.5), JSON, 400, "min_p"),
    ("presence_penalty 3", "POST", CHAT, chat(presence_penalty=3), JSON, 400, "presence_penalty"),
    ("max_tokens zero", "POST", CHAT, chat(max_tokens=0), JSON, 400, "max_tokens"),
    ("max_tokens above the server limit", "POST", CHAT, chat(max_tokens=100000), JSON, 400, "max_tokens"),
    ("seed beyond 64 bits", "POST", CHAT, chat(seed=2 ** 70), JSON, 400, "seed"),
    ("n beyond the batch window", "POST", CHAT, chat(n=64), JSON, 400, "n"),
    ("five stop strings", "POST", CHAT, chat(stop=["a", "b", "c", "d", "e"]), JSON, 400, "stop"),
    ("empty stop string", "POST", CHAT, chat(stop=[""]), JSON, 400, "stop"),
    ("unknown generation_mode", "POST", CHAT, chat(generation_mode="turbo"), JSON, 400, "generation_mode"),
    ("stream_options without stream", "POST", CHAT, chat(stream_options={"include_usage": True}), JSON, 400,
     "stream_options"),
    # token ids outside the vocabulary
    ("token id -1", "POST", COMP, comp(prompt=[1, 2, -1]), JSON, 400, "prompt"),
    ("token id = vocab size", "POST", COMP, comp(prompt=[1, 4096]), JSON, 400, "prompt"),
    ("token id 2**40", "POST", COMP, comp(prompt=[2 ** 40]), JSON, 400, "prompt"),
    ("empty token list", "POST", COMP, comp(prompt=[]), JSON, 400, "prompt"),
    ("empty prompt string", "POST", COMP, comp(prompt=""), JSON, 400, "prompt"),
    ("two prompts", "POST", COMP, comp(prompt=["a", "b"]), JSON, 400, "prompt"),
    # huge fields (the test app's body limit is 256 KiB)
    ("huge content", "POST", CHAT, {"messages": [{"role": "user", "content": "x" * 300_000}]}, JSON, 413, None),
    # unknown fields on every endpoint that takes a body
    ("unknown field chat", "POST", CHAT, chat(frobnicate=True), JSON, 400, "frobnicate"),
    ("unknown field completions", "POST", COMP, comp(best_of_luck=1), JSON, 400, "best_of_luck"),
    ("misspelt max_token", "POST", CHAT, chat(max_token=5), JSON, 400, "max_token"),
    ("session_id chat", "POST", CHAT, chat(session_id="s-1"), JSON, 400, "session_id"),
    ("session_id completions", "POST", COMP, comp(session_id="s-1"), JSON, 400, "session_id"),
    # unsupported features, unknown things
    ("tool without function", "POST", CHAT, chat(tools=[{"type": "function"}]), JSON, 400, "tools.0.function"),
    ("legacy functions", "POST", CHAT, chat(functions=[{"name": "f"}]), JSON, 400, "functions"),
    # structured output, tools, thinking
    ("schema keyword not enforced", "POST", CHAT, chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"uniqueItems": True}}}}}), JSON, 400,
     "response_format.json_schema.schema"),
    ("schema of an unknown type", "POST", COMP, comp(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "strng"}}}), JSON, 400, "response_format.json_schema.schema"),
    ("regex that does not compile", "POST", CHAT, chat(structured_outputs={"regex": "(ab"}), JSON, 400,
     "structured_outputs.regex"),
    ("lark grammar that does not compile", "POST", CHAT, chat(structured_outputs={"grammar": "start: nope"}), JSON,
     400, "structured_outputs.grammar"),
    ("deprecated guided_json", "POST", CHAT, chat(guided_json={"type": "object"}), JSON, 400, "guided_json"),
    ("tool_choice naming an unknown tool", "POST", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}],
                                                              tool_choice={"type": "function",
                                                                           "function": {"name": "g"}}), JSON, 400,
     "tool_choice"),
    ("tool without a name", "POST", CHAT, chat(tools=[{"type": "function", "function": {}}]), JSON, 400,
     "tools.0.function.name"),
    ("unknown reasoning_effort", "POST", CHAT, chat(reasoning_effort="max"), JSON, 400, "reasoning_effort"),
    ("echo", "POST", COMP, comp(echo=True), JSON, 400, "echo"),
    ("logit_bias", "POST", CHAT, chat(logit_bias={"5": 10}), JSON, 400, "logit_bias"),
    ("unknown model", "POST", CHAT, chat(model="gpt-4o"), JSON, 404, "model"),
    ("unknown model by id", "GET", "/v1/models/gpt-4o", None, {}, 404, "model"),
    ("unknown route", "GET", "/v1/nope", None, {}, 404, None),
    ("wrong method", "GET", CHAT, None, {}, 405, None),
    ("cancel of an unknown id", "POST", "/v1/mtplx/cancel/chatcmpl-does-not-exist", None, {}, 404, "request_id"),
    ("client request id with spaces", "POST", CHAT, chat(), {**JSON, "x-mtplx-request-id": "a b"}, 400,
     "x-mtplx-request-id"),
    ("client request id too long", "POST", CHAT, chat(), {**JSON, "x-mtplx-request-id": "x" * 200}, 400,
     "x-mtplx-request-id"),
]
