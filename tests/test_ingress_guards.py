"""The ingress's guards in-process (no Ray; these paths answer before any replica is reached): what a
browser page could make the browser send (Content-Type, Host, Origin), /health for a caller
without a key, the early size check and the prompt threads, and the start-up line about keys."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import pytest
from starlette.requests import Request

KEY = "guards-test-key"
LOOPBACK = ("127.0.0.1", 8000)


class UnreachedReplica:     # no path tested here reaches a model replica; a call to one fails
    def options(self, **_):
        return self


def _ingress(tmp_path_factory, keys: bool, **config):
    from deployments.ingress import OpenAIIngress

    cfg = {"metrics": False, "niceness": None, "api_keys_env": None, **config}
    if keys:
        path = tmp_path_factory.mktemp("keys") / "api_keys"
        path.write_text(KEY + "\n")
        cfg["api_keys_file"] = str(path)
    return OpenAIIngress(UnreachedReplica(), cfg)


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    return _ingress(tmp_path_factory, keys=True, allowed_hosts=["mtplx.internal"])


@pytest.fixture(scope="module")
def open_ingress(tmp_path_factory):
    return _ingress(tmp_path_factory, keys=False)


def _scope(method: str, path: str, body: bytes, headers: dict, server):
    raw = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    scope = {"type": "http", "method": method, "path": path, "root_path": "", "query_string": b"", "headers": raw}
    if server is not None:
        scope["server"] = server

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    return scope, receive


async def _acall(ingress, method: str, path: str, body=None, headers=None, key: bool = True, server=LOOPBACK):
    data = body if isinstance(body, bytes) else (json.dumps(body).encode() if body is not None else b"")
    hdrs = {"host": "127.0.0.1:8000", "content-type": "application/json", **(headers or {})}
    hdrs = {k: v for k, v in hdrs.items() if v is not None}
    if key:
        hdrs["authorization"] = f"Bearer {KEY}"
    resp = await ingress(Request(*_scope(method, path, data, hdrs, server)))
    is_json = resp.headers.get("content-type", "").startswith("application/json")
    return resp, (json.loads(resp.body) if is_json and resp.body else None)


def call(ingress, *args, **kwargs):
    return asyncio.run(_acall(ingress, *args, **kwargs))


TOKENIZE = {"prompt": "def f(x):"}


def test_a_body_that_is_not_json_gets_415_on_every_body_route(keyed):
    for path in ("/tokenize", "/detokenize", "/v1/chat/completions", "/v1/completions", "/v1/messages",
                 "/v1/messages/count_tokens"):
        for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
            resp, body = call(keyed, "POST", path, TOKENIZE, headers={"content-type": content_type})
            assert resp.status_code == 415, (path, content_type, resp.status_code)
            err = body["error"] if "type" not in body or body["type"] != "error" else body["error"]
            assert "content-type" in json.dumps(body).lower(), body
            if not path.startswith("/v1/messages"):
                assert err["code"] == "unsupported_media_type" and err["param"] == "content-type"
            else:           # Anthropic's shape
                assert body["type"] == "error" and err["type"] == "invalid_request_error"
    # JSON, JSON with a charset, a +json type and no declared type are read
    for content_type in ("application/json", "application/json; charset=utf-8", "application/vnd.api+json", None):
        resp, body = call(keyed, "POST", "/tokenize", TOKENIZE, headers={"content-type": content_type})
        assert resp.status_code == 200 and body["count"] > 0, (content_type, body)


def test_a_host_that_is_not_the_loopbacks_is_refused_on_loopback(keyed, open_ingress):
    """DNS rebinding: a page at evil.example whose name now resolves to 127.0.0.1 sends its own
    name as the Host header; every route, open ones included, refuses it (before the key check)."""
    for ingress in (keyed, open_ingress):
        for path in ("/health", "/v1/models", "/tokenize"):
            method = "POST" if path == "/tokenize" else "GET"
            resp, body = call(ingress, method, path, TOKENIZE, headers={"host": "evil.example:8000"}, key=False)
            assert resp.status_code == 403, (path, resp.status_code)
            assert body["error"]["code"] == "host_not_allowed" and body["error"]["param"] == "host"
        for host in ("127.0.0.1:8000", "localhost:8000", "[::1]:8000", "127.0.0.2", "LOCALHOST"):
            assert call(ingress, "GET", "/v1/models", headers={"host": host})[0].status_code == 200, host
    # a configured name is served; a connection that did not arrive on loopback is not checked
    assert call(keyed, "GET", "/v1/models", headers={"host": "mtplx.internal:443"})[0].status_code == 200
    assert call(open_ingress, "GET", "/v1/models", headers={"host": "mtplx.internal"})[0].status_code == 403
    assert call(open_ingress, "GET", "/v1/models", headers={"host": "evil.example"},
                server=("10.1.2.3", 8000))[0].status_code == 200


def test_with_no_key_a_cross_origin_page_is_refused(keyed, open_ingress):
    page = {"origin": "https://evil.example"}
    resp, body = call(open_ingress, "POST", "/tokenize", TOKENIZE, headers=page, key=False)
    assert resp.status_code == 403 and body["error"]["code"] == "origin_not_allowed"
    assert body["error"]["param"] == "origin"
    assert call(open_ingress, "POST", "/tokenize", TOKENIZE, headers={"origin": "null"}, key=False)[0].status_code \
        == 403
    # the loopback's own pages, and this server's own origin, may call it
    for origin in ("http://localhost:3000", "http://127.0.0.1:8000"):
        assert call(open_ingress, "POST", "/tokenize", TOKENIZE, headers={"origin": origin},
                    key=False)[0].status_code == 200, origin
    assert call(open_ingress, "POST", "/tokenize", TOKENIZE, server=("10.1.2.3", 8000), key=False,
                headers={"origin": "http://mtplx.lan:8000", "host": "mtplx.lan:8000"})[0].status_code == 200
    # with keys set the key is the guard (a page cannot send one it does not have)
    assert call(keyed, "POST", "/tokenize", TOKENIZE, headers=page)[0].status_code == 200


def test_health_without_a_key_is_liveness_only_and_checks_replicas_at_most_every_ttl(keyed):
    from deployments.ingress.server import LIVENESS_TTL_S

    before = keyed._stats["replica_health_checks"]
    started = time.monotonic()

    async def burst():
        return await asyncio.gather(*(_acall(keyed, "GET", "/health", key=False) for _ in range(40)))

    answers = asyncio.run(burst())
    # no model replica here: liveness says so, and nothing else (no versions, paths, ids, pids)
    for resp, body in answers:
        assert resp.status_code == 503 and body == {"status": "unavailable"}, body
    if time.monotonic() - started < LIVENESS_TTL_S:
        assert keyed._stats["replica_health_checks"] - before == 1
    # a wrong key is no key; a valid key gets the details (here: the replica did not answer)
    resp, body = call(keyed, "GET", "/health", key=False, headers={"authorization": "Bearer nope"})
    assert body == {"status": "unavailable"}
    resp, body = call(keyed, "GET", "/health")
    assert resp.status_code == 503 and body["error"]["code"] == "service_unavailable"


def test_a_prompt_longer_than_the_context_is_refused_before_it_is_rendered(keyed):
    """The early size check: a prompt of N characters is at least N / (the longest token's
    characters) tokens; beyond the context window it is refused without the template or the
    tokenizer running (here 3 MB: tokenizing it takes seconds)."""
    chars = 3_000_000
    for path, body, param in (
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "ab c" * (chars // 4)}]}, "messages"),
            ("/v1/messages", {"model": "mtplx-tiny-py", "max_tokens": 8,
                              "messages": [{"role": "user", "content": "ab c" * (chars // 4)}]}, "messages"),
            ("/v1/completions", {"prompt": "ab c" * (chars // 4)}, "prompt")):
        t0 = time.perf_counter()
        resp, out = call(keyed, "POST", path, body)
        took = time.perf_counter() - t0
        assert resp.status_code == 400, (path, out)
        message = out["error"]["message"]
        assert "characters" in message and "context length" in message, message
        if not path.startswith("/v1/messages"):
            assert out["error"]["code"] == "context_length_exceeded" and out["error"]["param"] == param
        assert took < 1.5, (path, took)


def test_a_large_request_does_not_stall_the_event_loop(keyed):
    """A request of 12,000 small messages (parse ~0.3 s, chat template ~1 s on a loaded 2-core box) is
    parsed, rendered and tokenized in the prompt threads: the event loop, which every open stream
    shares, keeps turning meanwhile (inline, it would not turn once until the answer)."""
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": "a"} for i in range(12000)]
    body = {"messages": messages, "add_generation_prompt": True}

    async def run():
        ticks, done = [], asyncio.Event()

        async def ticker():
            while not done.is_set():
                ticks.append(time.perf_counter())
                await asyncio.sleep(0.002)

        tick = asyncio.ensure_future(ticker())
        await asyncio.sleep(0.05)
        t0 = time.perf_counter()
        resp, out = await _acall(keyed, "POST", "/tokenize", body)
        t1 = time.perf_counter()
        done.set()
        await tick
        during = [t for t in ticks if t0 < t < t1]
        gaps = [b - a for a, b in zip([t0] + during, during + [t1])]
        return resp, out, t1 - t0, len(during), max(gaps)

    resp, out, took, turns, worst_gap = asyncio.run(run())
    assert resp.status_code == 200 and out["count"] > 12000, out
    assert took > 0.2, took                        # the work was large enough to matter
    # the loop kept turning (on a loaded 2-core box a gap is as long as the OS keeps the loop's
    # thread waiting for the interpreter; inline there would be one gap as long as the request)
    assert turns >= 10 and worst_gap < took / 2, (turns, worst_gap, took)


def test_the_start_up_line_says_whether_auth_is_on(tmp_path_factory, caplog, monkeypatch):
    monkeypatch.delenv("MTPLX_GUARDS_TEST_KEYS", raising=False)
    with caplog.at_level(logging.INFO, logger="ray.serve"):
        _ingress(tmp_path_factory, keys=False, api_keys_env="MTPLX_GUARDS_TEST_KEYS")
    line = next(r for r in caplog.records if "API keys" in r.getMessage())
    assert line.levelno == logging.WARNING
    assert "API keys OFF" in line.getMessage() and "$MTPLX_GUARDS_TEST_KEYS" in line.getMessage()
    assert "not set in this process's environment" in line.getMessage()
    caplog.clear()
    monkeypatch.setenv("MTPLX_GUARDS_TEST_KEYS", "k1,k2")
    with caplog.at_level(logging.INFO, logger="ray.serve"):
        _ingress(tmp_path_factory, keys=True, api_keys_env="MTPLX_GUARDS_TEST_KEYS")
    line = next(r for r in caplog.records if "API keys" in r.getMessage())
    assert "API keys ON: 3 key(s)" in line.getMessage(), line.getMessage()
    assert "k1" not in line.getMessage() and KEY not in line.getMessage()
