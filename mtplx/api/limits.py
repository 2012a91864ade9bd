"""What the served model and this server bound in a request, checked where the request is parsed
(`RequestLimits`, the request models' validation context): token ids within the vocabulary, token
counts within the context window, rows within a batch window, and numbers the engine's float32 and
int32 columns hold. A violation is a 400 naming the field. No MLX (the ingress imports this module)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from pydantic import BaseModel, PrivateAttr, ValidationInfo, model_validator

from mtplx.api.errors import invalid_request
from mtplx.sampling import FLOAT32_TINY, TOP_K_MAX, shown_value

MAX_STOP_STRINGS = 4
# A stop string is held back while the text may be its start: matching costs the square of its
# length for every token of the row, on the ingress's event loop.
MAX_STOP_STRING_CHARS = 256
MAX_TOP_LOGPROBS = 20
INT32_MAX = 2 ** 31 - 1
# Tool calls one answer may make when its request allows parallel calls (the app's max_tool_calls):
# a forced choice's grammar ends the answer after this many, an unforced answer's further calls
# are dropped (mtplx.api.parsing)
DEFAULT_MAX_TOOL_CALLS = 16


@dataclass(frozen=True)
class RequestLimits:
    """The bounds a request is parsed against (pydantic's validation context): the model's
    vocabulary (token ids), its context window (token counts: max_tokens, thinking budgets), the
    rows one request may ask for (n, best_of: one batch window) and the tool calls one answer may
    make. None: not bounded by it (the request models are then checked only against the fixed
    ranges; tool calls against DEFAULT_MAX_TOOL_CALLS)."""

    vocab_size: Optional[int] = None
    max_context: Optional[int] = None
    max_rows: Optional[int] = None
    max_tool_calls: Optional[int] = None

    @property
    def tool_calls(self) -> int:
        return self.max_tool_calls or DEFAULT_MAX_TOOL_CALLS


NO_LIMITS = RequestLimits()


def request_limits(info: ValidationInfo) -> RequestLimits:
    return info.context if isinstance(info.context, RequestLimits) else NO_LIMITS


def check_token_count(value: Optional[int], name: str, limits: RequestLimits) -> Optional[int]:
    """A count of tokens (max_tokens, a thinking budget): at most the model's context window."""
    bound = limits.max_context or INT32_MAX
    if value is not None and value > bound:
        where = f"the model's context window of {bound} tokens" if limits.max_context else f"{bound}"
        raise ValueError(f"{name}={shown_value(value)} is above {where}; ask for at most {bound}")
    return value


def check_token_ids(ids, name: str, limits: RequestLimits):
    """Token ids: each in [0, vocabulary size)."""
    vocab = limits.vocab_size or INT32_MAX + 1
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise ValueError(f"token id {shown_value(bad)} in {name} is outside the vocabulary [0, {vocab})")
    return ids


def check_top_p(value: Optional[float]) -> Optional[float]:
    """0 (the heaviest token only) or a top_p the device's float32 holds as a positive number."""
    if value is not None and 0.0 < value < FLOAT32_TINY:
        raise ValueError(f"top_p={value!r} is below {FLOAT32_TINY:.8g}, float32's smallest normal number (the "
                         f"engine's float32 would keep no token); send 0 for greedy decoding or at least that")
    return value


def check_top_k(value: Optional[int]) -> Optional[int]:
    """At most int32's largest (as vLLM reads it, a top_k at or above the vocabulary keeps every
    token: `sampler_from_request` turns it into 0)."""
    if value is not None and value > TOP_K_MAX:
        raise ValueError(f"top_k={shown_value(value)} is above {TOP_K_MAX}; any top_k at or above the vocabulary size keeps "
                         f"every token, as 0 and -1 do")
    return value


def check_stop_strings(items: List[str]) -> List[str]:
    """Stop strings (OpenAI's `stop`, Anthropic's `stop_sequences`): at most MAX_STOP_STRINGS, each
    non-empty and at most MAX_STOP_STRING_CHARS characters."""
    if len(items) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop sequences are allowed, got {len(items)}")
    if any(s == "" for s in items):
        raise ValueError("stop sequences must be non-empty strings")
    longest = max((len(s) for s in items), default=0)
    if longest > MAX_STOP_STRING_CHARS:
        raise ValueError(f"a stop sequence is at most {MAX_STOP_STRING_CHARS} characters, got one of {longest}")
    return items


MAX_ROWS = 64        # rows one request may ask for when no server bounds it (AppArgs' widest batch window)


def check_rows(value: int, name: str, limits: RequestLimits) -> None:
    """Rows one request asks for (n, best_of): they travel in one batch window to one replica."""
    bound = limits.max_rows or MAX_ROWS
    if value > bound:
        raise invalid_request(f"{name}={shown_value(value)} is above this server's limit of {bound} rows per request (its "
                              f"batch window holds {bound} rows)", param=name, code="invalid_value")


class BoundedRequest(BaseModel):
    """A request model parsed against `RequestLimits` (its validation context), kept for the
    checks that need the whole request (`checks()`)."""

    _limits: RequestLimits = PrivateAttr(default=NO_LIMITS)

    @model_validator(mode="after")
    def _keep_limits(self, info: ValidationInfo):
        self._limits = request_limits(info)
        return self

    def checks(self) -> None:
        pass
