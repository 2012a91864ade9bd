"""One row never ends another: faults forced inside a running lane while seven rows of mixed
settings decode beside the faulty one (greedy, with log-probabilities, sampled and seeded,
penalties, a JSON schema, plain AR, the bonus omitted).

Each fault is forced with a `RunningLane` subclass (the service's `running_lane_cls`): a sampler
that raises, a row whose hidden state goes NaN, a grammar in llguidance's error state, a verify
forward that raises once mid-cycle (after the cycle's draws), and a forward that raises whenever
one row is in the batch. Every bystander must finish with exactly the tokens it gets alone; the
faulty row fails alone with a clear error, or (the one-off forward fault) finishes as if nothing
happened.
"""

import mlx.core as mx
import numpy as np
import pytest

from mtplx.engine.install import install_a3b_mtp_batch_lane
from mtplx.engine.lane import RunningLane
from mtplx.engine.row import RowFailure
from mtplx.sampling import SamplerConfig
from mtplx.server.mtp_batch import MTPBatchGenerationService, MTPBatchJob
from mtplx.structured import Constraint, GrammarError, json_schema_grammar

TIMEOUT = 120
FAULTY = "faulty"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "size": {"type": "integer"}},
          "required": ["name", "size"]}
# (prompt, settings): the seven bystanders, then the row the fault is forced on
ROWS = [
    ("def add(a, b):\n", dict(sampler=SamplerConfig(temperature=0.0))),
    ("import os\n", dict(sampler=SamplerConfig(temperature=0.0), logprobs=2)),
    ("class Node:\n", dict(sampler=SamplerConfig(temperature=0.6, top_p=0.9), seed=11)),
    ("for i in range(3):\n", dict(sampler=SamplerConfig(temperature=0.9, top_k=20, min_p=0.02), seed=12)),
    ("def main():\n    ", dict(sampler=SamplerConfig(temperature=0.7, presence_penalty=0.5, frequency_penalty=0.3),
                               seed=13)),
    ("x = {", dict(sampler=SamplerConfig(temperature=0.0), constraint="json")),
    ("while True:\n", dict(sampler=SamplerConfig(temperature=0.8), seed=14, speculative=False)),
    ("# utils\ndef f(x):\n", dict(sampler=SamplerConfig(temperature=0.0), omit_speculative_bonus=True)),
]
FAULTY_ROW = ("def fibonacci(n):\n", dict(sampler=SamplerConfig(temperature=0.8, top_p=0.95), seed=7))
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def lanes(model):
    return {w: install_a3b_mtp_batch_lane(model, w) for w in (3, 8)}


def _job(model, i, prompt, settings, rid=None):
    settings = dict(settings)
    if settings.pop("constraint", None) == "json":
        settings["constraint"] = Constraint(json_schema_grammar(SCHEMA), "json_schema")
    return MTPBatchJob(request_id=rid or f"row-{i}", prompt_ids=model.tokenizer.encode(prompt),
                       max_tokens=MAX_TOKENS, compatibility_key=("tiny",), **settings)


def _run(model, lanes, jobs, lane_cls=RunningLane):
    service = MTPBatchGenerationService(model, lanes, batch_wait_s=0.02, running_lane_cls=lane_cls)
    try:
        futures = service.submit_cohort(jobs)
        outcomes = []
        for f in futures:
            try:
                outcomes.append(f.result(TIMEOUT))
            except Exception as exc:
                outcomes.append(exc)
        service.call_on_owner(lambda: None).result(TIMEOUT)
        return outcomes, service.snapshot()
    finally:
        service.shutdown(timeout_s=30)


@pytest.fixture(scope="module")
def alone(model, lanes):
    """Each bystander's tokens (and log-probability entries) decoded alone."""
    out = []
    for i, (prompt, settings) in enumerate(ROWS):
        tokens = []
        entries = []

        def keep(toks, lps=None, tokens=tokens, entries=entries):
            tokens.extend(toks)
            entries.extend(lps or [])

        job = _job(model, i, prompt, settings)
        job.token_callback = keep
        (result,), _ = _run(model, lanes, [job])
        out.append((result["tokens"], tokens, entries))
    return out


def _cohort(model):
    jobs = [_job(model, i, prompt, settings) for i, (prompt, settings) in enumerate(ROWS)]
    return jobs + [_job(model, len(ROWS), *FAULTY_ROW, rid=FAULTY)]


def _check_bystanders(outcomes, alone):
    for i, (outcome, (tokens, _, _)) in enumerate(zip(outcomes, alone)):
        assert not isinstance(outcome, Exception), f"bystander {i} ({ROWS[i]}) failed: {outcome!r}"
        assert outcome["tokens"] == tokens, f"bystander {i} ({ROWS[i]}) differs from its tokens alone"


class _Faulty(RunningLane):
    """Finds the faulty row's slot; subclasses force their fault through it."""

    def faulty_slot(self):
        return next((b for b, r in enumerate(self.rows) if r is not None and r.req.request_id == FAULTY), None)

    def faulty_row(self):
        return next((r for r in self._all_rows() if r.req.request_id == FAULTY), None)


class RaisingSampler(_Faulty):
    """The faulty row's sampler raises on its sixth distribution."""

    def add(self, req):
        result = super().add(req)
        row = self.admitter.waiting[-1]
        if req.request_id == FAULTY:
            calls = [0]
            dist = row.dist

            def raising(*args, **kwargs):
                calls[0] += 1
                if calls[0] == 6:
                    raise ValueError("the sampler's probabilities do not sum to 1")
                return dist(*args, **kwargs)

            row.dist = raising
        return result


class NaNRow(_Faulty):
    """The faulty row's hidden state goes NaN in a verify once it has emitted a few tokens."""

    def _forwards(self):
        forwards = super()._forwards()
        if not getattr(forwards, "poisoned", False):
            verify = forwards.verify

            def poisoned(tokens, graph=None):
                H, L = verify(tokens, graph=graph)
                b = self.faulty_slot()
                if b is not None and len(self.rows[b].result.tokens) >= 5:
                    row = (mx.arange(H.shape[0]) == b)[:, None, None]
                    H, L = mx.where(row, mx.array(np.nan, H.dtype), H), mx.where(row, mx.array(np.nan, L.dtype), L)
                return H, L

            forwards.verify, forwards.poisoned = poisoned, True
        return forwards


class BrokenGrammar(_Faulty):
    """The faulty row's grammar is pushed into llguidance's error state after its fourth token."""

    def add(self, req):
        result = super().add(req)
        row = self.admitter.waiting[-1]
        if req.request_id == FAULTY:
            consume = row.grammar.consume

            def consume_then_break(token):
                consume(token)
                if row.grammar.committed == 4:
                    allowed = row.grammar.allowed()
                    row.grammar.matcher.consume_token(int(np.flatnonzero(~allowed)[0]))

            row.grammar.consume = consume_then_break
        return result


class ForwardFailsOnce(_Faulty):
    """The verify forward raises once, mid-cycle: after the cycle's primaries and drafts were drawn
    (each sampled row's RNG has moved), before any row's decisions."""

    failed = []

    def _forwards(self):
        forwards = super()._forwards()
        if not getattr(forwards, "flaky", False):
            verify = forwards.verify

            def flaky(tokens, graph=None):
                if not ForwardFailsOnce.failed and self.counters.cycles >= 4 and self.faulty_slot() is not None:
                    ForwardFailsOnce.failed.append(self.counters.cycles)
                    raise RuntimeError("device lost")
                return verify(tokens, graph=graph)

            forwards.verify, forwards.flaky = flaky, True
        return forwards


class ForwardFailsWithRow(_Faulty):
    """Every forward that holds the faulty row past its fourth token raises (nobody is blamed)."""

    def _forwards(self):
        forwards = super()._forwards()
        if not getattr(forwards, "broken", False):
            verify = forwards.verify

            def broken(tokens, graph=None):
                b = self.faulty_slot()
                if b is not None and len(self.rows[b].result.tokens) >= 4:
                    raise RuntimeError("a kernel failed on this batch")
                return verify(tokens, graph=graph)

            forwards.verify, forwards.broken = broken, True
        return forwards


@pytest.mark.parametrize("lane_cls, error, message", [
    (RaisingSampler, RowFailure, "do not sum to 1"),
    (NaNRow, RowFailure, "non-finite"),
])
def test_a_row_whose_own_work_fails_ends_alone(model, lanes, alone, lane_cls, error, message):
    outcomes, snap = _run(model, lanes, _cohort(model), lane_cls)
    _check_bystanders(outcomes, alone)
    assert isinstance(outcomes[-1], error) and message in str(outcomes[-1])
    assert FAULTY in str(outcomes[-1])
    assert snap["rows_failed"] == 1 and snap["lanes_rebuilt"] == 1 and snap["driver_errors"] == 0


def test_a_grammar_in_its_error_state_fails_its_row(model, lanes, alone):
    jobs = _cohort(model)
    jobs[-1] = _job(model, len(ROWS), "x = {", dict(sampler=SamplerConfig(temperature=0.0), constraint="json"),
                    rid=FAULTY)
    outcomes, snap = _run(model, lanes, jobs, BrokenGrammar)
    _check_bystanders(outcomes, alone)
    failure = outcomes[-1]
    assert isinstance(failure, RowFailure) and isinstance(failure.__cause__, GrammarError), failure
    assert "grammar failed" in str(failure)
    assert snap["rows_failed"] == 1


def test_a_forward_that_fails_once_fails_nobody(model, lanes, alone):
    """Every row, the one beside which it failed included, resumes from its last completed step
    with its own RNG where it was: greedy and seeded sampled rows produce what they would have."""
    faulty_alone, = _run(model, lanes, [_job(model, len(ROWS), *FAULTY_ROW, rid=FAULTY)])[0]
    ForwardFailsOnce.failed.clear()
    outcomes, snap = _run(model, lanes, _cohort(model), ForwardFailsOnce)
    assert ForwardFailsOnce.failed, "the fault was never forced"
    _check_bystanders(outcomes, alone)
    assert outcomes[-1]["tokens"] == faulty_alone["tokens"]
    assert snap["driver_errors"] == 1 and snap["lanes_rebuilt"] == 1 and snap["rows_failed"] == 0


def test_streams_see_no_lost_or_repeated_token_across_a_rebuild(model, lanes, alone):
    """What the token callbacks saw (the stream) is the row's tokens, entries included."""
    ForwardFailsOnce.failed.clear()
    jobs = _cohort(model)
    seen = [([], []) for _ in jobs]
    for job, (tokens, entries) in zip(jobs, seen):
        job.token_callback = lambda toks, lps=None, tokens=tokens, entries=entries: (
            tokens.extend(toks), entries.extend(lps or []))
    outcomes, _ = _run(model, lanes, jobs, ForwardFailsOnce)
    assert ForwardFailsOnce.failed
    for i, ((tokens, entries), (_, streamed_alone, entries_alone)) in enumerate(zip(seen, alone)):
        assert tokens == streamed_alone, f"row {i}'s stream differs from its stream alone"
        # one entry per token, none lost or repeated; values as alone up to float32 rounding
        # (alone the row runs at width 1: other products)
        assert len(entries) == len(entries_alone)
        for got, want in zip(entries, entries_alone):
            assert [t for t, _ in got[1]] == [t for t, _ in want[1]]
            assert np.allclose([got[0], *(v for _, v in got[1])], [want[0], *(v for _, v in want[1])], atol=1e-4)


def test_a_row_that_breaks_every_batch_fails_alone_after_isolation(model, lanes, alone):
    """Nobody is blamed for the first fault: every row resumes in a rebuilt lane, as suspects.
    The second unblamed fault isolates the suspects, one lane each: the faulty row fails in its
    own, the others finish alone."""
    outcomes, snap = _run(model, lanes, _cohort(model), ForwardFailsWithRow)
    _check_bystanders(outcomes, alone)
    assert isinstance(outcomes[-1], RuntimeError) and "kernel failed" in str(outcomes[-1])
    assert snap["driver_errors"] == 2 and snap["rows_failed"] == 1 and snap["lanes_rebuilt"] == 3
