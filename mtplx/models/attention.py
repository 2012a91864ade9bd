"""Scaled dot-product attention that stays fast on MLX's CPU backend at long spans.

MLX's CPU `exp` costs about 12 ns an element (numpy's about 0.5), so once a lane's rows reach a
few hundred positions, or a prefill chunk attends to a long prompt, the softmax inside
`mx.fast.scaled_dot_product_attention` costs more than every matmul of the layer. Here, for score
tensors of at least `SCORE_ELEMENTS`, the softmax's exponential is a compiled kernel: a power of
two taken from the float's exponent bits (exact) times a degree-7 polynomial of the fraction
(relative error below 1e-6, the order of the rounding differences between batch shapes).
Everything else (small scores, an accelerator, quantized KV, attention sinks) goes to MLX's fused
kernel. `attention` is a drop-in for mlx-lm's `scaled_dot_product_attention`.
"""

from __future__ import annotations

from typing import Optional, Union

import mlx.core as mx
from mlx_lm.models.base import scaled_dot_product_attention as mlx_lm_attention

SCORE_ELEMENTS = 32768    # measured crossover on a 2-core x86 CPU: ~B8 x 4 heads x 2 queries x 512 keys

_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453


def _exp2_parts(x):
    """exp(x) as (mantissa, exponent bits) for x <= 0: 2^n * 2^f with n = floor(x log2 e); 2^f from
    the Taylor series of exp(f ln 2), f in [0, 1). Below 2^-126 the result is 2^-126 * 2^f
    (attention weights that small round away against a row sum of at least 1)."""
    t = mx.maximum(x * _LOG2E, -126.0)
    n = mx.floor(t)
    y = (t - n) * _LN2
    p = 1 + y * (1 + y * (1 / 2 + y * (1 / 6 + y * (1 / 24 + y * (1 / 120 + y * (1 / 720 + y / 5040))))))
    return p, (n.astype(mx.int32) + 127) << 23


_exp2_parts_compiled = mx.compile(_exp2_parts, shapeless=True)


def exp_nonpositive(x: mx.array) -> mx.array:
    """exp(x) for float32 x <= 0 (the shifted scores of a softmax)."""
    p, bits = _exp2_parts_compiled(x)
    return p * bits.view(mx.float32)


def _causal(T: int, S: int) -> mx.array:
    return mx.arange(S - T, S)[:, None] >= mx.arange(S)[None]


def softmax_attention(q: mx.array, k: mx.array, v: mx.array, scale: float,
                      mask: Union[None, str, mx.array]) -> mx.array:
    """q [B, H, T, D], k/v [B, Hkv, S, D] (grouped-query heads), mask None, "causal", boolean or
    additive [.., T, S]. Returns [B, H, T, D]."""
    B, H, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    rep = H // Hkv
    s = ((q * scale).reshape(B, Hkv, rep * T, D) @ k.swapaxes(-1, -2)).reshape(B, Hkv, rep, T, S)
    if isinstance(mask, str):
        mask = _causal(T, S)
    if mask is not None:
        if mask.ndim == 4:                       # [B, 1|H, T, S] -> the grouped layout
            mask = mask.reshape(mask.shape[0], -1, 1, T, S) if mask.shape[1] == 1 else \
                mask.reshape(mask.shape[0], Hkv, rep, T, S)
        s = mx.where(mask, s, -mx.inf) if mask.dtype == mx.bool_ else s + mask
    p = exp_nonpositive(s - mx.max(s, axis=-1, keepdims=True))
    out = (p.reshape(B, Hkv, rep * T, S) @ v) / p.sum(axis=-1).reshape(B, Hkv, rep * T, 1)
    return out.reshape(B, H, T, D)


def attention(queries, keys, values, cache, scale: float, mask, sinks: Optional[mx.array] = None):
    """mlx-lm's attention call, with the CPU softmax path for large float32 score tensors."""
    B, H, T, _ = queries.shape
    if (sinks is None and not hasattr(cache, "bits") and queries.dtype == mx.float32
            and B * H * T * keys.shape[2] >= SCORE_ELEMENTS and mx.default_device() == mx.cpu):
        return softmax_attention(queries, keys, values, scale, mask)
    return mlx_lm_attention(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
