"""When a lane runs an MTP cycle and when a plain AR step: the lane's step chooser (`CostSteps`,
or a test's `ScriptedSteps`), the cost model it consults (`StepPolicy`), from the costs of each
kind measured at its width, kept current by `StepCostMeter`; how deep a lane of drafting
greedy rows chains (`lane_depth`)."""

from __future__ import annotations

from typing import Callable, Optional, Protocol

from mtplx.engine.installed import DEPTH

NARROW_AFTER_CYCLES = 16     # cycles of low demand before a lane narrows (hysteresis)
STEP_COST_EMA = 0.25         # weight of a pair of steps' measured times in their kinds' costs
COST_PAIR_WITHIN = 3         # steps apart a counted step of each kind may be to make a pair
DEPTH_HYSTERESIS = 0.05      # a shared lane keeps its depth while within this of the best rate


class StepChooser(Protocol):
    """What a running lane asks before each step: `chooser(lane)` -> "mtp" | "ar". `ahead`: whether
    the next step's kind may be chosen at the end of the one before (an overlapped or run-ahead
    launch), before that step is counted."""
    ahead: bool

    def __call__(self, running) -> str: ...


class CostSteps:
    """The lane's step chooser: an MTP cycle when a row that wants to draft has draws the choice
    would change (sampled, or forced "mtp"); where only greedy adaptive rows want to, the lane's
    `StepPolicy` decides by measured cost, its acceptance starting from the model's prior per
    draft (`prior()`: measured once per model; a chain's j-th draft needs every one before it)."""
    ahead = True

    def __init__(self, prior: Callable[[], float]):
        self.prior = prior

    def __call__(self, running) -> str:
        live = [r for r in running.rows if r is not None]
        wanting = [r for r in live if r.wants_draft()]
        if not wanting:
            return "ar"
        if any(not (r.greedy and r.req.adaptive) for r in wanting):
            return "mtp"
        policy, depth = running.policy, running.lane.depth
        if policy.acceptance is None:
            # from the model's prior, as its rows start: estimated from its first outcome alone,
            # one rejected first draft sent a lane to 16 + 32 AR steps
            p = self.prior()
            policy.acceptance = sum(p ** j for j in range(1, depth + 1))
        return policy.choose(running.lane.step_costs, len(live), len(wanting), depth)


class ScriptedSteps:
    """A known sequence of step kinds in place of the cost policy, `plan(cycle index)` -> "mtp" |
    "ar" (tests and measurements that need one). The index is that of the step being run, so the
    lane never chooses ahead with it: no overlapped launch, no run-ahead."""
    ahead = False

    def __init__(self, plan: Callable[[int], str]):
        self.plan = plan

    def __call__(self, running) -> str:
        return self.plan(running.counters.cycles)


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


def chain_tokens(acceptance: float, depth: int) -> float:
    """Tokens a drafting row expects from a cycle chaining `depth` drafts: 1 + a + ... + a^depth
    (the chain's j-th draft is kept only with every one before it)."""
    return sum(acceptance ** j for j in range(depth + 1))


def lane_depth(lanes_by_depth: dict, current: Optional[int], acceptance: Callable[[], float]) -> Optional[int]:
    """The depth, chosen by cost, of a lane whose drafting rows are all greedy: of the installed
    depths, the one with the most tokens a second (a drafting row's tokens a cycle at the greedy
    rows' measured `acceptance()` over the lane's measured cycle cost, `step_costs["mtp"]`), the
    `current` one while it is within DEPTH_HYSTERESIS of the best (a move costs a head forward).
    None where a cost is not measured. Why: the head's acceptance at install (a fixed prompt) is
    not the traffic's; rows that keep few drafts pay for a deep verify and head for nothing."""
    costs = {d: ln.step_costs.get("mtp") for d, ln in lanes_by_depth.items()}
    if not all(costs.values()):
        return None
    a = acceptance()
    rate = {d: chain_tokens(a, d) / cost for d, cost in costs.items()}
    best = max(rate, key=lambda d: (rate[d], -d))
    if current in rate and rate[current] >= (1 - DEPTH_HYSTERESIS) * rate[best]:
        return current
    return best


class StepCostMeter:
    """Keeps a lane width's step costs (`InstalledA3BMTPBatchLane.step_costs`) current from the
    running lane's own steps: steady-state steps only (the first step after a switch also pays for
    the switch), and in pairs: a counted step of each kind within COST_PAIR_WITHIN steps updates
    both costs at once, so the ratio the StepPolicy compares is measured under one load (kept
    current only while its kind runs, each cost drifts with the machine's load while the other's
    stays stale). Nor a step that ran a compiled graph for the first time (a new span or shape:
    its trace and eager check cost about one more step, once, 0.5-0.7 s on Gemma 3 270M at width
    8), nor the step after it (a launch between steps carries into the next step's time). One slow
    step (a pause) moves a cost by at most half its weight."""

    def __init__(self):
        self._counted: dict = {}    # kind -> (step index, seconds, lane) of its last counted step not yet in a pair
        self._first_seen: set = set()   # (lane, kind) whose first step this meter saw
        self._first_runs, self._first_run_step = 0, None    # graph first runs seen; the step of the last

    def observe(self, lane, kind: str, previous: Optional[str], dt: float, step_index: int,
                graph_first_runs: int = 0) -> None:
        if graph_first_runs != self._first_runs:
            self._first_runs, self._first_run_step = graph_first_runs, step_index
        if self._first_run_step is not None and step_index - self._first_run_step <= 1:
            return
        costs = lane.step_costs
        other = "ar" if kind == "mtp" else "mtp"
        if kind not in costs:
            # an unmeasured lane's cost, from its second step of the kind: the first may have traced
            # its graphs (a solo lane's first AR step at a new buffer: 3x its cost on Gemma 3 270M,
            # which as its seed made auto run AR where MTP paid 1.2x)
            if (id(lane), kind) in self._first_seen:
                costs[kind] = dt
            self._first_seen.add((id(lane), kind))
            return
        if kind != previous:
            return
        seen = self._counted.pop(other, None)
        if seen is None or seen[2] is not lane or step_index - seen[0] > COST_PAIR_WITHIN:
            self._counted[kind] = (step_index, dt, lane)
            return
        self._counted.pop(kind, None)
        for k, t in ((kind, dt), (other, seen[1])):
            est = costs[k]
            costs[k] = est + STEP_COST_EMA * (min(max(t, est / 1.5), 1.5 * est) - est)
