"""The lanes a service's running lanes move along: the installed widths (self-checked), their
counterparts chaining more drafts (greedy rows' depth per width, `greedy_depths`, given or chosen
by measured cost; sampled rows' one depth, `sampled_depth`), the forced width, the numerics
profile, and the ladders a key's running lane takes from them."""

from __future__ import annotations

import logging
from typing import Any, Iterable, Optional

from mtplx.scheduler.config import MAX_COHORT_ROWS, NUMERICS, checked_greedy_depths
from mtplx.scheduler.results import MTP_DEPTH, installed_snapshot

logger = logging.getLogger(__name__)


class LaneLadder:
    """Installed lanes by width. `numerics=None` takes the installed lanes' profile (else
    "throughput"); `force_width`: the narrowest width, pinned (None: none); `compiled=None`: the
    engine's default. Lane installation runs on the model-owner thread (the service's call)."""

    def __init__(self, model, lanes=None, *, numerics: Optional[str] = None, greedy_depths=None,
                 sampled_depth: int = MTP_DEPTH, force_width: Optional[int] = None,
                 compiled: Optional[bool] = None, max_rows: Optional[int] = None):
        from mtplx.engine.installed import DEPTHS, MAX_WIDTH

        self.model = model
        # Greedy rows chain greedy_depths[width] drafts a cycle (a greedy row's tokens are the same
        # at any depth): given ({width: depth}; widths absent chain MTP_DEPTH), or "cost": at each
        # installed width the depth whose measured cycle cost and the head's acceptance promise
        # the most tokens a second (`choose_depth`). A sampled row chains `sampled_depth` at every
        # width: a chain's depth decides which draws a row makes, and a row's draws must not
        # depend on its neighbours, so its depth is the route's, not its lane's.
        self.choose_greedy_depths = greedy_depths == "cost"
        self.greedy_depths = {} if self.choose_greedy_depths else checked_greedy_depths(greedy_depths, MAX_WIDTH, DEPTHS)
        if isinstance(sampled_depth, bool) or sampled_depth not in DEPTHS:
            raise ValueError(f"sampled_depth={sampled_depth!r} is invalid: a lane chains {DEPTHS} drafts")
        self.sampled_depth = int(sampled_depth)
        self.deep_lanes: dict[tuple, Any] = {}    # (width, depth) -> lane chaining depth != MTP_DEPTH drafts
        self.compiled = compiled
        self.max_rows = int(max_rows) if max_rows is not None else None
        self.forced_width = force_width        # checked by EngineSettings
        self.lanes: dict[int, Any] = {}
        self.refused_widths: dict[int, str] = {}   # width -> why its lane refused to install
        self.numerics = numerics
        self.set_lanes(lanes or {})
        if self.numerics is None:
            self.numerics = "throughput"
        if self.numerics not in NUMERICS:
            raise ValueError(f"numerics={self.numerics!r} is invalid: choose one of {NUMERICS}")

    def install(self, widths: Iterable[int]) -> list:
        """Install (and self-check) lanes of these widths, adding to the installed set; a width
        whose self-check fails is refused (its rows run narrower, solo at worst)."""
        from mtplx.engine.install import LaneSelfCheckError, install_a3b_mtp_batch_lane

        lanes = dict(self.lanes)
        for w in widths:
            if w not in lanes:
                try:
                    lanes[w] = install_a3b_mtp_batch_lane(self.model, w, numerics=self.numerics,
                                                          compiled=self.compiled)
                except LaneSelfCheckError as exc:
                    self.refused_widths[w] = str(exc)
                    logger.warning("MTP batch lane B%d refused: %s", w, exc)
        self._install_deep_lanes(lanes)
        self.set_lanes(lanes)
        return sorted(lanes)

    def _install_deep_lanes(self, lanes: dict) -> None:
        """Lanes chaining more drafts, only where the width's own lane passed its self-check (the
        same forwards at that width; the self-check injects single drafts at any depth), with
        their step costs measured; then greedy rows' depth by width where it is chosen by cost."""
        from mtplx.engine.install import install_a3b_mtp_batch_lane, measure_step_costs
        from mtplx.engine.installed import DEPTHS, solo_lane

        if self.numerics == "b1-exact":
            return
        for w in [1] + sorted(lanes):
            wanted = set(DEPTHS) if self.choose_greedy_depths else {self.greedy_depths.get(w, MTP_DEPTH)}
            for d in sorted((wanted | {self.sampled_depth}) - {MTP_DEPTH}):
                if (w, d) in self.deep_lanes:
                    continue
                lane = (solo_lane(self.model, d, self.compiled) if w == 1 else install_a3b_mtp_batch_lane(
                    self.model, w, numerics=self.numerics, selfcheck=False, depth=d, compiled=self.compiled,
                    graphs=getattr(lanes[w], "_graphs", None)))
                if not lane.step_costs:
                    measure_step_costs(lane)
                self.deep_lanes[(w, d)] = lane
            if self.choose_greedy_depths:
                at = {d: self._installed(w, d, lanes) for d in DEPTHS}
                if all(ln is not None for ln in at.values()):
                    self.greedy_depths[w] = choose_depth(at, self.model)

    def _installed(self, width: int, depth: int, lanes: Optional[dict] = None):
        """The installed lane of this width chaining `depth` drafts (None: not installed)."""
        from mtplx.engine.installed import solo_lane

        if depth != MTP_DEPTH:
            return self.deep_lanes.get((width, depth))
        return solo_lane(self.model, compiled=self.compiled) if width == 1 else (lanes or self.lanes).get(width)

    def set_lanes(self, lanes) -> None:
        if not isinstance(lanes, dict):
            lanes = {lane.width: lane for lane in lanes}
        lanes = {int(w): lane for w, lane in lanes.items()}
        for w, lane in lanes.items():
            if getattr(lane, "width", w) != w:
                raise ValueError(f"lane {getattr(lane, 'route_id', lane)!r} has width {lane.width}, "
                                 f"installed under {w}")
        self._take_profile(lanes)
        if lanes and self.forced_width is not None and self.forced_width not in lanes:
            raise ValueError(f"force_width={self.forced_width} is not an installed width {sorted(lanes)}")
        self.lanes = lanes

    def _take_profile(self, lanes: dict) -> None:
        profiles = {getattr(lane, "numerics", None) for lane in lanes.values()} - {None}
        if len(profiles) > 1:
            raise ValueError(f"installed lanes disagree on the numerics profile: {sorted(profiles)}")
        if profiles:
            (profile,) = profiles
            if self.numerics is None:
                self.numerics = profile
            elif self.numerics != profile:
                raise ValueError(f"lanes are {profile!r} but the service was asked for {self.numerics!r}")

    @property
    def max_cohort_rows(self) -> int:
        """Most rows of one key that decode together: the widest installed lane (capped by
        `max_rows` when given)."""
        if self.numerics == "b1-exact" or not self.lanes:
            return self.max_rows or MAX_COHORT_ROWS
        return min(self.max_rows or max(self.lanes), max(self.lanes))

    def lane_for_real_width(self, real_width: int):
        """(fixed_width, lane): the forced width if it fits, else the narrowest lane that fits."""
        if self.forced_width is not None and self.forced_width in self.lanes and self.forced_width >= real_width:
            return self.forced_width, self.lanes[self.forced_width]
        for w in sorted(self.lanes):
            if w >= real_width:
                return w, self.lanes[w]
        raise ValueError(f"no installed lane fits a cohort of {real_width} rows (installed widths {sorted(self.lanes)})")

    def ladder(self, depth: Optional[int] = None) -> list:
        """The widths a key's running lane may run at: from the forced width (or the one-row solo
        lane) up to the widest installed lane within `max_cohort_rows`; each width's lane chaining
        `depth` drafts where one is installed (None: MTP_DEPTH). "b1-exact": the one-row lane
        alone, so a lane's rows decode one at a time."""
        from mtplx.engine.installed import solo_lane

        if self.numerics == "b1-exact":
            return [solo_lane(self.model, compiled=self.compiled)]
        lanes = [self.lanes[w] for w in sorted(self.lanes) if w <= self.max_cohort_rows]
        if self.forced_width is not None:
            lanes = [ln for ln in lanes if ln.width >= self.forced_width]
        elif not lanes or lanes[0].width > 1:     # (every width refused: rows decode solo)
            lanes.insert(0, solo_lane(self.model, compiled=self.compiled))
        if depth is not None:
            lanes = [self.deep_lanes.get((ln.width, depth), ln) for ln in lanes]
        return lanes

    def greedy_ladder(self) -> list:
        """Each width's lane at its greedy depth."""
        return [self.deep_lanes.get((ln.width, self.greedy_depths.get(ln.width)), ln) for ln in self.ladder()]

    def widths(self) -> list:
        return sorted({getattr(lane, "width", 1) for lane in self.ladder()}) or [1]

    def snapshot(self) -> dict:
        return {"installed_widths": sorted(self.lanes),
                "refused_widths": {str(w): why for w, why in sorted(self.refused_widths.items())},
                **installed_snapshot(self.lanes), "forced_width": self.forced_width, "numerics": self.numerics,
                "max_cohort_rows": self.max_cohort_rows,
                # drafts greedy rows chain by width (chosen by cost unless given), sampled rows at every width
                "greedy_depths": {str(w): d for w, d in sorted(self.greedy_depths.items())},
                "sampled_depth": self.sampled_depth}


def choose_depth(lanes_by_depth: dict, model) -> int:
    """The depth whose lane promises greedy rows the most tokens a second: a cycle chaining d
    drafts yields 1 + a + ... + a^d tokens a row, where a is the head's measured greedy
    acceptance (`draft_acceptance_prior`: a chain's j-th draft needs every one before it), for
    its measured cost (`step_costs["mtp"]`). Whether drafting pays at all (depth 0) the lane's
    StepPolicy decides as it runs."""
    from mtplx.engine.lane import draft_acceptance_prior
    from mtplx.engine.policy import chain_tokens

    a = draft_acceptance_prior(model)
    rate = {d: chain_tokens(a, d) / ln.step_costs["mtp"] for d, ln in lanes_by_depth.items()}
    return max(rate, key=lambda d: (rate[d], -d))
