"""How a running lane's width and depth follow its rows: the installed lane it runs as (the
narrowest width that holds the demand, the shallowest depth its drafting rows need;
`LaneShapes`). Moving the rows' state onto another installed lane is the lane's (`_reshape`)."""

from __future__ import annotations

from typing import Callable, Optional

from mtplx.engine.installed import InstalledA3BMTPBatchLane, sorted_ladder
from mtplx.engine.policy import NARROW_AFTER_CYCLES, lane_depth


def lanes_by_depth(ladder: list, greedy_ladder=None, sampled_ladder=None, depth_ladders=()) -> tuple:
    """A running lane's installed lanes by width and depth ({width: {depth: lane}}), greedy rows'
    depth by width (`greedy_ladder`'s, else the ladder's) and sampled rows' one depth
    (`sampled_ladder`'s, else the ladder's shallowest). `depth_ladders`: more ladders (lanes of
    other depths) to choose from. Every ladder has the same widths."""
    widths = [ln.width for ln in ladder]
    at: dict = {}
    named = {"ladder": ladder, "greedy_ladder": greedy_ladder, "sampled_ladder": sampled_ladder,
             **{f"depth_ladders[{i}]": v for i, v in enumerate(depth_ladders)}}
    for name, lanes in named.items():
        if lanes is None:
            continue
        lanes = sorted_ladder(lanes)
        if [ln.width for ln in lanes] != widths:
            raise ValueError(f"{name} widths {[ln.width for ln in lanes]} differ from the ladder's {widths}")
        for ln in lanes:
            at.setdefault(ln.width, {})[ln.depth] = ln
    greedy_depths = {ln.width: ln.depth for ln in sorted_ladder(greedy_ladder or ladder)}
    sampled = {ln.depth for ln in sorted_ladder(sampled_ladder or ladder)}
    if sampled_ladder is not None and len(sampled) != 1:
        raise ValueError(f"sampled_ladder chains {sorted(sampled)} drafts: a sampled row chains one depth at every width")
    return at, greedy_depths, min(sampled)


class LaneShapes:
    """The installed lanes a running lane may run as, by width and depth, and which one its rows
    want: the narrowest width that holds the demand (narrower only after `narrow_after` cycles of
    low demand), at the shallowest depth its drafting rows need. Greedy rows chain
    `greedy_depths[width]` drafts (with `depth_by_cost`: the depth their acceptance pays most at
    there), sampled rows their own depth (`sampled_depth` unless they ask)."""

    def __init__(self, ladder, greedy_ladder=None, sampled_ladder=None, depth_ladders: Optional[list] = None,
                 narrow_after: int = NARROW_AFTER_CYCLES):
        self.ladder = sorted_ladder(ladder)
        self.lanes_at, self.greedy_depths, self.sampled_depth = lanes_by_depth(
            self.ladder, greedy_ladder, sampled_ladder, depth_ladders or ())
        # greedy rows' depth chosen by cost as the lane runs, at their acceptance here (`lane_depth`)
        self.depth_by_cost = depth_ladders is not None
        self.narrow_after = int(narrow_after)
        self._low_demand = 0          # cycles in a row a narrower width would have held the demand

    def fit_width(self, demand: int) -> int:
        """The narrowest installed width that holds `demand` rows (else the widest)."""
        return next((ln.width for ln in self.ladder if ln.width >= demand), self.ladder[-1].width)

    def lane_at(self, width: int, rows: list, current: Optional[InstalledA3BMTPBatchLane],
                greedy_acceptance: Callable[[], float]) -> InstalledA3BMTPBatchLane:
        """The installed lane of this width for `rows` (live or queued; the lane runs as
        `current`): deep enough for every sampled row that drafts in its next cycle, and for
        greedy rows that draft, their depth here (`_greedy_need`); the shallowest such lane
        installed (else the deepest). With no row drafting the depth stays (a row that does not
        draft makes the same draws at any depth)."""
        at = self.lanes_at[width]
        rows = [r for r in rows if r.wants_draft()]
        sampled = [r.chain_depth for r in rows if not r.greedy]
        steady = any(r.drafting or not r.req.adaptive for r in rows if not r.greedy)
        greedy_rows = len(rows) - len(sampled)
        need = (self._greedy_need(width, sampled, steady, current, greedy_acceptance) if greedy_rows
                else max(sampled, default=0))
        if not need:
            need = current.depth if current is not None else self.ladder[0].depth
        return at[min((d for d in at if d >= need), default=max(at))]

    def _greedy_need(self, width: int, sampled: list, steady: bool, current, greedy_acceptance) -> int:
        """The depth a lane of this width holding drafting greedy rows (and sampled rows chaining
        `sampled`; `steady`: one of them drafts every cycle) runs at. Choosing by cost, a lane
        with steadily drafting sampled rows runs at theirs: a few greedy rows that take it a draft
        deeper make every row pay for the deeper verify and head forward, and the install's
        short-prompt costs cannot tell when that pays (served, mixed settings at 16 clients:
        1.08-1.19x the tok/s held at the sampled rows' depth 2 against the depth 3 the costs
        chose). Otherwise it goes by cost where that is measured (a sampled row that stopped
        drafting and probes does not move it for a cycle), else at the greedy rows' own depth
        here; never shallower than a drafting sampled row's."""
        if self.depth_by_cost:
            if steady:
                return max(sampled)
            depth = current.depth if current is not None and current.width == width else None
            chosen = lane_depth(self.lanes_at[width], depth, greedy_acceptance)
            if chosen is not None:
                return max(sampled + [chosen])
        return max(sampled + [self.greedy_depths[width]])

    def narrow_due(self, live_rows: int) -> bool:
        """One more cycle of low demand: True when the lane should narrow now."""
        self._low_demand += 1
        if self._low_demand >= self.narrow_after or not live_rows:
            self._low_demand = 0
            return True
        return False

    def demand_held(self) -> None:
        """The demand needs the current width (or more): low demand starts counting afresh."""
        self._low_demand = 0

    def checked_depth(self, req) -> int:
        """A sampled row's draft depth (its own, else `sampled_depth`), if every width chains it."""
        depth = self.sampled_depth if req.draft_depth is None else int(req.draft_depth)
        shallow = [w for w, at in self.lanes_at.items() if max(at) < depth]
        if req.speculative and shallow:
            raise ValueError(f"request {req.request_id}: draft_depth={depth} but this lane chains at most "
                             f"{max(self.lanes_at[shallow[0]])} drafts at width {shallow[0]}")
        return depth
