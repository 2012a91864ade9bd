"""The OpenAPI document at `/openapi.json`: generated from the ingress's own route table and request
models, so it lists every route (path and method) the server answers and every field each body
accepts. Kept true here: its operations are exactly the router's; each body's fields are exactly
its model's, every one of them accepted (its default sent alone is never an unknown parameter) and
a field it does not list refused; the document is valid OpenAPI 3.1. In-process (no Ray), then once
through the served app."""

from __future__ import annotations

import asyncio
import json

import pytest

RAY_MARK = pytest.mark.ray
KEY = "openapi-test-key"


class _UnreachedReplica:     # no route here reaches a replica
    def options(self, **_):
        return self


@pytest.fixture(scope="module")
def ingress(tmp_path_factory):
    from deployments.ingress import OpenAIIngress

    keys = tmp_path_factory.mktemp("keys") / "api_keys"
    keys.write_text(KEY + "\n")
    return OpenAIIngress(_UnreachedReplica(), {"metrics": False, "niceness": None, "api_keys_file": str(keys),
                                               "api_keys_env": None, "responses_store_path": None})


@pytest.fixture(scope="module")
def doc(ingress):
    from starlette.requests import Request

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    scope = {"type": "http", "method": "GET", "path": "/openapi.json", "root_path": "", "query_string": b"",
             "headers": []}                                     # no key: the document is open
    resp = asyncio.run(ingress(Request(scope, receive)))
    assert resp.status_code == 200
    return json.loads(resp.body)


def test_the_document_lists_exactly_the_routes(ingress, doc):
    from deployments.ingress.routes import IngressRoute

    routes = [r for r in ingress._router.routes if isinstance(r, IngressRoute)]
    assert len(routes) == len(ingress._router.routes)
    served = {(r.operation().template, m.lower()) for r in routes for m in r.methods}
    listed = {(path, method) for path, ops in doc["paths"].items() for method in ops}
    assert listed == served
    assert ("/v1/responses", "post") in listed and ("/v1/responses/{response_id}", "delete") in listed
    for r in routes:
        op = doc["paths"][r.operation().template][next(iter(r.methods)).lower()]
        assert (op.get("security") == []) is r.open, r.path
        assert [p["name"] for p in op.get("parameters", [])] == r.operation().path_params
        assert ("requestBody" in op) is bool(r.bodies), r.path
        assert ("text/event-stream" in op["responses"]["200"]["content"]) is r.streams, r.path


def test_every_listed_field_is_accepted_and_no_other(ingress, doc):
    from mtplx.api import openai as oa
    from mtplx.api.errors import OpenAIError
    from mtplx.api.openapi import body_fields
    from mtplx.api.responses import ResponsesRequest

    required = {"ChatCompletionRequest": {"messages": [{"role": "user", "content": "x"}]},
                "CompletionRequest": {"prompt": "x"},
                "MessagesRequest": {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]},
                "CountTokensRequest": {"model": "m", "messages": [{"role": "user", "content": "x"}]},
                "ResponsesRequest": {"input": "x"}, "TokenizeCompletionRequest": {"prompt": "x"},
                "TokenizeChatRequest": {"messages": [{"role": "user", "content": "x"}]},
                "DetokenizeRequest": {"tokens": [1]}}
    models = {r.operation().template: r.bodies for r in ingress._router.routes if r.bodies}
    assert ResponsesRequest in models["/v1/responses"]
    seen = set()
    for path, bodies in models.items():
        schema = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        for model, ref in zip(bodies, schema.get("oneOf", [schema])):
            fields = body_fields(doc, ref)
            assert fields == {f.alias or name for name, f in model.model_fields.items()}, model
            base = required[model.__name__]
            for name, spec in doc["components"]["schemas"][model.__name__]["properties"].items():
                if name in base or "default" not in spec:
                    continue
                try:        # the field at its default: never refused as unknown (other checks may refuse)
                    oa.parse_request(model, json.dumps({**base, name: spec["default"]}).encode())
                except OpenAIError as exc:
                    assert exc.code != "unknown_parameter", (model, name, exc.message)
            with pytest.raises(OpenAIError) as exc:
                oa.parse_request(model, json.dumps({**base, "not_a_field_anywhere": 1}).encode())
            assert exc.value.code == "unknown_parameter" and exc.value.param == "not_a_field_anywhere"
            seen.add(model.__name__)
    assert seen == set(required)


def test_the_document_is_valid_openapi(doc):
    from openapi_spec_validator import validate

    validate(doc)
    assert doc["openapi"].startswith("3.1") and doc["info"]["version"]
    chat = doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert {"skip_special_tokens", "include_stop_str_in_output", "spaces_between_special_tokens"} <= set(chat)
    assert chat["temperature"]["anyOf"][0]["maximum"] == 2.0


@RAY_MARK
def test_served_without_a_key(serve_app, doc):
    import httpx

    r = httpx.get(serve_app.base + "/openapi.json", timeout=60)
    assert r.status_code == 200 and r.json()["paths"] == doc["paths"]
