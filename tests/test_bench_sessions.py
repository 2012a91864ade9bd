"""`mtplx bench sessions`' figures from what an arm saw (its turns, the app's snapshots before and
after), without a cluster: which later turns found their conversation cached, the second turn's
prefill, rows per cohort call and per lane cycle over the arm alone, and the report's tables and
chart from a record in the bench's shape."""

import json

from benchmarks.report import machine_info, new_record, write_report
from benchmarks.sessions import BLOCK, _arm_figures, plot, render, summarize, user_message


def _turn(session, turn, prompt, cached, replica, ttft=1.0):
    return {"session": session, "turn": turn, "error": None, "ttft_s": ttft, "replica": replica,
            "prompt_tokens": prompt, "cached_tokens": cached, "completion_tokens": 32}


def _snapshot(cohorts, windows, decisions, rows_cycles):
    replicas = {r: {"pid": 1, "lane_row_cycles": rc, "lane_cycles": c,
                    "prefix_cache": {"requests": 2, "request_hit_rate": 0.5, "token_hit_rate": 0.25}}
                for r, (rc, c) in rows_cycles.items()}
    return {"ingress": {"cohort_size_histogram": cohorts, "batch_size_histogram": windows,
                        "routing": {"decisions": decisions}}, "replicas": replicas}


def test_an_arms_figures_count_only_what_the_arm_did():
    turns = [_turn(0, 0, 700, 0, "a", 2.0), _turn(0, 1, 1000, 2 * BLOCK, "a", 1.0),    # all of turn 1's blocks
             _turn(1, 0, 700, 0, "b", 2.0), _turn(1, 1, 1000, BLOCK, "a", 3.0)]        # only the system block
    before = _snapshot({"1": 4}, {"1": 4}, {"session": 5}, {"a": (10, 10), "b": (3, 3)})
    after = _snapshot({"1": 6, "2": 1}, {"1": 4, "2": 2}, {"session": 7}, {"a": (40, 20), "b": (3, 3)})
    f = _arm_figures(turns, 2.0, before, after)
    assert f["conversation_hit_rate"] == 0.5 and f["later_token_hit_rate"] == 3 * BLOCK / 2000
    assert f["turn2_prefilled_tokens"] == (1000 - 2 * BLOCK + 1000 - BLOCK) / 2
    assert f["rows_per_cohort"] == (2 * 1 + 1 * 2) / 3 and f["rows_per_window"] == 2.0
    assert f["rows_per_lane_cycle"] == 30 / 10 and f["decisions"] == {"session": 2}
    assert f["replicas"]["a"]["conversation_hits"] == 1 and f["replicas"]["a"]["later_turns"] == 2
    assert f["tok_s"] == 4 * 32 / 2.0 and f["errors"] == 0
    assert user_message(0, 1) != user_message(1, 1) and user_message(3, 2).startswith("[session 3, part 3]")


def test_the_report_renders_every_arm_and_the_kill(tmp_path):
    turns = [_turn(0, 0, 700, 0, "a"), _turn(0, 1, 1000, 512, "a")]
    arm = _arm_figures(turns, 1.0, _snapshot({}, {}, {}, {"a": (0, 0)}),
                       _snapshot({"1": 2}, {"1": 2}, {"session": 2}, {"a": (8, 4)}))
    kill = {"requests": 8, "problems": [], "deterministic": 6, "identical": 6, "completion_tokens": 3200,
            "expected_tokens": 3200, "rows_moved": 3, "row_moves_failed": 0, "longest_pause_s": 0.5, "rows_on_it": 3}
    result = {"runs": 1, "arms": ["power_of_two", "affinity"], "sessions": 1, "turns": 2, "answer_tokens": 32,
              "by_arm": {"power_of_two": [arm], "affinity": [arm]}, "kill": kill,
              "summary": {"power_of_two": summarize([arm]), "affinity": summarize([arm])}}
    record = new_record("sessions", result, "mtplx bench sessions --quick", "shipped", {"runs": 1}, machine_info(), 1.0)
    (tmp_path / "BENCHMARKS.md").write_text("# Benchmarks\n")
    artifacts = write_report(record, render, plot, root=tmp_path)
    md = (tmp_path / "BENCHMARKS.md").read_text()
    assert "<!-- bench:sessions -->" in md and "| affinity | 100% |" in md and "| 1.00x |" in md
    assert "| 8 | 8 | 6 of 6 | 3200 / 3200 | 3 | 0 | 0.5 |" in md
    assert (tmp_path / "docs" / "bench_sessions.png").stat().st_size > 0
    assert json.loads(open(artifacts["json"]).read())["summary"]["affinity"]["conversation_hit_rate"] == 1.0
