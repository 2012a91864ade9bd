"""`bench load` helpers: no servers are started here."""

import json
import struct
import types

import pytest

from deployments import bench_load as bl


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
    info = bl.make_peer_checkpoint(bl.SHIPPED_MODEL, out)
    src, src_meta = _read_safetensors(bl.SHIPPED_MODEL / "model.safetensors")
    dst, dst_meta = _read_safetensors(out / "model.safetensors")
    mtp = {k for k in src if k.startswith("mtp.")}
    assert mtp and info["dropped_tensors"] == len(mtp)
    assert set(dst) == set(src) - mtp
    assert all(dst[k] == src[k] for k in dst)
    assert dst_meta == src_meta
    cfg = json.loads((out / "config.json").read_text())
    assert "mtp_num_hidden_layers" not in cfg
    src_cfg = json.loads((bl.SHIPPED_MODEL / "config.json").read_text())
    src_cfg.pop("mtp_num_hidden_layers")
    assert cfg == src_cfg
    assert (out / "tokenizer.json").read_bytes() == (bl.SHIPPED_MODEL / "tokenizer.json").read_bytes()


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
    dropped = bl.strip_safetensors(src, tmp_path / "dst.safetensors", bl.is_mtp_tensor)
    out, meta = _read_safetensors(tmp_path / "dst.safetensors")
    assert dropped == ["mtp.x"]
    assert out == {k: v for k, v in tensors.items() if k != "mtp.x"}
    assert meta == {"format": "mlx"}
    (n,) = struct.unpack("<Q", (tmp_path / "dst.safetensors").read_bytes()[:8])
    assert n % 8 == 0


def test_percentile_matches_linear_interpolation():
    xs = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert bl.percentile(xs, 50) == 3.0
    assert bl.percentile(xs, 95) == pytest.approx(4.8)
    assert bl.percentile(xs, 0) == 1.0 and bl.percentile(xs, 100) == 5.0
    assert bl.percentile([None, 7.0], 95) == 7.0
    assert bl.percentile([], 50) is None
    assert bl.median_or_none([None, 1.0, 3.0]) == 2.0 and bl.median_or_none([None]) is None


def _row(index, ttft, itl, e2e, tokens, text="x", error=None, gaps=()):
    return {"index": index, "error": error, "ttft": ttft, "itl": itl, "e2e": e2e, "tokens": tokens,
            "text": text, "gaps": list(gaps)}


def test_summarize_arm_counts_only_successful_requests():
    rows = [_row(0, 0.1, 0.01, 1.0, 100, gaps=[0.01, 0.02]), _row(1, 0.3, 0.03, 2.0, 50, gaps=[0.03]),
            _row(2, None, None, None, 0, error="HTTP 503: busy")]
    s = bl.summarize_arm(rows, wall_s=3.0)
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
    assert bl.lane_occupancy(before, after) == pytest.approx(70 / 20)
    assert bl.lane_occupancy(snap({"cohort_calls": 1}), snap({"cohort_calls": 2})) is None
    assert bl.lane_occupancy(None, after) is None
    assert bl.lane_occupancy(after, after) is None


def test_identical_texts_pairs_by_index_and_skips_errors():
    ours = [_row(0, 0, 0, 0, 1, " a b"), _row(1, 0, 0, 0, 1, "b"), _row(2, 0, 0, 0, 1, "c", error="boom"),
            _row(3, 0, 0, 0, 1, "  d")]
    peer = [_row(1, 0, 0, 0, 1, "B"), _row(0, 0, 0, 0, 1, "a b"), _row(2, 0, 0, 0, 1, "c"),
            _row(3, 0, 0, 0, 1, "d")]
    # one leading space is ignored (mlx-lm trims it), a second one is a difference
    assert bl.identical_texts(ours, peer) == {"identical": 1, "compared": 3, "fraction": 1 / 3,
                                              "differing_indices": [1, 3]}


def test_summarize_runs_medians_ratio_and_summed_errors():
    def arm(tok_s, errors):
        return {"requests": 4, "errors": errors, "error_samples": ["e"] if errors else [], "tok_s": tok_s,
                "ttft_p95_s": tok_s / 1000, "lane_occupancy": None}

    per_run = [{"ours": {"greedy/closed-8": arm(t_o, 0)}, "peer": {"greedy/closed-8": arm(t_p, e)},
                "identical": {"greedy/closed-8": {"identical": 3, "compared": 4, "fraction": 0.75}}}
               for t_o, t_p, e in ((200, 100, 0), (300, 100, 1), (100, 200, 0))]
    s = bl.summarize_runs(per_run)["greedy/closed-8"]
    assert s["ours"]["tok_s"] == 200 and s["peer"]["tok_s"] == 100
    assert s["tok_s_ratio"] == 2.0            # median of 2.0, 3.0, 0.5
    assert s["peer"]["errors"] == 1 and s["peer"]["requests"] == 12
    assert s["ours"]["lane_occupancy"] is None
    assert s["greedy_identical"] == {"identical": 9, "compared": 12, "fraction": 0.75}


def test_replace_section_keeps_other_sections():
    text = "# Benchmarks\n\nintro\n\n<!-- bench:solo -->\nsolo v1\n<!-- /bench:solo -->\n\ntail\n"
    once = bl.replace_section(text, "load", "load v1")
    assert "<!-- bench:load -->\nload v1\n<!-- /bench:load -->" in once
    twice = bl.replace_section(once, "load", "load v2")
    assert "load v1" not in twice and twice.count("<!-- bench:load -->") == 1
    assert twice.replace("<!-- bench:load -->\nload v2\n<!-- /bench:load -->", "X") == \
        once.replace("<!-- bench:load -->\nload v1\n<!-- /bench:load -->", "X")
    assert "solo v1" in twice and "intro" in twice and "tail" in twice
    assert bl.replace_section("", "load", "body").startswith("# Benchmarks\n\n<!-- bench:load -->")


def test_workload_is_deterministic_and_mixed():
    a = [bl.request_body(i, 0.6, "m", send_seed=True) for i in range(40)]
    b = [bl.request_body(i, 0.6, "m", send_seed=True) for i in range(40)]
    assert a == b
    assert [x["seed"] for x in a] == [1000 + i for i in range(40)]
    assert "seed" not in bl.request_body(3, 0.6, "m", send_seed=False)
    greedy = bl.request_body(3, 0.0, "m", send_seed=True)
    assert "seed" not in greedy and "top_p" not in greedy and greedy["stream_options"] == {"include_usage": True}
    budgets = [bl.budget_for(i) for i in range(241)]
    assert sorted(budgets) == list(range(16, 257))        # every budget once per 241 requests
    short = [len(bl.prompt_for(i)) for i in range(40) if i % 5 != 4]
    long = [len(bl.prompt_for(i)) for i in range(40) if i % 5 == 4]
    ratio = (sum(long) / len(long)) / (sum(short) / len(short))
    assert 5.0 < ratio < 7.0
    assert bl.poisson_arrivals(20, 2.0, seed=1) == bl.poisson_arrivals(20, 2.0, seed=1)
    arrivals = bl.poisson_arrivals(2000, 2.0, seed=1)
    assert arrivals == sorted(arrivals) and 900 < arrivals[-1] < 1100
    assert bl.closed_loop_requests(1, 6, 12) == 12 and bl.closed_loop_requests(8, 6, 12) == 48


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

    monkeypatch.setattr(bl, "bench_load", fake_bench_load)
    monkeypatch.setattr(bl, "write_outputs", fake_outputs)
    bl.main(["--runs", "2", "--clients", "1,8", "--temperatures", "0,1.0", "--modes", "auto,mtp,ar"])
    assert seen["runs"] == 2 and seen["clients"] == [1, 8] and seen["temperatures"] == [0.0, 1.0]
    assert seen["modes"] == ["auto", "mtp", "ar"]
    assert seen["command"] == "mtplx bench load --runs 2 --clients 1,8 --temperatures 0,1.0 --modes auto,mtp,ar"
    bl.main(["--quick"])
    assert seen["temperatures"] == (0.0,) and seen["command"] == "mtplx bench load --quick"


def test_runs_with_other_arms_or_models_get_sections_of_their_own():
    def record(model="shipped", modes=(), logprobs=None, temperatures=(0.0, 0.6), clients=(1, 8, 16, 32)):
        return {"model": model, "plan": {"modes": list(modes), "logprobs": logprobs, "temperatures": list(temperatures),
                                         "clients": list(clients)}}

    assert bl.section_name(record()) == "load"
    assert bl.section_name(record(modes=["auto", "ar"])) == "load-modes"
    assert bl.section_name(record(logprobs=0)) == "load-logprobs"
    assert bl.section_name(record(model="/tmp/x/Never_Ckpt", modes=["auto"])) == "load-never-ckpt-modes"
    assert bl.section_name(record(modes=["auto"], temperatures=[0.0])) == "load-modes"
    assert bl.section_name(record(modes=["auto"], temperatures=[1.0])) == "load-modes-t1"
    assert bl.section_name(record(temperatures=[0.0, 0.7])) == "load-t07"
    assert bl.section_name(record(modes=["auto"], temperatures=[0.0, 1.0], clients=[1])) == "load-modes-t1-c1"
    assert bl.section_name(record(logprobs=5, clients=[1, 8, 16, 32])) == "load-logprobs"
    # a partial comparison never replaces the default one
    assert bl.section_name(record(temperatures=[0.0], clients=[16])) == "load-greedy-c16"
    assert bl.section_name(record(clients=[8, 16])) == "load-c8-16"


def test_mode_arms_run_each_mode_twice_in_a_mirrored_order(monkeypatch):
    """Each arm runs its modes in a rotation then its reverse (drift weighs on all alike), and a
    mode's figures pool both of its halves; with one client the modes instead take turns request
    by request (the order reversed every other request), and a mode's wall time is the sum of its
    own requests' times."""
    sent = []

    def fake_arm(server, run):
        bodies = run()                          # the arm's bodies, from the closed_loop below
        sent.append([(b["generation_mode"], b["prompt"]) for b in bodies])
        rows = [{"mode": b["generation_mode"], "e2e": 0.5} for b in bodies]
        return {"wall_s": 2.0, "tok_s": 1.0, "ttft_p95_s": None, "itl_p50_s": None, "errors": 0}, rows

    monkeypatch.setattr(bl, "closed_loop", lambda url, bodies, n: bodies)
    monkeypatch.setattr(bl, "_timed_arm", fake_arm)
    monkeypatch.setattr(bl, "summarize_arm", lambda rows, wall: {"rows": [r["mode"] for r in rows], "wall_s": wall,
                                                                  "tok_s": 1.0, "ttft_p95_s": None, "itl_p50_s": None,
                                                                  "errors": 0})
    server = types.SimpleNamespace(url="http://x", model="m", kind="ours")
    plan = {"temperatures": [0.0], "clients": [1, 8], "modes": ["auto", "mtp", "ar"], "per_client": 1,
            "min_requests": 2}
    out = bl.run_mode_arms(server, plan, run=1, log=lambda s: None)
    p0, p1 = bl.prompt_for(0), bl.prompt_for(1)
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
        bodies = run()
        sent.append("on" if "logprobs" in bodies[0] else "off")
        return {"wall_s": 2.0, "tok_s": 1.0, "ttft_p95_s": None, "itl_p50_s": None, "errors": 0}, [{}] * len(bodies)

    monkeypatch.setattr(bl, "closed_loop", lambda url, bodies, n: bodies)
    monkeypatch.setattr(bl, "_timed_arm", fake_arm)
    monkeypatch.setattr(bl, "summarize_arm", lambda rows, wall: {"rows": len(rows), "wall_s": wall, "tok_s": 1.0,
                                                                  "ttft_p95_s": None, "itl_p50_s": None, "errors": 0})
    server = types.SimpleNamespace(url="http://x", model="m", kind="ours")
    plan = {"temperatures": [0.0], "clients": [8, 16], "logprobs": 5, "per_client": 1, "min_requests": 1}
    out = bl.run_logprob_arms(server, plan, run=0, log=lambda s: None)
    assert sent == ["off", "on", "on", "off", "on", "off", "off", "on"]
    assert out["on"]["greedy/closed-16"] == {"rows": 32, "wall_s": 4.0, "tok_s": 1.0, "ttft_p95_s": None,
                                             "itl_p50_s": None, "errors": 0}
