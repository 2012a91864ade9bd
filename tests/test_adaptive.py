"""Speculation that steps aside (issue 14): plain AR lane steps beside MTP cycles, the lane's step
choice, rows that stop drafting, generation_mode "auto". Exactness: greedy equals plain greedy
whichever steps run; a sampled row's draws depend only on its own history."""

import dataclasses

import numpy as np
import pytest

import mtplx
from mtplx.engine.commit import HISTORY_FLUSH_AT
from mtplx.engine.install import install_a3b_mtp_batch_lane
from mtplx.engine.installed import solo_lane
from mtplx.engine.lane import RunningLane, draft_acceptance_prior
from mtplx.engine.settings import EngineSettings
from mtplx.engine.policy import ScriptedSteps, StepPolicy
from mtplx.engine.proposer import ScriptedProposer
from mtplx.engine.row import ROW_PROBE_FIRST, A3BMTPBatchRequest
from mtplx.engine.decisions import DecisionLog
from mtplx.sampling import SamplerConfig
from mtplx.server.mtp_batch import MTPBatchGenerationService, MTPBatchJob

from references import greedy_ar

GREEDY = SamplerConfig(temperature=0.0)
COSTS = {"mtp": 1.3, "ar": 1.0}      # a machine where an MTP cycle costs 1.3 AR steps
SAMPLED = SamplerConfig(temperature=1.0, top_p=0.95, top_k=20)
TEXTS = ["def fibonacci(n):", "import os\nimport sys\n\n", "class Stack:\n    def __init__(self):",
         "for i in range(10):\n", "try:\n    import json", "x"]
PLANS = {
    "ar": lambda i: "ar",
    "alternate": lambda i: "ar" if i % 2 else "mtp",
    # an AR run longer than HISTORY_FLUSH_AT: owed history is written while AR steps continue
    "blocks": lambda i: "ar" if 3 <= i < 8 + 2 * HISTORY_FLUSH_AT or 50 <= i < 57 else "mtp",
    "random": lambda i: ("mtp", "ar")[int(np.random.default_rng(i).integers(2))],
}


@pytest.fixture(scope="module")
def lane3(model):
    return install_a3b_mtp_batch_lane(model, 3, selfcheck=False)


def _run(ladder, reqs, plan=None, join_at=None, inject=None, costs=None, settings=None):
    """Run requests through a running lane; `join_at` {request index: step} adds rows later;
    `costs` pins the lanes' step costs (a fixed machine for the cost model)."""
    ladder = ladder if isinstance(ladder, list) else [ladder]
    proposer = ScriptedProposer(ladder[0].model.vocab_size, inject) if inject else None
    running = RunningLane(ladder, decision_log=DecisionLog(), proposer=proposer, settings=settings,
                          step_chooser=ScriptedSteps(plan) if plan is not None else None)
    join_at = join_at or {}
    streams = {i: running.add(r) for i, r in enumerate(reqs) if i not in join_at}
    steps = 0
    while running.has_work or len(streams) < len(reqs):
        for i, at in join_at.items():
            if at == steps:
                streams[i] = running.add(reqs[i])
        for ln in ladder if costs else ():
            ln.step_costs.clear()
            ln.step_costs.update(costs)
        running.step()
        steps += 1
        assert steps < 1000
    return running, [streams[i] for i in range(len(reqs))]


def _greedy_reqs(model, budgets, **kw):
    return [A3BMTPBatchRequest(request_id=str(i), prompt_ids=model.tokenizer.encode(TEXTS[i]), sampler=GREEDY,
                               max_tokens=n, **kw) for i, n in enumerate(budgets)]


@pytest.mark.parametrize("plan", sorted(PLANS))
def test_greedy_equals_plain_ar_whichever_steps_run(model, lane3, plan):
    reqs = _greedy_reqs(model, (70, 41, 64, 55))
    refs = [greedy_ar(model, r.prompt_ids, r.max_tokens) for r in reqs]
    # row 3 joins mid-run (into an AR run in "blocks"), after row 1 frees its slot
    running, streams = _run([solo_lane(model), lane3], reqs, PLANS[plan], join_at={3: 12})
    for i, (s, ref) in enumerate(zip(streams, refs)):
        assert s.tokens == ref, f"row {i}"
    all_ar = plan == "ar"
    assert running.counters.ar_steps > 0 and all_ar == (running.counters.mtp_cycles == 0)
    assert all_ar == (running.counters.accepted == running.counters.rejected == 0)
    assert all_ar == all(s.spec_cycles == 0 and s.drafts_skipped == s.cycles for s in streams)


def test_history_owed_by_ar_steps_is_what_mtp_cycles_would_have_written(model, lane3):
    """The head's history after AR steps is exact: every draft made at an output position is the
    draft an all-MTP run made there (the greedy tokens, hence the history, are the same). The
    head's own drafts: a row's context drafts would follow its own score, which AR steps leave."""
    reqs = _greedy_reqs(model, (70, 41, 64, 55))
    head_only = EngineSettings(context_drafts=False)
    base, _ = _run([lane3], reqs, lambda i: "mtp", join_at={3: 12}, settings=head_only)
    mixed, _ = _run([lane3], reqs, PLANS["blocks"], join_at={3: 12}, settings=head_only)
    want = {(rid, pos): d for rid, pos, d, _ in base.decisions.log.drafts}
    got = {(rid, pos): d for rid, pos, d, _ in mixed.decisions.log.drafts}
    common = sorted(set(want) & set(got))
    assert len(common) >= 40 and {rid for rid, _ in common} == {"0", "1", "2", "3"}
    assert [got[k] for k in common] == [want[k] for k in common]


def test_hybrid_compiled_lane_mixed_steps_equal_plain_ar(tmp_path):
    from test_hybrid import _build_weights, _config, _prompts, _write

    m = mtplx.load_model(_write(tmp_path / "qwen3_5", _config("qwen3_5"), _build_weights("qwen3_5")))
    lane = install_a3b_mtp_batch_lane(m, 3, selfcheck=False, compiled=True)
    prompts = _prompts(3, lengths=(5, 40, 2))
    reqs = [A3BMTPBatchRequest(request_id=str(i), prompt_ids=p, sampler=GREEDY, max_tokens=n)
            for i, (p, n) in enumerate(zip(prompts, (40, 25, 33)))]
    running, streams = _run([lane], reqs, PLANS["random"])
    for i, (r, s) in enumerate(zip(reqs, streams)):
        assert s.tokens == greedy_ar(m, r.prompt_ids, r.max_tokens), f"row {i}"
    assert running.counters.accepted > 0 and running.counters.ar_steps > 0 and running.counters.graph_retraces == 0


def _wrong_until(position_limit, rows=None, then=None):
    """A script of drafts (`ScriptedProposer`): a draft the target rejects (greedy) at output positions below the limit;
    from there the token `then` holds at that position, if given (accepted), else the head's."""
    def inject(b, position):
        if rows is not None and b not in rows:
            return None
        if position < position_limit:
            return 1          # a token id the shipped model never emits in these texts
        return then[position] if then is not None and position < len(then) else None
    return inject


def test_row_stops_drafting_while_neighbours_speculate_and_resumes_on_a_probe(model, lane3):
    reqs = _greedy_reqs(model, (90, 60, 60))
    reqs = [dataclasses.replace(reqs[0], adaptive=True)] + reqs[1:]     # row 0 "auto", rows 1-2 "mtp"
    refs = [greedy_ar(model, r.prompt_ids, r.max_tokens) for r in reqs]
    running, streams = _run([lane3], reqs, inject=_wrong_until(40, rows={0}, then=refs[0]), costs=COSTS)
    for ref, s in zip(refs, streams):
        assert s.tokens == ref
    bad, good = streams[0], streams[1:]
    assert all(s.spec_cycles == s.cycles and s.drafts_skipped == 0 for s in good)
    drafted_at = sorted(pos for rid, pos, _, _ in running.decisions.log.drafts if rid == "0")
    early = [p for p in drafted_at if p < 40]
    # from the model's prior (1.0 on its fixed text) fourteen rejections stop it; a probe 16 cycles on fails
    assert draft_acceptance_prior(model) == 1.0
    assert bad.drafts_skipped >= 15 and len(early) <= 15
    assert len([p for p in drafted_at if p >= 40]) >= 10           # an accepted probe: it drafts again
    assert bad.accepted_drafts == len([p for p in drafted_at if p >= 40])


def test_rows_of_a_head_that_never_agrees_start_stopped(model, lane3, monkeypatch):
    monkeypatch.setattr(model, "_draft_acceptance_prior", 0.0)      # as measured on such a head
    reqs = _greedy_reqs(model, (40, 40), adaptive=True)
    running, streams = _run(lane3, reqs, inject=_wrong_until(10 ** 6), costs=COSTS)
    for r, s in zip(reqs, streams):
        assert s.tokens == greedy_ar(model, r.prompt_ids, r.max_tokens)
    first = min(pos for _, pos, _, _ in running.decisions.log.drafts)
    assert first > ROW_PROBE_FIRST and running.counters.mtp_cycles <= 2    # no drafts until their first probe


def _sampled(i, prompt, seed, n=60, **kw):
    return A3BMTPBatchRequest(request_id=str(i), prompt_ids=prompt, sampler=SAMPLED, seed=seed, max_tokens=n,
                              adaptive=True, **kw)


def test_sampled_auto_row_depends_only_on_its_own_history(model, lane3):
    """A sampled "auto" row that stops drafting (its own rejections) and probes again draws the
    same tokens alone (the lane then runs AR steps) and beside neighbours that keep the lane in
    MTP cycles, or that run plain AR; and run to run."""
    p = [model.tokenizer.encode(t) for t in TEXTS]
    me = _sampled(0, p[0], seed=7, n=80)
    inject = _wrong_until(30, rows={0})
    alone_run, alone = _run([solo_lane(model), lane3], [me], inject=inject)
    again_run, again = _run([solo_lane(model), lane3], [me], inject=inject)
    drafting_run, beside_drafting = _run([lane3], [me, _sampled(1, p[1], 3, n=80), _sampled(2, p[2], 4, n=80)],
                                         inject=inject)
    ar_run, beside_ar = _run([lane3], [me, A3BMTPBatchRequest(request_id="1", prompt_ids=p[3], sampler=SAMPLED,
                                                              seed=5, max_tokens=30, speculative=False)],
                             inject=inject, join_at={1: 5})
    row = alone[0]
    assert row.tokens == again[0].tokens == beside_drafting[0].tokens == beside_ar[0].tokens
    assert (row.spec_cycles, row.drafts_skipped) == (beside_drafting[0].spec_cycles, beside_drafting[0].drafts_skipped)
    assert 0 < row.spec_cycles < row.cycles and alone_run.counters.ar_steps > 0
    assert drafting_run.counters.mtp_cycles > alone_run.counters.mtp_cycles        # the neighbours kept the lane drafting


def test_step_policy_steps_aside_with_hysteresis_and_backing_off_probes():
    pol = StepPolicy()
    costs = {"mtp": 1.3, "ar": 1.0}
    assert StepPolicy().choose({"mtp": 1.3}, 8, 8) == "ar"        # AR cost unknown: measure it
    assert StepPolicy().choose(costs, 8, 8) == "mtp"              # acceptance unknown: measure it
    pol.observe(8, 0)                                             # a head that never agrees
    kinds = [pol.choose(costs, 8, 8) for _ in range(118)]
    probes = [i for i, k in enumerate(kinds) if k == "mtp"]
    assert pol.kind == "ar" and probes == [16, 17, 50, 51, 116, 117]   # two-step probes, intervals doubling
    # hysteresis: a gain within 5% of AR's does not flip it back
    pol.acceptance = 0.33                                         # gain (1.33 / 1.3) = 1.023
    assert pol.choose(costs, 8, 8) == "ar" and pol.kind == "ar"
    pol.acceptance = 0.8                                          # gain 1.38: MTP pays again
    kinds = [pol.choose(costs, 8, 8) for _ in range(516)]
    assert pol.kind == "mtp" and [i for i, k in enumerate(kinds) if k == "ar"] == [256, 257, 514, 515]   # AR probes
    pol.acceptance = 0.3                                          # 1.3 / 1.3: within the margin
    assert pol.choose(costs, 8, 8) == "mtp"
    pol.acceptance = 0.2                                          # gain 0.92
    assert pol.choose(costs, 8, 8) == "ar"


def test_step_policy_probes_rarely_where_no_acceptance_could_pay():
    """A verify dearer than 1 + DEPTH AR steps loses at any acceptance: the lane probes only to
    keep its costs current, at the longest interval from the start, and goes back to the
    doubling probes once the costs say MTP could pay."""
    pol = StepPolicy()
    dear = {"mtp": 2.7, "ar": 1.0}                                # a 150k vocabulary's verify, B8
    pol.observe(8, 0)
    kinds = [pol.choose(dear, 8, 8) for _ in range(520)]
    assert pol.kind == "ar" and [i for i, k in enumerate(kinds) if k == "mtp"] == [256, 257, 514, 515]
    pol.acceptance = 1.0                                          # still (8 + 8) / 2.7 < 8 / 1
    assert pol.choose(dear, 8, 8) == "ar"
    costs = {"mtp": 1.3, "ar": 1.0}                               # the costs change: the doubling resumes
    pol.acceptance = 0.0
    pol.since_probe = 0
    pol.mtp_probe_every = pol.mtp_probe_first
    kinds = [pol.choose(costs, 8, 8) for _ in range(20)]
    assert [i for i, k in enumerate(kinds) if k == "mtp"] == [16, 17]


def test_early_rejections_keep_a_greedy_auto_row_and_its_lane_drafting(model):
    """A burst of rejections, the first draft's included, is not low acceptance: the row's estimate
    and the lane's start from the model's prior and weigh each outcome 0.1, so neither the row
    stops nor the lane steps aside (a lane starts with each request at one client)."""
    reqs = _greedy_reqs(model, (60,), adaptive=True)
    running, streams = _run([solo_lane(model)], reqs, inject=_wrong_until(5), costs=COSTS)
    assert streams[0].tokens == greedy_ar(model, reqs[0].prompt_ids, 60)
    assert running.counters.rejected >= 4 and running.counters.accepted > 0
    assert running.counters.ar_steps == 0 and streams[0].drafts_skipped == 0


def test_step_costs_move_in_pairs_measured_under_one_load(model):
    """A kind's cost moves only beside a fresh cost of the other kind: a load that slows the
    machine while MTP cycles run does not make them look dearer than the (stale) AR step."""
    from mtplx.engine.policy import StepCostMeter

    lane = install_a3b_mtp_batch_lane(model, 3, selfcheck=False)
    lane.step_costs.update({"mtp": 1.3, "ar": 1.0})
    meter, last = StepCostMeter(), {"kind": None, "steps": 0}

    def step(kind, seconds):
        previous, last["kind"] = last["kind"], kind
        last["steps"] += 1
        meter.observe(lane, kind, previous, seconds, last["steps"])

    for _ in range(50):
        step("mtp", 2.6)                          # twice as slow from here on
    assert lane.step_costs == {"mtp": 1.3, "ar": 1.0}
    for kind in ("ar", "ar", "mtp", "mtp"):      # an AR probe: its counted step pairs with an MTP one
        step(kind, 2.6 if kind == "mtp" else 2.0)
    assert lane.step_costs["ar"] > 1.0 and lane.step_costs["mtp"] / lane.step_costs["ar"] == pytest.approx(1.3)


def test_step_costs_skip_steps_that_ran_a_graph_first(model):
    """A step that ran a compiled graph for the first time (a new span: its trace and eager check)
    and the step after it are not steady costs; the next pair is."""
    from mtplx.engine.policy import StepCostMeter

    lane = install_a3b_mtp_batch_lane(model, 3, selfcheck=False)
    lane.step_costs.update({"mtp": 1.2, "ar": 1.0})
    meter = StepCostMeter()
    meter.observe(lane, "ar", "ar", 1.0, 1, graph_first_runs=0)
    meter.observe(lane, "mtp", "ar", 1.2, 2, graph_first_runs=0)       # a switch: not counted
    meter.observe(lane, "mtp", "mtp", 3.0, 3, graph_first_runs=2)      # traced at a new span
    meter.observe(lane, "mtp", "mtp", 3.0, 4, graph_first_runs=2)      # carried the launch
    assert lane.step_costs == {"mtp": 1.2, "ar": 1.0}
    meter.observe(lane, "mtp", "mtp", 1.5, 5, graph_first_runs=2)      # steady; step 1 is too far back to pair
    meter.observe(lane, "ar", "mtp", 1.0, 6, graph_first_runs=2)
    meter.observe(lane, "ar", "ar", 1.25, 7, graph_first_runs=2)       # pairs with step 5
    assert lane.step_costs["mtp"] > 1.2 and lane.step_costs["ar"] > 1.0


def test_lanes_of_one_width_share_their_compiled_graphs_across_depths(model):
    """A lane that switches depth runs its AR step through the graphs it already traced: the
    ladder installs each width's deeper lanes on the width's own graphs."""
    from mtplx.scheduler.ladder import LaneLadder

    ladder = LaneLadder(model, greedy_depths="cost")
    ladder.install([3])
    lanes = [ladder._installed(3, d) for d in (1, 2, 3)]
    assert all(ln is not None for ln in lanes) and len({ln.depth for ln in lanes}) == 3
    assert all(ln._graphs is lanes[0]._graphs for ln in lanes)


def test_an_unmeasured_cost_is_seeded_from_a_steady_step_not_the_first(model):
    """A lane's first step of a kind may trace its graphs (seconds on a large model): an
    unmeasured cost starts from the second."""
    from mtplx.engine.policy import StepCostMeter

    lane = install_a3b_mtp_batch_lane(model, 3, selfcheck=False)
    lane.step_costs.clear()
    meter = StepCostMeter()
    meter.observe(lane, "ar", None, 3.0, 1)
    assert lane.step_costs == {}
    meter.observe(lane, "ar", "ar", 1.0, 2)
    meter.observe(lane, "mtp", "ar", 9.0, 3)
    assert lane.step_costs == {"ar": 1.0}
    meter.observe(lane, "mtp", "mtp", 1.2, 4)
    assert lane.step_costs == {"ar": 1.0, "mtp": 1.2}


def test_greedy_auto_lane_runs_ar_steps_when_drafts_never_land(model, lane3):
    reqs = _greedy_reqs(model, (80, 80, 80), adaptive=True)
    running, streams = _run(lane3, reqs, inject=_wrong_until(10 ** 6), costs=COSTS)
    for r, s in zip(reqs, streams):
        assert s.tokens == greedy_ar(model, r.prompt_ids, r.max_tokens)
    # from the prior 1.0, fourteen straight rejections bring the rows' and the lane's estimates low
    assert running.counters.mtp_cycles <= 16 and running.counters.ar_steps >= 60 and running.policy.kind == "ar"


def test_install_measures_step_costs(model):
    lane = install_a3b_mtp_batch_lane(model, 3)
    for ln in (lane, solo_lane(model)):
        # measured wall times: which is larger is the machine's business, not a test's
        assert set(ln.step_costs) == {"mtp", "ar"} and all(v > 0 for v in ln.step_costs.values())
    assert model._draft_acceptance_prior == draft_acceptance_prior(model) == 1.0


def test_service_auto_is_the_default_and_reports_its_steps(model):
    service = MTPBatchGenerationService.for_model(model, widths=(3,), batch_wait_s=0.05)
    try:
        ids = [model.tokenizer.encode(t) for t in TEXTS[:3]]
        jobs = [MTPBatchJob(str(i), p, 40, sampler=GREEDY) for i, p in enumerate(ids)]
        forced = MTPBatchJob("f", ids[0], 40, sampler=GREEDY, adaptive=False)
        assert jobs[0].generation_mode == "auto" and forced.generation_mode == "mtp"
        assert jobs[0].compatibility_key == forced.compatibility_key      # modes share a lane: per row
        futures = [service.submit(j) for j in jobs + [forced]]
        snap = service.snapshot()
        results = [f.result(timeout=120) for f in futures]
        for r, p in zip(results, ids + [ids[0]]):
            st = r["stats"]
            assert r["tokens"] == greedy_ar(model, p, 40)
            assert st["speculated_cycles"] + st["drafts_skipped"] == st["verify_calls"]
            assert st["speculated_cycle_share"] == round(st["speculated_cycles"] / st["verify_calls"], 4)
        assert [r["stats"]["generation_mode"] for r in results] == ["auto"] * 3 + ["mtp"]
        assert results[-1]["stats"]["drafts_skipped"] == 0
        for lane in snap["lanes"]:
            assert set(lane["step_policy"]) == {"kind", "acceptance", "mtp_cycle_s", "ar_step_s", "mtp_gain"}
        snap = service.snapshot()
        assert snap["mtp_cycles"] + snap["ar_steps"] == snap["target_verify_cycles"] > 0
    finally:
        service.shutdown()


def test_bench_load_mode_arms_summary():
    from benchmarks import load as bl

    def run(auto, mtp, ar):
        return {"ours_modes": {m: {f"greedy/closed-{n}": {"tok_s": v} for n, v in zip((1, 8, 32), vals)}
                               for m, vals in (("auto", auto), ("mtp", mtp), ("ar", ar))}}

    s = bl.summarize_modes([run((10, 40, 36), (10, 44, 40), (5, 20, 50)), run((12, 40, 38), (10, 40, 38), (6, 40, 38))])
    one = s["arms"]["greedy/closed-1"]
    assert (one["auto"], one["mtp"], one["ar"]) == (11, 10, 5.5)
    assert one["auto_over_ar"] == pytest.approx((2 + 2) / 2) and one["auto_over_mtp"] == pytest.approx((1 + 1.2) / 2)
    assert s["auto_largest_drop"] == {"greedy": pytest.approx(1 - 37 / 40)}
    assert "| greedy/closed-8 | 40.0 | 42.0 | 30.0 |" in bl.format_modes_table(s)
    assert bl.summarize_modes([{"ours": {}}]) == {}


# -- lanes that chain 2-3 drafts a greedy cycle (install_a3b_mtp_batch_lane(depth=...))

@pytest.fixture(scope="module")
def chained(model):
    return {d: install_a3b_mtp_batch_lane(model, 3, selfcheck=False, depth=d) for d in (2, 3)}


@pytest.fixture(scope="module")
def chain_refs(model):
    reqs = _greedy_reqs(model, (70, 41, 64, 55))
    reqs[1] = dataclasses.replace(reqs[1], omit_speculative_bonus=True)
    return reqs, [greedy_ar(model, r.prompt_ids, r.max_tokens) for r in reqs]


@pytest.mark.parametrize("depth,plan", [(2, "blocks"), (3, "mtp")])
def test_chained_drafts_equal_plain_ar_whichever_steps_run(model, chained, chain_refs, depth, plan):
    """Greedy cycles that chain drafts stay exact: rows end inside a chain (their budgets), one
    omits its bonus, one joins mid-run into a freed slot, AR steps owe up to `depth` entries."""
    reqs, refs = chain_refs
    step_plan = (lambda i: "mtp") if plan == "mtp" else PLANS[plan]
    running, streams = _run([chained[depth]], reqs, step_plan, join_at={3: 12})
    for i, (s, ref) in enumerate(zip(streams, refs)):
        assert s.tokens == ref, f"row {i}"
    assert max(running.decisions.log.keeps) == 1 + depth                     # a whole chain accepted, and its bonus
    assert {j for *_, j in running.decisions.log.drafts} == set(range(depth))
    assert running.counters.accepted > running.counters.rejected > 0 and running.counters.graph_retraces == 0


def test_history_owed_after_chained_drafts_is_what_mtp_cycles_would_have_written(model, chained):
    """Each draft at an output position and chain index is the draft an all-MTP run made there:
    the history a cycle owes for its accepted drafts (up to two entries a row) is exact, whether
    the next cycle or an AR step writes it. The head's own drafts, as above."""
    reqs = _greedy_reqs(model, (70, 41, 64, 55))
    head_only = EngineSettings(context_drafts=False)
    base, _ = _run([chained[2]], reqs, lambda i: "mtp", join_at={3: 12}, settings=head_only)
    mixed, _ = _run([chained[2]], reqs, PLANS["alternate"], join_at={3: 12}, settings=head_only)
    want = {(rid, pos, j): d for rid, pos, d, j in base.decisions.log.drafts}
    got = {(rid, pos, j): d for rid, pos, d, j in mixed.decisions.log.drafts}
    common = sorted(set(want) & set(got))
    assert len(common) >= 40 and {rid for rid, *_ in common} == {"0", "1", "2", "3"}
    assert {j for *_, j in common} == {0, 1}
    assert [got[k] for k in common] == [want[k] for k in common]


def test_a_sampled_row_chaining_drafts_depends_only_on_its_seed(model, chained):
    """A sampled row in a lane chaining two drafts draws the tokens it draws alone (solo
    `generate_mtpk` at depth 2, a one-row lane), whether it joins a running lane beside greedy
    rows or not; the greedy rows beside it stay exact."""
    from mtplx.engine.decode import generate_mtpk

    p = [model.tokenizer.encode(t) for t in TEXTS]
    greedy = _greedy_reqs(model, (90, 80))
    me = A3BMTPBatchRequest(request_id="2", prompt_ids=p[2], sampler=SAMPLED, seed=11, max_tokens=40)
    solo = generate_mtpk(model, me.prompt_ids, me.max_tokens, SAMPLED, depth=2, seed=11)
    beside, beside_streams = _run([chained[2]], greedy + [me], join_at={2: 6})
    _, alone = _run([chained[2]], [me])
    assert beside_streams[2].tokens == alone[0].tokens == solo.tokens
    for r, s in zip(greedy, beside_streams):
        assert s.tokens == greedy_ar(model, r.prompt_ids, r.max_tokens)
    assert [j for rid, _, _, j in beside.decisions.log.drafts if rid == "2"].count(1) > 3


def test_chain_depth_is_checked_at_install_and_a_ladder_needs_distinct_widths(model, chained, lane3):
    with pytest.raises(ValueError, match="depth=4 is invalid"):
        install_a3b_mtp_batch_lane(model, 3, selfcheck=False, depth=4)
    assert chained[2].verify_t == 3 and "_t3_m9_" in chained[2].route_id and "_t2_m6_" in lane3.route_id
    with pytest.raises(ValueError, match="distinct widths"):
        RunningLane([lane3, chained[2]])      # both B3: a ladder moves between widths
