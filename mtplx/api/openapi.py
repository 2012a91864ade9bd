"""The server's OpenAPI document (`GET /openapi.json`), generated from what it serves: each route
(path, method, whether it needs an API key, whether it streams) with its request model's JSON
schema (pydantic's), so that every field a route accepts is listed and nothing it refuses is.
The ingress builds it from its own route table (`tests/test_openapi.py` checks the two agree).
No MLX."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from pydantic.json_schema import models_json_schema

OPENAPI_VERSION = "3.1.0"
REF = "#/components/schemas/{model}"
_PARAM = re.compile(r"\{(\w+)(?::\w+)?\}")


@dataclass(frozen=True)
class Operation:
    """One route as the document describes it: `bodies`, its request models (several: the body
    is any one of them); `open`: no API key needed; `streams`: answers SSE when the body asks;
    `anthropic`: errors in Anthropic's shape."""

    path: str
    method: str
    summary: str
    bodies: Tuple[type, ...] = ()
    open: bool = False
    streams: bool = False
    anthropic: bool = False

    @property
    def template(self) -> str:
        """The path as OpenAPI writes it: `{model:path}` -> `{model}`."""
        return _PARAM.sub(r"{\1}", self.path)

    @property
    def path_params(self) -> List[str]:
        return _PARAM.findall(self.path)


OPENAI_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
ANTHROPIC_ERROR = {"type": "object", "required": ["type", "error"], "properties": {
    "type": {"const": "error"}, "error": {"type": "object", "required": ["type", "message"],
                                          "properties": {"type": {"type": "string"}, "message": {"type": "string"}}}}}
ERROR_STATUSES = {"400": "The request is invalid (the field is named)", "401": "No valid API key",
                  "403": "Host or Origin not allowed", "404": "No such route, model or stored response",
                  "405": "Method not allowed", "413": "Body too large", "415": "Body is not JSON",
                  "429": "Overloaded: retry after Retry-After", "500": "Internal error (the request id to quote)",
                  "503": "No model replica can serve: retry after Retry-After"}


def _responses(op: Operation) -> dict:
    content = {"application/json": {"schema": {"type": "object"}}}
    if op.streams:
        content["text/event-stream"] = {"schema": {"type": "string"}}
    error = {"application/json": {"schema": {"$ref": REF.format(
        model="AnthropicError" if op.anthropic else "OpenAIError")}}}
    out = {"200": {"description": "OK", "content": content}}
    out.update({status: {"description": why, "content": error} for status, why in ERROR_STATUSES.items()})
    return out


def _operation(op: Operation, refs: Dict[type, dict]) -> dict:
    doc = {"operationId": f"{op.method.lower()}_{re.sub(r'[^a-zA-Z0-9]+', '_', op.template).strip('_')}",
           "summary": op.summary, "responses": _responses(op)}
    if op.path_params:
        doc["parameters"] = [{"name": p, "in": "path", "required": True, "schema": {"type": "string"}}
                             for p in op.path_params]
    if op.bodies:
        schemas = [refs[b] for b in op.bodies]
        doc["requestBody"] = {"required": True, "content": {"application/json": {
            "schema": schemas[0] if len(schemas) == 1 else {"oneOf": schemas}}}}
    if op.open:
        doc["security"] = []
    return doc


def document(operations: Sequence[Operation], version: str, title: str = "mtplx",
             description: Optional[str] = None) -> dict:
    """The OpenAPI 3.1 document of `operations`: request bodies from their models' JSON schemas
    (shared definitions under components.schemas), errors in OpenAI's shape (Anthropic's on its
    routes), an API key as a bearer token or an `x-api-key` header on every route not open."""
    models = sorted({b for op in operations for b in op.bodies}, key=lambda m: m.__name__)
    mapping, top = models_json_schema([(m, "validation") for m in models], ref_template=REF)
    refs = {m: mapping[(m, "validation")] for m in models}
    schemas = dict(top.get("$defs", {}))
    schemas.update(OpenAIError=OPENAI_ERROR, AnthropicError=ANTHROPIC_ERROR)
    paths: Dict[str, dict] = {}
    for op in operations:
        paths.setdefault(op.template, {})[op.method.lower()] = _operation(op, refs)
    info = {"title": title, "version": version}
    if description:
        info["description"] = description
    return {"openapi": OPENAPI_VERSION, "info": info, "paths": paths,
            "components": {"schemas": schemas, "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer"},
                "apiKeyHeader": {"type": "apiKey", "in": "header", "name": "x-api-key"}}},
            "security": [{"bearer": []}, {"apiKeyHeader": []}]}


def body_fields(doc: dict, schema: dict) -> set:
    """The top-level fields a request body schema (a $ref into the document) lists."""
    name = schema["$ref"].rsplit("/", 1)[-1]
    return set(doc["components"]["schemas"][name].get("properties", {}))
