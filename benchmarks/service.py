"""What the service costs on top of the lane it drives: one greedy cohort through the service
(concurrent submits) against the same cohort given to the lane directly, on the same owner thread.
`bench_service_overhead` builds the service and calls `measure_overhead`."""

from __future__ import annotations

import statistics
import time
from typing import Optional

from mtplx.api.rows import mtp_batch_compatibility_key
from mtplx.sampling import SamplerConfig
from mtplx.scheduler.config import DEFAULT_BATCH_WAIT_S, MAX_COHORT_ROWS
from mtplx.scheduler.job import MTPBatchJob
from mtplx.server.mtp_batch import MTPBatchGenerationService

_BENCH_PROMPTS = (
    "def fibonacci(n):\n",
    "class Stack:\n    def __init__(self):\n",
    "import os\n\ndef list_files(path):\n",
    "def parse_args(argv):\n    parser = ",
    "for i in range(10):\n    if i % 2 == 0:\n",
    "def read_json(path):\n    with open(path) as f:\n",
    "class Point:\n    def __init__(self, x, y):\n",
    "def merge_sort(items):\n    if len(items) <= 1:\n",
)


def measure_overhead(service, model, n_prompts: int = 8, min_tokens: int = 128, max_tokens: int = 256,
                     rounds: int = 3) -> dict:
    """Aggregate tok/s of one greedy cohort through `service` (``n_prompts`` concurrent submits)
    vs the lane called directly on the same cohort (on the same owner thread), median of
    ``rounds``, interleaved. Stop tokens are off so both arms decode the same token counts
    (budgets spread evenly over [min_tokens, max_tokens]). Returns a dict; ``overhead_pct`` is the
    aggregate tok/s lost through the service."""
    from mtplx.engine.cohort import generate_a3b_mtp_batch
    from mtplx.engine.row import A3BMTPBatchRequest

    if not 2 <= n_prompts <= MAX_COHORT_ROWS:
        raise ValueError(f"n_prompts={n_prompts} must be in [2, {MAX_COHORT_ROWS}]")
    greedy = SamplerConfig(temperature=0.0)
    prompts = [model.tokenizer.encode(_BENCH_PROMPTS[i % len(_BENCH_PROMPTS)]) for i in range(n_prompts)]
    step = (max_tokens - min_tokens) / max(n_prompts - 1, 1)
    budgets = [int(round(min_tokens + i * step)) for i in range(n_prompts)]
    total = sum(budgets)
    key = mtp_batch_compatibility_key(model.model_id)

    def direct():
        fixed_width, lane = service.ladder.lane_for_real_width(n_prompts)
        reqs = [A3BMTPBatchRequest(request_id=str(i), prompt_ids=tuple(p), sampler=greedy, seed=i,
                                   max_tokens=m) for i, (p, m) in enumerate(zip(prompts, budgets))]
        t0 = time.perf_counter()
        res = generate_a3b_mtp_batch(lane, reqs)
        wall = time.perf_counter() - t0
        return wall, [s.tokens for s in res.streams]

    def through_service():
        jobs = [MTPBatchJob(request_id=f"bench-{i}", prompt_ids=p, max_tokens=m, sampler=greedy,
                            seed=i, stop_token_ids=(), token_callback=lambda toks: None,
                            compatibility_key=key)
                for i, (p, m) in enumerate(zip(prompts, budgets))]
        t0 = time.perf_counter()
        futures = [service.submit(j) for j in jobs]
        results = [f.result() for f in futures]
        wall = time.perf_counter() - t0
        return wall, [r["tokens"] for r in results], results

    service.call_on_owner(direct).result()        # warm-up (allocations, caches)
    direct_walls, service_walls, same_tokens = [], [], True
    decode_tok_s = []
    for _ in range(rounds):
        d_wall, d_tokens = service.call_on_owner(direct).result()
        s_wall, s_tokens, results = through_service()
        direct_walls.append(d_wall)
        service_walls.append(s_wall)
        same_tokens &= d_tokens == s_tokens
        decode_tok_s.append(sum(r["stats"]["decode_tok_s"] for r in results))
    d_med, s_med = statistics.median(direct_walls), statistics.median(service_walls)
    direct_tps, service_tps = total / d_med, total / s_med
    return {
        "n_prompts": n_prompts, "budgets": budgets, "completion_tokens": total, "rounds": rounds,
        "fixed_width": service.ladder.lane_for_real_width(n_prompts)[0], "batch_wait_s": service.batch_wait_s,
        "direct_wall_s": direct_walls, "service_wall_s": service_walls,
        "direct_tok_s": direct_tps, "service_tok_s": service_tps,
        "overhead_pct": 100.0 * (1.0 - service_tps / direct_tps),
        "sum_row_decode_tok_s_median": statistics.median(decode_tok_s),
        "identical_tokens": bool(same_tokens),
        "service_snapshot": service.snapshot(),
    }


def bench_service_overhead(model, n_prompts: int = 8, min_tokens: int = 128, max_tokens: int = 256,
                           rounds: int = 3, width: int = 8, batch_wait_s: float = DEFAULT_BATCH_WAIT_S,
                           service: Optional[MTPBatchGenerationService] = None) -> dict:
    """Aggregate tok/s of one greedy cohort through the service vs the lane called directly
    (`measure_overhead`), on a service of its own at `width` unless given."""
    own = service is None
    if own:
        service = MTPBatchGenerationService.for_model(model, widths=(width,), batch_wait_s=batch_wait_s)
    try:
        return measure_overhead(service, model, n_prompts=n_prompts, min_tokens=min_tokens,
                                max_tokens=max_tokens, rounds=rounds)
    finally:
        if own:
            service.shutdown()
