"""How a running lane's width and depth follow its rows: the installed lane it runs as (the
narrowest width that holds the demand, the shallowest depth its drafting rows need), and moving
its rows' state onto another installed lane."""

from __future__ import annotations

from itertools import chain

import mlx.core as mx

from mtplx.engine.commit import HISTORY_FLUSH_AT
from mtplx.engine.installed import VERIFY_T, InstalledA3BMTPBatchLane, sorted_ladder
from mtplx.engine.policy import lane_depth
from mtplx.models.cache import RaggedKVCache


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


class LaneShape:
    """`RunningLane`'s width and depth (its rows, ladders and caches are the lane's own)."""

    def _lane_at(self, width: int) -> InstalledA3BMTPBatchLane:
        """The installed lane of this width for the rows live or queued: deep enough for every
        sampled row that drafts in its next cycle, and for greedy rows that draft, their depth
        here (`greedy_ladder`; with `depth_by_cost`, the sampled rows' depth where any draft, else
        the depth with the most tokens a second); the shallowest such lane installed (else the
        deepest). With no row drafting the depth stays (a row that does not draft makes the same
        draws at any depth)."""
        at = self._lanes_at[width]
        rows = [r for r in chain(self.rows, (a.row for a in self.admitting), self.waiting)
                if r is not None and r.wants_draft()]
        sampled = [r.chain_depth for r in rows if not r.greedy]
        steady = any(r.drafting or not r.req.adaptive for r in rows if not r.greedy)
        greedy_rows = len(rows) - len(sampled)
        need = self._greedy_need(width, sampled, steady) if greedy_rows else max(sampled, default=0)
        if not need:
            need = self.lane.depth if self.lane is not None else self.ladder[0].depth
        return at[min((d for d in at if d >= need), default=max(at))]

    def _greedy_need(self, width: int, sampled: list, steady: bool) -> int:
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
            current = self.lane.depth if self.lane is not None and self.lane.width == width else None
            chosen = lane_depth(self._lanes_at[width], current, self.greedy_acceptance)
            if chosen is not None:
                return max(sampled + [chosen])
        return max(sampled + [self.greedy_depths[width]])

    def _resize(self) -> None:
        """Pick the narrowest installed width that fits the demand: widen at once, narrow after
        `narrow_after` cycles of low demand (never below the live rows). The depth follows the
        rows at once (`_lane_at`)."""
        width = next((ln.width for ln in self.ladder if ln.width >= self.demand), self.ladder[-1].width)
        fit = self._lane_at(width)
        narrower = self.lane is not None and fit.width < self.width and self.live_rows <= fit.width
        if self.lane is None:
            self._reshape(fit, [])
        elif fit.width > self.width:
            self.counters.widenings += 1
            self._low_demand = 0
            self._reshape(fit, list(range(self.width)))
        elif narrower and self._narrow_due():
            self.counters.narrowings += 1
            self._reshape(fit, [b for b, r in enumerate(self.rows) if r is not None])
        else:
            if not narrower:
                self._low_demand = 0
            here = fit if fit.width == self.width else self._lane_at(self.width)
            if here is not self.lane:         # same width, another depth
                self.counters.depth_switches += 1
                self._reshape(here, list(range(self.width)))

    def _narrow_due(self) -> bool:
        self._low_demand += 1
        if self._low_demand >= self.narrow_after or not self.live_rows:
            self._low_demand = 0
            return True
        return False

    def _reshape(self, lane: InstalledA3BMTPBatchLane, keep: list) -> None:
        """Run as `lane` from now on; the rows in slots `keep` move to slots 0.. with their state.
        Onto a lane chaining another number of drafts, rows first settle the head history their
        last cycle left owed (its layout is [W, depth]), as before an AR step."""
        if self.history is not None:
            if self.lane is not None and lane.depth != self.lane.depth:
                self.history.owe_rows(self.rows)
                self.history.redepth(lane.depth)
            self.history.write(self.model, self.mtp_caches)     # its columns are as wide as the old width
        index = keep + [None] * (lane.width - len(keep))
        rows = [self.rows[i] if i is not None else None for i in index]
        if index == list(range(self.width)) and lane.width == self.width:
            pass                         # every row stays in its slot: the state as it is
        elif self.caches is not None and any(r is not None for r in rows):
            self._move_rows(index)
        else:            # nothing live to carry: start from empty layers at the new width
            self.caches = self.mtp_caches = self.history = None
        self.lane, self.rows = lane, rows
        self.forwards = self.logits_host = None
        self._reserve_for_life([r for r in rows if r is not None])

    def _move_rows(self, index: list) -> None:
        """New slot i takes old slot index[i]'s state (None: an empty slot)."""
        take = [i if i is not None else 0 for i in index]
        self.caches = [c.take_rows(index) for c in self.caches]
        self.mtp_caches = [c.take_rows(index) for c in self.mtp_caches]
        sel = mx.array(take, dtype=mx.int32)
        self.logits_last, self.h_last = self.logits_last[sel], self.h_last[sel]
        self.history.take(take)

    def _reserve_for_life(self, rows: list) -> None:
        """A compiled lane's KV buffers sized now for these rows' whole lives, so its graphs are not
        traced again while they decode."""
        if not self.lane.compiled or not rows or self.caches is None:
            return
        need = max(len(r.req.prompt_ids) + r.req.max_tokens for r in rows) + max(VERIFY_T, HISTORY_FLUSH_AT)
        for layer in self.caches + self.mtp_caches:
            if isinstance(layer, RaggedKVCache):
                layer.ensure_capacity(need)
