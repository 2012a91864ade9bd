"""Property-based fuzzing of every route that takes a body, against the real served app, while
well-formed greedy streams run beside it (bystanders).

Hypothesis builds each body from a table of the route's fields: each field is left out, given a
value valid in any company, or given a value that is invalid whatever else the body holds (out of
range, of the wrong type, beyond the served model's vocabulary or context window, a number beyond
every engine's int32 or float32, nested past the parsers). It asserts:
- no answer is a 5xx;
- a body with an invalid field gets a 4xx whose error names one of its invalid fields (OpenAI's
  `param`, or the message: Anthropic's error shape names it at the start of the message);
- a body with none is served (200; a stream to its end);
- every bystander stream ends with exactly the text and tokens it gets when it runs alone.
Fixed seed (`derandomize`), so CI runs the same bodies every time.
"""

from __future__ import annotations

import json
import re
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, List

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from benchmarks.http import BENCH_PROMPTS as PROMPTS  # noqa: E402

RAY_MARK = pytest.mark.ray
MODEL = "mtplx-tiny-py"
VOCAB, CONTEXT = 4096, 2048          # the shipped model's (config.json)
HUGE = 10 ** 400                     # a valid JSON integer no engine column holds (issue 57)
INT32_MAX = 2 ** 31 - 1
FUZZ_EXAMPLES = 300


# -- the field tables ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Field:
    """One field (or a group of fields that constrain each other): strategies of body fragments
    valid in any company (`valid`) and invalid in any company (`invalid`, named by `param`)."""

    param: str
    valid: st.SearchStrategy
    invalid: st.SearchStrategy


def one(name: str, valid: list, invalid: list) -> Field:
    return Field(name, st.sampled_from(valid).map(lambda v: {name: v}),
                 st.sampled_from(invalid).map(lambda v: {name: v}))


def ints(lo: int, hi: int) -> st.SearchStrategy:
    return st.integers(lo, hi)


def floats(lo: float, hi: float) -> st.SearchStrategy:
    return st.floats(lo, hi, allow_nan=False)


def frag(name: str, values: st.SearchStrategy) -> st.SearchStrategy:
    return values.map(lambda v: {name: v})


TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=12)
BAD_FLOATS = [HUGE, 1e300, "x", [1.0], True]
SAMPLING = [
    Field("temperature", frag("temperature", floats(0.0, 2.0)), frag("temperature", st.sampled_from(
        [-0.1, 2.01, *BAD_FLOATS]))),
    Field("top_p", frag("top_p", st.one_of(st.just(0), floats(1.2e-38, 1.0))),
          frag("top_p", st.sampled_from([1e-300, 1e-40, -0.1, 1.01, *BAD_FLOATS]))),
    Field("top_k", frag("top_k", st.one_of(ints(-1, 64), ints(VOCAB - 1, VOCAB + 1), st.just(INT32_MAX))),
          frag("top_k", st.sampled_from([-2, INT32_MAX + 1, HUGE, 1.5, "5"]))),
    Field("min_p", frag("min_p", floats(0.0, 1.0)), frag("min_p", st.sampled_from([-0.01, 1.01, *BAD_FLOATS]))),
    Field("presence_penalty", frag("presence_penalty", floats(-2.0, 2.0)),
          frag("presence_penalty", st.sampled_from([-2.5, 2.5, *BAD_FLOATS]))),
    Field("frequency_penalty", frag("frequency_penalty", floats(-2.0, 2.0)),
          frag("frequency_penalty", st.sampled_from([-2.5, 2.5, *BAD_FLOATS]))),
    Field("seed", frag("seed", st.one_of(ints(-(2 ** 63), 2 ** 64 - 1), st.just(0))),
          frag("seed", st.sampled_from([2 ** 64, -(2 ** 63) - 1, HUGE, 1.5, "7"]))),
    Field("stop", frag("stop", st.one_of(TEXT, st.lists(TEXT, min_size=1, max_size=4))),
          frag("stop", st.sampled_from([["a", "b", "c", "d", "e"], [""], "", ["x" * 257], 5]))),
    Field("stop_token_ids", frag("stop_token_ids", st.lists(ints(0, VOCAB - 1), max_size=3)),
          frag("stop_token_ids", st.sampled_from([[-1], [VOCAB], [HUGE], [1.5], "3"]))),
    one("ignore_eos", [True, False], ["maybe", 2]),
    one("generation_mode", ["auto", "mtp", "ar"], ["turbo", 1]),
    one("omit_speculative_bonus", [True, False], ["x"]),
    one("min_tokens", [0, 1], [HUGE, -1, 1.5]),
    one("repetition_penalty", [1.0], [1.3, 0.0, 1e300, HUGE]),
    one("model", [MODEL], ["gpt-4o", 5]),
    one("user", ["u-1"], [5]),
    one("cache_salt", ["tenant-a", "tenant-b"], ["", 7]),
    one("logit_bias", [None], [{"5": 10}]),
    Field("frobnicate", st.just({}), st.just({"frobnicate": 1})),           # a field no route knows
    Field("stream_options", st.sampled_from([{}, {"stream": False}, {"stream": True},
                                             {"stream": True, "stream_options": {"include_usage": True}}]),
          st.just({"stream_options": {"include_usage": True}})),               # without stream
    Field("n", frag("n", ints(1, 2)), frag("n", st.sampled_from([0, 9, HUGE, -1, 1.5]))),
]
DEEP_SCHEMA = "[" * 3000 + "]" * 3000      # a schema given as a string, nested past Python's json


def budget(name: str) -> Field:
    """max_tokens (one or the other name): small when valid (every valid body is served)."""
    return Field(name, frag(name, ints(1, 4)), frag(name, st.sampled_from([0, -1, CONTEXT + 1, HUGE, 2.5, "4"])))


CHAT_FIELDS = SAMPLING + [
    budget("max_tokens"), budget("max_completion_tokens"),
    Field("top_logprobs", st.one_of(st.just({}), st.just({"logprobs": False}),
                                    ints(0, 20).map(lambda k: {"logprobs": True, "top_logprobs": k})),
          st.sampled_from([{"logprobs": True, "top_logprobs": 21}, {"logprobs": True, "top_logprobs": -1},
                           {"logprobs": True, "top_logprobs": HUGE}, {"top_logprobs": 3}])),
    Field("thinking_budget", frag("thinking_budget", ints(0, 4)),
          frag("thinking_budget", st.sampled_from([-1, CONTEXT + 1, HUGE]))),
    one("reasoning_effort", ["low", "high"], ["max", 3]),
    Field("response_format", st.sampled_from([{"response_format": {"type": "json_object"}},
                                              {"response_format": {"type": "text"}}]),
          st.sampled_from([{"response_format": {"type": "bogus"}},
                           {"response_format": {"type": "json_schema",
                                                "json_schema": {"name": "x", "schema": DEEP_SCHEMA}}}])),
]
COMPLETION_FIELDS = SAMPLING + [
    budget("max_tokens"),
    Field("logprobs", frag("logprobs", ints(0, 5)), frag("logprobs", st.sampled_from([21, -1, HUGE, True]))),
    one("echo", [False], [True]),
    one("suffix", [""], ["tail"]),
    Field("best_of", st.just({}), frag("best_of", st.sampled_from([0, 9, HUGE]))),
    Field("prompt", st.one_of(st.sampled_from(PROMPTS[:4]), st.lists(ints(1, VOCAB - 1), min_size=1, max_size=8))
          .map(lambda p: {"prompt": p}),
          frag("prompt", st.sampled_from([[VOCAB], [-1], [HUGE], [], "", [[1, 2], [3]], {"text": "x"}]))),
]
ANTHROPIC_FIELDS = [
    Field("thinking", ints(1, 4).flatmap(lambda m: st.one_of(
        st.just({"max_tokens": m}),
        ints(0, m - 1).map(lambda b: {"max_tokens": m, "thinking": {"type": "enabled", "budget_tokens": b}}))),
        st.sampled_from([{"max_tokens": 4, "thinking": {"type": "enabled", "budget_tokens": HUGE}},
                         {"max_tokens": 4, "thinking": {"type": "enabled", "budget_tokens": 4}},
                         {"max_tokens": 4, "thinking": {"type": "bogus"}}])),
    Field("max_tokens", st.just({}), st.sampled_from([{"max_tokens": v} for v in (0, CONTEXT + 1, HUGE, "4")])),
    Field("temperature", frag("temperature", floats(0.0, 1.0)),
          frag("temperature", st.sampled_from([1.5, -0.1, *BAD_FLOATS]))),
    Field("top_p", frag("top_p", st.one_of(st.just(0), floats(1.2e-38, 1.0))),
          frag("top_p", st.sampled_from([1e-300, 1.5, *BAD_FLOATS]))),
    Field("top_k", frag("top_k", st.one_of(ints(0, 64), st.just(INT32_MAX))),
          frag("top_k", st.sampled_from([-1, INT32_MAX + 1, HUGE]))),
    Field("stop_sequences", frag("stop_sequences", st.lists(TEXT, min_size=1, max_size=4)),
          frag("stop_sequences", st.sampled_from([["a"] * 5, [""], ["x" * 257]]))),
    one("system", ["You write Python."], [5]),
    one("stream", [True, False], ["yes please"]),
    one("metadata", [{"user_id": "u"}], [{"user_id": 5}]),
    one("model", [MODEL], ["gpt-4o"]),
    Field("frobnicate", st.just({}), st.just({"frobnicate": 1})),
]
COUNT_TOKENS_FIELDS = [
    Field("thinking", st.sampled_from([{}, {"thinking": {"type": "enabled", "budget_tokens": 100}}]),
          st.sampled_from([{"thinking": {"type": "enabled", "budget_tokens": HUGE}},
                           {"thinking": {"type": "enabled", "budget_tokens": -1}}])),
    one("system", ["You write Python."], [5]),
    one("model", [MODEL], ["gpt-4o"]),
    Field("frobnicate", st.just({}), st.just({"frobnicate": 1})),
]
TOKENIZE_FIELDS = [
    one("add_special_tokens", [True, False], ["maybe"]),
    one("return_token_strs", [True, False], [3]),
    one("model", [MODEL], ["gpt-4o"]),
    Field("frobnicate", st.just({}), st.just({"frobnicate": 1})),
]
TOKENIZE_CHAT_FIELDS = TOKENIZE_FIELDS + [
    Field("continue_final_message", st.sampled_from([{}, {"add_generation_prompt": True},
                                                     {"add_generation_prompt": False, "continue_final_message": True}]),
          st.just({"add_generation_prompt": True, "continue_final_message": True})),
    one("chat_template_kwargs", [{"enable_thinking": True}, {"enable_thinking": False}], [{"foo": 1}]),
]
RESPONSES_SAMPLING = {"temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "seed",
                      "generation_mode", "omit_speculative_bonus", "model", "user", "frobnicate"}
RESPONSES_FIELDS = [f for f in SAMPLING if f.param in RESPONSES_SAMPLING] + [
    Field("max_output_tokens", frag("max_output_tokens", ints(1, 4)),
          frag("max_output_tokens", st.sampled_from([0, -1, CONTEXT + 1, HUGE, 2.5, "4"]))),
    one("stream", [True, False], ["yes please"]),
    one("store", [True, False], ["x"]),
    one("instructions", ["You write Python."], [5]),
    one("reasoning", [{"effort": "none"}, {"effort": "minimal"}], [{"effort": "max"}, {"bogus": 1}]),
    one("text", [{"format": {"type": "text"}}, {"format": {"type": "json_object"}}],
        [{"format": {"type": "xml"}}, {"format": {"type": "json_schema", "name": "x", "schema": DEEP_SCHEMA}}]),
    Field("top_logprobs", st.one_of(st.just({}), ints(0, 20).map(
        lambda k: {"top_logprobs": k, "include": ["message.output_text.logprobs"]})),
        frag("top_logprobs", st.sampled_from([21, -1, HUGE, "3"]))),
    Field("previous_response_id", st.just({}), st.just({"previous_response_id": "resp_missing"})),
    one("background", [False], [True]),
    one("truncation", ["disabled"], ["auto"]),
    one("input", ["def f(x):"], [[{"type": "input_image", "image_url": "x"}], 5, [{"role": "robot", "content": "x"}]]),
]
DETOKENIZE_FIELDS = [
    Field("tokens", frag("tokens", st.lists(ints(0, VOCAB - 1), max_size=12)),
          frag("tokens", st.sampled_from([[VOCAB], [-1], [HUGE], [1.5], "12"]))),
    one("model", [MODEL], ["gpt-4o"]),
]


def _user(prompt: str) -> list:
    return [{"role": "user", "content": prompt}]


@dataclass(frozen=True)
class Route:
    path: str
    base: Callable[[str], dict]          # a prompt -> the body's required fields
    fields: List[Field]
    anthropic: bool = False
    ends: tuple = ("data: [DONE]",)      # a stream's last line is one of these


ROUTES = [
    Route("/v1/chat/completions", lambda p: {"messages": _user(p), "max_tokens": 3}, CHAT_FIELDS),
    Route("/v1/completions", lambda p: {"prompt": p, "max_tokens": 3}, COMPLETION_FIELDS),
    Route("/v1/messages", lambda p: {"model": MODEL, "messages": _user(p), "max_tokens": 3}, ANTHROPIC_FIELDS,
          anthropic=True, ends=("event: message_stop",)),
    Route("/v1/messages/count_tokens", lambda p: {"model": MODEL, "messages": _user(p)}, COUNT_TOKENS_FIELDS,
          anthropic=True),
    Route("/tokenize", lambda p: {"prompt": p}, TOKENIZE_FIELDS),
    Route("/tokenize", lambda p: {"messages": _user(p) + [{"role": "assistant", "content": "x"}]},
          TOKENIZE_CHAT_FIELDS),
    Route("/detokenize", lambda p: {"tokens": [1, 2, 3]}, DETOKENIZE_FIELDS),
    Route("/v1/responses", lambda p: {"model": MODEL, "input": p, "max_output_tokens": 3}, RESPONSES_FIELDS,
          ends=("event: response.completed", "event: response.incomplete")),
]
RAW_INVALID = [   # bodies that are not JSON objects a model reads (sent as bytes), and the field they name
    ("/tokenize", b'{"messages": ' + b"[" * 3000 + b"]" * 3000 + b"}", "messages"),
    ("/tokenize", b'{"prompt": "x", "add_special_tokens": ' + b"[" * 3000 + b"]" * 3000 + b"}", "add_special_tokens"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "seed": 1' + b"0" * 5000 + b"}",
     "seed"),
]


@st.composite
def bodies(draw):
    """(route's index in ROUTES, body bytes, the params of its invalid fields)."""
    if draw(st.integers(0, 19)) == 0:
        path, raw, param = draw(st.sampled_from(RAW_INVALID))
        return next(i for i, r in enumerate(ROUTES) if r.path == path), raw, {param}
    index = draw(st.integers(0, len(ROUTES) - 1))
    route = ROUTES[index]
    body = route.base(draw(st.sampled_from(PROMPTS[:4])))
    n_invalid = draw(st.sampled_from([0, 0, 1, 1, 2]))
    chosen = draw(st.lists(st.sampled_from(route.fields), min_size=n_invalid, max_size=6, unique_by=lambda f: f.param))
    for field in chosen[n_invalid:]:
        body.update(draw(field.valid))
    invalid = set()
    for field in chosen[:n_invalid]:       # last: an invalid value overrides a valid group's
        body.update(draw(field.invalid))
        invalid.add(field.param)
    if {"max_tokens", "max_completion_tokens"} <= set(body) and not invalid & {"max_tokens", "max_completion_tokens"}:
        body["max_completion_tokens"] = body["max_tokens"]          # two valid budgets must agree
    return index, json.dumps(body).encode(), invalid


# -- the run -----------------------------------------------------------------------------------------------------


def _names_a_field(route: Route, error: dict, params: set) -> bool:
    if route.anthropic:       # Anthropic's shape names a refused field at the start of the message
        message = error["error"]["message"]
        return any(message.startswith(p) or re.search(rf"\b{re.escape(p)}\b", message) for p in params)
    err = error["error"]
    if err.get("param") and any(err["param"] == p or err["param"].startswith(p + ".") for p in params):
        return True
    return any(f"'{p}'" in err["message"] or err["message"].startswith(p) for p in params)


def _check(http, route: Route, raw: bytes, invalid: set) -> None:
    case = raw[:300]
    if not invalid and json.loads(raw).get("stream") is True:
        with http.stream("POST", route.path, content=raw, headers={"content-type": "application/json"}) as r:
            lines = list(r.iter_lines())
            status = r.status_code
        assert status == 200, (case, status, lines[:3])
        events = [json.loads(ln[6:]) for ln in lines if ln.startswith("data: {")]
        assert any(end in lines for end in route.ends), (case, lines[-4:])
        assert not any("error" in e or e.get("type") == "error" for e in events), (case, lines[-4:])
        return
    r = http.post(route.path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code < 500, (case, r.status_code, r.text[:300])
    if invalid:
        assert 400 <= r.status_code < 500, (case, r.status_code, r.text[:300])
        error = r.json()
        if route.anthropic:
            assert error["type"] == "error" and set(error["error"]) == {"type", "message"}, error
        else:
            assert set(error["error"]) == {"message", "type", "param", "code"}, error
        assert _names_a_field(route, error, invalid), (case, invalid, error)
    else:
        assert r.status_code == 200, (case, r.status_code, r.text[:300])


class Bystanders:
    """Greedy streams that run beside the fuzzing, each checked against its own solo run."""

    PROMPTS = PROMPTS[4:7]

    def __init__(self, base: str, headers: dict, max_tokens: int = 40):
        self.base, self.headers, self.max_tokens = base, headers, max_tokens
        self.solo: Dict[int, tuple] = {}
        self.runs: List[tuple] = []          # (prompt index, (text, tokens, finish)) of every stream beside
        self.errors: List[str] = []
        self._stop = threading.Event()
        self._threads: List[threading.Thread] = []

    def stream(self, i: int) -> tuple:
        import httpx

        body = {"model": MODEL, "messages": _user(self.PROMPTS[i]), "temperature": 0, "max_tokens": self.max_tokens,
                "stream": True, "stream_options": {"include_usage": True}}
        text, usage, finish = "", None, None
        with httpx.Client(base_url=self.base, timeout=120, headers=self.headers) as c:
            with c.stream("POST", "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200, r.read()
                for line in r.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    obj = json.loads(line[6:])
                    if "error" in obj:
                        raise AssertionError(f"bystander {i} got an error chunk: {obj}")
                    for ch in obj.get("choices") or ():
                        text += ch["delta"].get("content") or ""
                        finish = ch["finish_reason"] or finish
                    usage = obj.get("usage") or usage
        return text, usage["completion_tokens"], finish

    def start(self) -> None:
        for i in range(len(self.PROMPTS)):
            self.solo[i] = self.stream(i)          # alone: nothing else runs yet
        for i in range(len(self.PROMPTS)):
            t = threading.Thread(target=self._loop, args=(i,), daemon=True)
            t.start()
            self._threads.append(t)

    def _loop(self, i: int) -> None:
        while not self._stop.is_set():
            try:
                self.runs.append((i, self.stream(i)))
            except Exception as exc:       # reported by check()
                self.errors.append(f"bystander {i}: {type(exc).__name__}: {exc}")
                return

    def check(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=120)
        assert not self.errors, self.errors
        assert {i for i, _ in self.runs} == set(self.solo), "a bystander never finished a stream"
        for i, got in self.runs:
            assert got == self.solo[i], (i, got, self.solo[i])


@pytest.fixture()
def bystanders(serve_app):
    b = Bystanders(serve_app.base, serve_app.headers)
    b.start()
    yield b
    b._stop.set()


@RAY_MARK
def test_the_issues_two_requests_get_400s_and_bystanders_are_untouched(http, bystanders):
    for body in ({"temperature": 1.0, "generation_mode": "mtp", "top_k": HUGE},
                 {"temperature": 1.0, "top_p": 1e-300, "top_k": 0}):
        full = {"model": MODEL, "messages": _user(PROMPTS[0]), "max_tokens": 32, **body}
        for stream in (False, True):
            r = http.post("/v1/chat/completions", content=json.dumps({**full, "stream": stream}).encode(),
                          headers={"content-type": "application/json"})
            assert r.status_code == 400, r.text[:300]
            param = r.json()["error"]["param"]
            assert param in ("top_k", "top_p") and param in body, r.json()
    time.sleep(1.0)            # the bystanders keep streaming a moment longer
    bystanders.check()


@RAY_MARK
def test_fuzzed_bodies_on_every_route_never_5xx_and_never_touch_bystanders(http, bystanders):
    seen: Dict[str, int] = {}

    @settings(max_examples=FUZZ_EXAMPLES, derandomize=True, database=None, deadline=None,
              phases=(Phase.explicit, Phase.generate), suppress_health_check=list(HealthCheck))
    @given(bodies())
    def run(case):
        index, raw, invalid = case
        route = ROUTES[index]
        key = f"{route.path} {'invalid' if invalid else 'valid'}"
        seen[key] = seen.get(key, 0) + 1
        _check(http, route, raw, invalid)

    t0 = time.perf_counter()
    run()
    took = time.perf_counter() - t0
    bystanders.check()
    # every route was reached with valid and invalid bodies
    for route in {r.path for r in ROUTES}:
        assert seen.get(f"{route} valid") and seen.get(f"{route} invalid"), seen
    print(f"fuzz: {sum(seen.values())} bodies in {took:.0f} s, {len(bystanders.runs)} bystander streams: {seen}")
