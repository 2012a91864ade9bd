"""Attention kernels for MLX's CPU backend, where its own are slow at long spans.

MLX's CPU `exp` costs about 12 ns an element (numpy's about 0.5), so once a lane's rows
reach a few hundred positions, or a prefill chunk attends to a long prompt, the softmax inside
`mx.fast.scaled_dot_product_attention` costs more than every matmul of the layer. Here, for score
tensors of at least `SCORE_ELEMENTS`, the softmax's exponential is a compiled kernel: a power of
two taken from the float's exponent bits (exact) times a degree-7 polynomial of the fraction
(relative error below 1e-6, the order of the rounding differences between batch shapes).
Everything else (small scores, an accelerator, quantized KV, attention sinks) goes to MLX's fused
kernel. `attention` is a drop-in for mlx-lm's `scaled_dot_product_attention`. The MLP's
`swiglu` takes the same exponential for its sigmoid: at a B8 verify's [8, 2, 576] activations,
185 -> 65 us a layer.

A lane's rows have their own spans, yet one batched attention reads every row up to the longest:
one long prompt makes seven short rows pay for its length. When a lane's spans are uneven
enough, `split_attention` attends every row over the keys all rows share, and only the long rows
over the rest, then merges the two softmax parts per row (the running max and sum, as flash
attention does). BENCHMARKS.md ("Measurements behind the engine's constants") has what each of
these CPU paths saves.
"""

from __future__ import annotations

import math
from typing import Optional, Union

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.activations import swiglu as mlx_lm_swiglu
from mlx_lm.models.base import scaled_dot_product_attention as mlx_lm_attention

from .cache import RaggedKVCache

SCORE_ELEMENTS = 32768    # the crossover to the split path (~B8 x 4 heads x 2 queries x 512 keys)
SPLIT_SAVING = 2048       # key positions x rows a split must save to pay for its ~20 extra ops
_MASKED = -1e30           # finite, so that a part with every key masked merges with weight ~0

_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453


def _exp2_parts(x):
    """exp(x) as (mantissa, exponent bits) for x <= 0: 2^n * 2^f with n = floor(x log2 e); 2^f from
    the Taylor series of exp(f ln 2), f in [0, 1). Below 2^-126 the result is 2^-126 * 2^f
    (attention weights that small round away against a row sum of at least 1)."""
    t = mx.maximum(x * _LOG2E, -126.0)
    # floor(t) for t <= 0 from the cast's truncation (toward zero): one fused kernel, where
    # MLX's CPU floor ran as an op of its own (this exp 15% faster at [128, 576])
    ceil = t.astype(mx.int32)
    n = ceil - (ceil.astype(mx.float32) > t).astype(mx.int32)
    y = (t - n.astype(mx.float32)) * _LN2
    p = 1 + y * (1 + y * (1 / 2 + y * (1 / 6 + y * (1 / 24 + y * (1 / 120 + y * (1 / 720 + y / 5040))))))
    return p, (n + 127) << 23


_exp2_parts_compiled = mx.compile(_exp2_parts, shapeless=True)


def exp_nonpositive(x: mx.array) -> mx.array:
    """exp(x) for float32 x <= 0 (the shifted scores of a softmax)."""
    p, bits = _exp2_parts_compiled(x)
    return p * bits.view(mx.float32)


def _swiglu(gate, up):
    e = exp_nonpositive(-mx.abs(gate))                    # exp(-|g|): the sigmoid without overflow
    return gate * (mx.where(gate >= 0, 1.0, e) / (1 + e)) * up


_swiglu_compiled = mx.compile(_swiglu)     # one trace per shape: a lane's widths and prefill chunks


def swiglu(gate: mx.array, up: mx.array) -> mx.array:
    """silu(gate) * up, the MLP's activation; for float32 on the CPU its sigmoid takes the
    exponential above (relative error below 1e-6 against MLX's), elsewhere mlx-lm's."""
    if gate.dtype == mx.float32 and mx.default_device() == mx.cpu:
        return _swiglu_compiled(gate, up)
    return mlx_lm_swiglu(gate, up)


# A weight taller than wide is stored column-major only up to this many elements (1 MiB of float32)
COLUMN_MAJOR_TALL_MAX = 1 << 18


def column_major_weights(module: nn.Module) -> int:
    """Store float32 `nn.Linear` weights and embedding tables (a tied head multiplies by one)
    column-major, where that multiplies faster: the same [out, in] array, its buffer laid out as
    [in, out], so that `x @ w.T` reaches the BLAS as a plain row-major product instead of a
    transposed one. Measured here (OpenBLAS, one thread, rows 1-24): it wins for every weight at
    least as wide as tall (a down projection [640, 2048]: 3x; [640, 640]: 1.2x) and for small
    taller ones ([576, 192]: 1.5x at 8 rows), and loses for large taller ones ([1024, 640]:
    1.3x slower; [2048, 640]: 1.6x; the shipped model's tied 4096 x 192 output layer: 1.4x at 8
    rows; Gemma 3's tied 262,144 x 640 one: 2x, 97 against 48 ms a row), which stay row-major,
    as loaded. Same values, same parameters, no second copy; only on the CPU. Returns how many
    weights it rewrote."""
    if mx.default_device() != mx.cpu:
        return 0
    n = 0
    for m in module.modules():
        if type(m) not in (nn.Linear, nn.Embedding) or m.weight.dtype != mx.float32 or m.weight.ndim != 2:
            continue
        out_dim, in_dim = m.weight.shape
        if in_dim >= out_dim or m.weight.size <= COLUMN_MAJOR_TALL_MAX:
            m.weight = mx.contiguous(m.weight.T).T
            mx.eval(m.weight)       # one at a time: each old buffer goes before the next copy
            n += 1
    return n


def shares_rope_tables(rope) -> bool:
    """Whether `rope_tables` / `apply_rope` stand in for this rope module: mlx's plain `nn.RoPE`
    (non-traditional), on the CPU, where MLX's `fast.rope` is not a kernel but a graph of ~25
    operations that computes its cos and sin again in every call (two calls a layer)."""
    return type(rope) is nn.RoPE and not rope.traditional and mx.default_device() == mx.cpu


_last_tables = [None]        # (offset, key, tables): the forward in progress's, one entry


def rope_tables(rope: nn.RoPE, offset: mx.array, T: int, dtype) -> tuple:
    """cos and sin [B, 1, T, dims/2] at each row's positions offset .. offset + T - 1, computed as
    MLX's CPU rope computes them. A forward passes the same `offset` array to every layer's
    cache, so the last pair is kept and served again while that array comes back."""
    key = (T, rope.dims, rope.base, rope.scale, dtype)
    last = _last_tables[0]
    if last is not None and last[0] is offset and last[1] == key:
        return last[2]
    half = rope.dims // 2
    positions = (mx.arange(T, dtype=mx.float32) + offset.reshape(-1, 1, 1)) * mx.array(rope.scale, mx.float32)
    inv_freqs = mx.exp(mx.arange(0, -half, -1, dtype=mx.float32) * mx.array(math.log(rope.base) / half, mx.float32))
    theta = positions[..., None] * inv_freqs
    tables = (mx.cos(theta).astype(dtype), mx.sin(theta).astype(dtype))
    _last_tables[0] = (offset, key, tables)
    return tables


def apply_rope(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """RoPE (non-traditional) of x [B, H, T, D] with tables from `rope_tables`."""
    half = cos.shape[-1]
    x1, x2 = x[..., :half], x[..., half:2 * half]
    parts = [x1 * cos - x2 * sin, x1 * sin + x2 * cos]
    if 2 * half < x.shape[-1]:
        parts.append(x[..., 2 * half:])
    return mx.concatenate(parts, axis=-1)


def _causal(T: int, S: int) -> mx.array:
    return mx.arange(S - T, S)[:, None] >= mx.arange(S)[None]


def _scores(q, k, scale, mask, masked):
    """Grouped-query scores [B, Hkv, rep, T, S], masked entries set to `masked`."""
    B, H, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    s = ((q * scale).reshape(B, Hkv, H // Hkv * T, D) @ k.swapaxes(-1, -2)).reshape(B, Hkv, H // Hkv, T, S)
    if isinstance(mask, str):
        mask = _causal(T, S)
    if mask is not None:
        if mask.ndim == 4:                       # [B, 1|H, T, S] -> the grouped layout
            Bm, Hm = mask.shape[:2]
            mask = mask.reshape(Bm, 1, 1, T, S) if Hm == 1 else mask.reshape(Bm, Hkv, H // Hkv, T, S)
        s = mx.where(mask, s, masked) if mask.dtype == mx.bool_ else s + mask
    return s


def _softmax_part(s, v):
    """Unnormalized softmax attention over one key part: (max, sum, weighted values), each
    [B, Hkv, rep, T, .]."""
    B, Hkv, rep, T, S = s.shape
    m = mx.max(s, axis=-1, keepdims=True)
    p = exp_nonpositive(s - m)
    o = (p.reshape(B, Hkv, rep * T, S) @ v).reshape(B, Hkv, rep, T, -1)
    return m, p.sum(axis=-1, keepdims=True), o


def softmax_attention(q: mx.array, k: mx.array, v: mx.array, scale: float,
                      mask: Union[None, str, mx.array]) -> mx.array:
    """q [B, H, T, D], k/v [B, Hkv, S, D] (grouped-query heads), mask None, "causal", boolean or
    additive [.., T, S]. Returns [B, H, T, D]."""
    B, H, T, D = q.shape
    _, l, o = _softmax_part(_scores(q, k, scale, mask, -mx.inf), v)
    return (o / l).reshape(B, H, T, -1)


def split_point(spans: np.ndarray, width_span: int):
    """(cut, long rows) minimising the key positions read, or None when no cut saves
    SPLIT_SAVING: every row reads keys [0, cut), the long rows (span > cut) also [cut, width_span)."""
    W = len(spans)
    best_cost, best_cut = W * width_span - SPLIT_SAVING, None
    for cut in np.unique(spans)[:-1]:
        cost = W * int(cut) + int((spans > cut).sum()) * (width_span - int(cut))
        if cost < best_cost:
            best_cost, best_cut = cost, int(cut)
    if best_cut is None:
        return None
    return best_cut, np.flatnonzero(spans > best_cut)


def split_for(spans: np.ndarray, dtype) -> Optional[tuple]:
    """The split `attention` takes for lane rows of these spans and this dtype (None: whole)."""
    if dtype != mx.float32 or mx.default_device() != mx.cpu:
        return None
    return split_point(spans, int(spans.max()))


def _take_rows(x: mx.array, rows: np.ndarray, start: int) -> mx.array:
    """x[rows, :, start:] by basic slices: a gather on the lane's strided KV view would first copy
    every row of it."""
    parts = [x[int(b):int(b) + 1, :, start:] for b in rows]
    return parts[0] if len(parts) == 1 else mx.concatenate(parts)


def split_attention(q, k, v, scale: float, mask: mx.array, cut: int, long_rows: np.ndarray) -> mx.array:
    """Attention of a lane whose rows need different spans: all rows over keys [0, cut), the
    long rows over [cut, S) too, merged per row. `mask` is boolean [B, 1, T, S]."""
    B, H, T, D = q.shape
    m, l, o = _softmax_part(_scores(q, k[..., :cut, :], scale, mask[..., :cut], _MASKED), v[..., :cut, :])
    idx = mx.array(long_rows.astype(np.int32))
    mb, lb, ob = _softmax_part(_scores(q[idx], _take_rows(k, long_rows, cut), scale, mask[idx][..., cut:], _MASKED),
                               _take_rows(v, long_rows, cut))
    ma, la, oa = m[idx], l[idx], o[idx]
    top = mx.maximum(ma, mb)
    wa, wb = mx.exp(ma - top), mx.exp(mb - top)
    out = o / l
    out[idx] = (oa * wa + ob * wb) / (la * wa + lb * wb)
    return out.reshape(B, H, T, -1)


def attention(queries, keys, values, cache, scale: float, mask, sinks: Optional[mx.array] = None):
    """mlx-lm's attention call, with the CPU softmax paths for float32 scores: split by row span
    when a lane's rows are uneven enough, whole when the scores are large."""
    B, H, T, _ = queries.shape
    S = keys.shape[2]
    if sinks is None and not hasattr(cache, "bits") and queries.dtype == mx.float32 \
            and mx.default_device() == mx.cpu:
        if isinstance(cache, RaggedKVCache) and not cache.full_span and isinstance(mask, mx.array):
            split = split_point(np.minimum(cache.lengths, S), S)   # lengths: each row's span now
            if split is not None:
                return split_attention(queries, keys, values, scale, mask, *split)
        if B * H * T * S >= SCORE_ELEMENTS:
            return softmax_attention(queries, keys, values, scale, mask)
    return mlx_lm_attention(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

