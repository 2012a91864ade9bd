"""An installed lane: a model bound at one width and draft depth (route id, compiled graphs, the
step costs measured on this machine), and the ladders a running lane moves along."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional


from mtplx.engine.prefill import PREFILL_CHUNK
from mtplx.engine.row import validate_request

DEPTH = 1                   # drafts a cycle chains unless its lane is installed with another `depth`
DEPTHS = (1, 2, 3)
VERIFY_T = 2
MIN_WIDTH, MAX_WIDTH = 2, 32
NUMERICS_PROFILES = ("throughput", "b1-exact")
DRAFT_DRAWS = ("device", "host")


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
              depth: int = DEPTH) -> InstalledA3BMTPBatchLane:
    route_id = _route_id(model, width, numerics, depth)
    compiled = _default_compile() if compiled is None else bool(compiled)
    return InstalledA3BMTPBatchLane(
        model=model, width=width, depth=depth, verify_t=1 + depth, numerics=numerics, route_id=route_id,
        config_fingerprint=_fingerprint(model, numerics, route_id), selfcheck=selfcheck,
        compiled=compiled, span_bucket=_span_bucket(model, width) if compiled else None)


# Compiled attention spans of wide lanes are rounded up to this many positions: one graph per span
# (BENCHMARKS.md, "Measurements behind the engine's constants").
SPAN_BUCKET = 64


def _env_switch(name: str, default: bool) -> bool:
    """An on/off environment setting: "0", "off", "false" or "no" turn it off, anything else on;
    unset or blank, `default`."""
    env = os.environ.get(name, "").strip().lower()
    return env not in ("0", "off", "false", "no") if env else default


def _default_compile() -> bool:
    """Cycle graphs are compiled (`mx.compile`) unless MTPLX_MTP_BATCH_COMPILE=0 (faster on the
    shipped model: BENCHMARKS.md, "Measurements behind the engine's constants"). Each graph's
    first run at a span and shape is checked against its eager forward (`CycleForwards._checked`)."""
    return _env_switch("MTPLX_MTP_BATCH_COMPILE", True)


def default_draft_draw() -> str:
    """Where sampled rows draw their drafts unless MTPLX_DRAFT_DRAW says: on the device, so a
    cycle waits for the device once, however many drafts it chains (drawn on the host, each
    chained draft waits for the head: on this project's CPU a service of mixed settings made
    1.17x the tokens/s with its sampled rows chaining 2 drafts drawn on the device; BENCHMARKS.md,
    "Measurements behind the engine's constants")."""
    env = os.environ.get("MTPLX_DRAFT_DRAW", "").strip().lower()
    if env:
        if env not in DRAFT_DRAWS:
            raise ValueError(f"MTPLX_DRAFT_DRAW={env!r}: expected one of {DRAFT_DRAWS}")
        return env
    return "device"


def default_overlap() -> bool:
    """Whether running lanes launch their next MTP cycle before a step's events go out, unless
    MTPLX_OVERLAP says: on a GPU (Metal), where `mx.async_eval` returns at once and the device
    computes the launched cycle while the host streams the step's tokens; not on MLX's CPU
    backend, where a forward's async_eval computes most of it before returning (a B8 launch took
    18 of its cycle's 20 ms), so launching early only delays the step's events (BENCHMARKS.md,
    "Measurements behind the engine's constants")."""
    import mlx.core as mx

    return _env_switch("MTPLX_OVERLAP", mx.default_device() == mx.gpu)


def default_device_judging() -> bool:
    """Whether running lanes judge sampled rows' chains on the device (`acceptor.DeviceVerdicts`),
    unless MTPLX_DEVICE_JUDGE says: on a GPU, where the host's accept tests are what the device
    waits for each sampled cycle; not on MLX's CPU backend, where the device is the host's core and
    judging there cost what the host saved (served side by side, t0.6 at 8 clients 0.98x; mixed
    at 16 clients 0.95-1.05x; BENCHMARKS.md, "Measurements behind the engine's constants")."""
    import mlx.core as mx

    return _env_switch("MTPLX_DEVICE_JUDGE", mx.default_device() == mx.gpu)


def default_run_ahead() -> bool:
    """Whether running lanes of greedy rows launch each MTP cycle before the host reads the last
    one's verify (its keep and next primaries computed on the device), unless MTPLX_RUN_AHEAD
    says: on by default, on the CPU and on a GPU alike (BENCHMARKS.md, "Measurements behind the
    engine's constants")."""
    return _env_switch("MTPLX_RUN_AHEAD", True)


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
    compiled = _default_compile() if compiled is None else bool(compiled)
    lanes = model.__dict__.setdefault("_solo_lanes", {})
    if (depth, compiled) not in lanes:
        lanes[(depth, compiled)] = new_lane(model, 1, "throughput", {"skipped": "solo lane"}, compiled, depth)
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
