"""The routing policy, its prefix index and the rows autoscaling policy, in-process (no Ray): the
decisions, the load bound (no replica starves or floods under skewed sessions and prefixes),
and the prefix-cache events from a bank to the index."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from deployments import router
from deployments.autoscaling import RowsAutoscaling, desired_replicas
from deployments.prefix_index import PrefixCacheLog, PrefixIndex
from deployments.router import AffinityPolicy, session_key
from mtplx.api.prefix_hashes import prompt_hashes, state_hash

BLOCK = 4
NAME = "TestReplica"


@pytest.fixture
def replicas(monkeypatch):
    ids = ["r0", "r1", "r2"]
    monkeypatch.setitem(router.KNOWN_REPLICAS, NAME, ids)
    return ids


def _bank_event(log: PrefixCacheLog, prompt: tuple, m: int, salt=None, stored=True):
    log.on_change(stored, salt, prompt[:m + 1], False)


def test_prefix_names_chain_blocks_within_a_partition():
    prompt = tuple(range(11))
    blocks, whole = prompt_hashes(prompt, BLOCK, "a")
    assert len(blocks) == 2
    assert state_hash(prompt[:5], False, BLOCK, "a") == blocks[0]      # boundary 4 holds tokens 0-3
    assert state_hash(prompt[:9], False, BLOCK, "a") == blocks[1]
    assert state_hash(prompt, True, BLOCK, "a") == whole
    assert state_hash(prompt[:9], False, BLOCK, "b") != blocks[1]      # another caller's partition
    assert state_hash(prompt[:7], False, BLOCK, "a") is None           # not a boundary
    other = prompt_hashes((0, 1, 2, 3, 9, 9, 9, 9), BLOCK, "a")[0]
    assert other[0] == blocks[0] and other[1] != blocks[1]


def test_index_follows_a_replicas_events_in_order_once():
    log, index = PrefixCacheLog(BLOCK), PrefixIndex()
    prompt = tuple(range(13))
    assert log.since(0) is None and log.since(-1)["reset"] == []
    _bank_event(log, prompt, 4)
    _bank_event(log, prompt, 8)
    first = log.since(-1)                      # a reader new to this replica: the names held now
    index.apply("r0", first)
    assert index.held(prompt, None, ["r0", "r1"]) == {"r0": 8, "r1": 0}
    seen = index.seqs()["r0"]
    _bank_event(log, prompt, 8, stored=False)  # evicted
    update = log.since(seen)
    assert update["events"] == [(False, state_hash(prompt[:9], False, BLOCK, None))]
    index.apply("r0", update)
    index.apply("r0", update)                  # a second stream with the same events: applied once
    assert index.held(prompt, None, ["r0"]) == {"r0": 4}
    log.on_change(True, None, prompt, True)    # the whole prompt's state
    index.apply("r0", log.since(index.seqs()["r0"]))
    assert index.held(prompt, None, ["r0"]) == {"r0": len(prompt)}
    assert index.held(prompt, "other-caller", ["r0"]) == {"r0": 0}
    small = PrefixCacheLog(BLOCK, max_events=2)
    for m in (4, 8, 12):
        _bank_event(small, prompt + (1,), m)
    assert "reset" in small.since(0) and len(small.since(0)["reset"]) == 3   # too far behind: a reset
    index.forget("r0")
    assert index.held(prompt, None, ["r0"]) == {"r0": 0}


def test_sessions_stay_prefixes_attract_others_fall_back(replicas):
    policy = AffinityPolicy(NAME, load_factor=1.25)
    prompt = tuple(range(20))
    # no session, nothing cached: the least loaded replica, the fewest placed breaking ties
    policy.load.update({"r0": 2, "r1": 1, "r2": 1})
    policy.rows_by_replica.update({"r0": 2, "r1": 5, "r2": 3})
    assert policy.route(None, prompt, None, Counter()) == router.Route("r2", "fallback", 0)
    assert policy.route(None, prompt, None, Counter({"r2": 1})).replica == "r1"
    policy.load.clear()
    policy.rows_by_replica.clear()
    # a new session with nothing cached goes to the least loaded replica, then where its last row went
    policy.load.update({"r0": 1, "r2": 1})
    first = policy.route("s1", prompt, None, Counter())
    assert (first.replica, first.reason) == ("r1", "fallback")
    policy.load.clear()
    policy.placed(first.replica, 1, ["s1"])
    policy.left(first.replica)
    again = policy.route("s1", prompt, None, Counter())
    assert again.replica == first.replica and again.reason == "session"
    # a prefix held by one replica draws a sessionless row there
    log = PrefixCacheLog(BLOCK)
    _bank_event(log, prompt, 16)
    policy.index.apply("r2", log.since(-1))
    route = policy.route(None, prompt, None, Counter())
    assert (route.replica, route.reason, route.held) == ("r2", "prefix", 16)
    # a prefix every replica holds decides nothing
    for r in ("r0", "r1"):
        policy.index.apply(r, log.since(-1))
    assert policy.route(None, prompt, None, Counter()).reason == "fallback"
    # routing: power_of_two leaves every row to Serve
    assert AffinityPolicy(NAME, policy="power_of_two").route("s1", prompt, None, Counter()) == \
        router.Route(None, "power_of_two")
    # a replica that left is forgotten
    router.KNOWN_REPLICAS[NAME] = ["r0", "r1"]
    assert policy.route(None, prompt, None, Counter()).reason == "fallback" and policy.index.size("r2") == 0
    assert session_key(None, None, "k") is None and session_key("h", "u", "k") == "k/h"


def _simulate(policy: AffinityPolicy, sessions, rng: random.Random, steps: int = 400, stay: int = 12):
    """Rows arrive one per step and stay `stay` steps: the bound at each arrival, and the most
    rows any replica held against it."""
    live, worst, placed = [], 0, Counter()
    for t in range(steps):
        for end, r in [x for x in live if x[0] <= t]:
            policy.left(r)
            live.remove((end, r))
        session = sessions(rng)
        route = policy.route(session, (t,), None, Counter())
        policy.decided(route)
        replica = route.replica
        live_replicas = policy.replicas()
        cap = policy.bound(live_replicas, Counter())
        policy.placed(replica, 1, [session])
        placed[replica] += 1
        worst = max(worst, policy.load[replica] - cap)
        live.append((t + stay, replica))
    return worst, placed


def test_load_bound_keeps_every_replica_fed_under_a_hot_session(replicas):
    """One session sends half the rows, the rest come from 30 sessions: the hot session spills
    past the bound; no replica ever holds more than the bound and none starves."""
    rng = random.Random(0)
    policy = AffinityPolicy(NAME, load_factor=1.25)

    def sessions(rng):
        return "hot" if rng.random() < 0.5 else f"s{rng.randrange(30)}"

    worst, placed = _simulate(policy, sessions, rng)
    assert worst <= 0, f"a replica held {worst} rows over the bound"
    shares = {r: placed[r] / sum(placed.values()) for r in replicas}
    assert min(shares.values()) > 0.2 and max(shares.values()) < 0.45, shares
    assert policy.decisions["spill"] > 0           # the hot session did spill
    print(f"rows by replica under a hot session: {dict(placed)}; decisions {dict(policy.decisions)}")


def test_bound_formula_is_the_consistent_hashing_one(replicas):
    policy = AffinityPolicy(NAME, load_factor=1.25)
    policy.load.update({"r0": 5, "r1": 3, "r2": 0})
    assert policy.bound(replicas, Counter({"r2": 1})) == math.ceil(1.25 * (9 + 1) / 3)


def test_rows_autoscaling_asks_for_replicas_by_rows():
    assert desired_replicas({}, 2, 8) == 2                      # no report: stay
    assert desired_replicas({"a": 0.0, "b": 0.0}, 2, 8) == 0.0  # idle: min_replicas (Serve's bound) wins
    assert desired_replicas({"a": 3.0}, 1, 8) == 1
    assert desired_replicas({"a": 12.0, "b": 9.0}, 2, 8) == 3
    policy = RowsAutoscaling(target_rows_per_replica=4)

    class Ctx:
        aggregated_metrics = {"rows": {"a": 6.0, "b": 5.0, "gone": 40.0}}
        running_replicas = ["a", "b"]
        current_num_replicas = 2

    desired, state = policy(Ctx())
    assert desired == 3 and state["rows"] == 11.0
    with pytest.raises(ValueError):
        RowsAutoscaling(0)


def test_the_autoscaling_args_make_a_config_serve_takes_with_this_policy():
    """`autoscaling:` in the app args becomes the replica deployment's autoscaling config as Serve
    validates it, and Serve finds the rows policy by its path, with its target."""
    from ray.serve.config import AutoscalingConfig

    from deployments.app import AppArgs

    args = AppArgs(autoscaling={"min_replicas": 1, "max_replicas": 3, "target_rows_per_replica": 6})
    config = AutoscalingConfig(**args.autoscaling.serve_config())
    assert (config.min_replicas, config.max_replicas) == (1, 3)
    assert config.look_back_period_s > config.metrics_interval_s     # else a future Serve refuses it
    policy = config.policy.get_policy()(**config.policy.policy_kwargs)   # as Serve builds a policy class
    assert type(policy).__name__ == "RowsAutoscaling" and policy.target_rows == 6.0
    with pytest.raises(ValueError):
        AppArgs(autoscaling={"min_replicas": 3, "max_replicas": 2}).autoscaling.serve_config()
