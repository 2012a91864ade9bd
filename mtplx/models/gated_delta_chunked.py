"""The gated delta rule over a whole sequence in chunks, for training GDN layers on a CPU.

mlx-lm's CPU path (`gated_delta_ops`) steps the recurrence one position at a time, so a
256-token training forward materialises 256 [Hv, Dv, Dk] states per layer (and the backward
pass as many again). The chunked form (the "WY" form used by flash-linear-attention) computes
the same outputs with matrix products inside chunks of C positions and steps the state only
once per chunk.

Per head, with state S [Dv, Dk], decay g_t, write strength beta_t and unit-norm key k_t:
    S_t = g_t S_{t-1} + beta_t (v_t - g_t S_{t-1} k_t) k_t^T,     y_t = S_t q_t.
Inside a chunk that starts from S0, with G_i = g_1 ... g_i (cumulative decay), the written
vectors u_j = beta_j (v_j - g_j S_{j-1} k_j) satisfy a unit lower-triangular system
    (I + A) U = diag(beta) (V - diag(G) K S0^T),   A[i, j] = beta_i (G_i / G_j) k_i.k_j  (j < i)
and then
    Y   = diag(G) Q S0^T + ((Q K^T) * D) U          D[i, j] = G_i / G_j  (j <= i, else 0)
    S_C = G_C S0 + U^T diag(G_C / G) K.
(I + A)^-1 is the finite Neumann series of the nilpotent -A, as a product of C's log2 factors;
chunks are short (16) so its terms stay small in float32.

The same contract as `mlx_lm.models.gated_delta.gated_delta_ops`, except that the decay comes
as its logarithm (`log_g`, so strong decay never underflows to log(0)).
"""

from __future__ import annotations

from typing import Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

CHUNK = 16


def _unit_lower_inverse(a: mx.array) -> mx.array:
    """(I + a)^-1 for strictly lower-triangular a [..., C, C]: prod_k (I + (-a)^(2^k))."""
    C = a.shape[-1]
    eye = mx.eye(C, dtype=a.dtype)
    m = -a
    inv = eye + m
    power = 1
    while 2 * power < C:
        m = m @ m
        inv = inv + inv @ m
        power *= 2
    return inv


def gated_delta_chunked(q: mx.array, k: mx.array, v: mx.array, log_g: mx.array, beta: mx.array,
                        state: Optional[mx.array] = None, chunk: int = CHUNK) -> Tuple[mx.array, mx.array]:
    """q, k [B, T, Hk, Dk] (normalised as `normalize_qk` does); v [B, T, Hv, Dv];
    log_g, beta [B, T, Hv]; state [B, Hv, Dv, Dk] or None. Returns y [B, T, Hv, Dv], state."""
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    dtype = q.dtype
    if Hv // Hk > 1:
        q, k = mx.repeat(q, Hv // Hk, -2), mx.repeat(k, Hv // Hk, -2)
    pad = (-T) % chunk
    if pad:   # padded positions write nothing (beta 0, k 0) and do not decay (log_g 0)
        widths = lambda x: [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)
        q, k, v, log_g, beta = (mx.pad(x, widths(x)) for x in (q, k, v, log_g, beta))
    N, C = (T + pad) // chunk, chunk

    def per_chunk(x):                      # [B, T', H, ...] -> [B, H, N, C, ...]
        x = x.reshape(B, N, C, Hv, -1)
        return x.transpose(0, 3, 1, 2, 4)

    q, k, v = per_chunk(q).astype(mx.float32), per_chunk(k).astype(mx.float32), per_chunk(v).astype(mx.float32)
    beta = per_chunk(beta)[..., 0].astype(mx.float32)                 # [B, H, N, C]
    gam = mx.cumsum(per_chunk(log_g)[..., 0].astype(mx.float32), axis=-1)

    lower = mx.tril(mx.ones((C, C), dtype=mx.bool_))
    decay = mx.exp(mx.where(lower, gam[..., :, None] - gam[..., None, :], -mx.inf))   # D
    a = beta[..., None] * (k @ k.swapaxes(-1, -2)) * decay * mx.tril(mx.ones((C, C)), -1)
    inv = _unit_lower_inverse(a)
    w = inv @ (k * (beta * mx.exp(gam))[..., None])                    # U = u0 - w S0^T
    u0 = inv @ (v * beta[..., None])
    attn = (q @ k.swapaxes(-1, -2)) * decay
    q_decayed = q * mx.exp(gam)[..., None]
    k_to_end = k * mx.exp(gam[..., -1:] - gam)[..., None]
    chunk_decay = mx.exp(gam[..., -1])[..., None, None]                # [B, H, N, 1, 1]

    s = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32) if state is None else state.astype(mx.float32)
    ys = []
    for n in range(N):
        st = s.swapaxes(-1, -2)                                        # S0^T [Dk, Dv]
        u = u0[:, :, n] - w[:, :, n] @ st
        ys.append(q_decayed[:, :, n] @ st + attn[:, :, n] @ u)
        s = chunk_decay[:, :, n] * s + u.swapaxes(-1, -2) @ k_to_end[:, :, n]
    y = mx.stack(ys, axis=2).transpose(0, 2, 3, 1, 4).reshape(B, N * C, Hv, Dv)[:, :T]
    return y.astype(dtype), s


def gated_delta_update_chunked(q, k, v, a, b, A_log, dt_bias, state=None, mask=None, **_kwargs):
    """Drop-in for mlx-lm's `gated_delta_update` on full unmasked sequences (training)."""
    if mask is not None:
        raise ValueError("the chunked gated delta rule runs unmasked sequences only")
    log_g = -mx.exp(A_log.astype(mx.float32)) * nn.softplus(a + dt_bias)
    return gated_delta_chunked(q, k, v, log_g, mx.sigmoid(b), state)
