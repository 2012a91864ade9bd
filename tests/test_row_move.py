"""A row moves between replicas from what its stream carried (an in-process replica, no Ray).

A replica streams a cohort of mixed settings; the stream is dropped mid-way (as the ingress
loses a replica: the replica ends those rows); each unfinished row is re-admitted from its
prompt, the tokens streamed so far and the last checkpoint that came with them, as the ingress
re-admits it on another replica (here the same one: what the row carries is all it resumes
from; tests/test_scaleout.py moves rows between processes on two nodes). Every row's tokens,
before and after the move, are exactly those it gets uninterrupted: no token lost or repeated,
greedy and seeded sampled rows alike (and a greedy row with no checkpoint at all). The stream
never carries a row's tokens past its last checkpoint.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

import process_state
from mtplx.api.rows import RowSpec
from mtplx.sampling import SamplerConfig

MAX_TOKENS = 40
CUT_AFTER = 6        # the stream is dropped once every row has this many tokens (or ended)
ROWS = [
    ("def add(a, b):\n", dict(sampler=SamplerConfig(temperature=0.0))),
    ("import os\n", dict(sampler=SamplerConfig(temperature=0.0), logprobs=2)),
    ("class Node:\n", dict(sampler=SamplerConfig(temperature=0.7, top_p=0.9), seed=11)),
    ("for i in range(3):\n", dict(sampler=SamplerConfig(temperature=0.9, top_k=20), seed=12, generation_mode="mtp")),
    ("def main():\n    ", dict(sampler=SamplerConfig(temperature=0.7, presence_penalty=0.5), seed=13)),
    ("while True:\n", dict(sampler=SamplerConfig(temperature=0.8), seed=14, generation_mode="ar")),
]


@pytest.fixture(scope="module")
def replica():
    from deployments.replica import MTPReplica

    with process_state.restored():
        rep = MTPReplica(widths=(3, 8), warmup=False, metrics=False)
        yield rep
        rep.__del__()


def _spec(rep, i: int, prompt: str, settings: dict) -> RowSpec:
    fields = {"seed": i, **settings}
    ids = tuple(rep.model.tokenizer.encode(prompt, add_special_tokens=False))
    return RowSpec(request_id=f"move-{i}", model=rep.model.model_id, prompt_ids=ids, max_tokens=MAX_TOKENS,
                   ignore_eos=True, **fields)


async def _stream(rep, specs, cut_after=None):
    """Per row: tokens, the last checkpoint (None unless it follows exactly those tokens), final;
    and whether every message's checkpoints followed exactly the row's tokens so far (those it
    resumed after included)."""
    tokens = {i: [] for i in range(len(specs))}
    before = {i: len(spec.resume_tokens) for i, spec in enumerate(specs)}
    checkpoint, finals, aligned = {}, {}, True
    gen = rep.run_cohort(specs)
    async for msg in gen:
        for i, toks in (msg.get("t") or {}).items():
            tokens[i].extend(toks)
            checkpoint[i] = None
        for i, cp in (msg.get("c") or {}).items():
            aligned &= cp.tokens == before[i] + len(tokens[i])
            checkpoint[i] = cp
        finals.update(msg.get("f") or {})
        if cut_after is not None and all(len(tokens[i]) >= cut_after or i in finals for i in tokens):
            await gen.aclose()          # the replica's stream is gone: it ends these rows
            break
    return tokens, checkpoint, finals, aligned


def test_rows_resume_after_their_streamed_tokens_with_the_same_tokens(replica):
    specs = [_spec(replica, i, prompt, settings) for i, (prompt, settings) in enumerate(ROWS)]
    alone = [asyncio.run(_stream(replica, [spec]))[0][0] for spec in specs]
    assert all(len(t) == MAX_TOKENS for t in alone)

    tokens, checkpoint, finals, aligned = asyncio.run(_stream(replica, specs, cut_after=CUT_AFTER))
    assert aligned, "a message carried a row's tokens past its checkpoint"
    moving = [i for i in range(len(specs)) if i not in finals]
    assert moving and all(checkpoint[i] is not None for i in moving)
    resumed = [dataclasses.replace(specs[i], resume_tokens=tuple(tokens[i]), checkpoint=checkpoint[i])
               for i in moving]
    more, _, finals_b, aligned_b = asyncio.run(_stream(replica, resumed))
    assert aligned_b
    for k, i in enumerate(moving):
        assert tokens[i] + more[k] == alone[i], (i, ROWS[i], len(tokens[i]))
        stats = finals_b[k]["stats"]
        assert stats["resumed_tokens"] == len(tokens[i]) and finals_b[k]["finish_reason"] == "length"
    snap = asyncio.run(replica.snapshot())
    assert snap["resumed_rows"] >= len(moving) and snap["resumed_tokens"] >= sum(len(tokens[i]) for i in moving)


def test_a_greedy_row_resumes_from_its_tokens_alone(replica):
    """No checkpoint (the stream ended before one came): a greedy row's caches take every token
    and it goes on as it would have."""
    spec = _spec(replica, 0, *ROWS[0])
    alone = asyncio.run(_stream(replica, [spec]))[0][0]
    head = alone[:9]
    rest = asyncio.run(_stream(replica, [dataclasses.replace(spec, resume_tokens=tuple(head))]))[0][0]
    assert head + rest == alone
