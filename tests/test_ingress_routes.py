"""The ingress's routing in-process (no Ray, no model replica: these routes never reach one):
Starlette's router behind the API key, 404 / 405 in the route's error shape, request-id headers."""

from __future__ import annotations

import asyncio
import json

import pytest
from starlette.requests import Request

import process_state

KEY = "routes-test-key"


class UnreachedReplica:     # no route here calls a replica
    def options(self, **_):
        return self


@pytest.fixture(scope="module")
def ingress(tmp_path_factory):
    from deployments.ingress import OpenAIIngress

    keys = tmp_path_factory.mktemp("keys") / "api_keys"
    keys.write_text(KEY + "\n")
    with process_state.restored():          # a serving process freezes its startup heap
        yield OpenAIIngress(UnreachedReplica(), {"metrics": False, "niceness": None, "api_keys_file": str(keys),
                                                 "api_keys_env": None})


def call(ingress, method: str, path: str, key: bool = True, headers: dict = None):
    raw = [(b"content-type", b"application/json")] + [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    if key:
        raw.append((b"authorization", f"Bearer {KEY}".encode()))

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    scope = {"type": "http", "method": method, "path": path, "root_path": "", "query_string": b"", "headers": raw}
    resp = asyncio.run(ingress(Request(scope, receive)))
    json_body = resp.body and resp.headers.get("content-type", "").startswith("application/json")
    return resp, (json.loads(resp.body) if json_body else None)


def test_unknown_routes_and_wrong_methods_answer_in_the_routes_shape(ingress):
    resp, body = call(ingress, "GET", "/v1/nope")
    assert resp.status_code == 404 and body["error"]["code"] == "not_found"
    resp, body = call(ingress, "GET", "/v1/chat/completions")
    assert resp.status_code == 405 and body["error"]["code"] == "method_not_allowed" and "POST" in body["error"]["message"]
    assert resp.headers["x-mtplx-request-id"].startswith("chatcmpl-")
    resp, body = call(ingress, "HEAD", "/v1/models")        # Starlette would allow HEAD on GET; we do not
    assert resp.status_code == 405
    # Anthropic's routes: Anthropic's error shape, msg_ ids and its request-id header
    resp, body = call(ingress, "GET", "/v1/messages")
    assert resp.status_code == 405 and body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert resp.headers["request-id"] == resp.headers["x-mtplx-request-id"] and resp.headers["request-id"].startswith("msg_")
    resp, body = call(ingress, "GET", "/v1/messages/nope")
    assert resp.status_code == 404 and body["error"]["type"] == "not_found_error" and "request-id" in resp.headers
    assert "request-id" not in call(ingress, "GET", "/v1/nope")[0].headers


def test_the_api_key_comes_before_what_a_route_would_say(ingress):
    for method, path in [("GET", "/v1/nope"), ("GET", "/v1/chat/completions"), ("GET", "/v1/models")]:
        resp, body = call(ingress, method, path, key=False)
        assert resp.status_code == 401 and body["error"]["code"] == "invalid_api_key", (method, path)
    # the open routes answer without one, their 405 included
    assert call(ingress, "POST", "/health", key=False)[0].status_code == 405
    assert call(ingress, "GET", "/v1/mtplx/dashboard", key=False)[0].status_code == 200


def test_path_parameters_and_trailing_slashes(ingress):
    resp, body = call(ingress, "GET", f"/v1/models/{ingress.served_model}/")
    assert resp.status_code == 200 and body["id"] == ingress.served_model
    resp, body = call(ingress, "GET", "/v1/models/gpt-4o")
    assert resp.status_code == 404 and body["error"]["param"] == "model"
    resp, body = call(ingress, "GET", "/version", headers={"x-mtplx-request-id": "mine-1"})
    assert resp.status_code == 200 and resp.headers["x-mtplx-client-request-id"] == "mine-1"
    assert resp.headers["x-mtplx-request-id"].startswith("req-")
    resp, body = call(ingress, "GET", "/version", headers={"x-mtplx-request-id": "has space"})
    assert resp.status_code == 400 and body["error"]["param"] == "x-mtplx-request-id"
