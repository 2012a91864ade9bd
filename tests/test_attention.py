"""The CPU attention kernel: same numbers as MLX's fused kernel, and exact lanes at long spans."""

import mlx.core as mx
import pytest

from mtplx.a3b_mtp_batch import A3BMTPBatchRequest, RunningLane, install_a3b_mtp_batch_lane
from mtplx.generation import generate_ar
from mtplx.models import attention as A
from mtplx.sampling import SamplerConfig


def test_exp_nonpositive_matches_exp():
    x = mx.concatenate([-mx.abs(mx.random.normal((20000,), key=mx.random.key(0))) * 30,
                        mx.array([0.0, -1e-7, -1.0, -50.0, -87.0])])
    got, want = A.exp_nonpositive(x), mx.exp(x)
    assert (mx.abs(got - want) <= 1e-6 * want + 1e-37).all().item()
    assert A.exp_nonpositive(mx.array([-mx.inf])).item() < 1e-37        # a masked score weighs nothing


@pytest.mark.parametrize("heads,kv_heads,T,S,mask", [
    (4, 2, 2, 600, "ragged"), (4, 4, 1, 300, None), (8, 2, 64, 64, "causal"), (4, 2, 16, 80, "additive"),
])
def test_softmax_attention_matches_fused(heads, kv_heads, T, S, mask):
    k0, k1, k2 = mx.random.split(mx.random.key(1), 3)
    B, D = 3, 32
    q = mx.random.normal((B, heads, T, D), key=k0)
    k = mx.random.normal((B, kv_heads, S, D), key=k1) * 2
    v = mx.random.normal((B, kv_heads, S, D), key=k2)
    if mask == "ragged":            # a lane's mask: each row sees its own prefix
        lengths = mx.array([S // 3, S - T, S // 2])
        mask = (mx.arange(S)[None, None] <= (lengths[:, None] + mx.arange(T)[None])[..., None])[:, None]
    elif mask == "additive":
        mask = mx.where(mx.random.uniform(shape=(B, 1, T, S)) < 0.3, -1e9, 0.0)
    got = A.softmax_attention(q, k, v, 0.18, mask)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.18, mask=mask)
    assert mx.abs(got - want).max().item() < 1e-5


def test_long_span_lane_rows_equal_solo_ar(model, monkeypatch):
    """Eight rows whose spans pass the kernel's threshold decode exactly like plain greedy AR."""
    greedy = SamplerConfig(temperature=0.0)
    base = model.tokenizer.encode("def area(r):\n    return 3.14159 * r * r\n\n" * 40)
    prompts = [base[i * 7:i * 7 + 540] for i in range(8)]
    assert 8 * 4 * 2 * 540 >= A.SCORE_ELEMENTS
    calls, kernel = [], A.softmax_attention

    def counted(q, *args):
        calls.append(q.shape)
        return kernel(q, *args)

    monkeypatch.setattr(A, "softmax_attention", counted)
    lane = RunningLane(install_a3b_mtp_batch_lane(model, 8))
    streams = [lane.add(A3BMTPBatchRequest(str(i), p, greedy, max_tokens=12)) for i, p in enumerate(prompts)]
    while lane.has_work:
        lane.step()
    assert any(shape[0] == 8 and shape[2] == 2 for shape in calls)      # the [8, 2] verify took it
    for i, p in enumerate(prompts):
        assert streams[i].tokens == generate_ar(model, p, 12, greedy).tokens, f"row {i}"

