"""Errors in OpenAI's shape, {"error": {"message", "type", "param", "code"}}, by HTTP status (the
Anthropic routes reshape them, `mtplx.api.anthropic.error_body`), and a validation failure or a
body that is not JSON as the 400 that names the field. No MLX (the ingress imports this module)."""

from __future__ import annotations

import json
import random
import re
from typing import Dict, Optional, Sequence, Union

from pydantic import ValidationError

from mtplx.sampling import shown_value


class OpenAIError(Exception):
    """An error answered to the client as {"error": {...}} with an HTTP status."""

    def __init__(self, message: str, *, status: int = 400, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None,
                 headers: Optional[Dict[str, str]] = None):
        super().__init__(message)
        self.message = message
        self.status = int(status)
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(message: str, *, type: str = "invalid_request_error", param: Optional[str] = None,
               code: Optional[str] = None) -> dict:
    return {"error": {"message": str(message), "type": type, "param": param, "code": code}}


def invalid_request(message: str, param: Optional[str] = None, code: Optional[str] = None) -> OpenAIError:
    return OpenAIError(message, status=400, param=param, code=code)


def model_not_found(model: str, served: Sequence[str]) -> OpenAIError:
    return OpenAIError(f"The model {model!r} does not exist; this server serves {list(served)}",
                       status=404, param="model", code="model_not_found")


def route_not_found(method: str, path: str) -> OpenAIError:
    return OpenAIError(f"No route for {method} {path}", status=404, type="not_found_error",
                       code="not_found")


def context_length_exceeded(prompt_tokens: int, max_tokens: int, max_context: int,
                            param: str = "max_tokens") -> OpenAIError:
    return OpenAIError(
        f"This model's maximum context length is {max_context} tokens. However, you requested "
        f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, {max_tokens} for the "
        f"completion). Please reduce the prompt or max_tokens.",
        status=400, param=param, code="context_length_exceeded")


def internal_error(request_id: Optional[str] = None) -> OpenAIError:
    """A bug of ours. The client learns only that, and the id to quote; the details go to the log."""
    ref = f" (request id {request_id})" if request_id else ""
    return OpenAIError(f"The server had an internal error while processing the request{ref}; "
                       f"the server log has the details", status=500, type="server_error", code="internal_error")


def _retry_headers(retry_after_s: Optional[float], spread: bool = False) -> Dict[str, str]:
    """Retry-After in whole seconds (at least 1). `spread`: a random whole number of seconds from
    the delay to twice it, so that clients refused together do not all come back together."""
    if not retry_after_s:
        return {}
    seconds = max(1, int(-(-float(retry_after_s) // 1)))
    return {"retry-after": str(random.randint(seconds, 2 * seconds) if spread else seconds)}


def unavailable(message: str, retry_after_s: Optional[float] = None) -> OpenAIError:
    """503: no model replica can serve now (restarting, shut down); retry after the given delay."""
    return OpenAIError(message, status=503, type="server_error", code="service_unavailable",
                       headers=_retry_headers(retry_after_s))


def overloaded(message: str, retry_after_s: float, status: int = 429) -> OpenAIError:
    """429 (or 503, as configured): a bounded queue is full; answered at once with Retry-After."""
    return OpenAIError(message, status=status, type="server_error" if status == 503 else "rate_limit_error",
                       code="server_overloaded", headers=_retry_headers(retry_after_s, spread=True))


def unauthorized(message: str) -> OpenAIError:
    return OpenAIError(message, status=401, type="invalid_request_error", code="invalid_api_key",
                       headers={"www-authenticate": "Bearer"})


_UNION_TAG = re.compile(r"^(str|int|float|bool|none|dict|list|[a-z_-]+\[.*\])$")


_JSON_POSITION = re.compile(r"at line (\d+) column (\d+)")
_JSON_KEY = re.compile(rb'"((?:[^"\\]|\\.)*)"\s*:')


def _key_before(raw: bytes, error: str) -> Optional[str]:
    """The last object key before where the JSON parser stopped (a number out of range, say): the
    field the body could not be read at."""
    at = _JSON_POSITION.search(error)
    if not raw or at is None:
        return None
    lines = raw.split(b"\n")
    line, column = int(at.group(1)), int(at.group(2))
    offset = sum(len(x) + 1 for x in lines[:line - 1]) + column
    keys = _JSON_KEY.findall(raw[:offset])
    return keys[-1].decode("utf-8", "replace") if keys else None


def from_validation_error(exc: ValidationError, raw: Optional[bytes] = None) -> OpenAIError:
    """The first pydantic error as a 400 naming the offending field (`raw`: the body, to name
    where a body that is not JSON stopped being read)."""
    errors = exc.errors(include_url=False)
    if not errors:
        return invalid_request(str(exc))
    err = errors[0]
    # a union's member tags ("str", "list[str]", "function-after[...]") are not part of the field path
    loc = [str(p) for p in err.get("loc", ()) if p not in ("body",) and not _UNION_TAG.match(str(p))]
    param = ".".join(loc) or None
    msg = err.get("msg", "invalid value")
    if msg.startswith("Value error, "):   # our own validators' messages read better without it
        msg = msg[len("Value error, "):]
    if err.get("type") == "json_invalid":
        error = str(err.get("ctx", {}).get("error", msg))
        param = _key_before(raw, error)
        return invalid_request(f"The request body is not valid JSON: {error}"
                               + (f" (in {param!r})" if param else ""), param=param, code="invalid_json")
    if err.get("type") == "extra_forbidden":
        return invalid_request(f"Unrecognized request argument supplied: {param}", param=param,
                               code="unknown_parameter")
    if err.get("type") == "missing":
        return invalid_request(f"Missing required parameter: {param!r}", param=param,
                               code="missing_required_parameter")
    extra = f" (got {shown_value(err['input'])})" if "input" in err and not isinstance(err["input"], (dict, list)) \
        else ""
    where = f"for {param!r}" if param else "in the request body"
    return invalid_request(f"Invalid value {where}: {msg}{extra}", param=param, code="invalid_value")


def client_json(text: Union[str, bytes], param: Optional[str] = None, what: str = "the request body",
                code: str = "invalid_json"):
    """A JSON value a client sent as text (a schema given as a string, say); a 400 naming `param`
    when it is not JSON or nests deeper than Python's parser goes (never a RecursionError)."""
    try:
        return json.loads(text)
    except RecursionError:
        raise invalid_request(f"{what} nests too deeply to be read", param=param, code=code) from None
    except ValueError as exc:
        raise invalid_request(f"{what} is not valid JSON: {exc}", param=param, code=code) from None
