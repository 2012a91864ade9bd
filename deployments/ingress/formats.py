"""Response formats: one class per format a row answers in (chat completion, text completion,
Anthropic message), each a body (JSON) and a stream (SSE) built from a `RowStream`'s text and
result. A format object serves one row (a completion's log-probability text offsets are per row);
the choices of an n > 1 request are merged here too."""

from __future__ import annotations

import asyncio
from typing import List, Optional

from mtplx.api import anthropic
from mtplx.api import openai as oa
from mtplx.api.errors import OpenAIError
from mtplx.api.parsing import OutputParser, openai_delta, openai_message_fields
from mtplx.api.tools import new_call_id

from .row_stream import RowResult, RowStream


def with_dropped_calls(stats: dict, parser: Optional[OutputParser]) -> dict:
    """`stats` plus `dropped_tool_calls` when the answer wrote calls it does not return (cut by its
    budget, of a function the request did not offer, past the calls allowed, arguments not an
    object): [{name, reason, arguments, index}] (index: a stream's, when it announced the call)."""
    dropped = parser.result().dropped_calls if parser is not None else []
    return dict(stats, dropped_tool_calls=[d.as_dict() for d in dropped]) if dropped else stats


class _OpenAIFormat:
    """What chat and text completions share: usage, the stream's framing ([DONE], the usage chunk
    of stream_options.include_usage, an error as the last chunk)."""

    name = ""
    stream_object = ""

    def __init__(self, run: RowStream):
        self.run = run

    # the format's own shapes
    def _logprobs(self, tokens: List[int], entries: list) -> dict:
        raise NotImplementedError

    def _body(self, text: str, result: RowResult, logprobs: Optional[dict]) -> dict:
        raise NotImplementedError

    def _chunk(self, delta, finish_reason=None, stop_reason=None, logprobs=None, **extra) -> dict:
        raise NotImplementedError

    def _opening(self) -> List[dict]:
        return []

    def _text_delta(self, text: str):
        """The delta of a piece of text; None: nothing to send yet (held back by the parser)."""
        raise NotImplementedError

    def _flush_delta(self):
        """What the parser held back until the end (None: nothing)."""
        return None

    def _end_delta(self):
        raise NotImplementedError

    def _finish(self, result: RowResult) -> tuple:
        """(finish_reason, stats) the row reports."""
        return result.finish_reason, result.stats

    # shared
    def logprobs(self) -> Optional[dict]:
        """The `logprobs` of the tokens returned since the last call (None when not asked for)."""
        if self.run.logprobs is None:
            return None
        return self._logprobs(*self.run.take_logprobs())

    @staticmethod
    def usage(result: RowResult) -> dict:
        return oa.usage(result.prompt_tokens, result.completion_tokens, result.cached_tokens)

    async def response(self) -> dict:
        text = await self.run.text()
        result = self.run.result()
        return self._body(text, result, self.logprobs())

    async def chunks(self):
        """The row's chunks up to its finish chunk; a failure ends them with the error's body."""
        try:
            for chunk in self._opening():
                yield chunk
            try:
                async for text in self.run.texts():
                    delta, logprobs = self._text_delta(text), self.logprobs()
                    if delta is not None or logprobs is not None:
                        yield self._chunk(delta if delta is not None else {}, logprobs=logprobs)
            except OpenAIError as exc:
                yield exc.body()
                return
            result = self.run.result()
            tail = self._flush_delta()
            if tail is not None:
                yield self._chunk(tail)
            finish_reason, stats = self._finish(result)
            yield self._chunk(self._end_delta(), finish_reason, result.stop_reason, self.logprobs(),
                              mtplx_stats=stats)
        finally:
            self.run.close()   # before the end: the client went away, this row only is ended

    def usage_chunk(self, usage: dict, stats: dict) -> dict:
        run = self.run
        return oa.usage_chunk(run.rid, run.created, run.model, self.stream_object, usage, stats)

    async def sse(self):
        async for chunk in self.chunks():
            yield oa.sse(chunk)
            if "error" in chunk:
                yield oa.SSE_DONE
                return
        if self.run.req.include_usage:
            result = self.run.result()
            yield oa.sse(self.usage_chunk(self.usage(result), result.stats))
        yield oa.SSE_DONE

    def _with_usage_field(self, chunk: dict) -> dict:
        if self.run.req.include_usage:
            chunk["usage"] = None
        return chunk


class ChatFormat(_OpenAIFormat):
    """A chat answer. With a thinking section or tools (the run's `OutputPlan`), its text is
    parsed: reasoning_content, content and tool_calls, streamed as they arrive; a row whose
    calls were parsed finishes with "tool_calls" (unless it ran out of budget)."""

    name = "chat"
    stream_object = "chat.completion.chunk"

    def __init__(self, run: RowStream):
        super().__init__(run)
        self.parser = OutputParser.for_plan(run.plan, new_call_id)

    def _logprobs(self, tokens, entries):
        return oa.chat_logprobs(tokens, entries, self.run.logprobs, self.run.token_bytes)

    def _finish(self, result):
        stats = with_dropped_calls(result.stats, self.parser)
        if self.parser is None or not self.parser.result().tool_calls or result.finish_reason != "stop":
            return result.finish_reason, stats
        return "tool_calls", dict(stats, finish_reason="tool_calls")

    def _body(self, text, result, logprobs):
        run, extra = self.run, None
        if self.parser is not None:
            text, extra = openai_message_fields(self.parser.parse(text, cut=result.finish_reason == "length"))
        finish_reason, stats = self._finish(result)
        return oa.chat_response(run.rid, run.created, run.model, text, finish_reason, self.usage(result),
                                stats, result.stop_reason, logprobs, extra)

    def _chunk(self, delta, finish_reason=None, stop_reason=None, logprobs=None, **extra):
        run = self.run
        return self._with_usage_field(oa.chat_chunk(run.rid, run.created, run.model, delta, finish_reason,
                                                    stop_reason, logprobs, **extra))

    def _opening(self):
        return [self._chunk({"role": "assistant", "content": ""})]

    def _text_delta(self, text):
        return {"content": text} if self.parser is None else openai_delta(self.parser.push(text))

    def _flush_delta(self):
        if self.parser is None:
            return None
        return openai_delta(self.parser.flush(cut=self.run.result().finish_reason == "length"))

    def _end_delta(self):
        return {}


class CompletionFormat(_OpenAIFormat):
    name = "completion"
    stream_object = "text_completion"

    def __init__(self, run: RowStream):
        super().__init__(run)
        self._text_offset = 0      # text_offset of the next token's logprobs

    def _logprobs(self, tokens, entries):
        out = oa.completion_logprobs(tokens, entries, self.run.logprobs, self.run.token_bytes, self._text_offset)
        self._text_offset += sum(len(t) for t in out["tokens"])
        return out

    def _body(self, text, result, logprobs):
        run = self.run
        return oa.completion_response(run.rid, run.created, run.model, text, result.finish_reason,
                                      self.usage(result), result.stats, result.stop_reason, logprobs)

    def _chunk(self, delta, finish_reason=None, stop_reason=None, logprobs=None, **extra):
        run = self.run
        return self._with_usage_field(oa.completion_chunk(run.rid, run.created, run.model, delta, finish_reason,
                                                          stop_reason, logprobs, **extra))

    def _text_delta(self, text):
        return text

    def _end_delta(self):
        return ""


class AnthropicFormat:
    """A Messages answer. Usage counts the whole prompt as input unless the request sent
    cache_control (`cache_split`); then a body splits it into cache reads and uncached input as
    Anthropic's does. A stream's counts are message_start's throughout (see MessageStream). With
    thinking or tools (the run's plan) the answer is parsed into thinking, text and tool_use
    blocks (ids toolu_...), streamed as they arrive."""

    name = "anthropic"

    def __init__(self, run: RowStream, cache_split: bool = False):
        self.run = run
        self.cache_split = cache_split
        self.parser = OutputParser.for_plan(run.plan, lambda: new_call_id("toolu_"))

    async def response(self) -> dict:
        run = self.run
        text = await run.text()
        r = run.result()
        usage = anthropic.usage(r.prompt_tokens, r.completion_tokens, r.cached_tokens if self.cache_split else 0)
        parsed = self.parser.parse(text, cut=r.finish_reason == "length") if self.parser is not None else None
        return anthropic.message_response(run.rid, run.model, text, r.end, usage,
                                          with_dropped_calls(r.stats, self.parser), parsed)

    async def sse(self):
        run, parser = self.run, self.parser
        events = anthropic.MessageStream(run.rid, run.model, len(run.spec.prompt_ids), parsed=parser is not None)
        try:
            yield events.start()
            try:
                async for text in run.texts():
                    out = events.text(text) if parser is None else events.events(parser.push(text))
                    if out:
                        yield out
            except OpenAIError as exc:
                yield events.error(exc)
                return
            r = run.result()
            tail = b"" if parser is None else events.events(parser.flush(cut=r.finish_reason == "length"))
            yield tail + events.finish(r.end, r.completion_tokens, with_dropped_calls(r.stats, parser))
        finally:
            run.close()


# ----------------------------------------------------------------------------------------------
# n > 1: the choices of one request (chat and text completions)


def choices_usage_and_stats(formats: List[_OpenAIFormat], chosen: Optional[List[int]] = None):
    """usage and mtplx_stats of a request of several rows (`chosen`: the rows returned, in order;
    all by default): the prompt counted once, every row's completion summed; the first choice's
    stats with each choice's own under "choices", and how many rows took the shared prefill rather
    than their own ("shared_prefill_rows"); with best_of, each row's cumulative log-probability."""
    chosen = list(range(len(formats))) if chosen is None else chosen
    results = [f.run.result() for f in formats]
    stats = [r.stats for r in results]
    usage = oa.usage(results[0].prompt_tokens, sum(r.completion_tokens for r in results), results[0].cached_tokens)
    merged = dict(stats[chosen[0]], n=len(chosen), choices=[stats[i] for i in chosen],
                  shared_prefill_rows=sum(bool(s.get("shared_prefill")) for s in stats))
    if len(chosen) < len(formats):
        merged.update(best_of=len(formats), cumulative_logprobs=[f.run.cumulative_logprob for f in formats],
                      chosen_rows=chosen)
    return usage, merged


async def choices_response(formats: List[_OpenAIFormat], n: int) -> dict:
    """The body of n choices from len(formats) rows: all of them, or with best_of the n rows of
    highest cumulative log-probability (vLLM's semantics)."""
    bodies = await asyncio.gather(*(f.response() for f in formats))
    runs = [f.run for f in formats]
    chosen = list(range(n)) if len(runs) == n else \
        sorted(range(len(runs)), key=lambda i: -runs[i].cumulative_logprob)[:n]
    body = dict(bodies[chosen[0]])
    body["choices"] = [dict(bodies[i]["choices"][0], index=k) for k, i in enumerate(chosen)]
    body["usage"], body["mtplx_stats"] = choices_usage_and_stats(formats, chosen)
    return body


async def choices_sse(formats: List[_OpenAIFormat]):
    """The streams of an n > 1 request's choices, interleaved as their chunks come (each chunk
    carries its choice's index); one usage chunk at the end when asked for."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, fmt):
        try:
            async for chunk in fmt.chunks():
                for choice in chunk.get("choices", ()):
                    choice["index"] = i
                queue.put_nowait(chunk)
        finally:
            queue.put_nowait(None)

    tasks = [asyncio.get_running_loop().create_task(pump(i, fmt)) for i, fmt in enumerate(formats)]
    try:
        ended = 0
        while ended < len(formats):
            chunk = await queue.get()
            if chunk is None:
                ended += 1
                continue
            yield oa.sse(chunk)
            if "error" in chunk:
                yield oa.SSE_DONE
                return
        if formats[0].run.req.include_usage:
            usage, stats = choices_usage_and_stats(formats)
            yield oa.sse(formats[0].usage_chunk(usage, stats))
        yield oa.SSE_DONE
    finally:
        for t in tasks:      # the client went away (or a choice failed): the others' rows end too
            if not t.done():
                t.cancel()
