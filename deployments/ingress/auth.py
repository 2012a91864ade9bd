"""Who may call: API keys (where they come from, the check every guarded route makes, and the
caller's key as a digest the rest of the server keys its per-caller state by), and the guards a
browser needs (a web page must not drive a server on the user's loopback: the Host header against
DNS rebinding, and, with no key set, the Origin header)."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import re
from pathlib import Path
from typing import Iterable, List, Optional, Tuple
from urllib.parse import urlsplit

from starlette.requests import Request

from mtplx.api.errors import OpenAIError, unauthorized

# names a loopback server always answers to (besides any 127.0.0.0/8 or ::1 address)
LOOPBACK_NAMES = ("localhost",)


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


def auth_summary(keys: List[bytes], env_var: Optional[str], key_file: Optional[str]) -> Tuple[bool, str]:
    """(auth on, the start-up log line that says so): how many keys came from where, or why none
    did (an environment variable the config names but this process does not have, say)."""
    env = f"${env_var}" if env_var else None
    if keys:
        sources = " and ".join(s for s in (env and f"{env}", key_file and f"file {key_file}") if s)
        return True, f"mtplx ingress: API keys ON: {len(keys)} key(s) loaded from {sources}"
    if env_var and env_var not in os.environ:
        why = f"the config names {env}, which is not set in this process's environment"
    elif env_var:
        why = f"{env} is set but empty"
    else:
        why = "the config names no api_keys_env"
    why += f"; api_keys_file {key_file} holds no key" if key_file else " and no api_keys_file"
    return False, (f"mtplx ingress: API keys OFF: no key loaded ({why}); every route answers without a key, so keep "
                   f"the server on loopback")


def key_matches(presented: bytes, keys: List[bytes]) -> Optional[bytes]:
    """The key `presented` is, compared in constant time against every key (no early exit that
    would time which matched); None when it is none of them."""
    found = None
    for key in keys:
        if hmac.compare_digest(presented, key):
            found = key
    return found


def caller_digest(key: Optional[bytes]) -> Optional[str]:
    """The caller as the server keys per-caller state (who may cancel a request, the prefix cache's
    partition): a digest of its key, never the key. None: no key (no keys configured)."""
    if key is None:
        return None
    return hashlib.blake2b(key, digest_size=16, person=b"mtplx-caller").hexdigest()


def authorize(request: Request, keys: List[bytes]) -> Optional[bytes]:
    """The caller's key; 401 unless the request carries one of `keys` ('Authorization: Bearer
    <key>', or 'x-api-key: <key>' as Anthropic's clients send it). No keys configured: every
    request passes, with no key (None)."""
    if not keys:
        return None
    auth = request.headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    if not auth and request.headers.get("x-api-key"):
        scheme, token = "bearer", request.headers["x-api-key"]
    elif not auth:
        raise unauthorized("You didn't provide an API key. Send it as 'Authorization: Bearer <key>' "
                           "(or 'x-api-key: <key>').")
    if scheme.lower() != "bearer" or not token.strip():
        raise unauthorized("The Authorization header must be 'Bearer <key>'.")
    key = key_matches(token.strip().encode(), keys)
    if key is None:
        raise unauthorized("Incorrect API key provided.")
    return key


def _is_loopback(host: Optional[str]) -> bool:
    if not host:
        return False
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _hostname(value: str) -> Optional[str]:
    """The host name of a Host header ("name:port", "[::1]:port") or an Origin ("scheme://name:port")."""
    try:
        return urlsplit(value if "://" in value else f"//{value}").hostname
    except ValueError:
        return None


class BrowserGuard:
    """A web page the user visits can make the browser send requests to a server on the user's
    loopback. With DNS rebinding the page's own name resolves to 127.0.0.1, so the browser sends
    it as the Host header and lets the page read the answers. So, on a connection that arrived on
    a loopback address, the Host must name the loopback (`localhost`, a 127.0.0.0/8 or ::1 address)
    or one of `allowed_hosts` ("*": any). With no API key set, an Origin header (a page posting
    cross-origin) must name one of those, or this server's own Host. Both refusals are 403."""

    def __init__(self, allowed_hosts: Iterable[str], keys_configured: bool):
        self.allowed = {(_hostname(h) or h).lower() for h in allowed_hosts}     # "name", "name:port", "[::1]"
        self.any_host = "*" in self.allowed
        self.keys_configured = keys_configured

    def _allowed(self, name: Optional[str]) -> bool:
        return self.any_host or _is_loopback(name) or (name is not None and name.lower() in self.allowed)

    def check(self, request: Request) -> None:
        host = request.headers.get("host")
        server = request.scope.get("server")
        if server and _is_loopback(str(server[0])):
            if host is not None and not self._allowed(_hostname(host)):
                raise OpenAIError(
                    f"The Host header {host[:100]!r} is not a name this server answers to on loopback (DNS "
                    f"rebinding guard); add it to the app's allowed_hosts to serve it", status=403,
                    param="host", code="host_not_allowed")
        origin = request.headers.get("origin")
        if origin is None or self.keys_configured:
            return
        page = _hostname(origin)
        if not self._allowed(page) and (host is None or page != _hostname(host)):     # not same-origin
            raise OpenAIError(
                f"Requests from the web origin {origin[:100]!r} are refused: with no API key set only "
                f"this server's own pages, the loopback's and allowed_hosts' may call it", status=403,
                param="origin", code="origin_not_allowed")


def cache_partition(caller: Optional[str], cache_salt: Optional[str]) -> Optional[str]:
    """The prefix cache's partition a request's prompt is looked up and banked in: a digest of the
    caller (its key's digest) and the request's `cache_salt` (vLLM's field), so that one caller
    never learns from `cached_tokens` what another sent. None: the shared partition (no key
    configured and no salt)."""
    if caller is None and cache_salt is None:
        return None
    h = hashlib.blake2b(digest_size=16, person=b"mtplx-cache")
    for part in (caller or "", cache_salt or ""):
        h.update(len(part).to_bytes(8, "little") + part.encode())
    return h.hexdigest()
