"""Every number a request carries is bounded where the request is parsed, against the served model
(its vocabulary and context window) and this server (rows per request): a violation is a 400 naming
the field, on every route that takes a body. `SamplerConfig` refuses what its device columns cannot
hold, for Python API users, and keeps every valid value as it was."""

from __future__ import annotations

import json

import pytest

from mtplx.api import anthropic
from mtplx.api import openai as oa
from mtplx.api.errors import OpenAIError
from mtplx.api.limits import MAX_STOP_STRING_CHARS, RequestLimits
from mtplx.sampling import FLOAT32_TINY, TOP_K_MAX, SamplerConfig

VOCAB, CONTEXT, ROWS = 4096, 2048, 8
LIMITS = RequestLimits(vocab_size=VOCAB, max_context=CONTEXT, max_rows=ROWS)
USER = [{"role": "user", "content": "def f(x):"}]
HUGE = 10 ** 400        # a valid JSON integer (issue 57's first repro)


def _parse(cls, body):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return oa.parse_request(cls, raw, LIMITS)


def _refused(cls, body, param: str) -> OpenAIError:
    with pytest.raises(OpenAIError) as exc:
        _parse(cls, body)
    named = exc.value.param == param or (exc.value.param or "").startswith(param + ".")    # a list's item
    assert exc.value.status == 400 and named, (body, exc.value.param, exc.value.message)
    assert len(exc.value.message) < 600, exc.value.message        # a huge value is described, not printed
    return exc.value


def test_the_issues_two_repro_requests_are_refused_naming_the_field():
    err = _refused(oa.ChatCompletionRequest,
                   {"messages": USER, "temperature": 1.0, "generation_mode": "mtp", "top_k": HUGE}, "top_k")
    assert "2147483647" in err.message
    err = _refused(oa.ChatCompletionRequest, {"messages": USER, "temperature": 1.0, "top_p": 1e-300, "top_k": 0},
                   "top_p")
    assert "float32" in err.message


CHAT, COMP = oa.ChatCompletionRequest, oa.CompletionRequest
OUT_OF_RANGE = [
    # (request model, field, value); every route that takes numbers, every numeric field
    *[(cls, "max_tokens", v) for cls in (CHAT, COMP) for v in (0, CONTEXT + 1, HUGE)],
    (CHAT, "max_completion_tokens", CONTEXT + 1), (CHAT, "max_completion_tokens", HUGE),
    *[(cls, "temperature", v) for cls in (CHAT, COMP) for v in (-0.1, 2.01, 1e300, HUGE)],
    *[(cls, "top_p", v) for cls in (CHAT, COMP) for v in (-0.1, 1.01, 1e-300, 1e-40)],
    *[(cls, "top_k", v) for cls in (CHAT, COMP) for v in (-2, TOP_K_MAX + 1, HUGE)],
    *[(cls, "min_p", v) for cls in (CHAT, COMP) for v in (-0.01, 1.01)],
    *[(cls, f, v) for cls in (CHAT, COMP) for f in ("presence_penalty", "frequency_penalty") for v in (-2.5, 2.5, HUGE)],
    *[(cls, "seed", v) for cls in (CHAT, COMP) for v in (2 ** 64, -(2 ** 63) - 1, HUGE)],
    *[(cls, "n", v) for cls in (CHAT, COMP) for v in (0, ROWS + 1, HUGE)],
    (COMP, "best_of", ROWS + 1), (COMP, "best_of", HUGE),
    (CHAT, "top_logprobs", 21), (CHAT, "top_logprobs", -1), (COMP, "logprobs", 21), (COMP, "logprobs", HUGE),
    (CHAT, "thinking_budget", -1), (CHAT, "thinking_budget", CONTEXT + 1), (CHAT, "thinking_budget", HUGE),
    *[(cls, "stop_token_ids", v) for cls in (CHAT, COMP) for v in ([-1], [VOCAB], [HUGE])],
    (CHAT, "min_tokens", HUGE), (CHAT, "repetition_penalty", 1e300),
]


@pytest.mark.parametrize("cls,field,value", OUT_OF_RANGE,
                         ids=[f"{c.__name__}-{f}-{str(v)[:12]}" for c, f, v in OUT_OF_RANGE])
def test_every_numeric_field_out_of_range_is_a_400_naming_it(cls, field, value):
    base = {"messages": USER} if cls is CHAT else {"prompt": "def f(x):"}
    if field == "top_logprobs":
        base["logprobs"] = True
    _refused(cls, {**base, field: value}, field)


def test_token_ids_are_checked_against_the_vocabulary_on_every_route():
    for prompt in ([1, VOCAB], [-1], [HUGE], [[1, VOCAB]]):
        _refused(COMP, {"prompt": prompt}, "prompt")
    for tokens in ([VOCAB], [-1], [HUGE]):
        _refused(oa.DetokenizeRequest, {"tokens": tokens}, "tokens")
    assert _parse(COMP, {"prompt": [0, VOCAB - 1]}).prompt == [0, VOCAB - 1]
    assert _parse(oa.DetokenizeRequest, {"tokens": [VOCAB - 1]}).tokens == [VOCAB - 1]


def test_anthropic_numbers_are_bounded_too():
    base = {"model": "m", "max_tokens": 8, "messages": USER}
    for field, value in (("max_tokens", CONTEXT + 1), ("max_tokens", HUGE), ("temperature", 1.5),
                         ("top_p", 1e-300), ("top_k", HUGE), ("top_k", -1)):
        _refused(anthropic.MessagesRequest, {**base, field: value}, field)
    for budget in (HUGE, CONTEXT + 1, 8):       # above the context; not below max_tokens
        _refused(anthropic.MessagesRequest, {**base, "thinking": {"type": "enabled", "budget_tokens": budget}},
                 "thinking.budget_tokens")
    # count_tokens has no max_tokens: its budget is bounded by the context window
    _refused(anthropic.CountTokensRequest, {"model": "m", "messages": USER,
                                            "thinking": {"type": "enabled", "budget_tokens": HUGE}},
             "thinking.budget_tokens")


def test_stop_strings_have_a_count_and_a_length_cap():
    long_stop = "x" * (MAX_STOP_STRING_CHARS + 1)
    _refused(CHAT, {"messages": USER, "stop": long_stop}, "stop")
    _refused(CHAT, {"messages": USER, "stop": ["a"] * 5}, "stop")
    _refused(anthropic.MessagesRequest, {"model": "m", "max_tokens": 8, "messages": USER,
                                         "stop_sequences": [long_stop]}, "stop_sequences")
    ok = "y" * MAX_STOP_STRING_CHARS
    assert _parse(CHAT, {"messages": USER, "stop": [ok, "a", "b", "c"]}).stop_strings()[0] == ok


def test_a_number_too_long_for_the_json_parser_names_its_field():
    raw = b'{"messages": [{"role": "user", "content": "x"}],\n "seed": 1' + b"0" * 5000 + b"}"
    err = _refused(CHAT, raw, "seed")
    assert err.code == "invalid_json"


def test_top_k_at_or_above_the_vocabulary_keeps_every_token_as_vllm_reads_it():
    for top_k in (VOCAB, VOCAB + 1, TOP_K_MAX, -1, 0):
        req = _parse(CHAT, {"messages": USER, "temperature": 1.0, "top_k": top_k})
        assert oa.sampler_from_request(req, {}, VOCAB).top_k == 0
    req = _parse(CHAT, {"messages": USER, "temperature": 1.0, "top_k": VOCAB - 1})
    assert oa.sampler_from_request(req, {}, VOCAB).top_k == VOCAB - 1


def test_valid_edges_are_accepted():
    edges = {"max_tokens": CONTEXT, "temperature": 2.0, "top_p": FLOAT32_TINY, "top_k": TOP_K_MAX, "min_p": 1.0,
             "presence_penalty": -2.0, "frequency_penalty": 2.0, "seed": 2 ** 64 - 1, "n": ROWS,
             "stop_token_ids": [0, VOCAB - 1], "thinking_budget": CONTEXT}
    req = _parse(CHAT, {"messages": USER, **edges})
    assert all(getattr(req, k) == v for k, v in edges.items())
    assert _parse(CHAT, {"messages": USER, "top_p": 0}).top_p == 0      # greedy, not refused


def test_nested_json_is_a_400_on_tokenize_and_in_a_schema_given_as_a_string():
    """Python's `json` raises RecursionError past ~1000 levels; what a client nests is a 400."""
    deep = "[" * 5000 + "]" * 5000
    with pytest.raises(OpenAIError) as exc:
        oa.parse_tokenize_request(b'{"messages": ' + deep.encode() + b"}", LIMITS)
    assert exc.value.status == 400
    with pytest.raises(OpenAIError) as exc:
        oa.parse_tokenize_request(b'{"prompt": ' + deep.encode() + b"}", LIMITS)
    assert exc.value.status == 400
    from mtplx.api import output_plan

    for schema in (deep, '{"type": "object", "properties": {"a": ' * 900 + "{}" + "}}" * 900):
        req = _parse(CHAT, {"messages": USER, "response_format": {"type": "json_schema",
                                                                  "json_schema": {"name": "x", "schema": schema}}})
        with pytest.raises(OpenAIError) as exc:
            output_plan.for_chat(req)
        assert exc.value.status == 400 and exc.value.param == "response_format.json_schema.schema", exc.value.message
    from mtplx.api.parsing import ToolCall

    call = ToolCall("id", "f", arguments="[" * 5000)       # the model's own text nested past the parser
    call.finish()
    assert call.complete is False


# -- SamplerConfig: defence in depth for Python API users -------------------------------------------------------


@pytest.mark.parametrize("field,value,fix", [
    ("top_k", HUGE, "at most 2147483647"), ("top_k", TOP_K_MAX + 1, "at most 2147483647"),
    ("top_p", 1e-300, "at least 1.1754944e-38"), ("top_p", 1e-40, "at least 1.1754944e-38"),
    ("temperature", 1e300, "at most 3.402823e+38")])
def test_sampler_config_refuses_what_its_device_columns_cannot_hold(field, value, fix):
    with pytest.raises(ValueError) as exc:
        SamplerConfig(**{field: value})
    message = str(exc.value)
    assert message.startswith(f"SamplerConfig.{field}=") and fix in message and len(message) < 400, message


def test_sampler_config_keeps_valid_values_as_they_were():
    for kwargs in ({}, {"top_k": TOP_K_MAX}, {"top_p": FLOAT32_TINY}, {"temperature": 3.0e38},
                   {"temperature": 1e-6}, {"top_p": 1.0, "top_k": 0, "min_p": 1e-300}):
        cfg = SamplerConfig(**kwargs)
        for k, v in kwargs.items():
            assert getattr(cfg, k) == (0.0 if (k, v) == ("temperature", 1e-6) else v)
