"""How a row ended (`End`): decided once, by the engine where the row ends, and carried unchanged
through the scheduler and the replica to the ingress, whose formats map it to each API's reason
(one table per API: `mtplx.api.openai`, `mtplx.api.anthropic`, `mtplx.api.responses`,
`deployments.metrics`).

It lives below the engine, with no import of its own, because the protocol layer and the ingress
read it too and may not import the engine (or MLX)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

EOS = "eos"                             # the model's end-of-sequence token
STOP_TOKEN = "stop_token"               # a stop token id the request asked for
STOP_STRING = "stop_string"             # a stop string the request asked for, matched in the text
LENGTH = "length"                       # its max_tokens ran out
GRAMMAR_COMPLETE = "grammar_complete"   # its grammar (structured output) allows nothing more
REPETITION = "repetition"               # the engine's literal-repetition stop (mtplx.engine.repetition)
CANCELLED = "cancelled"                 # its caller ended it (a cancel, a client gone, a raising callback)
KINDS = (EOS, STOP_TOKEN, STOP_STRING, LENGTH, GRAMMAR_COMPLETE, REPETITION, CANCELLED)
# A row whose own work raised has no End: it fails with an exception, which the replica reports as
# an error of a kind (`deployments.replica`, `_error_class`) and the ingress turns into the
# client's error in its API's shape.

# The engine's coarse reason, as `GenerationResult.finish_reason` and a result's "finish_reason"
# have always said it: every kind of stop is "stop".
_FINISH_REASON = {EOS: "stop", STOP_TOKEN: "stop", STOP_STRING: "stop", LENGTH: "length",
                  GRAMMAR_COMPLETE: "stop", REPETITION: "stop", CANCELLED: "cancelled"}
_OF_FINISH_REASON = {"stop": STOP_TOKEN, "length": LENGTH, "cancelled": CANCELLED}


@dataclass(frozen=True)
class End:
    """A row's end: its kind (one of KINDS) and what that kind needs: the token that ended it
    (EOS, STOP_TOKEN), the stop string (STOP_STRING; None where the one who ended the row did not
    say which). Frozen and plain: it pickles, and `as_dict` is its JSON-safe form."""

    kind: str
    token: Optional[int] = None
    string: Optional[str] = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"End kind {self.kind!r} is invalid: expected one of {KINDS}")
        if self.token is not None and self.kind not in (EOS, STOP_TOKEN):
            raise ValueError(f"an End of kind {self.kind!r} has no token")
        if self.string is not None and self.kind != STOP_STRING:
            raise ValueError(f"an End of kind {self.kind!r} has no stop string")

    @property
    def finish_reason(self) -> str:
        """"stop" | "length" | "cancelled": the engine's coarse reason (compatibility)."""
        return _FINISH_REASON[self.kind]

    @property
    def engine_reason(self) -> str:
        """A result's stats' "engine_finish_reason": the coarse reason, but "stop_string" for a
        stop string (compatibility: what clients have read in `mtplx_stats`)."""
        return STOP_STRING if self.kind == STOP_STRING else self.finish_reason

    def as_dict(self) -> dict:
        out: dict = {"kind": self.kind}
        if self.token is not None:
            out["token"] = self.token
        if self.string is not None:
            out["string"] = self.string
        return out

    @classmethod
    def from_dict(cls, d: dict) -> "End":
        token = d.get("token")
        return cls(d["kind"], None if token is None else int(token), d.get("string"))

    @classmethod
    def from_finish_reason(cls, reason: Optional[str]) -> "End":
        """The End of a caller's own solo runner, which reports only a coarse reason: "stop"
        reads as a stop token (it does not say which), no reason as the budget run out. A runner
        whose run failed raises instead."""
        if reason is None:
            return cls(LENGTH)
        if reason not in _OF_FINISH_REASON:
            raise ValueError(f"a solo runner's finish_reason {reason!r} is not one of "
                             f"{sorted(_OF_FINISH_REASON)}; a runner whose run failed raises")
        return cls(_OF_FINISH_REASON[reason])
