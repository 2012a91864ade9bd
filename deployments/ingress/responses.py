"""The Responses API's answer format: a row's text as a response object (JSON) or its typed events
(SSE), read for reasoning and function calls as chat's are, usage with reasoning and cached
tokens, and the response kept in the store (`response_store`) when the request asks for it."""

from __future__ import annotations

import logging
from typing import List, Optional

from mtplx.api import openai as oa
from mtplx.api import responses
from mtplx.api.errors import OpenAIError
from mtplx.api.output_plan import THINK_END
from mtplx.api.parsing import OutputParser
from mtplx.api.text import tokens_through
from mtplx.api.tools import new_call_id

from .formats import with_dropped_calls
from .response_store import StoredResponse
from .row_stream import RowResult, RowStream

log = logging.getLogger("ray.serve")


class ResponsesFormat:
    """One row's answer as a Responses response. `turn`: the conversation it answers (kept with
    the response, so that a later request continues it); `store`: where (None: nowhere);
    `owner`: the caller's partition of the store."""

    name = "responses"

    def __init__(self, run: RowStream, turn: responses.Turn, store=None, owner: str = ""):
        self.run = run
        self.turn = turn
        self.store = store if turn.request.stores else None
        self.owner = owner
        self.echo = turn.request.echo()
        self.parser = OutputParser.for_plan(run.plan, new_call_id)

    def _logprobs(self) -> Optional[list]:
        """The output text's log-probability entries since the last call (None: not asked for)."""
        run = self.run
        if run.logprobs is None:
            return None
        return oa.chat_logprobs(*run.take_logprobs(), run.logprobs, run.token_bytes)["content"]

    def _usage(self, r: RowResult) -> dict:
        reasoning = tokens_through(self.run.ing.tokenizer, self.run.detok.ids, THINK_END) if self.turn.plan.thinking \
            else 0
        return responses.usage(r.prompt_tokens, r.completion_tokens, r.cached_tokens, min(reasoning, r.completion_tokens))

    def _final(self, r: RowResult, output: List[dict]) -> dict:
        run = self.run
        return responses.response_object(run.rid, run.created, run.model, self.echo, responses.STATUS_OF_END[r.end.kind],
                                         output, self._usage(r), with_dropped_calls(r.stats, self.parser),
                                         responses.INCOMPLETE_REASON.get(r.end.kind))

    async def _keep(self, body: dict) -> None:
        """Store the response with its conversation; a store that fails is logged and said in
        `mtplx_stats.stored` (the answer is not lost for it)."""
        if self.store is None:
            return
        body["mtplx_stats"]["stored"] = True       # as the stored copy says it too
        try:
            await self.store.put(StoredResponse(body["id"], self.owner, float(body["created_at"]), body,
                                                self.turn.context))
        except Exception:
            log.exception("mtplx ingress: storing response %s failed", body["id"])
            body["mtplx_stats"]["stored"] = False

    async def response(self) -> dict:
        text = await self.run.text()
        r = self.run.result()
        cut = r.finish_reason == "length"
        parsed = self.parser.parse(text, cut=cut) if self.parser is not None else None
        output = responses.output_items(parsed, text, "incomplete" if cut else "completed", self._logprobs())
        body = self._final(r, output)
        await self._keep(body)
        return body

    async def sse(self):
        run, parser = self.run, self.parser
        events = responses.ResponseEvents(responses.response_object(run.rid, run.created, run.model, self.echo,
                                                                    "in_progress", []))
        try:
            yield _frames(events.start())
            try:
                async for text in run.texts():
                    out = events.push(parser.push(text) if parser is not None else [("content", text)],
                                      self._logprobs())
                    if out:
                        yield _frames(out)
            except OpenAIError as exc:
                yield responses.sse(events.error(exc))
                return
            r = run.result()
            cut = r.finish_reason == "length"
            out = events.push(parser.flush(cut=cut)) if parser is not None else []
            out += events.close("incomplete" if cut else "completed")
            body = self._final(r, events.output)
            await self._keep(body)
            yield _frames(out + [events.terminal(body)])
        finally:
            run.close()


def _frames(events: List[dict]) -> bytes:
    return b"".join(responses.sse(e) for e in events)
