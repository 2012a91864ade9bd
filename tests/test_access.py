"""Per-caller isolation through the real served app (its two API keys, tests/conftest.py): /health
details behind a key, cancels only by the key that created the request (and an honest end for a
cancelled row), and the prefix cache partitioned per key and per `cache_salt`."""

from __future__ import annotations

import json
import uuid

import pytest

from conftest import TEST_API_KEY

RAY_MARK = pytest.mark.ray
KEY_B = "second-key-for-rotation"          # the test app's other key
AUTH_A = {"Authorization": f"Bearer {TEST_API_KEY}"}
AUTH_B = {"Authorization": f"Bearer {KEY_B}"}
MODEL = "mtplx-tiny-py"


def test_session_bank_partitions_never_see_each_other(model):
    """In-process: a state banked in one partition (a caller's cache_salt digest) is found from
    that partition only, whole-prompt and boundary entries alike."""
    import mlx.core as mx

    from mtplx.engine.prefix_cache import PrefixState
    from mtplx.scheduler.session_bank import SessionBank

    bank = SessionBank("fp")
    arr = mx.zeros((16,), dtype=mx.float32)
    boundary = PrefixState((1, 2), ((arr, arr[:0]),), ())
    bank.commit(boundary, "salt-a")
    assert bank.lookup([1, 2, 3], "salt-a") is boundary
    assert bank.lookup([1, 2, 3], "salt-b") is None and bank.lookup([1, 2, 3]) is None
    restore, commit = bank.hooks([1, 2, 3], "salt-b")
    assert restore() is None
    commit(boundary)
    assert restore() is boundary and bank.stats()["entries"] == 2


@RAY_MARK
def test_health_details_need_a_key(serve_app):
    import httpx

    with httpx.Client(base_url=serve_app.base, timeout=60) as c:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = c.get("/health", headers=headers)
            assert r.status_code == 200 and r.json() == {"status": "ok"}, r.text
        detailed = c.get("/health", headers=AUTH_B).json()
        assert detailed["status"] == "ok" and detailed["replicas"] and "ingress" in detailed


def _stream(c, body: dict, headers: dict, on_chunk=None):
    """(request id, finish_reason, mtplx_stats, text) of one streamed chat completion."""
    finish, stats, text = None, None, ""
    with c.stream("POST", "/v1/chat/completions", json=body, headers=headers) as resp:
        assert resp.status_code == 200, resp.read()
        rid, n = resp.headers["x-mtplx-request-id"], 0
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            obj = json.loads(line[6:])
            n += 1
            if on_chunk is not None:
                on_chunk(rid, n)
            for ch in obj.get("choices") or ():
                text += ch["delta"].get("content") or ""
                if ch["finish_reason"]:
                    finish, stats = ch["finish_reason"], obj["mtplx_stats"]
    return rid, finish, stats, text


@RAY_MARK
def test_only_the_key_that_created_a_request_can_cancel_it_and_its_end_is_abort(serve_app):
    import httpx

    body = {"model": MODEL, "messages": [{"role": "user", "content": "class Parser:"}], "temperature": 0,
            "max_tokens": 120, "stream": True, "ignore_eos": True}
    answers = []

    with httpx.Client(base_url=serve_app.base, timeout=120) as c:
        def other_key_cancels(rid, n):
            if n == 3:
                answers.append(c.post(f"/v1/mtplx/cancel/{rid}", headers=AUTH_B))

        _, finish, stats, _ = _stream(c, body, AUTH_A, other_key_cancels)
        (refused,) = answers
        assert refused.status_code == 404 and refused.json()["error"]["code"] == "request_not_found"
        assert finish == "length" and stats["cancelled"] is False and stats["completion_tokens"] == 120

        def owner_cancels(rid, n):
            if n == 3:
                answers.append(c.post(f"/v1/mtplx/cancel/{rid}", headers=AUTH_A))

        _, finish, stats, _ = _stream(c, body, AUTH_A, owner_cancels)
        assert answers[-1].status_code == 200 and answers[-1].json()["cancelled"] is True
        # a cancelled row did not finish: vLLM's "abort", not "stop"
        assert finish == "abort" and stats["finish_reason"] == "abort" and stats["cancelled"] is True
        assert stats["completion_tokens"] < 120


@RAY_MARK
def test_the_prefix_cache_is_partitioned_per_key_and_per_cache_salt(serve_app):
    """Key B sending key A's prompt learns nothing from cached_tokens; a cache_salt partitions
    one key's requests too (vLLM's field)."""
    import httpx

    prompt = f"# {uuid.uuid4().hex}\nclass Inventory:\n    def __init__(self, items):\n        self.items = items\n"

    def cached(headers, **extra) -> tuple:
        r = c.post("/v1/chat/completions", headers=headers,
                   json={"model": MODEL, "messages": [{"role": "user", "content": prompt}], "temperature": 0,
                         "max_tokens": 2, **extra})
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        return usage["prompt_tokens_details"]["cached_tokens"], usage["prompt_tokens"]

    with httpx.Client(base_url=serve_app.base, timeout=120) as c:
        assert cached(AUTH_A)[0] == 0
        hit, n = cached(AUTH_A)
        assert hit == n > 0                             # key A's own prompt is cached for key A
        assert cached(AUTH_B) == (0, n)                 # not for key B
        assert cached(AUTH_A, cache_salt="tenant-1") == (0, n)
        assert cached(AUTH_A, cache_salt="tenant-1") == (n, n)
        assert cached(AUTH_A, cache_salt="tenant-2") == (0, n)
        assert cached(AUTH_B, cache_salt="tenant-1") == (0, n)     # a salt is within its key
        r = c.post("/v1/chat/completions", headers=AUTH_A, json={"messages": [{"role": "user", "content": "x"}],
                                                                 "cache_salt": ""})
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"


@RAY_MARK
def test_the_snapshot_counts_what_grammars_hold(serve_app, http):
    """Structured output's memory where the replica reports its state: rows with a grammar, the
    bytes they hold (counted as their masks come and go) and llguidance's bounds."""
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x = "}],
                                                "max_tokens": 8, "temperature": 0,
                                                "response_format": {"type": "json_object"}})
    assert r.status_code == 200 and r.json()["mtplx_stats"]["constraint"] == "json_object", r.text
    (replica,) = http.get("/v1/mtplx/snapshot").json()["replicas"].values()
    grammar = replica["grammar"]
    assert grammar["rows_started"] >= 1 and grammar["peak_row_bytes"] > 0 and grammar["compiled_grammars"] >= 1
    assert grammar["max_lexer_states"] == 100_000 and grammar["step_lexer_fuel"] == 200_000


@RAY_MARK
def test_a_rebound_host_is_refused_through_the_proxy_and_the_direct_port(serve_app):
    """The served app listens on loopback: a Host that names another site (DNS rebinding) gets 403
    on every route, /health included, through Serve's proxy and the ingress's own port alike."""
    import httpx

    for base in filter(None, (serve_app.base, serve_app.direct)):
        with httpx.Client(base_url=base, timeout=60) as c:
            for path in ("/health", "/v1/models"):
                r = c.get(path, headers={**AUTH_A, "host": "evil.example:8000"})
                assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed", (base, r.text)
            assert c.get("/v1/models", headers={**AUTH_A, "host": "localhost"}).status_code == 200
