"""The API surface beyond text and usage: vLLM's /tokenize, /detokenize and /version, the vLLM
sampling fields (stop_token_ids, ignore_eos; min_tokens above max_tokens and repetition_penalty refused), stop_reason,
OpenAI-only finish reasons, and Anthropic's /v1/messages through the real `anthropic` client.

The HTTP tests share the session's served app (tests/conftest.py); references come from the engine
in this process (greedy AR), so what the server says is checked token for token.
"""

from __future__ import annotations

import asyncio
import json

import pytest

import process_state
from conftest import TEST_API_KEY

RAY_MARK = pytest.mark.ray
MODEL = "mtplx-tiny-py"
PROMPT = "def add(a, b):\n    return"


def _greedy(model, prompt_ids, max_tokens, stop_token_ids=None):
    from mtplx.engine.decode import generate_ar
    from mtplx.sampling import SamplerConfig

    stops = model.eos_token_ids if stop_token_ids is None else frozenset(stop_token_ids)
    return generate_ar(model, prompt_ids, max_tokens=max_tokens, sampler=SamplerConfig(temperature=0.0), seed=0,
                       stop_token_ids=stops)


def _first_new_token(tokens, start: int = 3) -> int:
    """Index of the first token at or after `start` that does not occur before it."""
    for k in range(start, len(tokens)):
        if tokens[k] not in tokens[:k]:
            return k
    raise AssertionError(f"no fresh token in {tokens}")


# ------------------------------------------------------------------------------------------------
# No Ray needed


def test_stop_string_matcher_names_the_earliest_match():
    from mtplx.api.text import StopStringMatcher

    m = StopStringMatcher(["world", "lo w"])
    assert m.push("hello world") == "hel" and m.stopped and m.matched == "lo w"
    assert StopStringMatcher(["x"]).matched is None


def test_the_replicas_stop_watch_ends_on_the_token_where_the_ingress_cuts_the_text(model):
    """`StopStringWatch` (the replica ends the row with it) names the stop string at the very token
    where the ingress's token-by-token matching of the client's text stops, with `min_tokens` held
    alike; a re-admitted row's watch, fed its tokens so far, matches where the first would have."""
    from mtplx.api.text import IncrementalDetokenizer, StopStringMatcher, StopStringWatch
    from references import greedy_ar, stop_string_in

    tok = model.tokenizer
    tokens = greedy_ar(model, tok.encode("def f60(x):\n", add_special_tokens=False), 60)
    stop, n = stop_string_in(tok, tokens, 4)
    for stops, min_tokens in (([stop], 0), (["\x00never", stop], 0), ([stop], n + 1), ([stop[:1]], 0)):
        detok, matcher, at = IncrementalDetokenizer(tok), StopStringMatcher(stops), None
        for k, t in enumerate(tokens, 1):        # the ingress, as `RowStream` reads each token
            matcher.push(detok.push([t]), armed=k >= min_tokens)
            if matcher.stopped:
                at = k
                break
        watch = StopStringWatch(tok, stops, min_tokens=min_tokens)
        got = next(((k, m) for k, m in ((k, watch.push(t)) for k, t in enumerate(tokens, 1)) if m), None)
        assert got == (None if at is None else (at, matcher.matched)), (stops, min_tokens)
    assert got is None or got[0] <= n
    resumed = StopStringWatch(tok, [stop])
    assert [resumed.push(t) for t in tokens[:n - 1]] == [None] * (n - 1) and resumed.push(tokens[n - 1]) == stop


def test_detokenizer_skips_special_tokens_unless_asked(model):
    """Special tokens inside the output (the template's `<|im_start|>` too) are left out of the
    text by default (vLLM's skip_special_tokens); with skip_special_tokens false they are text like
    any other. A multi-byte character split over tokens is never cut."""
    from mtplx.api.text import IncrementalDetokenizer, special_token_ids

    tok = model.tokenizer
    special = sorted(model.eos_token_ids) + [tok.convert_tokens_to_ids("<|im_start|>")]
    assert set(special) <= special_token_ids(tok)
    ids = (list(tok.encode("def f(x):", add_special_tokens=False)) + special
           + list(tok.encode(" return \u2192 \u00e9", add_special_tokens=False)))
    for skip in (False, True):
        detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
        text = "".join(detok.push([t]) for t in ids) + detok.flush()
        assert text == tok.decode(ids, skip_special_tokens=skip) and "\ufffd" not in text
        assert all((tok.decode([t]) in text) is not skip for t in special)
    assert text == "def f(x): return \u2192 \u00e9"


def test_anthropic_usage_splits_the_prompt_only_for_cache_control():
    from mtplx.api import anthropic
    from mtplx.api.openai import parse_request

    def req(**extra):
        body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "x"}], **extra}
        return parse_request(anthropic.MessagesRequest, json.dumps(body).encode())

    assert not req().sends_cache_control
    assert req(cache_control={"type": "ephemeral"}).sends_cache_control
    assert req(system=[{"type": "text", "text": "s", "cache_control": {"type": "ephemeral"}}]).sends_cache_control
    assert req(messages=[{"role": "user", "content": [{"type": "text", "text": "x",
                                                        "cache_control": {"type": "ephemeral"}}]}]).sends_cache_control
    assert anthropic.new_message_id().startswith("msg_")


def test_finish_reasons_are_openais_only():
    from mtplx.api.openai import FINISH_REASON_OF_END, FINISH_REASONS
    from mtplx.end import KINDS

    assert set(FINISH_REASON_OF_END) == set(KINDS) and set(FINISH_REASON_OF_END.values()) <= set(FINISH_REASONS)


def test_overload_refusals_spread_their_retry_after():
    """Clients refused together are told different whole seconds, from the delay to twice it, so
    they do not come back as one burst; a replica that is unavailable gives the delay itself."""
    from mtplx.api.errors import overloaded, unavailable

    told = [int(overloaded("full", 1.5, status=429).headers["retry-after"]) for _ in range(200)]
    assert set(told) == {2, 3, 4}
    assert unavailable("down", retry_after_s=1.0).headers["retry-after"] == "1"
    assert "retry-after" not in unavailable("down").headers


@pytest.mark.parametrize("field,value", [("repetition_penalty", 1.3)])
def test_fields_the_sampler_cannot_honour_are_refused_by_name(field, value):
    from mtplx.api.errors import OpenAIError
    from mtplx.api.openai import ChatCompletionRequest, CompletionRequest, parse_request

    for cls, base in ((ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}]}),
                      (CompletionRequest, {"prompt": "x"})):
        with pytest.raises(OpenAIError) as exc:
            parse_request(cls, json.dumps({**base, field: value}).encode())
        assert exc.value.status == 400 and exc.value.param == field and field in exc.value.message
        # their no-op values are accepted
        parse_request(cls, json.dumps({**base, field: {"repetition_penalty": 1.0}[field]}).encode())


def test_logprobs_fields_are_validated():
    from mtplx.api.errors import OpenAIError
    from mtplx.api.openai import ChatCompletionRequest, CompletionRequest, parse_request

    chat = {"messages": [{"role": "user", "content": "x"}]}
    cases = [(ChatCompletionRequest, {**chat, "top_logprobs": 3}, "top_logprobs"),        # without logprobs
             (ChatCompletionRequest, {**chat, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
             (CompletionRequest, {"prompt": "x", "logprobs": 21}, "logprobs"),
             (CompletionRequest, {"prompt": "x", "logprobs": True}, "logprobs")]
    for cls, body, param in cases:
        with pytest.raises(OpenAIError) as exc:
            parse_request(cls, json.dumps(body).encode())
        assert exc.value.status == 400 and exc.value.param == param, (body, exc.value.message)
    assert parse_request(ChatCompletionRequest, json.dumps({**chat, "logprobs": False}).encode()).requested_logprobs \
        is None
    assert parse_request(ChatCompletionRequest, json.dumps({**chat, "logprobs": True}).encode()).requested_logprobs == 0
    assert parse_request(CompletionRequest, json.dumps({"prompt": "x", "logprobs": 5}).encode()).requested_logprobs == 5


def test_logprobs_shapes_carry_each_tokens_exact_bytes(model):
    from mtplx.api.openai import chat_logprobs, completion_logprobs
    from mtplx.api.text import TokenBytes

    tok = model.tokenizer
    text = "h\u00e9llo \u2192 w\u00f6rld\n"
    ids = list(tok.encode(text, add_special_tokens=False))
    token_bytes = TokenBytes(tok)
    assert b"".join(token_bytes(i)[1] for i in ids).decode("utf-8") == text   # split characters included
    eos = sorted(model.eos_token_ids)[0]
    assert token_bytes(eos)[0] == tok.decode([eos])                              # a special token: its text
    entries = [(-0.5 * k, [(ids[k], -0.5 * k), (eos, -3.0), (ids[0], -4.0)]) for k in range(len(ids))]
    chat = chat_logprobs(ids, entries, 2, token_bytes)["content"]
    assert [c["logprob"] for c in chat] == [-0.5 * k for k in range(len(ids))]
    assert all(len(c["top_logprobs"]) == 2 and c["top_logprobs"][1]["logprob"] == -3.0 for c in chat)
    assert bytes(b for c in chat for b in c["bytes"]).decode("utf-8") == text
    comp = completion_logprobs(ids, entries, 1, token_bytes, text_offset=7)
    assert comp["text_offset"][0] == 7 and comp["token_logprobs"] == [c["logprob"] for c in chat]
    assert all(comp["tokens"][k] in comp["top_logprobs"][k] for k in range(len(ids)))


def test_anthropic_request_translates_to_the_chat_path(model):
    from mtplx.api import anthropic
    from mtplx.api.errors import OpenAIError
    from mtplx.api.openai import ChatMessage, encode_chat, parse_request

    body = {"model": MODEL, "max_tokens": 7, "system": [{"type": "text", "text": "Be brief."}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "def f"}, {"type": "text", "text": "(x):"}]},
                         {"role": "assistant", "content": "pass"},
                         {"role": "user", "content": "again"}],
            "stop_sequences": ["\n\n"], "temperature": 0.5, "top_k": 5, "top_p": 0.9}
    req = parse_request(anthropic.MessagesRequest, json.dumps(body).encode())
    chat = req.to_chat_request()
    assert [(m.role, m.content) for m in chat.messages] == [("system", "Be brief."), ("user", "def f(x):"),
                                                            ("assistant", "pass"), ("user", "again")]
    assert (chat.max_tokens, chat.stop, chat.temperature, chat.top_k, chat.top_p) == (7, ["\n\n"], 0.5, 5, 0.9)
    assert req.encode(model.tokenizer) == encode_chat(model.tokenizer, chat.messages)
    # a final assistant turn is a prefill: the prompt ends inside it, with no new assistant header
    body["messages"].append({"role": "assistant", "content": "def g("})
    prefill = parse_request(anthropic.MessagesRequest, json.dumps(body).encode()).encode(model.tokenizer)
    assert model.tokenizer.decode(prefill).endswith("assistant\ndef g(")
    # refusals name the field, in Anthropic's error shape
    for bad, param in [({**body, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
                        "messages.0.content.0.type"),
                       ({k: v for k, v in body.items() if k != "max_tokens"}, "max_tokens"),
                       ({**body, "temperature": 1.5}, "temperature"),
                       ({**body, "tools": [{"name": "t"}]}, "tools.0.input_schema"),
                       ({**body, "tool_choice": {"type": "any"}}, "tool_choice"),
                       ({**body, "frobnicate": 1}, "frobnicate")]:
        with pytest.raises(OpenAIError) as exc:
            r = parse_request(anthropic.MessagesRequest, json.dumps(bad).encode())
            r.encode(model.tokenizer)
        assert exc.value.param == param, (param, exc.value.message)
        err = anthropic.error_body(exc.value)
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert all(isinstance(m, ChatMessage) for m in chat.messages)


# ------------------------------------------------------------------------------------------------
# The replica maps a row's stop_token_ids / ignore_eos onto the job's stop set (in-process)


@pytest.fixture(scope="module")
def replica():
    from deployments.replica import MTPReplica

    # the replica sets what a serving process wants (BLAS threads, niceness, a frozen heap):
    # for this module only
    with process_state.restored():
        rep = MTPReplica(widths=(3,), warmup=False)
        yield rep
        rep.__del__()          # what Serve calls when it stops a replica


def test_replica_stop_set_is_eos_unless_ignored_plus_requested_ids(replica, monkeypatch):
    from mtplx.api.rows import RowSpec
    from mtplx.sampling import SamplerConfig

    model = replica.model
    ids = list(model.tokenizer.encode(PROMPT, add_special_tokens=False))
    ref = _greedy(model, ids, 24, stop_token_ids=()).tokens
    k = _first_new_token(ref)
    # The shipped model never emits its EOS greedily; make the k-th greedy token its "EOS" here.
    monkeypatch.setattr(model, "eos_token_ids", frozenset({ref[k]}))

    def row(i, **extra):
        return RowSpec(request_id=f"stopset-{i}", model=MODEL, prompt_ids=tuple(ids), max_tokens=24, seed=0,
                       sampler=SamplerConfig(temperature=0.0), **extra)

    async def go(rows):
        toks, finals = {}, {}
        async for msg in replica.run_cohort(rows):
            for i, t in (msg.get("t") or {}).items():
                toks.setdefault(i, []).extend(t)
            finals.update(msg.get("f") or {})
        return toks, finals

    toks, finals = asyncio.run(go([row(0), row(1, ignore_eos=True), row(2, ignore_eos=True, stop_token_ids=(ref[k],))]))
    # EOS ends row 0 at k (the stop token is not streamed; the replica counts it, the ingress does not)
    # and the engine's End says so, with the token
    assert toks[0] == ref[:k] and finals[0]["finish_reason"] == "stop"
    assert finals[0]["end"] == {"kind": "eos", "token": ref[k]}
    assert finals[0]["completion_tokens"] == k + 1
    # ignore_eos: the row runs to its budget, the "EOS" streamed as a token
    assert toks[1] == ref[:24] and finals[1]["finish_reason"] == "length" and finals[1]["end"] == {"kind": "length"}
    # ignore_eos with the same id requested: it stops there again, on the requested stop token
    assert toks[2] == ref[:k] and finals[2]["end"] == {"kind": "stop_token", "token": ref[k]}


# ------------------------------------------------------------------------------------------------
# Through the served app


@RAY_MARK
def test_tokenize_detokenize_and_version_as_vllm_serves_them(http, ref_model):
    import mtplx
    from mtplx.api.openai import ChatMessage, encode_chat

    tok = ref_model.tokenizer
    r = http.post("/tokenize", json={"model": MODEL, "prompt": PROMPT, "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    ids = list(tok.encode(PROMPT, add_special_tokens=True))
    assert body == {"count": len(ids), "max_model_len": ref_model.max_context, "tokens": ids,
                    "token_strs": tok.convert_ids_to_tokens(ids)}
    # chat form: exactly the prompt a chat completion of these messages decodes from
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def f(x):"}]
    r = http.post("/tokenize", json={"messages": msgs})
    assert r.status_code == 200, r.text
    chat_ids = encode_chat(tok, [ChatMessage(**m) for m in msgs])
    assert r.json()["tokens"] == chat_ids and r.json()["token_strs"] is None
    # /detokenize round trip (special tokens kept, as vLLM does)
    r = http.post("/detokenize", json={"model": MODEL, "tokens": chat_ids})
    assert r.status_code == 200 and r.json() == {"prompt": tok.decode(chat_ids)}
    r = http.get("/version")
    assert r.status_code == 200 and r.json() == {"version": mtplx.__version__}
    # errors in OpenAI's shape, naming the field
    for path, payload, param in [("/detokenize", {"tokens": [1, ref_model.vocab_size]}, "tokens"),
                                 ("/detokenize", {"tokens": "abc"}, "tokens"),
                                 ("/tokenize", {"prompt": "x", "messages": msgs}, "prompt"),
                                 ("/tokenize", {"prompt": "x", "frobnicate": 1}, "frobnicate"),
                                 ("/tokenize", {"messages": msgs, "continue_final_message": True},
                                  "continue_final_message"),
                                 ("/tokenize", {"prompt": "x", "model": "gpt-4o"}, "model")]:
        r = http.post(path, json=payload)
        assert r.status_code in (400, 404), (path, payload, r.text)
        assert r.json()["error"]["param"] == param, (path, payload, r.json())
    assert http.post("/version").status_code == 405


@RAY_MARK
def test_stop_token_ids_and_stop_reason(client, http, ref_model):
    tok = ref_model.tokenizer
    ids = list(tok.encode(PROMPT, add_special_tokens=False))
    ref = _greedy(ref_model, ids, 24).tokens
    k = _first_new_token(ref)
    text_k = tok.decode(ref[:k], skip_special_tokens=True)
    # a requested stop token ends the row there; it is not returned (no text, not counted)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0,
                                  extra_body={"stop_token_ids": [ref[k]], "ignore_eos": False})
    c = r.choices[0]
    assert c.text == text_k and c.finish_reason == "stop" and c.model_extra["stop_reason"] == ref[k]
    assert r.usage.completion_tokens == k
    # no stop: stop_reason null; a stop string: the string
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.choices[0].model_extra["stop_reason"] is None
    full = tok.decode(ref, skip_special_tokens=True)
    at = next(i for i in range(2, len(full) - 3) if full[i:i + 3].strip() and full.find(full[i:i + 3]) == i)
    stop = full[at:at + 3]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop])
    assert r.choices[0].text == full[:at] and r.choices[0].model_extra["stop_reason"] == stop
    assert r.choices[0].finish_reason == "stop"
    # chat, streaming: stop_reason on the final chunk only
    msgs = [{"role": "user", "content": PROMPT}]
    cref = _greedy(ref_model, _chat_ids(ref_model, PROMPT), 24).tokens
    kc = _first_new_token(cref)
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24, temperature=0,
                                                 stream=True, extra_body={"stop_token_ids": [cref[kc]]}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == tok.decode(cref[:kc], skip_special_tokens=True)
    reasons = [(ch.choices[0].finish_reason, ch.choices[0].model_extra["stop_reason"]) for ch in chunks]
    assert reasons[-1] == ("stop", cref[kc]) and all(r == (None, None) for r in reasons[:-1])
    # refused fields name themselves
    for extra, param in [({"min_tokens": 5}, "min_tokens"), ({"repetition_penalty": 1.1}, "repetition_penalty"),
                         ({"stop_token_ids": [ref_model.vocab_size]}, "stop_token_ids")]:
        r = http.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 4, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def _chat_ids(model, content):
    from mtplx.api.openai import ChatMessage, encode_chat

    return encode_chat(model.tokenizer, [ChatMessage(role="user", content=content)])


@RAY_MARK
def test_anthropic_messages_with_the_anthropic_client(serve_app, client, ref_model):
    import anthropic

    # This client has no sampling arguments of its own (the API dropped them); the server still
    # takes temperature / top_p / top_k, sent as extra body fields.
    GREEDY = {"extra_body": {"temperature": 0}}
    ac = anthropic.Anthropic(base_url=serve_app.base, api_key=TEST_API_KEY, max_retries=0, timeout=120)
    system = "You write Python."
    turns = [{"role": "user", "content": "def add(a, b):"}, {"role": "assistant", "content": "return a + b"},
             {"role": "user", "content": [{"type": "text", "text": "def mul(a, b):"}]}]
    chat_msgs = [{"role": "system", "content": system}, turns[0], turns[1],
                 {"role": "user", "content": "def mul(a, b):"}]
    # the same conversation as a chat completion: the same prompt, the same greedy text
    ref = client.chat.completions.create(model=MODEL, messages=chat_msgs, max_tokens=20, **GREEDY)
    m = ac.messages.create(model=MODEL, system=system, messages=turns, max_tokens=20, **GREEDY)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg")
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == ref.choices[0].message.content
    assert m.stop_reason == "max_tokens" and m.stop_sequence is None
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == ref.usage.prompt_tokens
    assert m.usage.output_tokens == 20
    # stop_sequences
    text = m.content[0].text
    stop = next(text[i:i + 2] for i in range(2, len(text) - 2) if text[i:i + 2].strip()
                and text.find(text[i:i + 2]) == i)
    s = ac.messages.create(model=MODEL, system=system, messages=turns, max_tokens=20, stop_sequences=[stop],
                           **GREEDY)
    assert s.content[0].text == text[:text.find(stop)] and s.stop_reason == "stop_sequence"
    assert s.stop_sequence == stop
    # streaming: Anthropic's event types in order, the same text, usage on message_delta
    with ac.messages.stream(model=MODEL, system=system, messages=turns, max_tokens=20, **GREEDY) as st:
        events = [e for e in st]
        final = st.get_final_message()
    kinds = [e.type for e in events if e.type in ("message_start", "content_block_start", "content_block_delta",
                                                 "content_block_stop", "message_delta", "message_stop")]
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert final.content[0].text == text and final.stop_reason == "max_tokens" and final.usage.output_tokens == 20
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == ref.usage.prompt_tokens
    # count_tokens: the prompt the request decodes from
    assert ac.messages.count_tokens(model=MODEL, system=system, messages=turns).input_tokens == \
        ref.usage.prompt_tokens
    # errors in Anthropic's shape, by class
    with pytest.raises(anthropic.BadRequestError) as exc:
        ac.messages.create(model=MODEL, messages=turns, max_tokens=20, extra_body={"top_k": -3})
    assert exc.value.body["type"] == "error" and exc.value.body["error"]["type"] == "invalid_request_error"
    assert "top_k" in exc.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as exc:
        ac.messages.create(model="claude-opus-4", messages=turns, max_tokens=20)
    assert exc.value.body["error"]["type"] == "not_found_error"
    bad_key = anthropic.Anthropic(base_url=serve_app.base, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as exc:
        bad_key.messages.create(model=MODEL, messages=turns, max_tokens=4)
    assert exc.value.body["error"]["type"] == "authentication_error"


# ------------------------------------------------------------------------------------------------
# Log-probabilities: the target's own, at every emitted token (accepted drafts included)


def _target_logprobs(model, prompt_ids, tokens, k):
    """(logprob of each token, its top-k logprobs) from one plain forward over prompt + tokens."""
    import mlx.core as mx
    import numpy as np

    logits = np.array(model.target(mx.array([list(prompt_ids) + list(tokens[:-1])]))[0].astype(mx.float32),
                      dtype=np.float64)[len(prompt_ids) - 1:]
    top = logits.max(-1, keepdims=True)
    lp = logits - (top + np.log(np.exp(logits - top).sum(-1, keepdims=True)))
    return [(lp[i, t], np.sort(lp[i])[::-1][:k]) for i, t in enumerate(tokens)]


def test_heaviest_ranks_like_a_full_sort():
    """The k heaviest ids of a row, by weight then id, as a stable sort of the whole row ranks
    them: ties, a vocabulary that is not a multiple of the block, more ids than blocks."""
    import numpy as np

    from mtplx.engine.row import heaviest, logprob_entry

    rng = np.random.default_rng(0)
    rows = [rng.standard_normal(4096).astype(np.float32), rng.standard_normal(1000).astype(np.float32) * 9,
            np.zeros(4096, np.float32), np.round(rng.standard_normal(3001) * 2).astype(np.float32),
            rng.standard_normal(70).astype(np.float32)]
    rows[2][[100, 5, 4095]] = 1.0
    for x in rows:
        for k in (0, 1, 5, 20, 64):
            assert heaviest(x, k).tolist() == np.argsort(-x, kind="stable")[:k].tolist(), (x.size, k)
        lp, alts = logprob_entry(x, 3, 5)
        ref = x.astype(np.float64) - np.log(np.exp(x.astype(np.float64)).sum())
        assert abs(lp - ref[3]) < 1e-6 and all(abs(a - ref[i]) < 1e-6 for i, a in alts)


@pytest.mark.parametrize("width,steps", [(1, "mtp"), (3, "mtp"), (3, "alternate")])
def test_lane_logprobs_are_the_targets_own(model, width, steps):
    """Every emitted token's entry (drafts accepted or not, bonus tokens, AR steps' tokens) equals
    the log-softmax of one plain forward over the prompt and the output."""
    from mtplx.engine.install import install_a3b_mtp_batch_lane
    from mtplx.engine.installed import solo_lane
    from mtplx.engine.lane import RunningLane
    from mtplx.engine.policy import ScriptedSteps
    from mtplx.engine.row import A3BMTPBatchRequest
    from mtplx.sampling import SamplerConfig

    lane = solo_lane(model) if width == 1 else install_a3b_mtp_batch_lane(model, width=width)

    def decode(reqs):      # a running lane: MTP cycles only, or alternating with plain AR steps
        running = RunningLane([lane], step_chooser=ScriptedSteps((lambda i: "ar" if i % 2 else "mtp")
                                                                 if steps == "alternate" else (lambda i: "mtp")))
        streams = [running.add(r) for r in reqs]
        while running.has_work:
            running.step()
        assert running.counters.accepted > 0 and (running.counters.ar_steps > 0) == (steps == "alternate")
        return streams

    prompts = [PROMPT, "import os\n", "class Stack:\n    def __init__(self):\n"][:width]
    ids = [list(model.tokenizer.encode(p, add_special_tokens=False)) for p in prompts]
    seen = {}
    samplers = [SamplerConfig(temperature=0.0)] if width == 1 else [SamplerConfig(temperature=0.0),
                                                                    SamplerConfig(temperature=0.8, top_k=0, top_p=1.0)]
    for sampler in samplers:
        reqs = [A3BMTPBatchRequest(request_id=str(i), prompt_ids=tuple(p), max_tokens=24, sampler=sampler, seed=i,
                                   logprobs=4 - i, on_token=lambda t, e, i=i: seen.setdefault(i, []).append((t, e)))
                for i, p in enumerate(ids)]
        seen.clear()
        for i, stream in enumerate(decode(reqs)):     # accepted drafts among the tokens checked
            assert [t for t, _ in seen[i]] == stream.tokens and [e for _, e in seen[i]] == stream.logprobs
            for (lp, alts), (ref_lp, ref_top) in zip(stream.logprobs, _target_logprobs(model, ids[i], stream.tokens,
                                                                                      4 - i)):
                assert abs(lp - ref_lp) < 1e-4 and len(alts) == 4 - i
                assert all(abs(a[1] - r) < 1e-4 for a, r in zip(alts, ref_top))
                assert alts[0][1] == lp or not sampler.is_greedy     # greedy: the heaviest token


@RAY_MARK
def test_logprobs_through_chat_and_completions(client, ref_model):
    tok = ref_model.tokenizer
    msgs = [{"role": "user", "content": PROMPT}]
    ids = _chat_ids(ref_model, PROMPT)
    tokens = _greedy(ref_model, ids, 16).tokens
    ref = _target_logprobs(ref_model, ids, tokens, 3)
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16, temperature=0, logprobs=True,
                                       top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == len(tokens) == r.usage.completion_tokens
    for c, (ref_lp, ref_top) in zip(content, ref):
        assert abs(c.logprob - ref_lp) < 1e-4 and len(c.top_logprobs) == 3
        assert all(abs(t.logprob - float(v)) < 1e-4 for t, v in zip(c.top_logprobs, ref_top))
        assert c.top_logprobs[0].logprob == c.logprob          # greedy: the heaviest token
    assert bytes(b for c in content for b in c.bytes).decode("utf-8", "replace") == \
        tok.decode(tokens, skip_special_tokens=True)         # a special token: counted, no text
    # streaming: the same entries, spread over the chunks
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16, temperature=0,
                                                 logprobs=True, top_logprobs=3, stream=True))
    streamed = [c for ch in chunks if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
    assert [c.token for c in streamed] == [c.token for c in content]     # values: a lane's own rounding
    assert all(abs(a.logprob - b.logprob) < 1e-4 for a, b in zip(streamed, content))
    # completions: the legacy shape
    cids = list(tok.encode(PROMPT, add_special_tokens=False))
    ctokens = _greedy(ref_model, cids, 12).tokens
    cref = _target_logprobs(ref_model, cids, ctokens, 2)
    c = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=2).choices[0]
    lp = c.logprobs
    assert "".join(lp.tokens) == c.text and len(lp.tokens) == len(ctokens)
    assert all(abs(a - b) < 1e-4 for a, (b, _) in zip(lp.token_logprobs, cref))
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert all(len(top) >= 2 and lp.tokens[i] in top for i, top in enumerate(lp.top_logprobs))


# ------------------------------------------------------------------------------------------------
# n > 1: rows of one lane sharing one prefill


def test_n_rows_share_one_prefill_and_keep_their_own_draws(model, monkeypatch):
    """n jobs of one prefill group run as rows of one lane after ONE prefill of the prompt; greedy
    rows equal plain greedy AR, sampled rows follow their own seeds whatever their neighbours."""
    import mtplx.engine.admission as admission_mod
    from mtplx.sampling import SamplerConfig
    from mtplx.server.mtp_batch import MTPBatchGenerationService, MTPBatchJob

    prefills = []
    real_start = admission_mod.start_prefill

    def counting(model_, prompt, *a, **k):
        prefills.append(len(prompt))
        return real_start(model_, prompt, *a, **k)

    monkeypatch.setattr(admission_mod, "start_prefill", counting)
    prompt = list(model.tokenizer.encode(PROMPT, add_special_tokens=False))
    sampled = SamplerConfig(temperature=0.9, top_p=0.95)

    def group(name, sampler, seeds):
        return [MTPBatchJob(request_id=name, prompt_ids=prompt, max_tokens=24, sampler=sampler, seed=s,
                            stop_token_ids=model.eos_token_ids, compatibility_key=(name,), prefill_group=name)
                for s in seeds]

    service = MTPBatchGenerationService.for_model(model, widths=(3,))
    try:
        def run(jobs):
            prefills.clear()
            outs = [f.result(timeout=300) for f in service.submit_cohort(jobs)]
            return outs, len(prefills)

        greedy, n_prefills = run(group("g", SamplerConfig(temperature=0.0), [0, 1, 2]))
        ref = _greedy(model, prompt, 24).tokens
        assert n_prefills == 1
        assert [o["tokens"] for o in greedy] == [ref] * 3
        assert sorted(o["stats"]["shared_prefill"] for o in greedy) == [False, True, True]
        assert service.snapshot()["shared_prefills"] >= 2

        first, n_prefills = run(group("s1", sampled, [7, 8, 9]))
        again, _ = run(group("s2", sampled, [7, 8, 9]))
        other, _ = run(group("s3", sampled, [8, 100, 200]))
        assert n_prefills == 1
        assert [o["tokens"] for o in first] == [o["tokens"] for o in again]      # reproducible
        assert first[1]["tokens"] == other[0]["tokens"]          # seed 8 whatever its neighbours
        assert len({tuple(o["tokens"]) for o in first}) > 1      # the seed streams differ
    finally:
        service.shutdown(timeout_s=10)


def test_n_and_best_of_are_validated():
    from mtplx.api.errors import OpenAIError
    from mtplx.api.openai import ChatCompletionRequest, CompletionRequest, parse_request

    chat = {"messages": [{"role": "user", "content": "x"}]}
    for cls, body, param in [(ChatCompletionRequest, {**chat, "n": 0}, "n"),
                             (CompletionRequest, {"prompt": "x", "n": 2, "best_of": 1}, "best_of"),
                             (CompletionRequest, {"prompt": "x", "best_of": 2, "stream": True}, "best_of")]:
        with pytest.raises(OpenAIError) as exc:
            parse_request(cls, json.dumps(body).encode())
        assert exc.value.status == 400 and exc.value.param == param
    req = parse_request(CompletionRequest, json.dumps({"prompt": "x", "n": 2, "best_of": 3}).encode())
    assert (req.requested_n, req.requested_rows) == (2, 3)
    assert parse_request(ChatCompletionRequest, json.dumps({**chat, "n": 3}).encode()).requested_rows == 3


@RAY_MARK
def test_n_choices_through_chat_and_completions(client, ref_model):
    import openai

    ids = _chat_ids(ref_model, PROMPT)
    ref = ref_model.tokenizer.decode(_greedy(ref_model, ids, 16).tokens, skip_special_tokens=True)
    msgs = [{"role": "user", "content": PROMPT}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16, temperature=0, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.message.content for c in r.choices] == [ref] * 3            # greedy: identical choices
    stats = r.model_extra["mtplx_stats"]
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == sum(
        s["completion_tokens"] for s in stats["choices"])
    assert stats["n"] == 3 and stats["shared_prefill_rows"] == 2
    assert [s["finish_reason"] for s in stats["choices"]] == [c.finish_reason for c in r.choices]
    # sampled, streamed: choice i is the n=1 request with seed + i
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0.9, seed=11)
    texts = {0: "", 1: ""}
    for chunk in client.completions.create(n=2, stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] += c.text
    for i in (0, 1):
        assert texts[i] == client.completions.create(**dict(kw, seed=11 + i)).choices[0].text
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(n=1000, **kw)
    assert exc.value.body["param"] == "n"
    # best_of: the row (seed + i) of highest cumulative log-probability is the choice
    best = client.completions.create(best_of=3, **kw)
    rows = [client.completions.create(logprobs=0, **dict(kw, seed=11 + i)).choices[0] for i in range(3)]
    top = max(rows, key=lambda c: sum(c.logprobs.token_logprobs))
    assert [c.text for c in best.choices] == [top.text] and best.choices[0].logprobs is None
    stats = best.model_extra["mtplx_stats"]
    assert stats["best_of"] == 3 and stats["n"] == 1
    assert best.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in rows)


@pytest.mark.parametrize("head", ["agree", "none"])
def test_b1_exact_serves_logprobs_in_the_one_row_lane(tmp_path, head):
    """numerics b1-exact installs no lane; a job asking for logprobs decodes in the one-row lane the
    solo path decodes through: the same tokens as the solo path, with the target's own entries
    (a checkpoint without an MTP head included: its rows decode plain AR)."""
    import mtplx
    from mtplx.sampling import SamplerConfig
    from mtplx.server.mtp_batch import MTPBatchGenerationService, MTPBatchJob
    from mtplx.synthetic import write_checkpoint

    m = mtplx.load_model(write_checkpoint(tmp_path / head, head=head, vocab=4096))
    prompt = list(m.tokenizer.encode(PROMPT, add_special_tokens=False))
    service = MTPBatchGenerationService.for_model(m, numerics="b1-exact")
    try:
        entries = []
        job = MTPBatchJob(request_id="lp", prompt_ids=prompt, max_tokens=12, sampler=SamplerConfig(temperature=0.0),
                          logprobs=2, token_callback=lambda toks, lps: entries.extend(lps),
                          speculative=m.mtp is not None, stop_token_ids=frozenset())
        out = service.submit(job).result(timeout=300)
        plain = service.submit(MTPBatchJob(request_id="plain", prompt_ids=prompt, max_tokens=12,
                                           sampler=SamplerConfig(temperature=0.0), speculative=m.mtp is not None,
                                           stop_token_ids=frozenset())).result(timeout=300)
        assert out["tokens"] == plain["tokens"] == _greedy(m, prompt, 12, ()).tokens
        ref = _target_logprobs(m, prompt, out["tokens"], 2)
        assert len(entries) == len(ref)
        for (lp, alts), (ref_lp, ref_top) in zip(entries, ref):
            assert abs(lp - ref_lp) < 1e-4 and [round(v, 4) for _, v in alts] == [round(float(v), 4) for v in ref_top]
    finally:
        service.shutdown(timeout_s=10)


@RAY_MARK
def test_cancelled_choices_report_openais_finish_reason_in_stats(serve_app, http):
    """A cancel of an n = 2 request's id reaches both rows; every client-visible finish reason,
    mtplx_stats' included, is the client's "abort" (the engine's "cancelled" stays as
    engine_finish_reason)."""
    import httpx

    body = {"model": MODEL, "prompt": PROMPT, "temperature": 0, "max_tokens": 400, "n": 2, "stream": True,
            "stream_options": {"include_usage": True}}
    finals, usage_stats, n_chunks = {}, None, 0
    with httpx.Client(base_url=serve_app.base, timeout=120, headers=serve_app.headers) as c:
        with c.stream("POST", "/v1/completions", json=body) as resp:
            rid = resp.headers["x-mtplx-request-id"]
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                n_chunks += 1
                if n_chunks == 4:
                    r = http.post(f"/v1/mtplx/cancel/{rid}")
                    assert r.status_code == 200 and r.json()["rows"] == 2, r.text
                obj = json.loads(line[6:])
                for ch in obj["choices"]:
                    if ch["finish_reason"]:
                        finals[ch["index"]] = (ch["finish_reason"], obj["mtplx_stats"])
                if not obj["choices"]:
                    usage_stats = obj["mtplx_stats"]
    assert sorted(finals) == [0, 1]
    for reason, stats in finals.values():
        assert reason == stats["finish_reason"] == "abort"
        assert stats["engine_finish_reason"] == "cancelled" and stats["cancelled"] is True
        assert stats["completion_tokens"] < 400
    assert all(s["finish_reason"] == "abort" for s in usage_stats["choices"])


def test_bench_load_logprobs_arms_summary():
    """`bench load --logprobs K`: per arm, median tok/s without and with, and the median ratio."""
    from benchmarks import load as bl

    def run(off, on):
        return {"ours_logprobs": {"off": {"greedy/closed-8": {"tok_s": off}},
                                  "on": {"greedy/closed-8": {"tok_s": on}}}}

    s = bl.summarize_logprobs([run(100, 95), run(120, 96), run(110, 99)])
    assert s["greedy/closed-8"] == {"off": 110, "on": 96, "on_over_off": 0.9}
    assert "| greedy/closed-8 | 110.0 | 96.0 | 0.900 |" in bl.format_logprobs_table(s)
    assert bl.summarize_logprobs([{"ours": {}}]) == {}
