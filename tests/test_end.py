"""How a row ended (`mtplx.end.End`): decided once, in the engine, where the row ends; carried
unchanged through the service's result; mapped to each API's reason by one table per API."""

import pickle
import threading

import pytest

from mtplx.end import CANCELLED, EOS, KINDS, LENGTH, STOP_STRING, STOP_TOKEN, End
from references import stop_string_in

# kind -> (OpenAI finish_reason, Anthropic stop_reason, Responses status, metrics label)
REASONS = {
    "eos": ("stop", "end_turn", "completed", "stop"),
    "stop_token": ("stop", "end_turn", "completed", "stop"),
    "stop_string": ("stop", "stop_sequence", "completed", "stop"),
    "length": ("length", "max_tokens", "incomplete", "length"),
    "grammar_complete": ("stop", "end_turn", "completed", "stop"),
    "repetition": ("stop", "end_turn", "completed", "stop"),
    "cancelled": ("abort", "abort", "cancelled", "cancelled"),
}


def _end_of(kind: str) -> End:
    return End(kind, token=7 if kind in (EOS, STOP_TOKEN) else None, string="\n\n" if kind == STOP_STRING else None)


# ------------------------------------------------------------------------------------------------
# The type and its tables (no model)


@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_has_its_reason_in_each_api(kind):
    from deployments.metrics import finish_reason_label
    from mtplx.api import anthropic, responses
    from mtplx.api.openai import FINISH_REASON_OF_END

    end = _end_of(kind)
    got = (FINISH_REASON_OF_END[kind], anthropic.stop_reason(end), responses.STATUS_OF_END[kind],
           finish_reason_label(end))
    assert got == REASONS[kind]
    assert responses.INCOMPLETE_REASON.get(kind) == ("max_output_tokens" if kind == LENGTH else None)


def test_the_tables_cover_the_kinds_exactly():
    from deployments.metrics import FINISH_REASON_OF_END as METRICS
    from mtplx.api.anthropic import STOP_REASON_OF_END
    from mtplx.api.openai import FINISH_REASON_OF_END
    from mtplx.api.responses import STATUS_OF_END

    assert set(REASONS) == set(KINDS)
    for table in (METRICS, STOP_REASON_OF_END, FINISH_REASON_OF_END, STATUS_OF_END):
        assert set(table) == set(KINDS)


@pytest.mark.parametrize("kind", KINDS)
def test_the_reasons_that_carry_data_carry_the_ends(kind):
    """vLLM's stop_reason: the requested stop token id or the stop string (None for EOS and the
    rest); Anthropic's stop_sequence: the stop string; a tool call turns only an ended turn into
    "tool_use"."""
    from mtplx.api import anthropic
    from mtplx.api.openai import vllm_stop_reason

    end = _end_of(kind)
    assert vllm_stop_reason(end) == {STOP_TOKEN: 7, STOP_STRING: "\n\n"}.get(kind)
    assert anthropic.stop_sequence(end) == ("\n\n" if kind == STOP_STRING else None)
    plain = anthropic.stop_reason(end)
    assert anthropic.stop_reason(end, tool_use=True) == ("tool_use" if plain == "end_turn" else plain)


@pytest.mark.parametrize("kind", KINDS)
def test_an_end_pickles_and_round_trips_its_plain_form(kind):
    import json

    end = _end_of(kind)
    assert pickle.loads(pickle.dumps(end)) == end
    assert End.from_dict(json.loads(json.dumps(end.as_dict()))) == end


def test_the_compatibility_strings_come_from_the_end():
    assert [End(k).finish_reason for k in (EOS, LENGTH, CANCELLED, "repetition", "grammar_complete")] == \
        ["stop", "length", "cancelled", "stop", "stop"]
    assert End(STOP_STRING).finish_reason == "stop" and End(STOP_STRING).engine_reason == "stop_string"
    assert End(EOS).engine_reason == "stop"
    assert End.from_finish_reason("length") == End(LENGTH) and End.from_finish_reason(None) == End(LENGTH)
    assert End.from_finish_reason("stop") == End(STOP_TOKEN)
    with pytest.raises(ValueError, match="finish_reason 'failed' is not one of"):
        End.from_finish_reason("failed")


def test_an_end_refuses_an_unknown_kind_and_data_its_kind_has_none_of():
    with pytest.raises(ValueError, match="'bored'"):
        End("bored")
    with pytest.raises(ValueError, match="no token"):
        End(LENGTH, token=3)
    with pytest.raises(ValueError, match="no stop string"):
        End(EOS, string="x")


# ------------------------------------------------------------------------------------------------
# Decided in the engine (the shipped tiny model)

TIMEOUT = 60


def _greedy():
    from mtplx.sampling import SamplerConfig

    return SamplerConfig(temperature=0.0)


@pytest.fixture(scope="module")
def lane(model):
    from mtplx.engine.install import install_a3b_mtp_batch_lane

    return install_a3b_mtp_batch_lane(model, 3)


@pytest.fixture(scope="module")
def reference(model):
    """A prompt, its greedy tokens with no stop, and k: the index of a token not seen before it."""
    from mtplx.engine.decode import generate_ar

    prompt = model.tokenizer.encode("def add(a, b):\n    return")
    ref = generate_ar(model, prompt, max_tokens=24, sampler=_greedy(), stop_token_ids=()).tokens
    k = next(k for k in range(3, len(ref)) if ref[k] not in ref[:k])
    return prompt, ref, k


def test_the_lane_decides_each_rows_end(model, lane, reference):
    """EOS, a requested stop token, a stop string, the budget, and a removal each end their row
    with that End (the stop tokens with the token, the stop string with the string: the token
    that completed it the row's last), on the row's last event and its result."""
    from functools import partial

    from mtplx.api.text import StopStringWatch
    from mtplx.engine.lane import RunningLane
    from mtplx.engine.row import A3BMTPBatchRequest

    prompt, ref, k = reference
    t = ref[k]
    s, n = stop_string_in(model.tokenizer, ref, 2)

    def req(rid, **kw):
        return A3BMTPBatchRequest(request_id=rid, prompt_ids=prompt, sampler=_greedy(), **kw)

    running = RunningLane(lane)
    running.insert([req("eos", max_tokens=24, stop_token_ids={t}, eos_token_ids={t}),
                    req("stop", max_tokens=24, stop_token_ids={t}),
                    req("length", max_tokens=k, stop_token_ids={t}),
                    req("removed", max_tokens=24),
                    req("stop_string", max_tokens=24, stop_text=partial(StopStringWatch, model.tokenizer, [s]))])
    running.remove(["removed"])
    ends = {}
    while running.has_work:
        for e in running.step():
            if e.end is not None:
                assert e.result.end is e.end
                ends[e.request_id] = (e.end, e.result.tokens)
    assert ends["eos"] == (End(EOS, token=t), ref[:k + 1])
    assert ends["stop"] == (End(STOP_TOKEN, token=t), ref[:k + 1])
    assert ends["length"] == (End(LENGTH), ref[:k])
    assert ends["removed"] == (End(CANCELLED), [])
    assert ends["stop_string"] == (End(STOP_STRING, string=s), ref[:n])


def test_the_services_result_carries_the_engines_end(model, lane, reference):
    """Through the service: each result's "end" is the End the engine decided (a stop string
    included: the job's own, matched on its text as it decodes), its "finish_reason" and stats'
    reasons the compatibility strings of that End; a cancelled row's future fails."""
    from functools import partial

    from mtplx.api.text import StopStringWatch
    from mtplx.server.mtp_batch import MTPBatchCancelled, MTPBatchGenerationService, MTPBatchJob

    prompt, ref, k = reference
    t = ref[k]
    s, n = stop_string_in(model.tokenizer, ref, 2)
    service = MTPBatchGenerationService(model, {3: lane}, batch_wait_s=0.02)
    try:
        def job(rid, **kw):
            kw.setdefault("max_tokens", 24)
            return MTPBatchJob(request_id=rid, prompt_ids=prompt, sampler=_greedy(), seed=0,
                               compatibility_key=("tiny", "end"), **kw)

        ended = [service.submit(job("eos", stop_token_ids={t}, eos_token_ids={t})),
                 service.submit(job("stop", stop_token_ids={t})),
                 service.submit(job("length", max_tokens=k, stop_token_ids={t})),
                 service.submit(job("stop_string", stop_text=partial(StopStringWatch, model.tokenizer, [s])))]
        results = [f.result(TIMEOUT) for f in ended]
        assert [r["end"] for r in results] == [End(EOS, token=t), End(STOP_TOKEN, token=t), End(LENGTH),
                                               End(STOP_STRING, string=s)]
        assert [r["finish_reason"] for r in results] == ["stop", "stop", "length", "stop"]
        assert [r["stats"]["engine_finish_reason"] for r in results] == ["stop", "stop", "length", "stop_string"]
        assert results[3]["tokens"] == ref[:n] and not results[3]["stats"]["cancelled"]

        seen = threading.Event()
        j = job("cancelled", max_tokens=400, token_callback=lambda toks: seen.set())
        fut = service.submit(j)
        assert seen.wait(TIMEOUT) and j.cancel()
        with pytest.raises(MTPBatchCancelled):
            fut.result(TIMEOUT)
    finally:
        service.shutdown(timeout_s=30)
