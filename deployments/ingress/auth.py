"""API keys: where they come from, and the check every guarded route makes."""

from __future__ import annotations

import hmac
import os
import re
from pathlib import Path
from typing import List, Optional

from starlette.requests import Request

from mtplx.api import openai as oa


def load_api_keys(env_var: Optional[str], key_file: Optional[str]) -> List[bytes]:
    """API keys from an environment variable (comma or whitespace separated) and/or a file (one
    key per line, # comments). No keys: no authentication (the loopback bind is the guard)."""
    raw: List[str] = []
    if env_var and os.environ.get(env_var):
        raw += re.split(r"[,\s]+", os.environ[env_var])
    if key_file:
        path = Path(key_file).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"api_keys_file {str(path)!r} does not exist; create it (one key per line) "
                                    f"or remove api_keys_file from the config")
        raw += [line.split("#", 1)[0] for line in path.read_text().splitlines()]
    return [k.strip().encode() for k in raw if k.strip()]


def key_matches(presented: bytes, keys: List[bytes]) -> bool:
    """Constant-time comparison against every key (no early exit that would time which matched)."""
    found = False
    for key in keys:
        found |= hmac.compare_digest(presented, key)
    return found


def authorize(request: Request, keys: List[bytes]) -> None:
    """Raise 401 unless the request carries one of `keys` ('Authorization: Bearer <key>', or
    'x-api-key: <key>' as Anthropic's clients send it). No keys configured: every request passes."""
    if not keys:
        return
    auth = request.headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    if not auth and request.headers.get("x-api-key"):
        scheme, token = "bearer", request.headers["x-api-key"]
    elif not auth:
        raise oa.unauthorized("You didn't provide an API key. Send it as 'Authorization: Bearer <key>' "
                              "(or 'x-api-key: <key>').")
    if scheme.lower() != "bearer" or not token.strip():
        raise oa.unauthorized("The Authorization header must be 'Bearer <key>'.")
    if not key_matches(token.strip().encode(), keys):
        raise oa.unauthorized("Incorrect API key provided.")
