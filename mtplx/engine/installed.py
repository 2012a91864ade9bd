"""An installed lane: a model bound at one width and draft depth (route id, compiled graphs, the
step costs measured on this machine), and the ladders a running lane moves along."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from mtplx.engine.commit import HISTORY_FLUSH_AT
from mtplx.engine.prefill import PREFILL_CHUNK
from mtplx.engine.row import validate_request

DEPTH = 1                   # drafts a cycle chains unless its lane is installed with another `depth`
DEPTHS = (1, 2, 3)
VERIFY_T = 2
MIN_WIDTH, MAX_WIDTH = 2, 32
NUMERICS_PROFILES = ("throughput", "b1-exact")
# KV positions a row's caches may hold past its prompt and budget: a verify's positions past its
# last kept token, or the head's history owed by plain AR steps until it is written
ROW_SLACK = max(1 + max(DEPTHS), HISTORY_FLUSH_AT)


def row_positions(prompt_tokens: int, max_tokens: int) -> int:
    """KV positions one row may hold in its whole life (what a lane reserves for it, what the
    memory budget counts)."""
    return prompt_tokens + max_tokens + ROW_SLACK


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


def new_lane(model, width: int, numerics: str, selfcheck: dict, compiled: Optional[bool],
              depth: int = DEPTH, graphs: Optional[dict] = None) -> InstalledA3BMTPBatchLane:
    """`graphs`: the compiled graphs of another lane of this width and numerics to share (lanes of
    other depths run the same forwards; a lane that switches depth would otherwise trace its AR
    step's graph again at every span)."""
    route_id = _route_id(model, width, numerics, depth)
    compiled = True if compiled is None else bool(compiled)      # None: EngineSettings' default
    return InstalledA3BMTPBatchLane(
        model=model, width=width, depth=depth, verify_t=1 + depth, numerics=numerics, route_id=route_id,
        config_fingerprint=_fingerprint(model, numerics, route_id), selfcheck=selfcheck,
        compiled=compiled, span_bucket=_span_bucket(model, width) if compiled else None,
        _graphs={} if graphs is None else graphs)


# Compiled attention spans of wide lanes are rounded up to this many positions: one graph per span
# (BENCHMARKS.md, "Measurements behind the engine's constants").
SPAN_BUCKET = 64


def _span_bucket(model, width: int) -> Optional[int]:
    """Wide lanes of attention-only models attend over a span rounded up to SPAN_BUCKET (a compiled
    graph has fixed shapes, and one over the whole buffer, sized for the rows' whole lives, was
    slower than eager). The one-row lane (its buffer is its own prompt + max_tokens) and models
    with recurrent (GDN) layers keep one graph over the whole buffer."""
    from mtplx.models.recurrent_cache import RecurrentCache

    if width == 1 or any(isinstance(c, RecurrentCache) for c in model.make_cache()):
        return None
    return SPAN_BUCKET


def solo_lane(model, depth: int = DEPTH, compiled: Optional[bool] = None) -> InstalledA3BMTPBatchLane:
    """The one-row lane chaining `depth` drafts: `generate_mtpk` decodes through it, and a running
    lane with one row runs at this width (compiled cycle graphs unless `compiled` is False, same
    code as the cohorts). Cached on the model; its numerics are covered by the cohort self-checks
    and the solo exactness tests."""
    compiled = True if compiled is None else bool(compiled)      # None: EngineSettings' default
    lanes = model.__dict__.setdefault("_solo_lanes", {})
    if (depth, compiled) not in lanes:
        shared = solo_lane(model, DEPTH, compiled)._graphs if depth != DEPTH else None
        lanes[(depth, compiled)] = new_lane(model, 1, "throughput", {"skipped": "solo lane"}, compiled, depth, shared)
    return lanes[(depth, compiled)]


def ar_lanes(model, widths, compiled: Optional[bool] = None) -> list:
    """Lanes for plain AR rows only (a model without an MTP head): the one-row lane and these
    widths, with no self-check (no drafts, no commits but 1)."""
    reason = getattr(model, "mtp_disabled_reason", None) or "no MTP head"
    return [solo_lane(model, compiled=compiled)] + [
        new_lane(model, int(w), "throughput", {"skipped": f"AR rows only: {reason}"}, compiled)
        for w in sorted(set(widths)) if int(w) > 1]


def validate_cohort(lane, requests) -> None:
    n = len(requests)
    lo = 1 if lane.width == 1 else MIN_WIDTH
    if not lo <= n <= lane.width:
        raise ValueError(f"a cohort needs {lo}..{lane.width} requests for lane {lane.route_id}; got {n}")
    for r in requests:
        validate_request(lane.model, r)


def sorted_ladder(ladder) -> list:
    ladder = [ladder] if isinstance(ladder, InstalledA3BMTPBatchLane) else list(ladder)
    if not ladder:
        raise ValueError("a running lane needs at least one installed lane")
    ladder = sorted(ladder, key=lambda ln: ln.width)
    if len({ln.width for ln in ladder}) < len(ladder):
        raise ValueError(f"a running lane's installed lanes need distinct widths; got {[ln.width for ln in ladder]}")
    return ladder
