"""`EngineSettings`: what an entry point was given, else its environment, else the defaults; read
once, and nothing below the entry points reads the environment."""

import ast
from pathlib import Path

import pytest

from mtplx.engine.repetition import RepetitionLimits
from mtplx.engine.settings import ENVIRONMENT, EngineSettings

ROOT = Path(__file__).resolve().parents[1]


def test_given_over_environment_over_defaults():
    env = {"MTPLX_DRAFT_DRAW": "host", "MTPLX_MTP_BATCH_COMPILE": "0", "MTPLX_RUN_AHEAD": "off",
           "MTPLX_DEVICE_JUDGE": "1", "MTPLX_MTP_BATCH_FORCE_WIDTH": " 8 ", "MTPLX_KV_BUDGET_GB": "1.5",
           "MTPLX_REPETITION_STOP_MIN_TOKENS": "10", "MTPLX_CONTEXT_DRAFTS": "yes"}
    s = EngineSettings.from_environ(env)
    assert (s.draft_draw, s.compiled, s.run_ahead, s.device_judging, s.force_width) == ("host", False, False, True, 8)
    assert s.context_drafts and not EngineSettings().context_drafts
    assert s.kv_budget_bytes() == int(1.5 * 2**30) and s.overlap is None
    assert s.repetition_limits == RepetitionLimits(min_tokens=10) and not s.repetition_stop_all
    given = EngineSettings.from_environ(env, draft_draw="device", compiled=True, force_width=None,
                                        repetition_limits=RepetitionLimits(max_block=4), repetition_stop_all=True)
    assert (given.draft_draw, given.compiled, given.force_width) == ("device", True, 8)   # None: not given
    assert given.repetition_limits == RepetitionLimits(max_block=4) and given.repetition_stop_all
    assert EngineSettings.from_environ({}) == EngineSettings()
    assert EngineSettings().lane_overlap() is False and EngineSettings(overlap=True).lane_overlap()   # CPU here


@pytest.mark.parametrize("env, named", [
    ({"MTPLX_DRAFT_DRAW": "gpu"}, "MTPLX_DRAFT_DRAW='gpu' is invalid"),
    ({"MTPLX_MTP_BATCH_FORCE_WIDTH": "eight"}, "MTPLX_MTP_BATCH_FORCE_WIDTH='eight' is invalid"),
    ({"MTPLX_KV_BUDGET_GB": "lots"}, "MTPLX_KV_BUDGET_GB='lots' is invalid"),
    ({"MTPLX_KV_BUDGET_GB": "0"}, "kv_budget_gb=0.0 is invalid"),
    ({"MTPLX_REPETITION_STOP_MAX_BLOCK": "zero"}, "MTPLX_REPETITION_STOP_MAX_BLOCK='zero' is invalid"),
    ({"MTPLX_REPETITION_STOP_MIN_REPEATS": "0"}, "MTPLX_REPETITION_STOP_MIN_REPEATS=0 is invalid"),
])
def test_a_bad_value_names_where_it_came_from(env, named):
    with pytest.raises(ValueError, match=named):
        EngineSettings.from_environ(env)


def test_unknown_settings_are_refused():
    with pytest.raises(TypeError, match="unknown engine settings"):
        EngineSettings.from_environ({}, draft_drwa="host")
    with pytest.raises(TypeError, match="repetition_limits=None is invalid"):
        EngineSettings(repetition_limits=None)


def test_nothing_below_the_entry_points_reads_the_environment():
    """The engine, scheduler, protocol and models read settings they are given: `os.environ` and
    `os.getenv` appear only in the entry points (deployments, the CLI, benchmarks) and the runtime's
    BLAS loading and the model directory's default, which run before any setting exists."""
    allowed = {"mtplx/cli.py", "mtplx/runtime.py", "mtplx/models/registry.py"}
    readers = []
    for path in sorted((ROOT / "mtplx").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv") \
                    and isinstance(node.value, ast.Name) and node.value.id == "os":
                readers.append(rel)
    assert sorted(set(readers) - allowed) == []
    assert set(ENVIRONMENT.values()) >= {"MTPLX_DRAFT_DRAW", "MTPLX_OVERLAP", "MTPLX_DEVICE_JUDGE", "MTPLX_RUN_AHEAD"}
