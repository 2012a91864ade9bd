"""Installing a lane: bind it to the model at one width, prove its mechanism at real shapes
(`run_selfcheck`), and measure what its steps cost on this machine (`measure_step_costs`)."""

from __future__ import annotations

import time
from typing import Optional

import mlx.core as mx
import numpy as np

from mtplx.engine.cohort import generate_a3b_mtp_batch
from mtplx.engine.decode import generate_ar
from mtplx.engine.installed import (DEPTH, DEPTHS, MAX_WIDTH, MIN_WIDTH, NUMERICS_PROFILES, VERIFY_T,
                                    InstalledA3BMTPBatchLane, new_lane, solo_lane)
from mtplx.engine.lane import RunningLane, draft_acceptance_prior
from mtplx.engine.proposer import ScriptedProposer
from mtplx.engine.row import A3BMTPBatchRequest
from mtplx.engine.decisions import DecisionLog
from mtplx.models.cache import RaggedKVCache, commit_rows
from mtplx.sampling import GREEDY

MEASURE_BUDGET_S = 4.0       # a lane's step-cost measurement stops past this, once it has ...
MIN_MEASURE_ROUNDS = 2       # ... this many rounds (the first warms up and is not counted)


class LaneSelfCheckError(RuntimeError):
    """The lane's self-check failed; the lane was not installed. `receipt` names the failed checks."""

    def __init__(self, message: str, receipt: Optional[dict] = None):
        super().__init__(message)
        self.receipt = receipt or {}


def install_a3b_mtp_batch_lane(model, width: int = 8, numerics: str = "throughput",
                               selfcheck: bool = True, compiled: Optional[bool] = None,
                               depth: int = DEPTH, graphs: Optional[dict] = None) -> InstalledA3BMTPBatchLane:
    """Bind a fixed-width cohort lane to a model, after a numerical self-check at real shapes.
    `depth`: drafts a cycle chains (1-3; the self-check's injected cycles draft one). `graphs`:
    compiled graphs to share with a lane of this width at another depth (`new_lane`)."""
    if getattr(model, "mtp", None) is None:
        raise ValueError(f"cannot install an MTP batch lane: the model has no MTP head "
                         f"({getattr(model, 'mtp_disabled_reason', 'no mtp.* weights')})")
    if isinstance(width, bool) or not isinstance(width, int) or not MIN_WIDTH <= width <= MAX_WIDTH:
        raise ValueError(f"width={width!r} is invalid: must be an integer in [{MIN_WIDTH}, {MAX_WIDTH}]")
    if numerics not in NUMERICS_PROFILES:
        raise ValueError(f"numerics={numerics!r} is invalid: choose one of {NUMERICS_PROFILES}")
    if isinstance(depth, bool) or depth not in DEPTHS:
        raise ValueError(f"depth={depth!r} is invalid: a lane chains {' or '.join(map(str, DEPTHS))} drafts")
    lane = new_lane(model, width, numerics, {"skipped": True}, compiled, depth, graphs)
    if selfcheck:
        receipt = run_selfcheck(lane)
        if not receipt["ok"]:
            raise LaneSelfCheckError(
                f"lane {lane.route_id} refused to install: failed self-check "
                f"{', '.join(receipt['failed_checks'])}: {receipt['failures']}", receipt)
        object.__setattr__(lane, "selfcheck", receipt)
        # what "auto" rows and lanes start from, measured now rather than in a request's time
        measure_step_costs(lane)
        # measured unless both kinds were (the self-check's references seed its AR cost only)
        if not {"mtp", "ar"} <= solo_lane(model, compiled=compiled).step_costs.keys():
            measure_step_costs(solo_lane(model, compiled=compiled))
        draft_acceptance_prior(model)
    return lane


def measure_step_costs(lane: InstalledA3BMTPBatchLane, rounds: int = 8, block: int = 3,
                       budget_s: float = MEASURE_BUDGET_S) -> dict:
    """Seconds per MTP cycle and per plain AR step at the lane's width, measured on this machine:
    a full lane of greedy rows runs blocks of `block` steps of each kind in turn; the first round
    warms up (first use of each shape), and the first step of a block carries the switch (owed
    history written, the other kind's lazy commit), so neither is counted. What the StepPolicy
    compares is the ratio, so it is taken round by round (an MTP block over the AR block beside
    it: a load that comes and goes between rounds cancels) and its median kept, at least 1 (an
    MTP cycle does an AR step's work and more); medians of each kind alone swung with the
    machine's load. `lane.step_costs` gets
    the median AR step and the MTP cycle at that ratio; running lanes then keep both current.
    Past `budget_s` it stops after MIN_MEASURE_ROUNDS rounds: a model whose step takes a second
    (Gemma 3 270M at width 32 on a CPU) would otherwise take minutes per lane at a replica's start,
    and a step that long is timed well by fewer rounds."""
    running = RunningLane(lane, prefill_budget=None)
    prompt = tuple(3 + i % (lane.model.vocab_size - 3) for i in range(16))
    for b in range(lane.width):
        running.add(A3BMTPBatchRequest(request_id=f"measure-{b}", prompt_ids=prompt,
                                       max_tokens=3 * block * rounds + 8))
    running.admit_all()
    times = {"mtp": [], "ar": []}
    start, done = time.perf_counter(), 0
    while done < rounds and (done < MIN_MEASURE_ROUNDS or time.perf_counter() - start < budget_s):
        for i in range(2 * block):
            kind = "mtp" if i < block else "ar"
            t0 = time.perf_counter()
            running._run_step(kind)
            mx.eval(running.state.logits_last, running.state.h_last)
            if i % block and done:
                times[kind].append(time.perf_counter() - t0)
        done += 1
    running.cancel_all()
    per_round = {k: np.median(np.reshape(v, (done - 1, block - 1)), axis=1) for k, v in times.items()}
    ratio = max(1.0, float(np.median(per_round["mtp"] / per_round["ar"])))
    ar = float(np.median(times["ar"]))
    lane.step_costs.update(mtp=ratio * ar, ar=ar)
    return dict(lane.step_costs)



# Greedy parity tolerance by the dtype the model computes in. fp32: exact. bf16/fp16: batched
# [W, 2] and solo [1, 1] forwards round differently, so a batched row may pick another token where
# the solo forward's top two logits are within 9 units in the last place of the dtype (relative to
# the larger), as MTPLX allows on Metal (its bf16 bound is 9/128); anything wider is a failure.
PARITY_ULPS = 9
_EPS = {"float32": 0.0, "bfloat16": 2.0 ** -7, "float16": 2.0 ** -10}


def parity_tolerance(model) -> tuple:
    """(dtype name, relative logit tolerance) of the model's logits."""
    dtype = str(model.logits(model.hidden(mx.array([[0]]), model.make_cache())).dtype).split(".")[-1]
    return dtype, PARITY_ULPS * _EPS.get(dtype, 2.0 ** -7)


def run_selfcheck(lane: InstalledA3BMTPBatchLane) -> dict:
    """Prove the lane's mechanism at its width, whatever the head's quality. Every draft is
    injected: at each cycle a row is handed the target's own next token (must be accepted: commit
    2) or another token (must be rejected: commit 1), in a pattern that differs by row; rows have
    mixed prompt lengths and budgets, so they finish (commit 0) at different cycles. Checks, each
    named in a failure: `greedy_parity` (every row equals solo greedy AR; for bf16/fp16 a
    divergence is tolerated only at a near-tie of the solo logits, see PARITY_ULPS),
    `row_isolation` (rows 1.. do not move when row 0 changes), `commit_keeps` (commits of 0, 1 and
    2 all happened), `commit_math` (ragged commit of keeps 0/1/2 at cache level). The solo
    references are `generate_ar`'s, the one-row lane's AR rows: a check of this width against
    width 1 (the tests check both against mlx-lm's own `generate_step`)."""
    model, W = lane.model, lane.width
    t0 = time.perf_counter()
    vocab = model.vocab_size
    dtype, tol = parity_tolerance(model)
    rng = np.random.default_rng(0)
    lengths = [1 + (7 * b) % 23 for b in range(W)]
    prompts = [tuple(int(t) for t in rng.integers(3, vocab, size=n)) for n in lengths]
    budgets = [3 + (5 * b) % 9 for b in range(W)]       # mixed: rows go inert at different cycles
    failures, tolerated = [], []

    def cohort(ps, refs, log=None):
        def inject(b, position):           # the draft for output `position` of row b
            ref = refs[b]
            if position >= len(ref):
                return None
            return ref[position] if (position + b) % 3 else (ref[position] + 1) % vocab

        reqs = [A3BMTPBatchRequest(request_id=str(b), prompt_ids=p, sampler=GREEDY, max_tokens=m)
                for b, (p, m) in enumerate(zip(ps, budgets))]
        return generate_a3b_mtp_batch(lane, reqs, decision_log=log, proposer=ScriptedProposer(vocab, inject))

    def parity(b, prompt, got, ref):
        if got == ref:
            return
        k = next((i for i, (g, r) in enumerate(zip(got, ref)) if g != r), min(len(got), len(ref)))
        if tol > 0 and k < min(len(got), len(ref)):
            solo = model.logits(model.hidden(mx.array([list(prompt) + ref[:k]]), model.make_cache()))[0, -1]
            a, c = float(solo[ref[k]].astype(mx.float32)), float(solo[got[k]].astype(mx.float32))
            if abs(a - c) <= tol * max(1.0, abs(a), abs(c)):
                tolerated.append(f"row {b} at token {k}: {got[k]} vs {ref[k]}, logits {c:.4f} vs {a:.4f}")
                return
        failures.append(f"greedy_parity: row {b}: batched greedy {got} != solo {ref}")

    refs = [_solo_reference(model, p, m) for p, m in zip(prompts, budgets)]
    decisions = DecisionLog()
    first = cohort(prompts, refs, decisions)
    for b in range(W):
        parity(b, prompts[b], first.streams[b].tokens, refs[b])
    swapped = [tuple(int(t) for t in rng.integers(3, vocab, size=5))] + prompts[1:]
    second = cohort(swapped, [_solo_reference(model, swapped[0], budgets[0])] + refs[1:])
    for b in range(1, W):
        if second.streams[b].tokens != first.streams[b].tokens:
            failures.append(f"row_isolation: row {b} changed when row 0's prompt changed")
    keeps = sorted(set(decisions.keeps))
    if keeps != [0, 1, 2]:
        failures.append(f"commit_keeps: injected drafts should have produced commits of 0, 1 and 2 (saw {keeps})")
    failures.extend(f"commit_math: {f}" for f in _check_commit_math())
    return {"ok": not failures, "failures": failures,
            "failed_checks": sorted({f.split(":")[0] for f in failures}), "rows": W,
            "commit_keeps_seen": keeps, "greedy_parity_rows": W, "dtype": dtype, "parity_tolerance": tol,
            "tolerated_divergences": tolerated, "seconds": round(time.perf_counter() - t0, 3)}


def _solo_reference(model, prompt: tuple, max_tokens: int) -> list:
    """`generate_ar`'s greedy tokens for a self-check row, decoded once per loaded model: every
    width's self-check draws the same prompts for its first rows, so a replica installing widths
    3..32 decodes 32 references, not 59 (on a real model each is max_tokens one-row forwards)."""
    refs = model.__dict__.setdefault("_selfcheck_references", {})
    if (prompt, max_tokens) not in refs:
        refs[prompt, max_tokens] = generate_ar(model, prompt, max_tokens, GREEDY).tokens
    return list(refs[prompt, max_tokens])


def _check_commit_math() -> list:
    """Three rows write 2 positions, keep 0 / 1 / 2, then write one more: each row's next write
    must land right after what it kept, and its mask must not reach the dropped slots."""
    k = mx.zeros((3, 1, 4, 1))
    cache = RaggedKVCache(k, k, [1, 1, 1])
    cache.update_and_fetch(mx.full((3, 1, 2, 1), 5.0), mx.full((3, 1, 2, 1), 5.0))
    commit_rows([cache], VERIFY_T, np.array([0, 1, 2]))
    mask = cache.make_mask(1)
    keys, _ = cache.update_and_fetch(mx.full((3, 1, 1, 1), 7.0), mx.full((3, 1, 1, 1), 7.0))
    got = np.array(keys[:, 0, :, 0]).tolist()
    want_rows = [[0, 7, 5, 0], [0, 5, 7, 0], [0, 5, 5, 7]]
    failures = []
    if cache.lengths.tolist() != [2, 3, 4]:
        failures.append(f"commit of keeps 0/1/2 left lengths {cache.lengths.tolist()}, want [2, 3, 4]")
    if [row[:4] for row in got] != want_rows:
        failures.append(f"commit of keeps 0/1/2 wrote {got}, want {want_rows}")
    if np.array(mask[:, 0, 0]).astype(int).tolist()[0][:3] != [1, 1, 0]:
        failures.append("the mask of a row that kept 0 still reaches its dropped slots")
    return failures
