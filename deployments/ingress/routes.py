"""Routing: Starlette's router over the ingress's routes, each route's HTTP facts (API key or
not, the tokenizer needed or not, how its request ids look, its metric tag), a request's ids and
headers, and errors in the route's shape (Anthropic's on /v1/messages routes, OpenAI's elsewhere)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Match, Route, Router

from mtplx.api import anthropic
from mtplx.api import openai as oa
from mtplx.api.errors import OpenAIError, invalid_request, route_not_found
from mtplx.api.openapi import Operation

REQUEST_ID_HEADER = "x-mtplx-request-id"                # the server's id; a client's own goes in it too
CLIENT_REQUEST_ID_ECHO = "x-mtplx-client-request-id"    # a client's own id: metadata, echoed back
_CLIENT_ID_OK = re.compile(r"^[\x21-\x7e]{1,128}$")    # printable ASCII, no spaces
ANTHROPIC_PREFIX = "/v1/messages"                       # routes that answer in Anthropic's shape
UNMATCHED_TAG = "other"                                 # the metric tag of a path no route knows


def request_id(prefix: str) -> Callable[[], str]:
    return lambda: oa.new_id(prefix)


class IngressRoute(Route):
    """A Starlette route with the ingress's facts about it. `open`: served without an API key;
    `needs_model`: its handler uses the tokenizer or model metadata; `tag`: its metric label;
    `new_id`: makes the ids of its requests. For the OpenAPI document: `summary`, `bodies` (the
    request models its body is parsed as) and `streams` (it answers SSE when asked)."""

    def __init__(self, path: str, endpoint, method: str, *, open: bool = False, needs_model: bool = False,
                 tag: Optional[str] = None, new_id: Callable[[], str] = request_id("req"), summary: str = "",
                 bodies: tuple = (), streams: bool = False):
        super().__init__(path, endpoint, methods=[method], name=tag or path)
        self.methods = {method}      # Starlette adds HEAD to GET routes; it stays refused with 405
        self.open, self.needs_model, self.new_id = open, needs_model, new_id
        self.summary, self.bodies, self.streams = summary, tuple(bodies), streams

    @property
    def tag(self) -> str:
        return self.name

    def operation(self) -> Operation:
        (method,) = self.methods
        return Operation(self.path, method, self.summary, self.bodies, self.open, self.streams,
                         anthropic=self.path.startswith(ANTHROPIC_PREFIX))


@dataclass
class RouteMatch:
    """Where a request goes: the route whose path and method match (`route`), or the route whose
    path matches with another method (`wrong_method`), or neither (404)."""

    route: Optional[IngressRoute] = None
    wrong_method: Optional[IngressRoute] = None
    params: Dict[str, str] = field(default_factory=dict)

    @property
    def known(self) -> Optional[IngressRoute]:
        return self.route or self.wrong_method

    @property
    def open(self) -> bool:
        """Served without an API key (an open path answers its 405 without one too)."""
        return self.known is not None and self.known.open

    @property
    def tag(self) -> str:
        return self.known.tag if self.known else UNMATCHED_TAG

    def raise_unless_found(self, method: str, path: str) -> IngressRoute:
        if self.route is not None:
            return self.route
        if self.wrong_method is not None:
            allowed = " or ".join(sorted(self.wrong_method.methods))
            raise OpenAIError(f"Method {method} is not allowed on {path}; use {allowed}", status=405,
                              code="method_not_allowed")
        raise route_not_found(method, path)


def match(router: Router, method: str, path: str) -> RouteMatch:
    """Starlette's matching (what `Router` does for an ASGI call), kept apart from the call so that
    the API key is checked before a 404 or 405 says anything about the routes."""
    scope = {"type": "http", "method": method, "path": path, "root_path": ""}
    found = RouteMatch()
    for route in router.routes:
        kind, child = route.matches(scope)
        if kind is Match.FULL:
            return RouteMatch(route=route, params=dict(child.get("path_params") or {}))
        if kind is Match.PARTIAL and found.wrong_method is None:
            found.wrong_method = route
    return found


def route_path(request: Request) -> str:
    """The request's path within the app (an app served under a route_prefix), without a trailing /."""
    path, root = request.url.path, request.scope.get("root_path") or ""
    if root and path.startswith(root):
        path = path[len(root):]
    return path.rstrip("/") or "/"


@dataclass
class RequestContext:
    """One request's ids: the server's (`rid`, made per route), a client's own (validated, echoed),
    and who called (the digest of its key)."""

    rid: str
    path: str
    params: Dict[str, str] = field(default_factory=dict)
    client_id: Optional[str] = None
    caller: Optional[str] = None        # a digest of the caller's API key (`auth.caller_digest`); None: no key
    authenticated: bool = False         # carries a valid key, or no key is configured
    session: Optional[str] = None       # the x-session-id header (affinity routing: deployments.router)

    @property
    def anthropic(self) -> bool:
        return self.path.startswith(ANTHROPIC_PREFIX)

    def read_client_id(self, request: Request) -> None:
        """The client's x-mtplx-request-id, if any: only metadata (echoed, in stats), never the id."""
        value = request.headers.get(REQUEST_ID_HEADER)
        if value is None:
            return
        if not _CLIENT_ID_OK.match(value):
            raise invalid_request(f"The {REQUEST_ID_HEADER} header must be 1-128 printable ASCII characters "
                                  f"without spaces", param=REQUEST_ID_HEADER)
        self.client_id = value

    def read_session(self, request: Request, header: str) -> None:
        """The client's session header, if any (1-128 printable ASCII characters, like an id)."""
        value = request.headers.get(header)
        if value is None:
            return
        if not _CLIENT_ID_OK.match(value):
            raise invalid_request(f"The {header} header must be 1-128 printable ASCII characters without spaces",
                                  param=header)
        self.session = value

    def headers(self) -> Dict[str, str]:
        out = {REQUEST_ID_HEADER: self.rid}
        if self.client_id is not None:
            out[CLIENT_REQUEST_ID_ECHO] = self.client_id
        if self.anthropic:
            out[anthropic.REQUEST_ID_HEADER] = self.rid
        return out

    def error_response(self, exc: OpenAIError) -> JSONResponse:
        body = anthropic.error_body(exc) if self.anthropic else exc.body()
        return JSONResponse(body, status_code=exc.status, headers=exc.headers)

