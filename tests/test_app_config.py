"""The app's config: one default per knob, shared by AppArgs, the replica and the scheduler;
engine switches are config fields, checked when the app is built (the error names the field)."""

from __future__ import annotations

import inspect

import pytest
from pydantic import ValidationError

from deployments.app import AppArgs, build_app
from deployments.replica import MTPReplica
from mtplx.scheduler.config import DEFAULT_BATCH_WAIT_S, DEFAULT_WIDTHS
from mtplx.server.mtp_batch import MTPBatchGenerationService


def _replica_kwargs(args: dict) -> dict:
    """The keyword arguments build_app binds to the model replica."""
    ingress = build_app(args)._bound_deployment
    return dict(ingress.init_args[0]._bound_deployment.init_kwargs)


def test_the_apps_defaults_are_the_replicas_and_the_services():
    bound = _replica_kwargs({})
    defaults = {name: p.default for name, p in inspect.signature(MTPReplica.__init__).parameters.items()
                if name != "self"}
    assert set(bound) == set(defaults)           # every replica setting comes from the config
    assert bound == {**defaults, "widths": tuple(defaults["widths"])}
    assert bound["widths"] == DEFAULT_WIDTHS and bound["batch_wait_s"] == DEFAULT_BATCH_WAIT_S
    for_model = inspect.signature(MTPBatchGenerationService.for_model).parameters
    assert for_model["widths"].default == DEFAULT_WIDTHS and for_model["batch_wait_s"].default == DEFAULT_BATCH_WAIT_S


def test_replica_cpus_reach_the_replica_one_replica_to_a_node():
    """`replica_cpus` pins a replica to its node's first CPUs, so two may not share a node."""
    assert _replica_kwargs({"replica_cpus": 1})["replica_cpus"] == 1

    def per_node(args):
        return build_app(args)._bound_deployment.init_args[0]._bound_deployment._replica_config.max_replicas_per_node

    assert per_node({"replica_cpus": 1, "num_replicas": 2}) == 1
    assert per_node({}) is None
    with pytest.raises(ValidationError, match="replica_cpus"):
        AppArgs(replica_cpus=0)


def test_engine_switches_reach_the_replica():
    engine = _replica_kwargs({"force_width": 8, "draft_draw": "host", "compiled": False, "kv_budget_gb": 1.5,
                              "device_judging": True, "run_ahead": False, "context_drafts": False,
                              "repetition_stop": {"min_tokens": 50}})["engine"]
    assert engine == {"force_width": 8, "draft_draw": "host", "compiled": False, "kv_budget_gb": 1.5,
                      "device_judging": True, "run_ahead": False, "context_drafts": False,
                      "repetition_stop": {"min_tokens": 50, "min_repeated": 192, "min_repeats": 4, "max_block": 96}}
    assert _replica_kwargs({})["engine"] is None       # nothing given: the environment's, else the defaults
    assert _replica_kwargs({"overlap": False})["engine"] == {"overlap": False}


@pytest.mark.parametrize("args, field", [
    ({"force_width": 0}, "force_width"), ({"draft_draw": "gpu"}, "draft_draw"),
    ({"kv_budget_gb": 0}, "kv_budget_gb"), ({"repetition_stop": {"min_repeats": 1}}, "repetition_stop.min_repeats"),
    ({"repetition_stop": {"max_blocks": 9}}, "repetition_stop.max_blocks"), ({"numerics": "fast"}, "numerics"),
])
def test_a_bad_setting_is_refused_by_name(args, field):
    with pytest.raises(ValidationError) as err:
        AppArgs(**args)
    assert [".".join(map(str, e["loc"])) for e in err.value.errors()] == [field]
