"""The CPU kernels: same numbers as MLX's (attention, the MLP's activation), and exact lanes at long spans."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mtplx.engine.install import install_a3b_mtp_batch_lane
from mtplx.engine.lane import RunningLane
from mtplx.engine.row import A3BMTPBatchRequest
from mtplx.engine.decode import generate_ar
from mtplx.models import cpu_ops as A
from mtplx.sampling import SamplerConfig


def test_exp_nonpositive_matches_exp():
    x = mx.concatenate([-mx.abs(mx.random.normal((20000,), key=mx.random.key(0))) * 30,
                        mx.array([0.0, -1e-7, -1.0, -50.0, -87.0])])
    got, want = A.exp_nonpositive(x), mx.exp(x)
    assert (mx.abs(got - want) <= 1e-6 * want + 1e-37).all().item()
    assert A.exp_nonpositive(mx.array([-mx.inf])).item() < 1e-37        # a masked score weighs nothing


def test_swiglu_matches_mlx():
    g = mx.concatenate([mx.random.normal((20000,), key=mx.random.key(2)) * 12,
                        mx.array([0.0, -0.0, 1e-7, -1e-7, 30.0, -30.0, 87.0, -87.0, 200.0, -200.0])])
    u = mx.random.normal(g.shape, key=mx.random.key(3))
    got, want = A.swiglu(g, u), A.mlx_lm_swiglu(g, u)
    assert (mx.abs(got - want) <= 1e-6 * mx.abs(want) + 1e-30).all().item()


@pytest.mark.parametrize("dims,T", [(48, 1), (48, 4), (32, 2)])
def test_shared_rope_tables_match_mlx_rope(dims, T):
    """A decode step's RoPE from tables shared by all layers: MLX's own CPU rope, bit for bit,
    including a partial rotation (dims below the head size) and per-row offsets."""
    rope = nn.RoPE(dims, base=10000.0)
    x = mx.random.normal((8, 4, T, 48), key=mx.random.key(5))
    offset = mx.array([0, 5, 17, 100, 1000, 3, 9, 2040], dtype=mx.int32)
    tables = A.rope_tables(rope, offset, T, x.dtype)
    assert mx.array_equal(A.apply_rope(x, *tables), rope(x, offset=offset)).item()
    assert A.rope_tables(rope, offset, T, x.dtype) is tables         # the next layer of the same forward
    moved = offset + 1                                                 # the next forward's offsets
    assert mx.array_equal(A.apply_rope(x, *A.rope_tables(rope, moved, T, x.dtype)), rope(x, offset=moved)).item()


def test_column_major_weights_keep_values_and_products():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(192, 576)          # taller than wide but small: column-major
            self.down = nn.Linear(576, 192)          # wider than tall: column-major
            self.embed = nn.Embedding(4096, 192)     # a tied output layer, tall and large: stays row-major
            self.half = nn.Linear(192, 8)
            self.half.set_dtype(mx.float16)

    net = Net()
    assert net.half.weight.dtype == mx.float16
    before = {k: mx.array(v) for k, v in tree_flatten(net.parameters())}
    x = mx.random.normal((8, 192), key=mx.random.key(6))
    tokens = mx.array([[1, 7, 4095]])
    wide = mx.random.normal((8, 576), key=mx.random.key(7))
    want = (net.proj(x), net.embed.as_linear(x), net.down(wide), net.embed(tokens))
    loaded = {name: getattr(net, name).weight for name in ("proj", "down", "embed", "half")}
    assert A.column_major_weights(net) == 2                           # `proj`, `down` (not the float16 layer)
    assert [name for name, w in loaded.items() if getattr(net, name).weight is not w] == ["proj", "down"]
    assert all(mx.array_equal(v, before[k]).item() for k, v in tree_flatten(net.parameters()))
    got = (net.proj(x), net.embed.as_linear(x), net.down(wide), net.embed(tokens))
    for g, w in zip(got, want):
        assert mx.allclose(g, w, rtol=1e-5, atol=1e-5).item()
    assert mx.array_equal(got[3], want[3]).item()


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


def _lane_rows_equal_solo_ar(model, monkeypatch, prompts):
    """Decode the prompts as one B8 lane (all prefilled first) and check every row against plain
    greedy AR; returns which kernel each [8, 2] forward took."""
    greedy = SamplerConfig(temperature=0.0)
    taken = []
    for name in ("softmax_attention", "split_attention"):
        kernel = getattr(A, name)

        def counted(q, *args, name=name, kernel=kernel):
            if q.shape[0] == 8 and q.shape[2] == 2:
                taken.append(name)
            return kernel(q, *args)

        monkeypatch.setattr(A, name, counted)
    lane = RunningLane(install_a3b_mtp_batch_lane(model, 8))
    streams = [lane.add(A3BMTPBatchRequest(str(i), p, greedy, max_tokens=12)) for i, p in enumerate(prompts)]
    lane.admit_all()
    while lane.has_work:
        lane.step()
    for i, p in enumerate(prompts):
        assert streams[i].tokens == generate_ar(model, p, 12, greedy).tokens, f"row {i}"
    return set(taken)


def _long_prompts(model):
    base = model.tokenizer.encode("def area(r):\n    return 3.14159 * r * r\n\n" * 40)
    return [base[i * 7:i * 7 + 540] for i in range(8)]


def test_long_span_lane_rows_equal_solo_ar(model, monkeypatch):
    """Eight rows of one long span: the whole-span kernel, exact against plain greedy AR."""
    assert 8 * 4 * 2 * 540 >= A.SCORE_ELEMENTS
    assert _lane_rows_equal_solo_ar(model, monkeypatch, _long_prompts(model)) == {"softmax_attention"}


def test_uneven_span_lane_rows_equal_solo_ar(model, monkeypatch):
    """Two long rows among short ones: attention split by span, exact against plain greedy AR."""
    prompts = _long_prompts(model)
    prompts = prompts[:2] + [p[:40 + 9 * i] for i, p in enumerate(prompts[2:])]
    assert "split_attention" in _lane_rows_equal_solo_ar(model, monkeypatch, prompts)


def test_split_point_saves_reads_or_declines():
    cut, rows = A.split_point(np.array([600, 120, 80, 130, 100, 90, 110, 95]), 600)
    assert cut == 130 and rows.tolist() == [0]
    assert A.split_point(np.array([600, 590, 580, 600]), 600) is None       # nothing worth it


def test_split_attention_matches_whole():
    k0, k1, k2 = mx.random.split(mx.random.key(2), 3)
    B, T, S = 6, 2, 800
    spans = np.array([800, 40, 75, 500, 12, 60])
    q = mx.random.normal((B, 4, T, 32), key=k0)
    k = mx.random.normal((B, 2, S, 32), key=k1) * 2
    v = mx.random.normal((B, 2, S, 32), key=k2)
    q_pos = mx.array(spans - T)[:, None] + mx.arange(T)[None]
    mask = (mx.arange(S)[None, None] <= q_pos[..., None])[:, None]
    cut, rows = A.split_point(spans, S)
    assert 0 < cut < S and rows.tolist() == [0, 3]
    got = A.split_attention(q, k, v, 0.18, mask, cut, rows)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.18, mask=mask)
    assert mx.abs(got - want).max().item() < 1e-5
