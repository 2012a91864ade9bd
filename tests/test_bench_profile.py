"""`mtplx bench profile`: a forward's parts at a lane's shapes, on the shipped model."""

import mtplx
from benchmarks import forward_profile
from benchmarks.report import machine_info, new_record


def test_profile_splits_a_forward_into_its_parts_and_reports_them(tmp_path, monkeypatch):
    monkeypatch.setattr(forward_profile, "SHAPES", ((1, 1), (8, 2)))
    model = mtplx.load_model()
    result = forward_profile.bench_profile(model, rounds=2)
    rows = result["rows"]
    assert [r["shape"] for r in rows] == ["[1,1]", "[8,2]"]
    for r in rows:
        assert r["forward_ms"] > 0 and r["trunk_ms"] > 0 and r["output_layer_ms"] > 0
        assert r["attention_ms"] > 0 and r["mlp_ms"] > 0 and r["rest_ms"] >= 0
        assert r["draft_ms"] > 0                          # the shipped model has its head
        assert 0 < r["dispatch_floor_ms"] and r["read_gb_s"] > 0
    # the shipped model's weights: its trunk's layers and its output layer, as loaded
    assert 1 < result["trunk_mb"] < 100 and 0 < result["output_layer_mb"] < result["trunk_mb"]
    record = new_record("profile", result, "mtplx bench profile", "shipped", {"rounds": 2}, machine_info(), 1.0)
    text = forward_profile.render_profile(record, "docs/bench_profile.png")
    assert text.count("\n| [") == 2 and "dispatch floor" in text.lower()
    forward_profile.plot_profile(record, tmp_path / "profile.png")
    assert (tmp_path / "profile.png").stat().st_size > 0
