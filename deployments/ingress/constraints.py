"""Whether a request's constraint can be enforced for the served model: its grammar compiled by
llguidance against the model's tokenizer (llguidance's view of it built once per ingress, on first
use, off the event loop). A grammar that does not compile is a 400 naming the request field it came
from (and the place in its JSON schema), before any row is sent."""

from __future__ import annotations

import asyncio
import logging
from typing import Optional

from mtplx.api.errors import OpenAIError, invalid_request
from mtplx.api.output_plan import OutputPlan
from mtplx.structured import ConstraintError, check_constraint, grammar_tokenizer

log = logging.getLogger("ray.serve")


def _refusal(exc: Exception, param: Optional[str], schema) -> OpenAIError:
    message = str(exc) if isinstance(exc, ConstraintError) else f"the constraint cannot be enforced: {exc}"
    return invalid_request(message, param=param, code="invalid_schema" if schema is not None else "invalid_value")


def check_plan(plan: OutputPlan, tokenizer) -> None:
    """Raise a 400 when the plan's grammar does not compile for `tokenizer` (llguidance's); when
    the whole fails, its parts are tried one by one to name the field at fault."""
    try:
        check_constraint(plan.constraint, tokenizer, None, plan.schema)
        return
    except Exception as exc:          # llguidance's refusal, whatever its class: a 400, never a 500
        whole = exc
    for constraint, param, schema in plan.parts:
        try:
            check_constraint(constraint, tokenizer, None, schema)
        except Exception as exc:
            raise _refusal(exc, param, schema) from None
    raise _refusal(whole, plan.param, plan.schema) from None


class ConstraintChecker:
    def __init__(self):
        self._tokenizer = None
        self._unavailable: Optional[str] = None     # why the grammar engine cannot read this tokenizer
        self._lock = asyncio.Lock()

    async def _grammar_tokenizer(self, tokenizer, vocab_size: Optional[int]):
        if self._tokenizer is None and self._unavailable is None:
            async with self._lock:
                if self._tokenizer is None and self._unavailable is None:
                    loop = asyncio.get_running_loop()
                    try:
                        self._tokenizer = await loop.run_in_executor(None, grammar_tokenizer, tokenizer, vocab_size)
                        log.info("mtplx ingress: the grammar engine's tokenizer is built (%d tokens)",
                                 self._tokenizer.vocab_size)
                    except Exception as exc:     # a slow (not Rust) tokenizer, say
                        log.exception("mtplx ingress: the grammar engine cannot read this model's tokenizer")
                        self._unavailable = f"{type(exc).__name__}: {exc}"
        return self._tokenizer

    async def check(self, plan: OutputPlan, tokenizer, vocab_size: Optional[int]) -> None:
        if plan.constraint is None or plan.constraint.grammar is None:
            return
        llg_tokenizer = await self._grammar_tokenizer(tokenizer, vocab_size)
        if llg_tokenizer is None:
            raise invalid_request(f"structured output is not available for this model: the grammar engine "
                                  f"cannot read its tokenizer ({self._unavailable})", param=plan.param,
                                  code="unsupported_value")
        await asyncio.get_running_loop().run_in_executor(None, check_plan, plan, llg_tokenizer)
