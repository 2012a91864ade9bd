"""Benchmark reports (`benchmarks.report`): each bench's record becomes a JSON file, a PNG chart
and its own section of BENCHMARKS.md, and every other section stays as it was. The solo, lane and
service records come from the real benches at a few tokens; the http record (its bench needs a
server of its own) is written in bench_http's shape."""

import json

import pytest

from benchmarks import http as bench_http
from benchmarks import lane as bench
from benchmarks.report import machine_info, new_record, replace_section, write_report
from benchmarks.service import bench_service_overhead

OTHER_SECTIONS = ("# Benchmarks\n\nintro\n\n<!-- bench:load -->\nload table\n<!-- /bench:load -->\n\n"
                  "<!-- bench:load-latest -->\nlatest quick run\n<!-- /bench:load-latest -->\n\ntail\n")


def _http_result():
    case = {"rows": 8, "completion_tokens": 800, "same_token_counts": True, "inproc_tok_s_median": 300.0,
            "http_stream_tok_s_median": 280.0, "http_json_tok_s_median": 290.0, "ratio_stream": 0.93,
            "ratio_json": 0.97, "http_ttft_s_median": 0.12, "inproc_ttft_s_median": 0.1, "metrics": None}
    metrics = {"on_tok_s": [280.0], "off_tok_s": [284.0], "on_off_ratios": [0.986], "on_off_ratio_median": 0.986,
               "cost_pct": 1.4}
    return {"n_rows": 8, "max_tokens": 100, "rounds": 1, "settle_s": 0.3,
            "blas_threads": {"replica": 2, "in_process": 2}, "cohort": {**case, "metrics": metrics},
            "two_rows": {**case, "rows": 2, "completion_tokens": 200},
            "lone_ttft": {"http_s": [0.05], "inproc_submit_s": [0.03], "inproc_submit_cohort_s": [0.01],
                          "http_median_s": 0.05, "inproc_submit_median_s": 0.03,
                          "inproc_submit_cohort_median_s": 0.01, "overhead_ms_vs_submit": 20.0,
                          "overhead_ms_vs_submit_cohort": 40.0}}


BENCHES = {   # name -> (its result at a few tokens, the options it ran with)
    "solo": (lambda m: bench.bench_solo(m, tokens=4, n_prompts=1, rounds=1, blas_off_child=False),
             {"prompts": 1, "tokens": 4, "rounds": 1}),
    "lane": (lambda m: bench.bench_lane(m, tokens=4, rounds=1), {"tokens": 4, "rounds": 1}),
    "service": (lambda m: bench_service_overhead(m, n_prompts=2, min_tokens=4, max_tokens=6, rounds=1, width=3),
                {"prompts": 2, "rounds": 1}),
    "http": (lambda m: _http_result(), {"rows": 8, "tokens": 100, "rounds": 1}),
}


WRITERS = {"solo": (bench.render_solo, bench.plot_solo), "lane": (bench.render_lane, bench.plot_lane),
           "service": (bench.render_service, bench.plot_service),
           "http": (bench_http.render_report, bench_http.plot_report)}


@pytest.mark.parametrize("name", list(WRITERS))
def test_report_writes_json_png_and_only_its_own_section(tmp_path, model, name):
    run, options = BENCHES[name]
    record = new_record(name, run(model), f"mtplx bench {name}", "shipped", options, machine_info(), 1.0)
    md = tmp_path / "BENCHMARKS.md"
    md.write_text(OTHER_SECTIONS)
    render, plot = WRITERS[name]
    artifacts = write_report(record, render, plot, root=tmp_path)
    saved = json.loads((tmp_path / "build" / "bench" / artifacts["json"].rsplit("/", 1)[-1]).read_text())
    assert saved["bench"] == name and saved["machine"]["cpu_count"] >= 1 and saved["artifacts"] == artifacts
    assert (tmp_path / "docs" / f"bench_{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = md.read_text()
    start, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    section = text[text.index(start):text.index(end)]
    assert f"## bench {name}" in section and f"](docs/bench_{name}.png)" in section
    assert "Machine: `" in section and "-" * 3 in section        # the machine line and a table
    assert replace_section(text, name, "X") == replace_section(OTHER_SECTIONS, name, "X")
    write_report(record, render, plot, root=tmp_path)      # a rerun replaces, never appends
    again = md.read_text()
    assert again.count(start) == 1 and replace_section(again, name, "X") == replace_section(OTHER_SECTIONS, name, "X")


def test_a_run_on_another_checkpoint_writes_a_section_of_its_own(tmp_path):
    """`mtplx bench lane --model DIR` writes `bench:lane-DIRNAME`; the shipped model's stays."""
    record = new_record("http", _http_result(), "mtplx bench http", "shipped", BENCHES["http"][1], machine_info(), 1.0)
    (tmp_path / "BENCHMARKS.md").write_text(OTHER_SECTIONS)
    artifacts = write_report(record, *WRITERS["http"], root=tmp_path, name="http-qwen3-bf16")
    text = (tmp_path / "BENCHMARKS.md").read_text()
    assert "<!-- bench:http-qwen3-bf16 -->" in text and "<!-- bench:http -->" not in text
    assert artifacts["png"].endswith("bench_http-qwen3-bf16.png") and "load table" in text
