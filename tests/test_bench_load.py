"""`bench load` helpers: no servers are started here."""

import asyncio
import json
import struct
import subprocess
import sys
import time
import types

import pytest

from benchmarks import report, servers
from benchmarks.load import arms, cli, clients, outputs, summary, workload
from benchmarks.load import summary as summary_mod


def _read_safetensors(path):
    """{name: (dtype, shape, raw bytes)} and the metadata of a safetensors file."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = f.read()
    meta = header.pop("__metadata__", None)
    return {k: (v["dtype"], v["shape"], data[v["data_offsets"][0]:v["data_offsets"][1]])
            for k, v in header.items()}, meta


def test_peer_checkpoint_drops_mtp_and_keeps_the_rest_byte_identical(tmp_path):
    out = tmp_path / "peer"
    info = servers.make_peer_checkpoint(servers.SHIPPED_MODEL, out)
    src, src_meta = _read_safetensors(servers.SHIPPED_MODEL / "model.safetensors")
    dst, dst_meta = _read_safetensors(out / "model.safetensors")
    mtp = {k for k in src if k.startswith("mtp.")}
    assert mtp and info["dropped_tensors"] == len(mtp)
    assert set(dst) == set(src) - mtp
    assert all(dst[k] == src[k] for k in dst)
    assert dst_meta == src_meta
    cfg = json.loads((out / "config.json").read_text())
    assert "mtp_num_hidden_layers" not in cfg
    src_cfg = json.loads((servers.SHIPPED_MODEL / "config.json").read_text())
    src_cfg.pop("mtp_num_hidden_layers")
    assert cfg == src_cfg
    assert (out / "tokenizer.json").read_bytes() == (servers.SHIPPED_MODEL / "tokenizer.json").read_bytes()


def test_strip_safetensors_handles_any_dtype_and_offsets(tmp_path):
    tensors = {"b": ("BF16", [2], b"\x01\x02\x03\x04"), "mtp.x": ("F32", [1], b"\x00\x00\x80\x3f"),
               "a": ("U8", [3], b"xyz")}
    header, offset, blob = {"__metadata__": {"format": "mlx"}}, 0, b""
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
        blob += raw
    h = json.dumps(header).encode()
    src = tmp_path / "src.safetensors"
    src.write_bytes(struct.pack("<Q", len(h)) + h + blob)
    dropped = servers.strip_safetensors(src, tmp_path / "dst.safetensors", servers.is_mtp_tensor)
    out, meta = _read_safetensors(tmp_path / "dst.safetensors")
    assert dropped == ["mtp.x"]
    assert out == {k: v for k, v in tensors.items() if k != "mtp.x"}
    assert meta == {"format": "mlx"}
    (n,) = struct.unpack("<Q", (tmp_path / "dst.safetensors").read_bytes()[:8])
    assert n % 8 == 0


def test_percentile_matches_linear_interpolation():
    xs = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert summary.percentile(xs, 50) == 3.0
    assert summary.percentile(xs, 95) == pytest.approx(4.8)
    assert summary.percentile(xs, 0) == 1.0 and summary.percentile(xs, 100) == 5.0
    assert summary.percentile([None, 7.0], 95) == 7.0
    assert summary.percentile([], 50) is None
    assert summary.median_or_none([None, 1.0, 3.0]) == 2.0 and summary.median_or_none([None]) is None


def _row(index, ttft, itl, e2e, tokens, text="x", error=None, gaps=()):
    return {"index": index, "error": error, "ttft": ttft, "itl": itl, "e2e": e2e, "tokens": tokens,
            "text": text, "gaps": list(gaps)}


def test_summarize_arm_counts_only_successful_requests():
    rows = [_row(0, 0.1, 0.01, 1.0, 100, gaps=[0.01, 0.02]), _row(1, 0.3, 0.03, 2.0, 50, gaps=[0.03]),
            _row(2, None, None, None, 0, error="HTTP 503: busy")]
    s = summary.summarize_arm(rows, wall_s=3.0)
    assert s["requests"] == 3 and s["errors"] == 1 and s["error_samples"] == ["HTTP 503: busy"]
    assert s["completion_tokens"] == 150 and s["tok_s"] == pytest.approx(50.0)
    assert s["req_s"] == pytest.approx(2 / 3)
    assert s["ttft_p50_s"] == pytest.approx(0.2) and s["ttft_p95_s"] == pytest.approx(0.29)
    assert s["chunk_gap_p50_s"] == pytest.approx(0.02)
    assert s["e2e_p95_s"] == pytest.approx(1.95)


def test_lane_occupancy_sums_replicas_and_tolerates_missing_counters():
    def snap(*reps):
        return {"model": "m", "ingress": {}, "replicas": {f"r{i}": r for i, r in enumerate(reps)}}

    before = snap({"lane_row_cycles": 10, "lane_cycles": 5}, {"lane_row_cycles": 0, "lane_cycles": 0})
    after = snap({"lane_row_cycles": 50, "lane_cycles": 15}, {"lane_row_cycles": 30, "lane_cycles": 10})
    assert summary.lane_occupancy(before, after) == pytest.approx(70 / 20)
    assert summary.lane_occupancy(snap({"cohort_calls": 1}), snap({"cohort_calls": 2})) is None
    assert summary.lane_occupancy(None, after) is None
    assert summary.lane_occupancy(after, after) is None


def test_identical_texts_pairs_by_index_and_skips_errors():
    ours = [_row(0, 0, 0, 0, 1, " a b"), _row(1, 0, 0, 0, 1, "b"), _row(2, 0, 0, 0, 1, "c", error="boom"),
            _row(3, 0, 0, 0, 1, "  d")]
    peer = [_row(1, 0, 0, 0, 1, "B"), _row(0, 0, 0, 0, 1, "a b"), _row(2, 0, 0, 0, 1, "c"),
            _row(3, 0, 0, 0, 1, "d")]
    # one leading space is ignored (mlx-lm trims it), a second one is a difference
    assert summary.identical_texts(ours, peer) == {"identical": 1, "compared": 3, "fraction": 1 / 3,
                                              "differing_indices": [1, 3]}


def test_summarize_runs_medians_ratio_and_summed_errors():
    def arm(tok_s, errors):
        return {"requests": 4, "errors": errors, "error_samples": ["e"] if errors else [], "tok_s": tok_s,
                "ttft_p95_s": tok_s / 1000, "lane_occupancy": None}

    per_run = [{"ours": {"greedy/closed-8": arm(t_o, 0)}, "peer": {"greedy/closed-8": arm(t_p, e)},
                "identical": {"greedy/closed-8": {"identical": 3, "compared": 4, "fraction": 0.75}}}
               for t_o, t_p, e in ((200, 100, 0), (300, 100, 1), (100, 200, 0))]
    s = summary.summarize_runs(per_run)["greedy/closed-8"]
    assert s["ours"]["tok_s"] == 200 and s["peer"]["tok_s"] == 100
    assert s["tok_s_ratio"] == 2.0            # median of 2.0, 3.0, 0.5
    assert s["peer"]["errors"] == 1 and s["peer"]["requests"] == 12
    assert s["ours"]["lane_occupancy"] is None
    assert s["greedy_identical"] == {"identical": 9, "compared": 12, "fraction": 0.75}


def test_the_table_gives_every_row_as_many_cells_as_its_header():
    figures = {"tok_s": 200.0, "ttft_p50_s": 0.1, "ttft_p95_s": 0.2, "itl_p50_s": 0.02, "itl_p95_s": 0.03,
               "e2e_p95_s": 4.0, "errors": 0}
    ours = dict(figures, lane_occupancy=7.5, drafts_per_row_cycle=2.16, accepted_share=0.667)
    record = {"summary": {"mixed/closed-8": {"ours": ours, "peer": figures, "tok_s_ratio": 1.5,
                                             "greedy_identical": {"identical": 3, "compared": 3}}}}
    lines = outputs.format_table(record).splitlines()
    assert len({line.count("|") for line in lines}) == 1
    assert "| 7.50 | 2.16 | 67 | 3/3 |" in lines[2] and lines[3].endswith("| 0 |  |  |  |  |")


def test_replace_section_keeps_other_sections():
    text = "# Benchmarks\n\nintro\n\n<!-- bench:solo -->\nsolo v1\n<!-- /bench:solo -->\n\ntail\n"
    once = report.replace_section(text, "load", "load v1")
    assert "<!-- bench:load -->\nload v1\n<!-- /bench:load -->" in once
    twice = report.replace_section(once, "load", "load v2")
    assert "load v1" not in twice and twice.count("<!-- bench:load -->") == 1
    assert twice.replace("<!-- bench:load -->\nload v2\n<!-- /bench:load -->", "X") == \
        once.replace("<!-- bench:load -->\nload v1\n<!-- /bench:load -->", "X")
    assert "solo v1" in twice and "intro" in twice and "tail" in twice
    assert report.replace_section("", "load", "body").startswith("# Benchmarks\n\n<!-- bench:load -->")


def test_workload_is_deterministic_and_mixed():
    a = [workload.request_body(i, 0.6, "m", send_seed=True) for i in range(40)]
    b = [workload.request_body(i, 0.6, "m", send_seed=True) for i in range(40)]
    assert a == b
    assert [x["seed"] for x in a] == [1000 + i for i in range(40)]
    assert "seed" not in workload.request_body(3, 0.6, "m", send_seed=False)
    greedy = workload.request_body(3, 0.0, "m", send_seed=True)
    assert "seed" not in greedy and "top_p" not in greedy and greedy["stream_options"] == {"include_usage": True}
    budgets = [workload.budget_for(i) for i in range(241)]
    assert sorted(budgets) == list(range(16, 257))        # every budget once per 241 requests
    short = [len(workload.prompt_for(i)) for i in range(40) if i % 5 != 4]
    long = [len(workload.prompt_for(i)) for i in range(40) if i % 5 == 4]
    ratio = (sum(long) / len(long)) / (sum(short) / len(short))
    assert 5.0 < ratio < 7.0
    assert workload.poisson_arrivals(20, 2.0, seed=1) == workload.poisson_arrivals(20, 2.0, seed=1)
    arrivals = workload.poisson_arrivals(2000, 2.0, seed=1)
    assert arrivals == sorted(arrivals) and 900 < arrivals[-1] < 1100
    assert workload.closed_loop_requests(1, 6, 12) == 12 and workload.closed_loop_requests(8, 6, 12) == 48


def test_cli_options_reach_the_plan(monkeypatch):
    """`--clients`, `--temperatures` and `--modes` become the plan, and the command line recorded
    with the results names them."""
    seen = {}

    def fake_bench_load(**opts):
        seen.update(opts)
        return {}

    def fake_outputs(record, command):
        seen["command"] = command
        return {"table": "", "json": "j", "png": "p", "markdown": "m"}

    monkeypatch.setattr(cli, "bench_load", fake_bench_load)
    monkeypatch.setattr(cli, "write_outputs", fake_outputs)
    cli.main(["--runs", "2", "--clients", "1,8", "--temperatures", "0,1.0", "--modes", "auto,mtp,ar"])
    assert seen["runs"] == 2 and seen["clients"] == [1, 8] and seen["temperatures"] == [0.0, 1.0]
    assert seen["modes"] == ["auto", "mtp", "ar"]
    assert seen["command"] == "mtplx bench load --runs 2 --clients 1,8 --temperatures 0,1.0 --modes auto,mtp,ar"
    cli.main(["--quick"])
    assert seen["temperatures"] == (0.0,) and seen["command"] == "mtplx bench load --quick"
    cli.main(["--runs", "1", "--min-requests", "4", "--open-requests", "0", "--long-prompt-tokens", "1000"])
    assert seen["min_requests"] == 4 and seen["open_requests"] == 0 and seen["long_prompt_tokens"] == 1000
    assert seen["command"] == "mtplx bench load --runs 1 --min-requests 4 --open-requests 0 --long-prompt-tokens 1000"
    cli.main(["--runs", "1", "--generation-mode", "ar"])
    assert seen["generation_mode"] == "ar" and seen["command"] == "mtplx bench load --runs 1 --generation-mode ar"


def test_runs_with_other_arms_or_models_get_sections_of_their_own():
    def record(model="shipped", modes=(), logprobs=None, temperatures=(0.0, 0.6, "mixed"), clients=(1, 8, 16, 32),
               generation_mode=None):
        return {"model": model, "plan": {"modes": list(modes), "logprobs": logprobs, "temperatures": list(temperatures),
                                         "clients": list(clients), "generation_mode": generation_mode}}

    assert outputs.section_name(record()) == "load"
    assert outputs.section_name(record(modes=["auto", "ar"])) == "load-modes"
    assert outputs.section_name(record(logprobs=0)) == "load-logprobs"
    assert outputs.section_name(record(model="/m/gemma-3-270m", generation_mode="ar", clients=[1, 8, 16])) == \
        "load-gemma-3-270m-ar-c1-8-16"
    assert outputs.section_name(record(model="/tmp/x/Never_Ckpt", modes=["auto"])) == "load-never-ckpt-modes"
    assert outputs.section_name(record(modes=["auto"], temperatures=[0.0])) == "load-modes"
    assert outputs.section_name(record(modes=["auto"], temperatures=[1.0])) == "load-modes-t1"
    assert outputs.section_name(record(temperatures=[0.0, 0.7])) == "load-t07"
    assert outputs.section_name(record(modes=["auto"], temperatures=[0.0, 1.0], clients=[1])) == "load-modes-t1-c1"
    assert outputs.section_name(record(logprobs=5, clients=[1, 8, 16, 32])) == "load-logprobs"
    # a partial comparison never replaces the default one
    assert outputs.section_name(record(temperatures=[0.0], clients=[16])) == "load-greedy-c16"
    assert outputs.section_name(record(clients=[8, 16])) == "load-c8-16"
    # the default arms are greedy, t0.6 and mixed: a run without the mixed arm is partial
    assert outputs.section_name(record(temperatures=[0.0, 0.6])) == "load-greedy-t06"
    assert outputs.section_name(record(temperatures=[0.6, "mixed"], clients=[8, 16])) == "load-t06-mixed-c8-16"
    assert outputs.section_name(record(temperatures=["mixed"])) == "load-mixed"
    assert outputs.section_name(record(temperatures=[0.0, 0.7, "mixed"])) == "load-t07"
    assert outputs.section_name(record(modes=["auto"], temperatures=[0.0, "mixed"])) == "load-modes"


def test_mode_arms_run_each_mode_twice_in_a_mirrored_order(monkeypatch):
    """Each arm runs its modes in a rotation then its reverse (drift weighs on all alike), and a
    mode's figures pool both of its halves; with one client the modes instead take turns request
    by request (the order reversed every other request), and a mode's wall time is the sum of its
    own requests' times."""
    sent = []

    def fake_arm(server, run):
        bodies = run(None)                      # the arm's bodies, from the closed_loop below
        sent.append([(b["generation_mode"], b["prompt"]) for b in bodies])
        rows = [{"mode": b["generation_mode"], "e2e": 0.5} for b in bodies]
        return {"wall_s": 2.0, "tok_s": 1.0, "ttft_p95_s": None, "itl_p50_s": None, "errors": 0}, rows

    monkeypatch.setattr(arms, "closed_loop", lambda url, bodies, n, at_drain=None: bodies)
    monkeypatch.setattr(arms, "_timed_arm", fake_arm)
    monkeypatch.setattr(arms, "summarize_arm", lambda rows, wall: {"rows": [r["mode"] for r in rows], "wall_s": wall,
                                                                  "tok_s": 1.0, "ttft_p95_s": None, "itl_p50_s": None,
                                                                  "errors": 0})
    server = types.SimpleNamespace(url="http://x", model="m", kind="ours")
    plan = {"temperatures": [0.0], "clients": [1, 8], "modes": ["auto", "mtp", "ar"], "per_client": 1,
            "min_requests": 2}
    out = arms.run_mode_arms(server, plan, run=1, log=lambda s: None)
    p0, p1 = workload.prompt_for(0), workload.prompt_for(1)
    closed_1 = [("mtp", p0), ("ar", p0), ("auto", p0), ("auto", p1), ("ar", p1), ("mtp", p1)]  # rotation 1
    assert sent[0] == closed_1 + closed_1        # one closed loop: each mode twice over, request by request
    assert [[mode for mode, _ in arm] for arm in sent[1:]] == [
        ["ar"] * 8, ["auto"] * 8, ["mtp"] * 8, ["mtp"] * 8, ["auto"] * 8, ["ar"] * 8]   # closed-8: rotation 2, mirrored
    assert (out["auto"]["greedy/closed-1"]["rows"], out["auto"]["greedy/closed-1"]["wall_s"]) == (["auto"] * 4, 2.0)
    assert (out["auto"]["greedy/closed-8"]["rows"], out["auto"]["greedy/closed-8"]["wall_s"]) == (["auto"] * 16, 4.0)


def test_logprob_arms_alternate_off_and_on_in_a_mirrored_order(monkeypatch):
    """Without and with logprobs, off-on-on-off (reversed per arm and run); each side pools its halves."""
    sent = []

    def fake_arm(server, run):
        bodies = run(None)
        sent.append("on" if "logprobs" in bodies[0] else "off")
        return {"wall_s": 2.0, "tok_s": 1.0, "ttft_p95_s": None, "itl_p50_s": None, "errors": 0}, [{}] * len(bodies)

    monkeypatch.setattr(arms, "closed_loop", lambda url, bodies, n, at_drain=None: bodies)
    monkeypatch.setattr(arms, "_timed_arm", fake_arm)
    monkeypatch.setattr(arms, "summarize_arm", lambda rows, wall: {"rows": len(rows), "wall_s": wall, "tok_s": 1.0,
                                                                  "ttft_p95_s": None, "itl_p50_s": None, "errors": 0})
    server = types.SimpleNamespace(url="http://x", model="m", kind="ours")
    plan = {"temperatures": [0.0], "clients": [8, 16], "logprobs": 5, "per_client": 1, "min_requests": 1}
    out = arms.run_logprob_arms(server, plan, run=0, log=lambda s: None)
    assert sent == ["off", "on", "on", "off", "on", "off", "off", "on"]
    assert out["on"]["greedy/closed-16"] == {"rows": 32, "wall_s": 4.0, "tok_s": 1.0, "ttft_p95_s": None,
                                             "itl_p50_s": None, "errors": 0}


def test_mixed_arm_payloads_are_per_index_and_identical_for_both_servers_but_the_seed():
    ours = [workload.request_body(i, workload.MIXED, "m", send_seed=True) for i in range(60)]
    peer = [workload.request_body(i, workload.MIXED, "m", send_seed=False) for i in range(60)]
    assert ours == [workload.request_body(i, "mixed", "m", send_seed=True) for i in range(60)]   # deterministic
    for i, (o, p) in enumerate(zip(ours, peer)):
        t, top_p = workload.mixed_settings(i)
        assert (o["temperature"], o["top_p"], o["top_k"]) == (t, top_p, 20) and p["top_k"] == 20
        assert "seed" not in p
        assert o.get("seed") == (1000 + i if t > 0 else None)      # sampled only, ours only
        assert {k: v for k, v in o.items() if k != "seed"} == p
        shared = workload.request_body(i, 0.6, "m", send_seed=False)      # same prompt and budget by index
        assert (p["prompt"], p["max_tokens"], p["stream_options"]) == \
            (shared["prompt"], shared["max_tokens"], shared["stream_options"])
    pairs = [(b["temperature"], b["top_p"]) for b in peer[:15]]
    assert sorted(pairs) == sorted((t, q) for t in workload.MIXED_TEMPERATURES for q in workload.MIXED_TOP_PS)
    assert sorted(pairs) == sorted((b["temperature"], b["top_p"]) for b in peer[45:60])   # every block of 15
    ours = [workload.request_body(i, workload.MIXED, "m", send_seed=True) for i in range(75)]
    long = {(b["temperature"], b["top_p"]) for i, b in enumerate(ours) if i % workload.LONG_EVERY == workload.LONG_EVERY - 1}
    assert len(long) == 15                                          # long prompts meet every pair
    # a few requests already mix temperatures: the first five take each once
    assert sorted(b["temperature"] for b in peer[:5]) == sorted(workload.MIXED_TEMPERATURES)
    # the other arms are unchanged: t0.6 sends top_p 0.95 / top_k 20
    assert {k: workload.request_body(2, 0.6, "m", False)[k] for k in ("temperature", "top_p", "top_k")} == \
        {"temperature": 0.6, "top_p": 0.95, "top_k": 20}


def test_mixed_arm_counts_identical_texts_of_its_greedy_requests_only():
    ours_rows = [_row(i, 0, 0, 0, 1, f"o{i}") for i in range(15)]
    peer_rows = [_row(i, 0, 0, 0, 1, f"o{i}" if workload.mixed_settings(i)[0] == 0 else f"p{i}") for i in range(15)]
    out = summary.identical_by_arm({"greedy/closed-8": ours_rows, "t0.6/closed-8": ours_rows, "mixed/closed-8": ours_rows,
                               "mixed/open": ours_rows},
                              {"greedy/closed-8": peer_rows, "t0.6/closed-8": peer_rows, "mixed/closed-8": peer_rows,
                               "mixed/open": peer_rows})
    assert set(out) == {"greedy/closed-8", "mixed/closed-8", "mixed/open"}
    assert out["mixed/closed-8"] == {"identical": 3, "compared": 3, "fraction": 1.0, "differing_indices": []}
    assert out["greedy/closed-8"]["compared"] == 15 and out["greedy/closed-8"]["identical"] == 3


def _arm(tok_s, occupancy=None):
    return {"requests": 4, "errors": 0, "error_samples": [], "tok_s": tok_s, "ttft_p95_s": 0.1,
            "lane_occupancy": occupancy}


def test_mixed_over_shared_is_the_median_of_per_run_ratios():
    # ours mixed 100, 300, 200 over t0.6 100, 100, 400: ratios 1.0, 3.0, 0.5 -> 1.0 (medians alone: 2.0)
    per_run = [{"ours": {"t0.6/closed-8": _arm(s), "mixed/closed-8": _arm(m, 7.5), "mixed/open": _arm(m)},
                "peer": {"t0.6/closed-8": _arm(100), "mixed/closed-8": _arm(pm), "mixed/open": _arm(pm)},
                "identical": {"mixed/closed-8": {"identical": 2, "compared": 2, "fraction": 1.0},
                              "mixed/open": {"identical": 1, "compared": 1, "fraction": 1.0}}}
               for m, s, pm in ((100, 100, 50), (300, 100, 100), (200, 400, 200))]
    by_arm = summary.summarize_runs(per_run)
    e = by_arm["mixed/closed-8"]
    assert e["mixed_over_shared"] == 1.0
    assert e["peer_mixed_over_shared"] == 1.0          # peer: 0.5, 1.0, 2.0
    assert e["tok_s_ratio"] == 2.0                     # ours/peer: 2.0, 3.0, 1.0
    assert "mixed_over_shared" not in by_arm["mixed/open"] and "mixed_over_shared" not in by_arm["t0.6/closed-8"]
    mixed = summary.summarize_mixed(by_arm)
    assert list(mixed) == ["closed-8"]
    assert mixed["closed-8"] == {"clients": 8, "ours_tok_s": 200, "peer_tok_s": 100, "ours_over_peer": 2.0,
                                 "lane_occupancy": 7.5, "steady_lane_occupancy": None,
                                 "mixed_over_shared": 1.0, "peer_mixed_over_shared": 1.0,
                                 "greedy_identical": {"identical": 6, "compared": 6, "fraction": 1.0}}
    table = outputs.format_mixed_table(mixed)
    assert table.splitlines()[-1] == "| 8 | 200.0 | 100.0 | 2.00 | 7.50 | - | 1.000 | 1.000 | 6/6 |"
    # a run without the t0.6 arm: no ratio; one without a mixed arm: no mixed table
    no_shared = [{**r, "ours": {"mixed/closed-8": r["ours"]["mixed/closed-8"]},
                  "peer": {"mixed/closed-8": r["peer"]["mixed/closed-8"]}} for r in per_run]
    assert summary.summarize_runs(no_shared)["mixed/closed-8"]["mixed_over_shared"] is None
    assert summary.summarize_mixed({"t0.6/closed-8": by_arm["t0.6/closed-8"]}) == {}


def test_temperatures_accept_the_mixed_arm(monkeypatch):
    seen = {}
    monkeypatch.setattr(cli, "bench_load", lambda **opts: seen.update(opts) or {})
    monkeypatch.setattr(cli, "write_outputs",
                        lambda record, command: seen.update(command=command) or {"table": "", "json": "j", "png": "p",
                                                                                 "markdown": "m"})
    assert workload.parse_temperatures("0, 0.6,Mixed") == [0.0, 0.6, "mixed"]
    cli.main(["--clients", "8,16", "--temperatures", "0.6,mixed"])
    assert seen["temperatures"] == [0.6, "mixed"] and seen["clients"] == [8, 16]
    assert seen["command"] == "mtplx bench load --runs 3 --clients 8,16 --temperatures 0.6,mixed"
    seen.clear()
    cli.main([])
    assert seen["temperatures"] == (0.0, 0.6, "mixed") == workload.DEFAULT_TEMPERATURES
    with pytest.raises(SystemExit):
        cli.main(["--temperatures", "0,hot"])
    from benchmarks import cli as bench_cli
    seen.clear()
    bench_cli.main(["load", "--temperatures", "0,0.6,mixed", "--clients", "8"])
    assert seen["temperatures"] == [0.0, 0.6, "mixed"] and seen["clients"] == [8]


def test_run_turn_runs_the_mixed_arm_like_the_others(monkeypatch):
    """The mixed arm gets a closed loop per client count and an open loop (its own rate, from the
    peer's mixed closed loop), and both servers receive the same bodies but for ours' seeds."""
    sent = {}

    def fake_arm(server, run):
        bodies = run(None)
        return {"tok_s": 1.0, "req_s": 10.0, "ttft_p95_s": None, "itl_p50_s": None, "errors": 0}, bodies

    monkeypatch.setattr(arms, "_warm_up", lambda *a: None)
    monkeypatch.setattr(arms, "closed_loop", lambda url, bodies, n, at_drain=None: bodies)
    monkeypatch.setattr(arms, "open_loop", lambda url, bodies, arrivals: bodies)
    monkeypatch.setattr(arms, "_timed_arm", fake_arm)
    plan = {"temperatures": [0.6, "mixed"], "clients": [1, 8], "per_client": 2, "min_requests": 15,
            "capacity_clients": 8, "open_requests": 15, "seed": 0}
    for kind, seed in (("peer", False), ("ours", True)):
        server = types.SimpleNamespace(url="http://x", model="m", kind=kind)
        sent[kind] = arms.run_turn(server, plan, 0, {}, send_seed=seed, log=lambda s: None)
    peer, ours = sent["peer"], sent["ours"]
    assert list(peer["arms"]) == ["t0.6/closed-1", "t0.6/closed-8", "t0.6/open",
                                  "mixed/closed-1", "mixed/closed-8", "mixed/open"]
    assert peer["rates"] == {0.6: 7.0, "mixed": 7.0}
    for key in ("mixed/closed-8", "mixed/open"):
        assert [{k: v for k, v in b.items() if k != "seed"} for b in ours["rows"][key]] == peer["rows"][key]
        assert [b.get("seed") is not None for b in ours["rows"][key]] == [b["temperature"] > 0
                                                                          for b in peer["rows"][key]]
    assert len({(b["temperature"], b["top_p"]) for b in peer["rows"]["mixed/closed-8"]}) == 15


def test_a_closed_loop_marks_when_its_first_client_runs_out_of_requests(monkeypatch):
    """`at_drain` runs once, as the first worker finds no request left and before the others
    finish: the steady rows per cycle of `_timed_arm` end there."""
    events = []

    async def fake_request(client, i, body):
        await asyncio.sleep(0.01 * (1 + i % 3))
        events.append(i)
        return {"index": i}

    async def at_drain(client):
        events.append("drain")

    monkeypatch.setattr(clients, "_one_request", fake_request)
    rows, _ = asyncio.run(clients.closed_loop("http://127.0.0.1:9", [{}] * 9, 3, at_drain))
    assert [r["index"] for r in rows] == list(range(9))
    assert events.count("drain") == 1 and 0 < events.index("drain") < len(events) - 1

    def counters(rows, cycles, seconds):
        return {"lane_row_cycles": rows, "lane_cycles": cycles, "cycle_seconds_total": seconds,
                "cycle_device_seconds_total": 0.6 * seconds, "cycle_host_seconds_total": 0.1 * seconds,
                "prefill_seconds_total": 0.05 * seconds, "delivery_seconds_total": 0.01 * seconds,
                "draft_proposals": rows, "draft_tokens": 2 * rows, "accepted_draft_tokens": rows // 2 * 3}

    snaps = iter([{"replicas": {"a": counters(0, 0, 0.0)}}, {"replicas": {"a": counters(90, 30, 0.9)}}])
    monkeypatch.setattr(arms, "snapshot", lambda url: next(snaps))

    async def drained(client):
        return {"replicas": {"a": {"lane_row_cycles": 80, "lane_cycles": 10}}}

    monkeypatch.setattr(arms, "snapshot_with", drained)
    monkeypatch.setattr(arms, "summarize_arm", lambda rows, wall: {})

    async def run(at_drain):
        await at_drain(None)
        return [], 1.0

    server = types.SimpleNamespace(url="http://x", kind="ours")
    summary, _ = arms._timed_arm(server, run)
    # where the replicas' time went over the arm (1 s of wall): 30 cycles of 30 ms
    # and how deep the rows drafted: 90 drafting row-cycles, 180 drafts, 135 of them accepted
    drafting = {"drafts_per_row_cycle": 2.0, "accepted_share": 0.75}
    breakdown = {"cycle_ms": {"device": 18.0, "host": 3.0, "cycles": 30.0, "graphs_and_books": 9.0},
                 "wall_share": {"cycles": 0.9, "prefill": 0.045, "delivery": 0.009}}
    assert summary == {"lane_occupancy": 3.0, "steady_lane_occupancy": 8.0, "cycle_breakdown": breakdown, **drafting}
    assert "drafts/row-cycle 2.00, accepted 75%" in arms._brief({**summary, "tok_s": 1.0, "ttft_p95_s": None,
                                                                 "itl_p50_s": None, "errors": 0})
    assert summary_mod.cycle_breakdown({"replicas": {"a": {"lane_cycles": 1}}}, None, 1.0) is None  # older servers
    # a server without the drafting counters still gets its breakdown, and no drafting figures
    old = [{"replicas": {"a": {k: v for k, v in counters(*c).items() if "draft" not in k}}} for c in ((0, 0, 0.0), (90, 30, 0.9))]
    assert summary_mod.cycle_breakdown(*old, 1.0) == breakdown and summary_mod.drafting(*old) is None


_NOT_JSON_FIRST = """
import http.server, sys
answers = {"n": 0}
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        answers["n"] += 1
        body = b"<html>busy</html>" if answers["n"] <= int(sys.argv[2]) else b'{"ready": true}'
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


@pytest.mark.parametrize("not_json", [2, 1000])
def test_wait_ready_takes_a_200_that_is_not_json_for_not_ready(tmp_path, not_json):
    """A port answering 200 with a page that is not JSON (another server, or one starting) is
    not ready yet: polled again, and named in the error if it never becomes ready."""
    import sys

    port = servers.free_port()
    proc = servers.ServerProcess("fake", [sys.executable, "-c", _NOT_JSON_FIRST, str(port), str(not_json)], {},
                                 tmp_path / "fake.log", f"http://127.0.0.1:{port}", "m", 15)
    try:
        if not_json == 2:
            assert proc.wait_ready("/health", 30) == {"ready": True}
        else:
            with pytest.raises(TimeoutError, match="last answer: '<html>busy</html>'"):
                proc.wait_ready("/health", 4)
    finally:
        proc.proc.kill()
        proc.proc.wait()


def test_peak_memory_reads_the_servers_own_processes(tmp_path):
    """The peak resident memory of the processes a server started (its tag in their environment),
    its child included; none of another process's."""
    import sys

    hold = "import sys, subprocess; b = bytearray(int(sys.argv[1]) << 20); b[::4096] = b'x' * len(b[::4096]); " \
           "subprocess.run([sys.executable, '-c', 'import time; time.sleep(30)'])"
    proc = servers.ServerProcess("fake", [sys.executable, "-c", hold, "64"], {}, tmp_path / "fake.log",
                                 "http://127.0.0.1:1", "m", 15)
    try:
        deadline = time.monotonic() + 30
        while (peak := proc.peak_memory_mb()) is None or peak["processes"] < 2:
            assert time.monotonic() < deadline, peak
            time.sleep(0.2)
        assert peak["largest_process"] >= 64 and peak["all_processes"] > peak["largest_process"]
    finally:
        proc.stop(grace_s=1)


def test_long_prompts_are_long_and_share_no_prefix():
    from benchmarks.load.workload import CHARS_PER_TOKEN, long_prompt_for

    prompts = [long_prompt_for(i, 1000) for i in range(4)]
    assert all(len(p) >= 1000 * CHARS_PER_TOKEN for p in prompts)
    assert len({p[:20] for p in prompts}) == 4


def test_mtplx_bench_runs_the_benchmarks_as_a_program():
    """`mtplx bench ...` is `python -m benchmarks ...`: the library's command line never imports the
    benchmarks (the layer contract has no exception for it), and their options are theirs."""
    out = subprocess.run([sys.executable, "-m", "mtplx.cli", "bench", "--help"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: mtplx bench") and "--long-prompt-tokens" in out.stdout
