"""The fixed-width batched MTP lane: many requests decoded as one cohort.

Each cycle, for all rows at once: one MTP head forward [B, 2] (the row's owed history entry, if
any, and the draft entry (h_last, primary)), one target verify forward [B, 2] = [primary, draft],
then a per-row decision with the row's own RNG in the solo path's order (primary, draft,
accept/residual, bonus), and a per-row commit of 0, 1 or 2 positions into ragged caches. Rows are
prefilled one by one at their own length (no padding tokens), then merged. Finished, cancelled
and free rows stay in the batch, inert (keep 0), until a row takes their slot. Where drafting does
not pay, a lane runs plain AR steps instead ([B, 1], no head forward; `StepPolicy`) and a row can
stop drafting on its own (`_LaneRow.drafted`), with greedy output unchanged.

The lane name and route ids follow MTPLX's A3B lane; the lane here is architecture-neutral.
"""

from __future__ import annotations

import logging
import math
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from functools import partial
from itertools import chain
from typing import Callable, Optional

import mlx.core as mx
import numpy as np

from mtplx.engine.prefill import PREFILL_CHUNK, CapacityError, start_prefill
from mtplx.models.cache import RaggedKVCache, commit_rows, empty_batch_layer
from mtplx.models.cpu_ops import split_for
from mtplx.engine.repetition import RepetitionLimits, repeated_tail
from mtplx.sampling import (Distribution, SamplerConfig, device_draft_distribution, device_draft_draw, draft_uniform,
                       draws_on_device, row_distribution, sample, to_host, verify_one_token)

log = logging.getLogger("mtplx")

DEPTH = 1                   # drafts a cycle chains unless its lane is installed with another `depth`
DEPTHS = (1, 2, 3)
VERIFY_T = 2
MIN_WIDTH, MAX_WIDTH = 2, 32
NUMERICS_PROFILES = ("throughput", "b1-exact")
DRAFT_DRAWS = ("device", "host")
REPETITION_LIMITS = RepetitionLimits.from_env()


class A3BMTPBatchCapacityError(CapacityError):
    """A row's prompt + max_tokens exceeds the model's context window."""


class LaneSelfCheckError(RuntimeError):
    """The lane's self-check failed; the lane was not installed. `receipt` names the failed checks."""

    def __init__(self, message: str, receipt: Optional[dict] = None):
        super().__init__(message)
        self.receipt = receipt or {}


def _noop(*_args, **_kwargs):
    return None


def _never() -> bool:
    return False


@dataclass(frozen=True)
class A3BMTPBatchRequest:
    request_id: str
    prompt_ids: tuple
    sampler: SamplerConfig = SamplerConfig(temperature=0.0)
    draft_sampler: Optional[SamplerConfig] = None      # None mirrors the target sampler
    seed: int = 0
    max_tokens: int = 64
    stop_token_ids: frozenset = frozenset()
    omit_speculative_bonus: bool = False
    on_token: Callable[[int], None] = _noop
    on_admit: Callable[[], None] = _noop               # the row leaves the queue: its prefill starts
    on_decode_start: Callable[[], None] = _noop        # the row has a slot: its first cycle is next
    on_terminal: Callable[[str, int], None] = _noop
    cancelled: Callable[[], bool] = _never
    repetition_stop: bool = False
    session_restore: Optional[Callable[[], object]] = None
    session_commit: Optional[Callable[..., None]] = None
    on_result: Optional[Callable[["A3BMTPBatchStreamResult"], None]] = None  # the row's final stream, at its terminal
    speculative: bool = True                            # False: one target token per cycle (plain AR)
    # Log-probabilities: None off; k >= 0 reports, per emitted token, the target's log-softmax at it
    # and its k heaviest alternatives, as on_token(token, (logprob, ((id, logprob), ...))).
    logprobs: Optional[int] = None
    adaptive: bool = False                              # generation_mode "auto": may step aside from drafting
    # Rows of one request (n > 1) with the same prompt: the first of them to finish its prefill
    # gives its prefill to the others queued in the lane (one prefill for all of them).
    prefill_group: Optional[object] = None

    def __post_init__(self):
        object.__setattr__(self, "prompt_ids", tuple(int(t) for t in self.prompt_ids))
        object.__setattr__(self, "stop_token_ids", frozenset(int(t) for t in self.stop_token_ids))


@dataclass
class A3BMTPBatchStreamResult:
    request_id: str
    tokens: list = field(default_factory=list)
    finish_reason: Optional[str] = None             # "stop" | "length" | "cancelled"
    cycles: int = 0                                 # cycles this row was live in
    accepted_drafts: int = 0
    rejected_drafts: int = 0
    terminal_perf_s: Optional[float] = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    # what the lane looked like while this row ran (a running lane widens and narrows)
    admitted_at_cycle: Optional[int] = None         # the lane's cycle count when the row took its slot
    fixed_width: int = 0                            # widest lane width the row decoded in
    route_id: Optional[str] = None                  # that lane's route id
    real_width: int = 0                             # most live rows in one of its cycles
    occupancy_sum: int = 0                          # live rows, summed over its cycles
    mean_occupancy: float = 0.0                     # occupancy_sum / cycles
    repetition_stop: Optional[object] = None        # a RepetitionStop when the row stopped on a repeat
    logprobs: list = field(default_factory=list)    # per token, when requested: (logprob, alternatives)
    spec_cycles: int = 0                            # cycles in which this row drafted
    drafts_skipped: int = 0                         # cycles of a speculative row without a draft
    shared_prefill: bool = False                    # took a sibling row's prefill (same prefill_group)
    mtp_depth: int = 0                              # most drafts it chained in one cycle's lane (0: never drafted)


@dataclass
class A3BMTPBatchResult:
    streams: list
    cycles: int
    accepted_drafts: int
    rejected_drafts: int
    route_id: str
    width_histogram: dict
    real_width: int
    fixed_width: int
    prefill_s: float = 0.0
    decode_s: float = 0.0
    host_s: float = 0.0          # of decode_s: host work (sampling, accept tests, bookkeeping)


@dataclass(frozen=True)
class InstalledA3BMTPBatchLane:
    model: object = field(repr=False, compare=False)
    width: int
    depth: int
    verify_t: int
    numerics: str
    route_id: str
    config_fingerprint: str
    selfcheck: dict = field(compare=False)
    prefill_chunk: int = PREFILL_CHUNK
    compiled: bool = True                 # mx.compile the cycle's forwards when the caches allow
    span_bucket: Optional[int] = None     # compiled attention reads a span rounded up to this (None: the whole buffer)
    _graphs: dict = field(default_factory=dict, repr=False, compare=False)
    # seconds per step at this width by kind ("mtp": a full cycle, "ar": a plain AR step): measured
    # at install, then a moving average of the running lanes' own steps
    step_costs: dict = field(default_factory=dict, repr=False, compare=False)


# ---------------------------------------------------------------- installation

def _route_id(model, width: int, numerics: str, depth: int = DEPTH) -> str:
    t = 1 + depth          # a cycle's verify positions
    return f"{model.model_id}_mtp_batch_b{width}_t{t}_m{t * width}_{numerics.replace('-', '_')}"


def _fingerprint(model, numerics: str, route_id: str) -> str:
    return f"{model.fingerprint}:{numerics}:{route_id}"


def install_a3b_mtp_batch_lane(model, width: int = 8, numerics: str = "throughput",
                               selfcheck: bool = True, compiled: Optional[bool] = None,
                               depth: int = DEPTH) -> InstalledA3BMTPBatchLane:
    """Bind a fixed-width cohort lane to a model, after a numerical self-check at real shapes.
    `depth`: drafts a cycle chains (1-3; the self-check's injected cycles draft one)."""
    if getattr(model, "mtp", None) is None:
        raise ValueError(f"cannot install an MTP batch lane: the model has no MTP head "
                         f"({getattr(model, 'mtp_disabled_reason', 'no mtp.* weights')})")
    if isinstance(width, bool) or not isinstance(width, int) or not MIN_WIDTH <= width <= MAX_WIDTH:
        raise ValueError(f"width={width!r} is invalid: must be an integer in [{MIN_WIDTH}, {MAX_WIDTH}]")
    if numerics not in NUMERICS_PROFILES:
        raise ValueError(f"numerics={numerics!r} is invalid: choose one of {NUMERICS_PROFILES}")
    if isinstance(depth, bool) or depth not in DEPTHS:
        raise ValueError(f"depth={depth!r} is invalid: a lane chains {' or '.join(map(str, DEPTHS))} drafts")
    lane = _new_lane(model, width, numerics, {"skipped": True}, compiled, depth)
    if selfcheck:
        receipt = run_selfcheck(lane)
        if not receipt["ok"]:
            raise LaneSelfCheckError(
                f"lane {lane.route_id} refused to install: failed self-check "
                f"{', '.join(receipt['failed_checks'])}: {receipt['failures']}", receipt)
        object.__setattr__(lane, "selfcheck", receipt)
        # what "auto" rows and lanes start from, measured now rather than in a request's time
        measure_step_costs(lane)
        if not solo_lane(model).step_costs:
            measure_step_costs(solo_lane(model))
        draft_acceptance_prior(model)
    return lane


def measure_step_costs(lane: InstalledA3BMTPBatchLane, rounds: int = 8, block: int = 3) -> dict:
    """Seconds per MTP cycle and per plain AR step at the lane's width, measured on this machine:
    a full lane of greedy rows runs blocks of `block` steps of each kind in turn; the first round
    warms up (first use of each shape), and the first step of a block carries the switch (owed
    history written, the other kind's lazy commit), so neither is counted. What the StepPolicy
    compares is the ratio, so it is taken round by round (an MTP block over the AR block beside
    it: a load that comes and goes between rounds cancels) and its median kept, at least 1 (an
    MTP cycle does an AR step's work and more); under a load average of 10 on 2 cores, medians of
    each kind alone measured MTP cycles at 0.9x and at 1.7x an AR step. `lane.step_costs` gets
    the median AR step and the MTP cycle at that ratio; running lanes then keep both current."""
    running = RunningLane(lane, prefill_budget=None)
    prompt = tuple(3 + i % (lane.model.vocab_size - 3) for i in range(16))
    for b in range(lane.width):
        running.add(A3BMTPBatchRequest(request_id=f"measure-{b}", prompt_ids=prompt,
                                       max_tokens=3 * block * rounds + 8))
    running.admit_all()
    times = {"mtp": [], "ar": []}
    for i in range(2 * block * rounds):
        kind = "mtp" if (i // block) % 2 == 0 else "ar"
        t0 = time.perf_counter()
        running._run_step(kind)
        mx.eval(running.logits_last, running.h_last)
        if i % block and i >= 2 * block:
            times[kind].append(time.perf_counter() - t0)
    running.cancel_all()
    per_round = {k: np.median(np.reshape(v, (rounds - 1, block - 1)), axis=1) for k, v in times.items()}
    ratio = max(1.0, float(np.median(per_round["mtp"] / per_round["ar"])))
    ar = float(np.median(times["ar"]))
    lane.step_costs.update(mtp=ratio * ar, ar=ar)
    return dict(lane.step_costs)


def _new_lane(model, width: int, numerics: str, selfcheck: dict, compiled: Optional[bool],
              depth: int = DEPTH) -> InstalledA3BMTPBatchLane:
    route_id = _route_id(model, width, numerics, depth)
    compiled = _default_compile() if compiled is None else bool(compiled)
    return InstalledA3BMTPBatchLane(
        model=model, width=width, depth=depth, verify_t=1 + depth, numerics=numerics, route_id=route_id,
        config_fingerprint=_fingerprint(model, numerics, route_id), selfcheck=selfcheck,
        compiled=compiled, span_bucket=_span_bucket(model, width) if compiled else None)


# A compiled graph's first run at each span and shape must match its eager forward to within this
# (|compiled - eager| / (1 + |eager|), every output); fusion's rounding differences are ~1e-6.
GRAPH_CHECK_RTOL = 1e-3

# Compiled attention spans of wide lanes are rounded up to this many positions: one graph per span.
# Measured on the shipped model (2-core CPU, B8, rows of 60-260 prompt tokens decoding to ~750,
# graphs traced beforehand, blocks of cycles alternating on the same rows): eager 26.5 ms a cycle,
# compiled with 64-position spans 23.2 (1.14x; 32: 1.10x, within the noise of 64). A new span's
# graphs trace once per lane width and buffer size, in 10-50 ms.
SPAN_BUCKET = 64


def _default_compile() -> bool:
    """Cycle graphs are compiled (`mx.compile`) unless MTPLX_MTP_BATCH_COMPILE=0: on the shipped
    model the one-row lane ran 1.2-1.4x faster compiled, a B8 lane's cycles 1.14x (SPAN_BUCKET).
    Each graph's first run at a span and shape is checked against its eager forward
    (`_CycleForwards._checked`)."""
    import os

    env = os.environ.get("MTPLX_MTP_BATCH_COMPILE")
    if env is not None and env.strip():
        return env.strip().lower() not in ("0", "off", "false", "no")
    return True


def default_draft_draw() -> str:
    """Where sampled rows draw their drafts unless MTPLX_DRAFT_DRAW says: on the device on a GPU
    (Metal), where the wait between the head and the verify idles it; on the host on MLX's CPU
    backend, where the device draw cost more than the wait (BENCHMARKS.md, bench:lane: 0.94x)."""
    import os

    env = os.environ.get("MTPLX_DRAFT_DRAW", "").strip().lower()
    if env:
        if env not in DRAFT_DRAWS:
            raise ValueError(f"MTPLX_DRAFT_DRAW={env!r}: expected one of {DRAFT_DRAWS}")
        return env
    return "device" if mx.default_device() == mx.gpu else "host"


def _span_bucket(model, width: int) -> Optional[int]:
    """Wide lanes of attention-only models attend over a span rounded up to SPAN_BUCKET (a compiled
    graph has fixed shapes: over the whole buffer, sized for the rows' whole lives, B8 compiled
    served 364 tok/s against eager's 429). The one-row lane (its buffer is its own prompt +
    max_tokens; 1.2-1.4x faster compiled over the whole buffer) and models with recurrent (GDN)
    layers keep one graph over the whole buffer."""
    from mtplx.models.recurrent_cache import RecurrentCache

    if width == 1 or any(isinstance(c, RecurrentCache) for c in model.make_cache()):
        return None
    return SPAN_BUCKET


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
    2 all happened), `commit_math` (ragged commit of keeps 0/1/2 at cache level)."""
    from mtplx.engine.decode import generate_ar
    from mtplx.sampling import GREEDY

    model, W = lane.model, lane.width
    t0 = time.perf_counter()
    vocab = model.vocab_size
    dtype, tol = parity_tolerance(model)
    rng = np.random.default_rng(0)
    lengths = [1 + (7 * b) % 23 for b in range(W)]
    prompts = [tuple(int(t) for t in rng.integers(3, vocab, size=n)) for n in lengths]
    budgets = [3 + (5 * b) % 9 for b in range(W)]       # mixed: rows go inert at different cycles
    failures, tolerated = [], []

    def cohort(ps, refs):
        def inject(b, position):           # the draft for output `position` of row b
            ref = refs[b]
            if position >= len(ref):
                return None
            return ref[position] if (position + b) % 3 else (ref[position] + 1) % vocab

        reqs = [A3BMTPBatchRequest(request_id=str(b), prompt_ids=p, sampler=GREEDY, max_tokens=m)
                for b, (p, m) in enumerate(zip(ps, budgets))]
        return generate_a3b_mtp_batch(lane, reqs, _keep_log=True, _inject_drafts=inject)

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

    refs = [generate_ar(model, p, m, GREEDY).tokens for p, m in zip(prompts, budgets)]
    first = cohort(prompts, refs)
    for b in range(W):
        parity(b, prompts[b], first.streams[b].tokens, refs[b])
    swapped = [tuple(int(t) for t in rng.integers(3, vocab, size=5))] + prompts[1:]
    second = cohort(swapped, [generate_ar(model, swapped[0], budgets[0], GREEDY).tokens] + refs[1:])
    for b in range(1, W):
        if second.streams[b].tokens != first.streams[b].tokens:
            failures.append(f"row_isolation: row {b} changed when row 0's prompt changed")
    keeps = sorted(set(first.keep_log))
    if keeps != [0, 1, 2]:
        failures.append(f"commit_keeps: injected drafts should have produced commits of 0, 1 and 2 (saw {keeps})")
    failures.extend(f"commit_math: {f}" for f in _check_commit_math())
    return {"ok": not failures, "failures": failures,
            "failed_checks": sorted({f.split(":")[0] for f in failures}), "rows": W,
            "commit_keeps_seen": keeps, "greedy_parity_rows": W, "dtype": dtype, "parity_tolerance": tol,
            "tolerated_divergences": tolerated, "seconds": round(time.perf_counter() - t0, 3)}


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


# ---------------------------------------------------------------- the cohort driver

def _graph_inputs(caches) -> Optional[list]:
    """The caches as plain arrays for a compiled forward; None when some cache cannot enter one
    (no graph protocol, or a buffer not allocated yet)."""
    arrays = []
    for c in caches:
        if not hasattr(c, "graph_inputs"):
            return None
        arrays.extend(c.graph_inputs())
    return arrays if all(a is not None for a in arrays) else None


def _graph_outputs(caches) -> tuple:
    return tuple(a for c in caches for a in c.graph_outputs())


def _graph_views(kinds, arrays, offset, span) -> list:
    """Inside a graph: each layer's cache rebuilt from its two arrays."""
    it = iter(arrays)
    return [kind.graph_view([next(it), next(it)], offset, span) for kind in kinds]


def _draft(model, mtp_caches, h_hist, h_last, t_hist, x0, owed):
    """`_CycleForwards.draft`'s forward (the input's gather inside it: in a compiled graph it
    costs no dispatch of its own)."""
    D = h_hist.shape[1]
    slot = mx.arange(D + 1)[None, :]
    take = mx.where(slot < owed[:, None], slot, D)
    h_in = mx.take_along_axis(mx.concatenate([h_hist, h_last], axis=1), take[:, :, None], axis=1)
    t_in = mx.take_along_axis(mx.concatenate([t_hist, x0[:, None]], axis=1), take, axis=1)
    g = mx.take_along_axis(model.draft_hidden(h_in, t_in, mtp_caches), owed[:, None, None], axis=1)
    return model.logits(g)[:, 0], g


def _chain(model, mtp_caches, g, d):
    g = model.draft_hidden(g, d[:, None], mtp_caches)
    return model.logits(g)[:, 0], g


class _CycleForwards:
    """The forwards of a cycle over fixed shapes: the MTP head over [W, 1 + depth] (owed history
    entries + draft entry), at depth 2-3 the head again over [W, 1] per chained draft, and the
    target verify over [W, 1 + drafts]. They run as `mx.compile`d graphs cached on the lane: each
    cache enters as arrays (KV buffers, or a GDN layer's conv window and state) and comes back as
    arrays (updated buffers, or the GDN capture the commit rolls back from). A graph retraces
    when a KV buffer's capacity grows. With the lane's `span_bucket`, attention reads only the
    buffer's first positions, up to the rows' longest rounded up to the bucket: one graph per
    span, traced when first reached. Eager through the same code when compiling is off or a
    cache cannot enter a graph yet."""

    def __init__(self, lane, caches, mtp_caches, counters=None):
        self.model, self.caches, self.mtp_caches = lane.model, caches, mtp_caches
        self.compiled, self.span_bucket = lane.compiled, lane.span_bucket
        # gets `graph_retraces` += 1 per retrace of a lane graph: the running lane, weakly (it holds
        # this object; a cycle would keep an ended lane's KV buffers until a cyclic collection)
        self.counters = counters
        if self.compiled and "fns" not in lane._graphs:
            model = lane.model
            kinds = [type(c) for c in caches]
            mtp_kinds = [type(c) for c in mtp_caches]

            def draft(span, h_hist, h_last, t_hist, x0, owed, offset, *arrays):
                mc = _graph_views(mtp_kinds, arrays, offset, span)
                return _draft(model, mc, h_hist, h_last, t_hist, x0, owed) + _graph_outputs(mc)

            def chain(span, g, d, offset, *arrays):
                mc = _graph_views(mtp_kinds, arrays, offset, span)
                return _chain(model, mc, g, d) + _graph_outputs(mc)

            def verify(span, tokens, offset, *arrays):   # [W, 2] a cycle's verify, [W, 1] an AR step
                tc = _graph_views(kinds, arrays, offset, span)
                H = model.hidden(tokens, tc)
                return (H, model.logits(H)) + _graph_outputs(tc)

            # one name per input shape, so that a shape first met is a trace, not a retrace
            lane._graphs["fns"] = {"draft": draft, "chain": chain, "verify": verify, "verify3": verify,
                                   "verify4": verify, "ar": verify}
        self._graphs = lane._graphs

    def _run(self, name, caches, T, *args):
        """Run graph `name` over these caches if they can enter it; None otherwise."""
        if not self.compiled or "eager_since" in self._graphs:
            return None
        ragged = [c for c in caches if isinstance(c, RaggedKVCache)]
        for c in ragged:
            c.ensure_capacity(int(c.lengths.max()) + T)
        arrays = _graph_inputs(caches)
        if arrays is None:
            return None
        offset = ragged[0].offset if ragged else mx.zeros((1,), mx.int32)
        span = None
        if ragged and self.span_bucket:
            spans = ragged[0].lengths + T
            if caches is self.caches and split_for(spans, ragged[0].keys.dtype) is not None:
                return None        # rows this uneven attend split by span (cpu_ops), eagerly
            span = min(-(-int(spans.max()) // self.span_bucket) * self.span_bucket, ragged[0].keys.shape[2])
        traced = self._graphs.setdefault("traced", set())        # (graph, input shapes) seen
        signature = (name,) + tuple(a.shape for a in args + tuple(arrays))
        if signature not in traced:
            if self.counters is not None and any(t[0] == name for t in traced):
                self.counters.graph_retraces += 1
            traced.add(signature)
        graph = self._graphs.get((name, span))
        if graph is None:
            graph = self._graphs[(name, span)] = mx.compile(partial(self._graphs["fns"][name], span))
        out = graph(*args, offset, *arrays)
        checked = self._graphs.setdefault("checked", set())        # (graph, span, input shapes) checked
        if (span,) + signature not in checked:
            checked.add((span,) + signature)
            out = self._checked(name, span, out, args, offset, arrays)
        return out, offset + T

    def _checked(self, name, span, out, args, offset, arrays):
        """A compiled graph's first run at a span and shape, against the same function run eagerly on
        the same arrays (both pure; ~one eager forward, once per graph). On disagreement beyond
        rounding the lane logs it and runs eagerly from then on, and this run takes the eager
        result. Why: one CI run out of four saw a compiled B3 lane decode a row wrongly from the
        cycle where its span crossed 64 (the cause was not found); this turns such a graph into a
        logged fallback instead of a wrong token."""
        ref = self._graphs["fns"][name](span, *args, offset, *arrays)
        mx.eval(out, ref)
        worst = max(float(mx.max(mx.abs(a.astype(mx.float32) - b.astype(mx.float32)) /
                                 (1.0 + mx.abs(b.astype(mx.float32))))) for a, b in zip(out, ref))
        if worst <= GRAPH_CHECK_RTOL:
            return out
        log.error("mtplx: the lane's compiled %s graph (span %s, inputs %s) disagrees with its eager forward "
                  "(relative difference %.3g); the lane runs eagerly from now on", name, span,
                  [tuple(a.shape) for a in args + tuple(arrays)], worst)
        self._graphs["eager_since"] = f"{name} graph at span {span}: relative difference {worst:.3g}"
        self.compiled = False
        return ref

    def draft(self, h_hist, h_last, t_hist, x0, owed):
        """The cycle's first draft logits [W, V] and the head's output [W, 1, H] there: the head over
        [W, 1 + D] = each row's `owed` history entries (of `h_hist` [W, D, H], `t_hist` [W, D]),
        then (h_last, x0) to the end."""
        args = (h_hist, h_last, t_hist, x0, owed)
        T = h_hist.shape[1] + 1
        ran = self._run("draft", self.mtp_caches, T, *args)
        if ran is None:
            return _draft(self.model, self.mtp_caches, *args)
        return tuple(self._absorb(ran, self.mtp_caches, T, 2))

    def chain(self, g, d):
        """The next chained draft's logits [W, V] and the head's output: the head over [W, 1] =
        (its own last output `g`, the last draft `d`)."""
        ran = self._run("chain", self.mtp_caches, 1, g, d)
        if ran is None:
            return _chain(self.model, self.mtp_caches, g, d)
        return tuple(self._absorb(ran, self.mtp_caches, 1, 2))

    def verify(self, tokens, graph: Optional[str] = None):
        """Target hidden [W, T, H] and logits [W, T, V]: T = 1 + depth for [primary, drafts]
        (graphs "verify", "verify3", "verify4"), T = 1 for a plain AR step (graph "ar")."""
        graph = graph or ("verify" if tokens.shape[1] == 2 else f"verify{tokens.shape[1]}")
        ran = self._run(graph, self.caches, tokens.shape[1], tokens)
        if ran is None:
            H = self.model.hidden(tokens, self.caches)
            return H, self.model.logits(H)
        return tuple(self._absorb(ran, self.caches, tokens.shape[1], 2))

    @staticmethod
    def _absorb(ran, caches, T, n_results):
        out, offset = ran
        rest = iter(out[n_results:])
        for c in caches:
            c.absorb_graph(rest, T, offset)
        return out[:n_results]


# A row's own drafting policy (`adaptive`, generation_mode "auto"). It reads only the row's own
# accept/reject outcomes and counts only its own cycles, so a sampled row's draws (which change
# when it drafts) stay reproducible and independent of its neighbours.
ROW_ACCEPT_PRIOR = 0.5        # acceptance estimate on resuming (it starts at the model's `draft_acceptance_prior`)
# weight of each new outcome. Rejections come in bursts (a new identifier, a line's end): at 0.3 a
# burst of four stopped rows whose acceptance stayed ~0.7 (and a stopped row waits 16+ cycles for
# its probe); at 0.1 it takes 14 straight rejections from the prior 1.0.
ROW_ACCEPT_EMA = 0.1
ROW_STOP_BELOW = 0.25
ROW_PROBE_FIRST, ROW_PROBE_MAX = 16, 256   # own cycles before a stopped row drafts once to probe


PRIOR_TEXT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number, computed iteratively."""\n'
PRIOR_TOKENS = 48


def draft_acceptance_prior(model) -> float:
    """Where an adaptive row's acceptance estimate starts: the head's greedy acceptance over a
    fixed text (PRIOR_TEXT, PRIOR_TOKENS tokens through the one-row lane), measured once per
    loaded model. A constant of the model, so rows stay reproducible and independent of each
    other; a head that never agrees starts its rows stopped (probing) instead of spending two
    drafts, and lane cycles, on learning it."""
    prior = getattr(model, "_draft_acceptance_prior", None)
    if prior is None:
        ids = model.tokenizer.encode(PRIOR_TEXT)
        res = generate_a3b_mtp_batch(solo_lane(model), [A3BMTPBatchRequest(
            request_id="draft-acceptance-prior", prompt_ids=ids, max_tokens=PRIOR_TOKENS)])
        drafts = res.accepted_drafts + res.rejected_drafts
        prior = model._draft_acceptance_prior = res.accepted_drafts / drafts if drafts else ROW_ACCEPT_PRIOR
    return prior


class _LaneRow:
    """One lane row's own state: request, budget, stops, penalties, RNG, output, and what the
    lane looked like while it ran (for its stats)."""

    def __init__(self, req: A3BMTPBatchRequest, vocab: int, prior: float = ROW_ACCEPT_PRIOR):
        self.req = req
        self.live = True
        self.sampler = req.sampler
        self.draft_sampler = req.draft_sampler or req.sampler
        self.rng = np.random.default_rng(req.seed)
        self.counts = {} if self.sampler.has_penalties else None     # completion token -> count
        self.result = A3BMTPBatchStreamResult(request_id=req.request_id, prompt_tokens=len(req.prompt_ids))
        self.pending: Optional[int] = None
        self.owed = 0         # head-history entries owed for drafts its last MTP cycle accepted
        # its own drafting policy (adaptive rows): from its own accept/reject history only
        self.accept_est = prior
        self.drafting = prior >= ROW_STOP_BELOW
        self.probe_every = ROW_PROBE_FIRST
        self.probe_in = 0 if self.drafting else ROW_PROBE_FIRST

    def wants_draft(self) -> bool:
        """Whether this row drafts in the next MTP cycle: a speculative row always unless it is
        adaptive and has stopped, in which case only when its own probe is due."""
        if not self.req.speculative:
            return False
        return not self.req.adaptive or self.drafting or self.probe_in <= 0

    def drafted(self, ok: bool) -> None:
        """After its draft's accept test. A drafting adaptive row stops when its acceptance
        estimate falls below ROW_STOP_BELOW; a stopped one resumes when its probe is accepted, and
        otherwise waits twice as long for the next probe."""
        self.result.spec_cycles += 1
        if not self.req.adaptive:
            return
        if self.drafting:
            self.accept_est += ROW_ACCEPT_EMA * (float(ok) - self.accept_est)
            if self.accept_est < ROW_STOP_BELOW:
                self.drafting, self.probe_in = False, self.probe_every
        elif ok:
            self.drafting, self.accept_est, self.probe_every = True, ROW_ACCEPT_PRIOR, ROW_PROBE_FIRST
        else:
            self.probe_every = min(2 * self.probe_every, ROW_PROBE_MAX)
            self.probe_in = self.probe_every

    def skipped(self) -> None:
        """A live cycle in which this row did not draft."""
        if self.req.speculative:
            self.result.drafts_skipped += 1
            self.probe_in -= 1

    @property
    def greedy(self) -> bool:
        return self.sampler.is_greedy and self.draft_sampler.is_greedy and not self.sampler.has_penalties

    @property
    def greedy_draft(self) -> bool:
        """Drafts the head's argmax (on the device, no RNG draw)."""
        return self.draft_sampler.is_greedy and not self.draft_sampler.has_penalties

    def dist(self, logits_row, cfg=None):
        return row_distribution(logits_row, cfg or self.sampler, self.counts)

    def finish(self, reason: str) -> None:
        r = self.result
        if r.finish_reason is not None:
            return
        r.finish_reason = reason
        r.terminal_perf_s = time.perf_counter()
        if r.cycles:
            r.mean_occupancy = r.occupancy_sum / r.cycles
        self.live = False
        try:
            self.req.on_terminal(reason, r.cycles)
            if self.req.on_result is not None:
                self.req.on_result(r)
        except Exception:  # a client's callback never breaks the lane
            pass

    def emit(self, token: int, logprob: Optional[tuple] = None) -> bool:
        """Record a token (and its log-probability entry, when the row asked); returns True when the
        row has finished."""
        r = self.result
        r.tokens.append(token)
        if self.counts is not None:
            self.counts[token] = self.counts.get(token, 0) + 1
        try:
            if self.req.logprobs is None:
                self.req.on_token(token)
            else:
                r.logprobs.append(logprob)
                self.req.on_token(token, logprob)
        except Exception:
            self.finish("cancelled")
            return True
        if token in self.req.stop_token_ids:
            self.finish("stop")
        elif len(r.tokens) >= self.req.max_tokens:
            self.finish("length")
        return not self.live

    def check_repetition(self) -> None:
        """Stop with the repeats after the block's first copy trimmed (mtplx.engine.repetition)."""
        hit = repeated_tail(self.result.tokens, REPETITION_LIMITS)
        if hit is not None:
            self.result.repetition_stop = hit
            del self.result.tokens[len(self.result.tokens) - hit.trimmed_tokens:]
            del self.result.logprobs[len(self.result.tokens):]
            self.finish("stop")

    def cancelled(self) -> bool:
        try:
            return bool(self.req.cancelled())
        except Exception:  # a broken callback cancels its own row only
            return True


# `heaviest` ranks the tokens at or above the k-th largest of the row's block maxima: at least k
# tokens (those maxima) reach it, so they hold the k heaviest, and they are few.
HEAVIEST_BLOCK = 64


def heaviest(x: np.ndarray, k: int) -> np.ndarray:
    """Ids of the `k` heaviest entries of one row, heaviest first, ties by lower id (a partition of
    the whole row costs several times this at a 4k vocabulary)."""
    if k <= 0:
        return np.zeros(0, dtype=np.int64)
    pad = -x.size % HEAVIEST_BLOCK
    blocks = np.concatenate([x, np.full(pad, -np.inf, x.dtype)]) if pad else x
    block_max = blocks.reshape(-1, HEAVIEST_BLOCK).max(axis=1)
    if k >= block_max.size:        # fewer blocks than k: rank the whole row
        return np.argsort(-x, kind="stable")[:k]
    cand = np.flatnonzero(x >= np.partition(block_max, -k)[-k])
    return cand[np.argsort(-x[cand], kind="stable")][:k]


def logprob_entry(logits_row: np.ndarray, token: int, k: int) -> tuple:
    """(log-probability of `token`, its `k` heaviest alternatives as ((id, log-probability), ...))
    under one float32 logits row [V]. The normalizer sums the row's exponentials, taken in float32
    relative to the heaviest (none overflows), in float64."""
    x = logits_row
    top = x.max()
    lse = float(top) + math.log(float(np.exp(x - top).sum(dtype=np.float64)))
    return float(x[token]) - lse, tuple((int(i), float(x[i]) - lse) for i in heaviest(x, k))


def _host_logprob(logits_row, token: int, k: Optional[int]) -> Optional[tuple]:
    """A row's entry for `token` under one logits row (an MLX or host array); None when off."""
    return None if k is None else logprob_entry(to_host(logits_row), token, k)


def solo_lane(model, depth: int = DEPTH) -> InstalledA3BMTPBatchLane:
    """The one-row lane chaining `depth` drafts: `generate_mtpk` decodes through it, and a running
    lane with one row runs at this width (compiled cycle graphs, same code as the cohorts). Cached
    on the model; its numerics are covered by the cohort self-checks and the solo exactness tests."""
    lanes = model.__dict__.setdefault("_solo_lanes", {})
    if depth not in lanes:
        lanes[depth] = _new_lane(model, 1, "throughput", {"skipped": "solo lane"}, None, depth)
    return lanes[depth]


def ar_lanes(model, widths) -> list:
    """Lanes for plain AR rows only (a model without an MTP head): the one-row lane and these
    widths, with no self-check (no drafts, no commits but 1)."""
    reason = getattr(model, "mtp_disabled_reason", None) or "no MTP head"
    return [solo_lane(model)] + [_new_lane(model, int(w), "throughput", {"skipped": f"AR rows only: {reason}"}, None)
                                 for w in sorted(set(widths)) if int(w) > 1]


def _validate_request(model, r: A3BMTPBatchRequest) -> None:
    if not r.prompt_ids:
        raise ValueError(f"request {r.request_id}: prompt_ids is empty")
    if r.max_tokens < 1:
        raise ValueError(f"request {r.request_id}: max_tokens={r.max_tokens} must be >= 1")
    bad = [t for t in r.prompt_ids if not 0 <= t < model.vocab_size]
    if bad:
        raise ValueError(f"request {r.request_id}: token id {bad[0]} is outside the vocabulary")
    if r.speculative and getattr(model, "mtp", True) is None:
        raise ValueError(f"request {r.request_id}: the model has no MTP head "
                         f"({model.mtp_disabled_reason}); send it with speculative=False (plain AR)")
    if len(r.prompt_ids) + r.max_tokens > model.max_context:
        raise A3BMTPBatchCapacityError(
            f"request {r.request_id}: prompt ({len(r.prompt_ids)}) + max_tokens ({r.max_tokens}) "
            f"exceeds the context window of {model.max_context} tokens")


def _validate(lane, requests) -> None:
    n = len(requests)
    lo = 1 if lane.width == 1 else MIN_WIDTH
    if not lo <= n <= lane.width:
        raise ValueError(f"a cohort needs {lo}..{lane.width} requests for lane {lane.route_id}; got {n}")
    for r in requests:
        _validate_request(lane.model, r)


class _Admission:
    """A row on its way into the lane: its own prefill, one chunk at a time. The prefill starts
    (and the row's prefix restore is looked up) at the first chunk, so a row queued behind another
    with the same prompt prefix reuses what that one banked."""

    def __init__(self, model, row: _LaneRow, chunk: int):
        self.model, self.row, self.chunk = model, row, chunk
        self.steps = None
        self.out = None        # (logits [V], hidden [1, 1, H]) once the prefill has ended

    def advance(self) -> int:
        """Run the next chunk; returns its token count."""
        if self.steps is None:
            req = self.row.req
            try:
                req.on_admit()
            except Exception:
                pass
            self.cache, self.mtp_cache, self.steps, cached = start_prefill(
                self.model, list(req.prompt_ids), self.chunk, req.session_restore, req.session_commit)
            self.row.result.cached_tokens = cached
            self.fed = cached
        try:
            n = next(self.steps)
        except StopIteration as done:     # the final chunk ran and returned the prefill's output
            self.out = done.value
            n = len(self.row.req.prompt_ids) - self.fed
        self.fed += n
        return n

    def shared_with(self, row: _LaneRow) -> "_Admission":
        """A finished admission for `row`, a sibling with the same prompt: this prefill's state,
        as its own would be (the lane copies a row's caches into its slot, so both may read them)."""
        try:
            row.req.on_admit()
        except Exception:
            pass
        sib = _Admission(self.model, row, self.chunk)
        sib.cache, sib.mtp_cache, sib.out = self.cache, self.mtp_cache, self.out
        row.result.cached_tokens, row.result.shared_prefill = self.row.result.cached_tokens, True
        return sib


def _sorted_ladder(ladder) -> list:
    ladder = [ladder] if isinstance(ladder, InstalledA3BMTPBatchLane) else list(ladder)
    if not ladder:
        raise ValueError("a running lane needs at least one installed lane")
    ladder = sorted(ladder, key=lambda ln: ln.width)
    if len({ln.width for ln in ladder}) < len(ladder):
        raise ValueError(f"a running lane's installed lanes need distinct widths; got {[ln.width for ln in ladder]}")
    return ladder


NARROW_AFTER_CYCLES = 16     # cycles of low demand before a lane narrows (hysteresis)
HISTORY_FLUSH_AT = 16        # AR steps of owed MTP history a lane holds before writing it into the head's KV
STEP_COST_EMA = 0.25         # weight of a pair of steps' measured times in their kinds' costs
COST_PAIR_WITHIN = 3         # steps apart a counted step of each kind may be to make a pair


class StepPolicy:
    """A lane's choice, at each cycle boundary, between an MTP cycle and a plain AR step, where
    the choice cannot change a row's draws (greedy rows of generation_mode "auto"): an MTP cycle
    yields live + acceptance x drafting tokens for its cost, an AR step yields live tokens for its
    own; the lane runs the better by expected tokens/s, switching only past a margin
    (`hysteresis`), with probes of the other kind (`probe_steps` AR steps every `ar_probe_every`
    MTP cycles to keep its cost current; `probe_steps` MTP cycles after `mtp_probe_first` AR
    steps, the interval doubling up to `mtp_probe_max` while MTP does not pay, to notice when it
    pays again). A probe is two steps long because the first step after a switch also pays for
    the switch (owed history, the other kind's lazy work) and is not counted as a cost. Where the
    costs alone rule MTP out (every row drafting and every draft accepted, 1 + DEPTH tokens a row,
    would still lose to AR: a verify dearer than two AR steps, as on a 150k-vocabulary model whose
    logits dominate), acceptance cannot matter: the probes only keep the costs current, at the
    longest interval (on such a model the doubling probes cost auto 2.3% of AR's tok/s, B8)."""

    def __init__(self, hysteresis: float = 0.05, ar_probe_every: int = 256, mtp_probe_first: int = 16,
                 mtp_probe_max: int = 256, acceptance_ema: float = 0.1, probe_steps: int = 2):
        self.kind = "mtp"                      # the kind it runs between probes
        # moving average of drafts accepted per drafting row and cycle (at depth 1 the acceptance
        # rate; a cycle of depth d yields live + acceptance x drafting tokens, d + 1 at most a row)
        self.acceptance: Optional[float] = None
        self.hysteresis, self.ar_probe_every = hysteresis, ar_probe_every
        self.mtp_probe_first, self.mtp_probe_max = mtp_probe_first, mtp_probe_max
        self.acceptance_ema = acceptance_ema
        self.mtp_probe_every = mtp_probe_first
        self.since_probe = 0
        self.probe_steps, self._probe_left = probe_steps, 0
        self.last_gain: Optional[float] = None    # MTP tokens/s over AR tokens/s, at the last choice

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted:
            rate = accepted / drafted
            a = self.acceptance
            self.acceptance = rate if a is None else a + self.acceptance_ema * (rate - a)

    def choose(self, costs: dict, live: int, drafting: int, depth: int = DEPTH) -> str:
        mtp_s, ar_s = costs.get("mtp"), costs.get("ar")
        if ar_s is None:
            return "ar"                         # unmeasured at this width: measure it
        if mtp_s is None or self.acceptance is None:
            return "mtp"
        self.last_gain = (live + self.acceptance * drafting) / mtp_s / (live / ar_s)
        if self.kind == "mtp" and self.last_gain < 1 - self.hysteresis:
            self.kind, self.since_probe, self.mtp_probe_every, self._probe_left = "ar", 0, self.mtp_probe_first, 0
        elif self.kind == "ar" and self.last_gain > 1 + self.hysteresis:
            self.kind, self.since_probe, self._probe_left = "mtp", 0, 0
        if self.kind == "ar" and (1 + depth) * ar_s / mtp_s < 1 - self.hysteresis:
            self.mtp_probe_every = self.mtp_probe_max
        other = "ar" if self.kind == "mtp" else "mtp"
        if self._probe_left:
            self._probe_left -= 1
            return other
        self.since_probe += 1
        every = self.ar_probe_every if self.kind == "mtp" else self.mtp_probe_every
        if self.since_probe <= every:
            return self.kind
        self.since_probe, self._probe_left = 0, self.probe_steps - 1
        if self.kind == "ar":
            self.mtp_probe_every = min(2 * self.mtp_probe_every, self.mtp_probe_max)
        return other

    def snapshot(self, costs: dict) -> dict:
        return {"kind": self.kind, "acceptance": None if self.acceptance is None else round(self.acceptance, 4),
                "mtp_cycle_s": None if costs.get("mtp") is None else round(costs["mtp"], 6),
                "ar_step_s": None if costs.get("ar") is None else round(costs["ar"], 6),
                "mtp_gain": None if self.last_gain is None else round(self.last_gain, 4)}


class RunningLane:
    """A fixed-width lane that keeps running while rows come and go (continuous admission).

    `add(request)` queues a row; each `step()` is one cycle boundary: rows whose prefill is done
    take free slots (a new row is prefilled alone, at its own length, one chunk per step while
    other rows decode, then merged into its slot of the ragged caches and the MTP history), then
    one MTP cycle runs for every live row. A row leaves at its own end and its slot is free at the
    next boundary. `ladder` is the installed lanes this one may run as: when more rows want in than
    the current width holds, the lane widens to the narrowest installed width that fits, carrying
    the live rows' state over; after `narrow_after` cycles of low demand it narrows again. The
    compiled [W, 2] graphs belong to the installed lanes, so rows coming and going never
    recompile. Rows of any sampling settings share the lane; `greedy_ladder` (the same widths,
    chaining more drafts) is what it runs as while every row that drafts is greedy, and a drafting
    sampled row moves it back to `ladder`'s depth at the boundary where it is queued. Shaped after mlx-lm's `BatchGenerator` (`insert`, `next`), with MTP inside.

    Each cycle, for all rows at once: one MTP head forward [W, 1 + depth] (the row's owed history
    entries, if any, and the draft entry (h_last, primary)), one target verify forward [W, 2] =
    [primary, draft], then a per-row decision with the row's own RNG in the solo path's order
    (primary, draft, accept/residual, bonus), and a per-row commit of 0, 1 or 2 positions. A
    lane installed with `depth` 2 or 3 chains that many drafts a cycle (the head again on its own
    output and last draft), verifies [primary, drafts], accepts left to right (the first rejection
    takes the residual) and commits 0 to 1 + depth positions a row. Free slots are
    inert (commit 0). A row with `speculative=False` keeps one target token per cycle (plain AR in
    the same forwards; its output and RNG draws are `generate_ar`'s), and so does an `adaptive`
    row that has stopped drafting (`_LaneRow.drafted`).

    When no live row drafts, or the `StepPolicy` finds that an MTP cycle does not pay where that
    cannot change a row's draws (greedy adaptive rows), the lane runs a plain AR step instead: one
    target forward [W, 1], no head forward. The head's history entries of those positions are
    owed: kept as columns (hidden, token) and written into the head's KV in one [W, n] forward
    before the next MTP cycle, or every HISTORY_FLUSH_AT steps.
    """

    def __init__(self, ladder, prefill_budget: Optional[int] = PREFILL_CHUNK,
                 narrow_after: int = NARROW_AFTER_CYCLES, keep_log: bool = False,
                 draft_draw: Optional[str] = None, greedy_ladder=None):
        if draft_draw is not None and draft_draw not in DRAFT_DRAWS:
            raise ValueError(f"draft_draw={draft_draw!r}: expected one of {DRAFT_DRAWS}")
        self.ladder = _sorted_ladder(ladder)
        # While every row that drafts is greedy, the lane runs as these instead (deeper chains): a
        # greedy row's tokens are the same at any depth, a drafting sampled row's draws are not, so
        # the lane moves to `ladder` at the boundary where such a row is queued or live in it.
        self.greedy_ladder = _sorted_ladder(greedy_ladder) if greedy_ladder is not None else self.ladder
        if [ln.width for ln in self.greedy_ladder] != [ln.width for ln in self.ladder]:
            raise ValueError(f"greedy_ladder widths {[ln.width for ln in self.greedy_ladder]} differ from "
                             f"the ladder's {[ln.width for ln in self.ladder]}")
        self.model = self.ladder[0].model
        self.prefill_chunk = self.ladder[0].prefill_chunk
        self.prefill_budget = prefill_budget          # prompt tokens prefilled per step; None: all
        self.narrow_after = int(narrow_after)
        self.lane: Optional[InstalledA3BMTPBatchLane] = None
        self.rows: list = []                           # slot -> _LaneRow or None (free)
        self.waiting: deque = deque()                  # rows not yet prefilling
        self.admitting: deque = deque()                # _Admission, FIFO
        self.caches = self.mtp_caches = None
        self.logits_last = self.h_last = self.hist_h = None
        self.logits_host: Optional[np.ndarray] = None   # logits_last on the host, kept by sampled cycles
        self.hist_tok: Optional[np.ndarray] = None
        self.forwards: Optional[_CycleForwards] = None
        self.cycles = self.accepted = self.rejected = 0
        self.draft_proposals = self.draft_tokens = 0    # rows' drafting cycles, the drafts they chained
        self.accepted_at = [0] * max(DEPTHS)           # accepted drafts by position in their chain
        self.row_cycles = self.peak_rows = 0            # live rows: summed over cycles, most in one
        self.width_cycles: dict = {}
        self.admitted = self.widenings = self.narrowings = 0
        self.depth_switches = 0                        # moves between ladder and greedy_ladder at one width
        self.shared_prefills = 0                       # rows admitted with a sibling's prefill (n > 1)
        self.cycle_s = self.prefill_s = 0.0            # time spent in cycles / in admission prefill
        self.graph_retraces = 0                        # compiled cycle graphs traced again at new shapes
        self.host_s = 0.0                              # host work in cycles: sampling, accept tests, rows' bookkeeping
        # where sampled rows draw their drafts: "device" (no wait between the head and the verify:
        # one synchronization a cycle) or "host" (from the whole draft distribution, after a wait)
        self.draft_draw = draft_draw or default_draft_draw()
        self.device_drafts = 0                         # drafts drawn on the device
        self._low_demand = 0
        self.keep_log = [] if keep_log else None
        self.draft_log = [] if keep_log else None      # (request id, output position, draft, index in its chain)
        self._policies: dict = {}   # depth -> StepPolicy (a chain's acceptance is its own)
        self.mtp_cycles = self.ar_steps = 0            # of `cycles`, by kind
        self.last_step: Optional[str] = None
        self._owed: list = []       # owed head-history columns: (hidden [W, 1, H], token [W], owner mask [W])
        self._counted: dict = {}    # kind -> (cycle, seconds, lane) of its last counted step not yet in a pair
        # tests: step_plan(cycle index) -> "mtp" | "ar" forces the kind of each step
        self.step_plan: Optional[Callable[[int], str]] = None
        # the self-check's hook: inject_drafts(row index, output position) -> draft token or None
        self.inject_drafts: Optional[Callable[[int, int], Optional[int]]] = None

    # -- rows in and out --------------------------------------------------------------------

    @property
    def width(self) -> int:
        return self.lane.width if self.lane is not None else 0

    @property
    def route_id(self) -> Optional[str]:
        return self.lane.route_id if self.lane is not None else None

    @property
    def policy(self) -> StepPolicy:
        """The step policy of the current lane's draft depth."""
        return self._policies.setdefault(self.lane.depth if self.lane is not None else DEPTH, StepPolicy())

    @property
    def live_rows(self) -> int:
        return sum(1 for r in self.rows if r is not None)

    @property
    def greedy_rows(self) -> int:
        return sum(1 for r in self.rows if r is not None and r.greedy)

    @property
    def demand(self) -> int:
        """Rows that want a slot: live, prefilling and waiting."""
        return self.live_rows + len(self.admitting) + len(self.waiting)

    @property
    def has_work(self) -> bool:
        return self.demand > 0

    def add(self, req: A3BMTPBatchRequest) -> A3BMTPBatchStreamResult:
        """Queue a row; it joins at a cycle boundary when a slot is free. Returns its stream."""
        _validate_request(self.model, req)
        prior = draft_acceptance_prior(self.model) if req.speculative and req.adaptive else ROW_ACCEPT_PRIOR
        row = _LaneRow(req, self.model.vocab_size, prior)
        self.waiting.append(row)
        return row.result

    def cancel_all(self, reason: str = "cancelled") -> None:
        for row in list(self.waiting) + [a.row for a in self.admitting] + [r for r in self.rows if r]:
            row.finish(reason)
        self.waiting.clear()
        self.admitting.clear()
        self.rows = [None] * len(self.rows)

    # -- one cycle boundary and one cycle ------------------------------------------------------

    def step(self) -> None:
        """Admit what fits, then run one cycle for the live rows."""
        self._drop_cancelled()
        self._resize()
        t0 = time.perf_counter()
        self._admit()
        t1 = time.perf_counter()
        self.prefill_s += t1 - t0
        if self.live_rows:
            kind, previous = self._choose_step(), self.last_step
            self._run_step(kind)
            dt = time.perf_counter() - t1
            self.cycle_s += dt
            self._measured(previous, dt)

    def _measured(self, previous: Optional[str], dt: float) -> None:
        """Keep the width's step costs current from this step's time: steady-state steps only (the
        first step after a switch also pays for the switch), and in pairs: a counted step of each
        kind within COST_PAIR_WITHIN steps updates both costs at once, so the ratio the StepPolicy
        compares is measured under one load. (Kept current only while its kind runs, each cost drifts
        with the machine's load while the other's stays stale: a one-row lane whose head drafted
        at 0.9, with MTP cycles costing 1.2x AR steps, stepped aside to AR steps.)
        One slow step (a retrace, a pause) moves a cost by at most half its weight."""
        kind, costs = self.last_step, self.lane.step_costs
        other = "ar" if kind == "mtp" else "mtp"
        if kind not in costs:
            costs[kind] = dt
            return
        if kind != previous:
            return
        seen = self._counted.pop(other, None)
        if seen is None or seen[2] is not self.lane or self.cycles - seen[0] > COST_PAIR_WITHIN:
            self._counted[kind] = (self.cycles, dt, self.lane)
            return
        self._counted.pop(kind, None)
        for k, t in ((kind, dt), (other, seen[1])):
            est = costs[k]
            costs[k] = est + STEP_COST_EMA * (min(max(t, est / 1.5), 1.5 * est) - est)

    def _choose_step(self) -> str:
        """An MTP cycle or a plain AR step for the next cycle. A row that wants to draft and whose
        draws the choice would change (sampled, or forced "mtp") gets an MTP cycle; greedy
        adaptive rows leave it to the cost model."""
        if self.step_plan is not None:
            return self.step_plan(self.cycles)
        live = [r for r in self.rows if r is not None]
        wanting = [r for r in live if r.wants_draft()]
        if not wanting:
            return "ar"
        if any(not (r.greedy and r.req.adaptive) for r in wanting):
            return "mtp"
        if self.policy.acceptance is None:
            # from the model's prior, as its rows start: a lane starts with each request at one
            # client, and estimated from its first outcome alone, one rejected first draft sent it
            # to 16 + 32 AR steps (the acceptance then climbing back one weighted outcome a probe)
            p = draft_acceptance_prior(self.model)       # per draft; a chain's j-th needs all before it
            self.policy.acceptance = sum(p ** j for j in range(1, self.lane.depth + 1))
        return self.policy.choose(self.lane.step_costs, len(live), len(wanting), self.lane.depth)

    def _run_step(self, kind: str) -> None:
        # an MTP cycle in which no row drafts is an AR step (and the head's history is owed)
        if kind == "mtp" and any(r is not None and r.wants_draft() for r in self.rows):
            self.mtp_cycles += 1
            self._cycle()
        else:
            kind = "ar"             # its time is an AR step's
            self.ar_steps += 1
            self._ar_step()
        self.last_step = kind

    def admit_all(self) -> None:
        """Prefill and merge every waiting row that fits, before any cycle (a sealed cohort)."""
        budget, self.prefill_budget = self.prefill_budget, None
        try:
            self._drop_cancelled()
            self._resize()
            self._admit()
        finally:
            self.prefill_budget = budget

    def _drop_cancelled(self) -> None:
        for row in [r for r in self.waiting if r.cancelled()]:
            self.waiting.remove(row)
            row.finish("cancelled")
        for adm in [a for a in self.admitting if a.row.cancelled()]:
            self.admitting.remove(adm)
            adm.row.finish("cancelled")
        for b, row in enumerate(self.rows):
            if row is not None and row.cancelled():
                row.finish("cancelled")
                self.rows[b] = None

    def _resize(self) -> None:
        """Pick the narrowest installed width that fits the demand: widen at once, narrow after
        `narrow_after` cycles of low demand (never below the live rows). The depth follows the
        rows at once: `greedy_ladder` while every row, live or queued, that drafts in its next cycle
        is greedy (a sampled row that does not draft makes the same draws at any depth)."""
        demand = self.demand
        ladder = self.ladder
        if self.greedy_ladder is not self.ladder:
            rows = chain(self.rows, (a.row for a in self.admitting), self.waiting)
            if all(r is None or r.greedy or not r.wants_draft() for r in rows):
                ladder = self.greedy_ladder
        fit = next((ln for ln in ladder if ln.width >= demand), ladder[-1])
        if self.lane is None:
            self._reshape(fit, [])
            return
        if fit.width > self.width:
            self.widenings += 1
            self._low_demand = 0
            self._reshape(fit, list(range(self.width)))
            return
        if fit.width < self.width and self.live_rows <= fit.width:
            self._low_demand += 1
            if self._low_demand >= self.narrow_after or not self.live_rows:
                self.narrowings += 1
                self._low_demand = 0
                self._reshape(fit, [b for b, r in enumerate(self.rows) if r is not None])
                return
        else:
            self._low_demand = 0
        here = next(ln for ln in ladder if ln.width == self.width)
        if here is not self.lane:         # same width, another depth
            self.depth_switches += 1
            self._reshape(here, list(range(self.width)))

    def _reshape(self, lane: InstalledA3BMTPBatchLane, keep: list) -> None:
        """Run as `lane` from now on; the rows in slots `keep` move to slots 0.. with their state.
        Onto a lane chaining another number of drafts, rows first settle the head history their
        last cycle left owed (its layout is [W, depth]), as before an AR step."""
        if self.lane is not None and lane.depth != self.lane.depth and self.hist_h is not None:
            self._owe_cycle_history()
            self.hist_h = mx.zeros((self.width, lane.depth) + self.hist_h.shape[2:], self.hist_h.dtype)
            self.hist_tok = np.zeros((self.width, lane.depth), dtype=np.int64)
        self._write_owed_history()       # its columns are as wide as the old width
        W = lane.width
        index = keep + [None] * (W - len(keep))
        rows = [self.rows[i] if i is not None else None for i in index]
        if index == list(range(self.width)) and W == self.width:
            pass                         # every row stays in its slot: the state as it is
        elif self.caches is not None and any(r is not None for r in rows):
            take = [i if i is not None else 0 for i in index]
            self.caches = [c.take_rows(index) for c in self.caches]
            self.mtp_caches = [c.take_rows(index) for c in self.mtp_caches]
            sel = mx.array(take, dtype=mx.int32)
            self.logits_last, self.h_last, self.hist_h = (
                self.logits_last[sel], self.h_last[sel], self.hist_h[sel])
            self.hist_tok = self.hist_tok[np.array(take)]
        else:            # nothing live to carry: start from empty layers at the new width
            self.caches = self.mtp_caches = None
        self.lane, self.rows = lane, rows
        self.forwards = self.logits_host = None
        self._reserve_for_life([r for r in rows if r is not None])

    def _reserve_for_life(self, rows: list) -> None:
        """A compiled lane's KV buffers sized now for these rows' whole lives, so its graphs are not
        traced again while they decode."""
        if not self.lane.compiled or not rows or self.caches is None:
            return
        need = max(len(r.req.prompt_ids) + r.req.max_tokens for r in rows) + max(VERIFY_T, HISTORY_FLUSH_AT)
        for layer in self.caches + self.mtp_caches:
            if isinstance(layer, RaggedKVCache):
                layer.ensure_capacity(need)

    def _ensure_state(self, adm: _Admission) -> None:
        """Empty lane state at the current width, shaped like this first row's."""
        if self.caches is not None:
            return
        W = self.width
        self.caches = [empty_batch_layer(c, W) for c in adm.cache]
        self.mtp_caches = [empty_batch_layer(c, W) for c in adm.mtp_cache or []]
        logits, hidden = adm.out
        self.logits_last = mx.zeros((W,) + logits.shape, logits.dtype)
        self.h_last = mx.zeros((W,) + hidden.shape[1:], hidden.dtype)
        D = self.lane.depth
        self.hist_h = mx.zeros((W, D) + hidden.shape[2:], hidden.dtype)    # owed entries, oldest first
        self.hist_tok = np.zeros((W, D), dtype=np.int64)

    def _admit(self) -> None:
        """Start prefills for free slots (FIFO), advance them within the prefill budget, and merge
        each finished prefill into a free slot."""
        free = self.width - self.live_rows
        while self.waiting and len(self.admitting) < free:
            self.admitting.append(_Admission(self.model, self.waiting.popleft(), self.prefill_chunk))
        budget = self.prefill_budget
        spent = 0
        while self.admitting and (budget is None or spent < budget):
            adm = self.admitting[0]
            spent += adm.advance()
            if adm.out is not None:
                self.admitting.popleft()
                self._place(adm)
                self._place_siblings(adm)

    def _place_siblings(self, adm: _Admission) -> None:
        """Rows of adm's prefill group that have not started their own prefill take its prefill
        instead, as far as free slots go (the rest prefill on their own when a slot frees)."""
        group = adm.row.req.prefill_group
        if group is None:
            return

        def sibling(row):
            return row.req.prefill_group == group and row.req.prompt_ids == adm.row.req.prompt_ids

        for other in [a for a in self.admitting if a.steps is None and sibling(a.row)]:
            if None not in self.rows:
                return
            self.admitting.remove(other)
            self.shared_prefills += 1
            self._place(adm.shared_with(other.row))
        for row in [r for r in self.waiting if sibling(r)]:
            if None not in self.rows:
                return
            self.waiting.remove(row)
            self.shared_prefills += 1
            self._place(adm.shared_with(row))

    def _place(self, adm: _Admission) -> None:
        self._ensure_state(adm)
        b = self.rows.index(None)
        for layer, per_row in zip(self.caches, adm.cache):
            layer.put_row(b, per_row)
        for layer, per_row in zip(self.mtp_caches, adm.mtp_cache or []):
            layer.put_row(b, per_row)
        self._reserve_for_life([adm.row])
        logits, hidden = adm.out
        self.logits_last[b] = logits
        self.h_last[b] = hidden[0]
        self.logits_host = None
        self.hist_tok[b] = 0
        for _h, _t, owner in self._owed:       # the slot's owed history was its previous row's
            owner[b] = False
        row = adm.row
        r = row.result
        self.rows[b] = row
        r.admitted_at_cycle, r.fixed_width, r.route_id = self.cycles, self.width, self.lane.route_id
        r.real_width = self.live_rows
        self.admitted += 1
        try:
            row.req.on_decode_start()
        except Exception:
            row.finish("cancelled")
            self.rows[b] = None
            return
        # The first token comes from the prefill's logits: emit it now rather than after a cycle
        # (time to first token); the next cycle feeds it as the row's primary. Same draw, same order.
        first = int(mx.argmax(logits).item()) if row.greedy else sample(row.dist(to_host(logits)), row.rng)
        if row.emit(first, _host_logprob(logits, first, row.req.logprobs)):
            self.rows[b] = None
        else:
            row.pending = first

    def _injected(self, drafts: np.ndarray, has_pending: np.ndarray, drafting: np.ndarray) -> np.ndarray:
        """Drafts replaced by `inject_drafts` (row index = request id in a sealed cohort); the
        draft guesses the output position after this cycle's primary."""
        for b, row in enumerate(self.rows):
            if drafting[b]:
                primary_at = len(row.result.tokens) - int(has_pending[b])
                tok = self.inject_drafts(int(row.req.request_id), primary_at + 1)
                if tok is not None:
                    drafts[b] = tok
        return drafts

    def _primaries(self):
        """Start a step (cycle or AR step): count it for the lane and its live rows, and pick each
        row's primary token (its pending token, else drawn from its last logits)."""
        rows, W = self.rows, self.width
        self.cycles += 1
        n_live = self.live_rows
        self.row_cycles += n_live
        self.peak_rows = max(self.peak_rows, n_live)
        self.width_cycles[W] = self.width_cycles.get(W, 0) + 1
        active = np.array([r is not None for r in rows])
        for row in rows:
            if row is not None:
                r = row.result
                r.cycles += 1
                r.occupancy_sum += n_live
                r.real_width = max(r.real_width, n_live)
                if W >= r.fixed_width:
                    r.fixed_width, r.route_id = W, self.lane.route_id
        has_pending = np.array([r is not None and r.pending is not None for r in rows])
        pending = np.array([r.pending if r is not None and r.pending is not None else 0 for r in rows],
                           dtype=np.int64)
        greedy = all(r.greedy for r in rows if r is not None)
        logits_host = None if greedy else (self.logits_host if self.logits_host is not None
                                           else to_host(self.logits_last))
        x0_host = None
        if greedy:
            x0 = mx.where(mx.array(has_pending), mx.array(pending, dtype=mx.uint32),
                          mx.argmax(self.logits_last, axis=-1).astype(mx.uint32))
        else:
            t_host = time.perf_counter()
            x0_host = pending.copy()
            for b, row in enumerate(rows):
                if active[b] and not has_pending[b]:
                    x0_host[b] = sample(row.dist(logits_host[b]), row.rng)
            x0 = mx.array(x0_host, dtype=mx.uint32)
            self.host_s += time.perf_counter() - t_host
        return active, has_pending, greedy, logits_host, x0, x0_host

    def _write_owed_history(self) -> None:
        """Write the head-history entries owed by AR steps into the head's KV: one head forward
        over [W, n] (no logits), each row's own columns left-aligned in order, then each row keeps
        its own count. MTP history is then exactly what consecutive MTP cycles would have written."""
        cols, self._owed = self._owed, []
        if not cols or not self.mtp_caches:
            return
        owner = np.stack([c[2] for c in cols], axis=1)                  # [W, n]
        counts = owner.sum(axis=1)
        if not counts.any():
            return
        n = len(cols)
        own = np.argsort(~owner, axis=1, kind="stable")              # each row's own columns first, in order
        last = np.take_along_axis(own, np.maximum(counts - 1, 0)[:, None], axis=1)
        idx = np.where(np.arange(n)[None, :] < counts[:, None], own, last).astype(np.int32)
        h = mx.take_along_axis(mx.concatenate([c[0] for c in cols], axis=1), mx.array(idx)[:, :, None], axis=1)
        t = mx.take_along_axis(mx.stack([c[1] for c in cols], axis=1), mx.array(idx), axis=1)
        self.model.draft_hidden(h, t, self.mtp_caches)     # lazy: only the layer's keys and values are used
        commit_rows(self.mtp_caches, n, counts)

    def _owe_cycle_history(self) -> np.ndarray:
        """Move the head-history entries the last MTP cycle left owed (rows' accepted drafts) to
        the owed columns `_write_owed_history` writes; rows then owe none. Returns which rows may
        draft (their entries are kept)."""
        rows = self.rows
        may_draft = np.array([r is not None and r.req.speculative for r in rows])
        owed = np.array([r.owed if r is not None else 0 for r in rows]) * may_draft
        for j in range(int(owed.max(initial=0))):      # oldest first
            self._owed.append((self.hist_h[:, j:j + 1], mx.array(self.hist_tok[:, j], dtype=mx.uint32), owed > j))
        for row in rows:
            if row is not None:
                row.owed = 0
        return may_draft

    def _ar_step(self) -> None:
        """One plain AR step for every live row: one target forward over [W, 1] = [primary], no
        head forward; each row keeps its target's next token (the same draws, in the same order,
        as a non-drafting row in an MTP cycle: `generate_ar`'s). The head-history entries of these
        positions (and any entry owed from the last MTP cycle) are kept for `_write_owed_history`."""
        if self.forwards is None:
            self.forwards = _CycleForwards(self.lane, self.caches, self.mtp_caches, weakref.proxy(self))
        rows, W = self.rows, self.width
        active, has_pending, greedy, _, x0, x0_host = self._primaries()
        if self.mtp_caches:
            may_draft = self._owe_cycle_history()
            if may_draft.any():
                self._owed.append((self.h_last, x0, may_draft))
        H, L = self.forwards.verify(x0[:, None], graph="ar")          # [W, 1, Hd], [W, 1, V]
        if greedy:
            target_ids = mx.argmax(L[:, 0], axis=-1)
            mx.eval(x0, target_ids)
            x0_host, target_ids = np.array(x0), np.array(target_ids)
        else:
            L_host = to_host(L[:, 0])
        lp_host = self._logprob_logits(L[:, 0], None if greedy else L_host)
        t_host = time.perf_counter()
        keep = np.zeros(W, dtype=np.int64)
        for b, row in enumerate(rows):
            if not active[b]:
                continue
            if not has_pending[b] and self._emit_primary(b, row, int(x0_host[b])):
                continue
            row.skipped()
            tok = int(target_ids[b]) if greedy else sample(row.dist(L_host[b]), row.rng)
            row.pending, keep[b] = None, 1
            if not row.emit(tok, None if row.req.logprobs is None else logprob_entry(lp_host[b], tok, row.req.logprobs)):
                row.pending = tok
        for b, row in enumerate(rows):
            if active[b] and row.live and row.req.repetition_stop:
                row.check_repetition()
            if active[b] and not row.live:
                keep[b] = 0
                rows[b] = None
        if self.keep_log is not None:
            self.keep_log.extend(int(k) for k, a in zip(keep, active) if a)
        self.host_s += time.perf_counter() - t_host
        commit_rows(self.caches, 1, keep)
        self.h_last, self.logits_last = H, L[:, 0]
        self.logits_host = None if greedy else L_host
        if len(self._owed) >= HISTORY_FLUSH_AT:
            self._write_owed_history()

    def _emit_primary(self, b: int, row: _LaneRow, token: int) -> bool:
        """Emit row b's primary token (not yet emitted: it came from last step's logits); True
        when the row finished on it."""
        return row.emit(token, _host_logprob(self.logits_last[b], token, row.req.logprobs))

    def _logprob_logits(self, logits: mx.array, host: Optional[np.ndarray]):
        """This step's logits on the host for logprob entries, only when a row asked for them
        (a sampled step already has them: `host`)."""
        if not any(r is not None and r.req.logprobs is not None for r in self.rows):
            return None
        return host if host is not None else to_host(logits)

    def _sampled_drafts(self, q_logits: mx.array, drafting: np.ndarray, q_probs: list):
        """A sampled lane's drafts [W] (lazy): a greedy draft sampler's is the head's argmax (q a
        point mass, no draw); with `draft_draw` "device" the others are drawn on the device from
        each row's own uniform (no wait: the host learns q after the verify), except rows whose
        draft sampler has penalties, which draw on the host from their whole q (`q_probs`) after
        a wait for the draft logits. Returns (drafts, device-drawn rows, the device draw)."""
        rows, W = self.rows, self.width
        coupled = np.array([drafting[b] and r.greedy_draft for b, r in enumerate(rows)])
        drawn = drafting & ~coupled
        on_device = drawn & (self.draft_draw == "device") & np.array(
            [r is not None and draws_on_device(r.draft_sampler) for r in rows])
        on_host = [b for b in range(W) if drawn[b] and not on_device[b]]
        d_host = np.zeros(W, dtype=np.int64)
        q_host = to_host(q_logits) if on_host else None     # the wait for the head
        t_host = time.perf_counter()
        for b in on_host:
            q_probs[b] = rows[b].dist(q_host[b], rows[b].draft_sampler)
            d_host[b] = sample(q_probs[b], rows[b].rng)
        d = mx.array(d_host, dtype=mx.uint32)
        device_draw = None
        if on_device.any():
            m = np.array([draft_uniform(r.rng) if on_device[b] else 0 for b, r in enumerate(rows)])
            cfgs = [r.draft_sampler if on_device[b] else SamplerConfig() for b, r in enumerate(rows)]
            drafts, ids, t = device_draft_draw(q_logits, cfgs, m)
            d = mx.where(mx.array(on_device), drafts, d)
            device_draw = (ids, t, m)
            self.device_drafts += int(on_device.sum())
        if coupled.any():
            d = mx.where(mx.array(coupled), mx.argmax(q_logits, axis=-1).astype(mx.uint32), d)
        self.host_s += time.perf_counter() - t_host
        return d, on_device, device_draw

    def _device_draft_distributions(self, device_draw, on_device: np.ndarray, d_host: np.ndarray,
                                    q_probs: list) -> None:
        """After the cycle's one wait: each device-drawn row's exact q, from its candidates and
        thresholds, and a check that the device took the candidate its uniform names."""
        ids, t, m = device_draw
        ids, t = np.asarray(ids), np.asarray(t)
        t_host = time.perf_counter()
        for b in np.flatnonzero(on_device):
            q_probs[b], drawn = device_draft_distribution(ids[b], t[b], self.model.vocab_size, int(m[b]))
            if self.inject_drafts is None and drawn != int(d_host[b]):
                raise RuntimeError(f"row {b}'s device draft {int(d_host[b])} is not the candidate its "
                                   f"uniform names ({drawn}): the device draw and its q disagree")
        self.host_s += time.perf_counter() - t_host

    def _cycle(self) -> None:
        if self.forwards is None:
            self.forwards = _CycleForwards(self.lane, self.caches, self.mtp_caches, weakref.proxy(self))
        caches, mtp_caches, forwards = self.caches, self.mtp_caches, self.forwards
        rows, W, D = self.rows, self.width, self.lane.depth
        # -- which rows draft (their own policy), with the history owed by AR steps written first
        self._write_owed_history()
        drafting = np.array([r is not None and r.wants_draft() for r in rows])
        active, has_pending, greedy, logits_host, x0, x0_host = self._primaries()
        owed = np.array([r.owed if r is not None else 0 for r in rows])
        depth = D if self.inject_drafts is None else 1      # the self-check injects single drafts

        # 2. draft: MTP head over [W, 1 + D] = [owed history entries | (h_last, x0) | repeats of it]
        #    (non-drafting rows write their history entries too); at depth 2-3 the head then chains
        #    on its own output and last draft, entries it drops at once
        d = x0[:, None]
        q_probs = [[None] * W for _ in range(depth)]   # sampled rows' draft distributions (None: a point mass)
        draws = []       # per chained draft: rows drawn on the device, their candidates and thresholds, uniforms
        if drafting.any():
            q_logits, g = forwards.draft(self.hist_h, self.h_last, mx.array(self.hist_tok, dtype=mx.uint32), x0,
                                         mx.array(owed.astype(np.int32)))        # [W, V], [W, 1, H]
            commit_rows(mtp_caches, D + 1, np.where(active, 1 + owed, 0))

            def drafts_from(j, q_logits):      # the j-th draft of every row [W] (lazy)
                if greedy:
                    return mx.argmax(q_logits, axis=-1).astype(mx.uint32)
                dj, on_device, device_draw = self._sampled_drafts(q_logits, drafting, q_probs[j])
                draws.append((on_device, device_draw))
                return dj

            drafts = [drafts_from(0, q_logits)]
            for j in range(1, depth):
                q_logits, g = forwards.chain(g, drafts[-1])
                commit_rows(mtp_caches, 1, np.zeros(W, dtype=np.int64))
                drafts.append(drafts_from(j, q_logits))
            d = mx.stack(drafts, axis=1) if depth > 1 else drafts[0][:, None]
            if greedy:
                mx.async_eval(d)        # the drafts compute while the verify's graph is built

        if self.inject_drafts is not None:
            d = mx.array(self._injected(np.array(d[:, 0]), has_pending, drafting), dtype=mx.uint32)[:, None]

        # 3. verify: target forward over [W, 1 + depth] = [x0, drafts]
        H, L = forwards.verify(mx.concatenate([x0[:, None], d], axis=1))   # [W, T, Hd], [W, T, V]
        if greedy:
            target_ids = mx.argmax(L, axis=-1)
            mx.eval(x0, d, target_ids)
            x0_host, d_host, target_ids = np.array(x0), np.array(d), np.array(target_ids)
        else:
            mx.eval(L, d)              # the cycle's one wait (drafts drawn on the device ride along)
            L_host = to_host(L)
            d_host = np.array(d)
        # log-probabilities from the verify logits on the host (a greedy lane's are read only when
        # one of its rows asked for them)
        lp_host = self._logprob_logits(L, None if greedy else L_host)

        for j, (on_device, device_draw) in enumerate(draws):
            if on_device.any():
                self._device_draft_distributions(device_draw, on_device, d_host[:, j], q_probs[j])

        def entry(b, j, tok):      # row b's log-probability entry for token `tok` at verify position j
            k = rows[b].req.logprobs
            return None if k is None else logprob_entry(lp_host[b, j], tok, k)

        # 4. per-row decision, same RNG order as the solo path
        t_host = time.perf_counter()
        keep = np.zeros(W, dtype=np.int64)
        n_drafted = n_accepted = 0
        for b, row in enumerate(rows):
            if not active[b]:
                continue
            if not has_pending[b] and self._emit_primary(b, row, int(x0_host[b])):
                continue
            r = row.result
            if not drafting[b]:               # plain AR: the target's own next token
                row.skipped()
                tok = int(target_ids[b, 0]) if greedy else sample(row.dist(L_host[b, 0]), row.rng)
                row.pending, row.owed, keep[b] = None, 0, 1
                if not row.emit(tok, entry(b, 0, tok)):
                    row.pending = tok
                continue
            row.pending = None
            n_drafted += 1
            a = 0                            # drafts accepted
            for j in range(depth):
                draft = int(d_host[b, j])
                if greedy:
                    ok, tok = draft == int(target_ids[b, j]), int(target_ids[b, j])
                else:
                    q = q_probs[j][b] if q_probs[j][b] is not None else Distribution.point(draft, self.model.vocab_size)
                    ok, tok = verify_one_token(row.dist(L_host[b, j]), q, draft, row.rng)
                if j == 0:
                    row.drafted(ok)          # its policy reads its first draft's outcome
                    r.mtp_depth = max(r.mtp_depth, depth)
                    self.draft_proposals += 1
                    self.draft_tokens += depth
                if self.draft_log is not None:
                    self.draft_log.append((row.req.request_id, len(r.tokens), draft, j))
                if not ok:
                    self.rejected += 1
                    r.rejected_drafts += 1
                    keep[b] = 1 + a
                    if not row.emit(tok, entry(b, j, tok)):
                        row.pending = tok
                    break
                a += 1
                self.accepted += 1
                self.accepted_at[j] += 1
                r.accepted_drafts += 1
                if row.emit(tok, entry(b, j, tok)):
                    break
            n_accepted += a
            if not row.live:
                continue
            if a == depth:
                keep[b] = 1 + depth
                if not row.req.omit_speculative_bonus and len(r.tokens) < row.req.max_tokens:
                    bonus = int(target_ids[b, depth]) if greedy else sample(row.dist(L_host[b, depth]), row.rng)
                    if not row.emit(bonus, entry(b, depth, bonus)):
                        row.pending = bonus
            row.owed = a                     # entries (H[j], draft j) for its accepted drafts
        self.hist_tok[:, :depth] = d_host    # read only for the entries rows owe
        for b, row in enumerate(rows):
            if active[b] and row.live and row.req.repetition_stop:
                row.check_repetition()
            if active[b] and not row.live:
                keep[b] = 0           # finished this cycle: freeze its state, free its slot
                rows[b] = None
        if self.keep_log is not None:
            self.keep_log.extend(int(k) for k, a in zip(keep, active) if a)
        self.policy.observe(n_drafted, n_accepted)
        self.host_s += time.perf_counter() - t_host

        # 5. commit: each row keeps 0..1 + depth verify positions; last logits/hidden follow
        commit_rows(caches, 1 + depth, keep)
        sel = mx.array(np.maximum(keep - 1, 0).astype(np.int32))[:, None, None]
        self.hist_h = H[:, :D]
        self.h_last = mx.take_along_axis(H, sel, axis=1)
        self.logits_last = mx.take_along_axis(L, sel, axis=1)[:, 0]
        self.logits_host = None if greedy else L_host[np.arange(W), np.maximum(keep - 1, 0)]


def generate_a3b_mtp_batch(lane: InstalledA3BMTPBatchLane, requests, *, draft_draw: Optional[str] = None,
                           _keep_log: bool = False, _inject_drafts=None) -> A3BMTPBatchResult:
    """Decode 2..width requests as one sealed cohort of this lane (every row prefilled before the
    first cycle; no row joins later). Rows are returned in request order. `draft_draw`: where
    sampled rows draw their drafts ("device" | "host"; None: `default_draft_draw()`)."""
    requests = list(requests)
    _validate(lane, requests)
    running = RunningLane(lane, keep_log=_keep_log, draft_draw=draft_draw)
    running.inject_drafts = _inject_drafts
    streams = [running.add(r) for r in requests]
    t_prefill = time.perf_counter()
    running.admit_all()
    t_decode = time.perf_counter()
    max_cycles = max(r.max_tokens for r in requests) + 2
    while running.has_work:
        if running.cycles >= max_cycles:
            raise RuntimeError(f"cohort exceeded its safety cap of {max_cycles} cycles")
        running.step()
    t_end = time.perf_counter()
    result = A3BMTPBatchResult(
        streams=streams, cycles=running.cycles, accepted_drafts=running.accepted,
        rejected_drafts=running.rejected, route_id=lane.route_id, width_histogram={lane.width: running.cycles},
        real_width=len(requests), fixed_width=lane.width, prefill_s=t_decode - t_prefill,
        decode_s=t_end - t_decode, host_s=running.host_s)
    if _keep_log:
        result.keep_log = running.keep_log
    return result
