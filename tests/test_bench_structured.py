"""`bench structured`'s pure parts: every schema compiles against the shipped model's tokenizer, is
what the bench promises (15-80 tokens, every string and array bounded, every required feature
present), and its hand-written instance validates; the judge, the summary, the request bodies,
the report and the chart on synthetic records. No lane runs here."""

import json

import pytest

from benchmarks import structured as S
from benchmarks.schemas import SCHEMAS, format_checker, validation_error
from mtplx.structured import Constraint, check_constraint, grammar_tokenizer, json_schema_grammar


def _compact(value) -> str:
    return json.dumps(value, separators=(",", ":"))


def _walk(schema):
    yield schema
    for key, value in schema.items():
        if key == "properties":
            for sub in value.values():
                yield from _walk(sub)
        elif key == "items":
            yield from _walk(value)
        elif key == "anyOf":
            for sub in value:
                yield from _walk(sub)


def test_every_schema_compiles_and_its_instance_validates(model):
    tokenizer = grammar_tokenizer(model.tokenizer, model.vocab_size)
    assert len(SCHEMAS) >= 24 and len({s["name"] for s in SCHEMAS}) == len(SCHEMAS)
    for s in SCHEMAS:
        check_constraint(Constraint(json_schema_grammar(s["schema"]), "json_schema"), tokenizer, schema=s["schema"])
        text = _compact(s["example"])
        assert validation_error(text, s["schema"]) is None, s["name"]
        assert 15 <= len(model.tokenizer.encode(text)) <= 80, (s["name"], len(model.tokenizer.encode(text)))
        assert s["prompt"].endswith("= ") and len(model.tokenizer.encode(s["prompt"])) < 40


def test_schemas_are_bounded_and_cover_the_features():
    seen = set()
    for s in SCHEMAS:
        for node in _walk(s["schema"]):
            kind = node.get("type")
            if kind == "string":
                assert "maxLength" in node or "pattern" in node or node.get("format") in ("date", "uuid"), s["name"]
                seen |= {f"format:{node['format']}" for _ in [0] if "format" in node}
                seen |= {k for k in ("maxLength", "pattern") if k in node}
            elif kind == "array":
                assert "maxItems" in node, s["name"]
                seen |= {k for k in ("minItems", "maxItems") if k in node}
            elif kind == "number":
                assert "multipleOf" in node, s["name"]     # digits bounded
            elif kind == "object":
                if set(node["properties"]) - set(node["required"]):
                    seen.add("optional")
                if node.get("additionalProperties") is False:
                    seen.add("additionalProperties")
                if any(sub.get("type") == "object" for sub in node["properties"].values()):
                    seen.add("nested")
            seen |= {k for k in ("enum", "const", "anyOf") if k in node}
            if kind in ("integer", "number") and "minimum" in node and "maximum" in node:
                seen.add(f"bounded {kind}")
            if kind in ("boolean", "null"):
                seen.add(kind)
    wanted = {"nested", "minItems", "maxItems", "enum", "bounded integer", "bounded number", "optional", "anyOf",
              "format:date", "format:email", "format:uuid", "format:date-time", "const", "boolean", "null",
              "additionalProperties", "maxLength", "pattern"}
    assert wanted <= seen, wanted - seen


def test_validation_is_exact_and_checks_formats():
    price = next(s for s in SCHEMAS if s["name"] == "price")["schema"]
    assert validation_error('{"amount":19.99,"currency":"EUR","taxed":true}', price) is None   # 19.99 % 0.01 exact
    assert "multiple" in validation_error('{"amount":19.999,"currency":"EUR","taxed":true}', price)
    log = next(s for s in SCHEMAS if s["name"] == "log_line")["schema"]
    assert validation_error('{"level":"info","at":"2026-12-03T10:15:00Z","msg":"x"}', log) is None
    assert validation_error('{"level":"info","at":"2026-12-03 soon","msg":"x"}', log) is not None
    contact = next(s for s in SCHEMAS if s["name"] == "contact")["schema"]
    assert validation_error('{"name":"a","email":"not an email"}', contact) is not None
    assert validation_error('{"name":"a"', contact).startswith("not JSON")
    assert format_checker().conforms("2026-02-30T00:00:00Z", "date-time") is False


def test_judge_counts_finishes_and_validity():
    item = next(s for s in SCHEMAS if s["name"] == "rgb")
    tally = S.new_tally()
    S.judge(tally, item, '{"name":"x","rgb":[1,2,3]}', "stop", 12)
    S.judge(tally, item, '{"name":"x","rgb":[1,2]}', "stop", 10)
    S.judge(tally, item, '{"name":"x","rgb":[1,', "length", 96)
    S.judge(tally, item, "", "cancelled", 0)
    assert {k: tally[k] for k in ("rows", "row_tokens", "stop", "length", "other", "valid", "invalid")} == \
        {"rows": 4, "row_tokens": 118, "stop": 2, "length": 1, "other": 1, "valid": 1, "invalid": 1}
    assert tally["invalid_examples"][0]["schema"] == "rgb"


def _run(tok_s, valid=10, invalid=0, length=1, acceptance=0.8, errors=0):
    return {"tok_s": tok_s, "acceptance": acceptance, "rows_per_cycle": 8.0, "tokens_per_cycle": 20.0,
            "ms_per_step": 30.0, "host_ms_per_step": 4.0, "prefill_share": 0.2, "rows": valid + invalid + length,
            "row_tokens": 40 * (valid + invalid) + 96 * length, "stop": valid + invalid, "length": length, "other": 0,
            "valid": valid, "invalid": invalid, "errors": errors,
            "invalid_examples": [{"schema": "rgb", "error": "/: bad", "text": "{}"}] * invalid}


def _summary(ratios=(0.9, 0.8, 0.95), invalid=0):
    rounds = [{"constrained": _run(100 * r, invalid=invalid), "unconstrained": _run(100.0, valid=0, length=8)}
              for r in ratios]
    return S.summarize_arms(rounds)


def test_summary_medians_ratios_and_targets():
    s = _summary()
    assert s["ratio"] == pytest.approx(0.9) and s["ratio_per_round"] == [0.9, 0.8, 0.95]
    assert s["constrained"]["tok_s"] == pytest.approx(90.0) and s["constrained"]["valid"] == 30
    assert s["constrained"]["validity"] == 1.0 and s["unconstrained"]["validity"] is None
    assert s["constrained"]["mean_tokens_per_row"] == pytest.approx((30 * 40 + 3 * 96) / 33)
    assert s["targets"] == {"ratio": True, "validity": True}
    bad = _summary((0.7, 0.8, 0.84), invalid=1)
    assert bad["targets"] == {"ratio": False, "validity": False} and len(bad["constrained"]["invalid_examples"]) == 3


def test_arms_alternate_and_bodies():
    assert [S.arm_order(r, t)[0] for r in range(2) for t in range(2)] == \
        ["constrained", "unconstrained", "unconstrained", "constrained"]
    item = SCHEMAS[3]
    body = S.request_body(item, 7, "t0.6", True, "completions", 96, "m")
    assert body["prompt"] == item["prompt"] and body["seed"] == 7 and body["top_p"] == 0.95
    assert body["response_format"]["json_schema"] == {"name": item["name"], "schema": item["schema"], "strict": True}
    free = S.request_body(item, 7, "greedy", False, "chat")
    assert "response_format" not in free and "seed" not in free and free["temperature"] == 0.0
    assert free["messages"] == [{"role": "user", "content": item["prompt"]}]
    assert S.response_text({"choices": [{"message": {"content": "{}"}, "finish_reason": "stop"}],
                            "usage": {"completion_tokens": 2}}) == ("{}", "stop", 2)
    run = S.served_run([(1, {"text": _compact(SCHEMAS[1]["example"]), "finish": "stop", "tokens": 20}),
                        (0, {"error": "HTTP 400: no"})], 2.0, SCHEMAS)
    assert run["tok_s"] == 10.0 and run["valid"] == 1 and run["errors"] == 1 and run["first_error"] == "HTTP 400: no"
    snap = lambda a, r, c, rc: {"replicas": {"x": {"accepted_draft_tokens": a, "rejected_draft_tokens": r,  # noqa: E731
                                                  "lane_cycles": c, "lane_row_cycles": rc}}}
    assert S.lane_deltas(snap(10, 5, 10, 60), snap(40, 15, 20, 140)) == {"acceptance": 0.75, "rows_per_cycle": 8.0}
    assert S.lane_deltas(None, None) == {"acceptance": None, "rows_per_cycle": None}


def test_report_and_chart_on_a_synthetic_record(tmp_path):
    from benchmarks.report import write_report

    machine = {"platform": "Linux", "cpu_count": 2, "loadavg": [1.0, 1.0, 1.0],
               "runtime": {"blas": "openblas", "blas_path": "/x.so", "mlx_version": "0", "mlx_device": "cpu",
                           "mlx_lm_version": "0", "python": "3"}}
    record = {"bench": "structured", "date": "2026-12-03T00:00:00+00:00", "command": "mtplx bench structured",
              "model": "shipped", "machine": machine, "elapsed_s": 60.0, "options": {},
              "lane": {"greedy": _summary(), "t0.6": _summary((0.7, 0.8, 0.84), invalid=1)},
              "lane_setup": {"width": 8, "duration_s": 20.0, "max_tokens": 96, "rounds": 3, "blas_threads": 1,
                             "greedy_depths": {"1": 3, "8": 2}, "sampled_depth": 2, "draft_draw": "device"},
              "served": {"c1": {"greedy": _summary(), "t0.6": _summary()},
                         "c8": {"greedy": _summary(), "t0.6": _summary()}},
              "served_setup": {"endpoint": "/v1/completions", "clients": [1, 8], "duration_s": 20.0, "rounds": 3}}
    (tmp_path / "BENCHMARKS.md").write_text("# Benchmarks\n")
    artifacts = write_report(record, S.render_structured, S.plot_structured, root=tmp_path)
    text = (tmp_path / "BENCHMARKS.md").read_text()
    assert "<!-- bench:structured -->" in text and "docs/bench_structured.png" in text
    assert "| greedy | constrained | 90.0 | 0.900 (met)" in text and "0.800 (**missed**)" in text
    assert "| 8, t0.6 | constrained |" in text and "Invalid constrained outputs" in text
    assert "B1 3, B8 2" in text
    assert (tmp_path / "docs" / "bench_structured.png").stat().st_size > 1000 and artifacts["json"]
    refused = dict(record, served={"error": "the server refused response_format"})
    assert "**Served**: not measured: the server refused" in S.render_structured(refused, "x.png")
    S.plot_structured(refused, tmp_path / "refused.png")


def test_a_server_refusing_response_format_stops_the_served_part(monkeypatch, capsys):
    import argparse

    import httpx

    monkeypatch.setattr(httpx, "post", lambda url, json, timeout: httpx.Response(
        400, json={"error": {"message": "response_format other than text is not supported"}}))
    with pytest.raises(S.ResponseFormatRefused, match="refused response_format json_schema on /v1/completions "
                                                      r"\(HTTP 400: .*not supported"):
        S.check_structured_server("http://127.0.0.1:1", "completions", "m")

    def refused(*args, **kwargs):
        raise S.ResponseFormatRefused("the server refused response_format")

    monkeypatch.setattr(S, "bench_structured_served", refused)
    a = argparse.Namespace(quick=True, rounds=3, duration=None, tokens=None, clients=None, served=True,
                           served_only=True, endpoint="completions", blas_threads=1, model=None, no_report=True,
                           json=True, command_line="mtplx bench structured --served-only", config=None)
    assert S.run_cli(a) == 1
    out, err = capsys.readouterr()
    assert json.loads(out)["served"] == {"error": "the server refused response_format"}
    assert "bench structured: the server refused response_format" in err
