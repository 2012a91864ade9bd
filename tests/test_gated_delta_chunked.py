"""The chunked gated delta rule (training's GDN forward) == mlx-lm's step-by-step recurrence."""

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.gated_delta import gated_delta_ops, normalize_qk

from mtplx.models.gated_delta_chunked import gated_delta_chunked, gated_delta_update_chunked


def _inputs(B, T, Hk, Hv, D, seed=0, correlated=False):
    mx.random.seed(seed)
    q, k = mx.random.normal((B, T, Hk, D)), mx.random.normal((B, T, Hk, D))
    if correlated:   # near-identical keys and strong writes: the hardest case for the chunk solve
        k = 0.1 * k + 3 * mx.random.normal((B, 1, Hk, D))
    q, k = normalize_qk(q, k, inv_scale=D ** -0.5, eps=1e-6)
    v = mx.random.normal((B, T, Hv, D))
    log_g = -mx.exp(mx.random.normal((Hv,)) * 0.5 - (3 if correlated else 0)) * nn.softplus(mx.random.normal((B, T, Hv)))
    beta = mx.sigmoid(mx.random.normal((B, T, Hv)) + (4 if correlated else 0))
    state = 0.1 * mx.random.normal((B, Hv, D, D))
    return q, k, v, log_g, beta, state


@pytest.mark.parametrize("T", [1, 16, 37, 256])
@pytest.mark.parametrize("correlated", [False, True])
def test_matches_stepped_recurrence(T, correlated):
    q, k, v, log_g, beta, state = _inputs(2, T, 2, 4, 32, correlated=correlated)
    y_ref, s_ref = gated_delta_ops(q, k, v, mx.exp(log_g), beta, state)
    y, s = gated_delta_chunked(q, k, v, log_g, beta, state)
    assert y.shape == y_ref.shape and s.shape == s_ref.shape
    tol = 2e-4 if correlated else 2e-6
    assert mx.abs(y - y_ref).max().item() < tol
    assert mx.abs(s - s_ref).max().item() < 10 * tol


def test_no_initial_state_and_gradients_match():
    q, k, v, log_g, beta, _ = _inputs(2, 48, 2, 2, 32, seed=1)
    ref = lambda q, k, v: gated_delta_ops(q, k, v, mx.exp(log_g), beta)[0].square().sum()
    got = lambda q, k, v: gated_delta_chunked(q, k, v, log_g, beta)[0].square().sum()
    g_ref = mx.grad(ref, argnums=(0, 1, 2))(q, k, v)
    g_got = mx.grad(got, argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(g_ref, g_got):
        assert mx.abs(a - b).max().item() < 1e-4 * max(1.0, mx.abs(a).max().item())


def test_update_wrapper_refuses_masks():
    q, k, v, _, _, _ = _inputs(1, 4, 1, 1, 32)
    a = b = mx.zeros((1, 4, 1))
    with pytest.raises(ValueError, match="unmasked"):
        gated_delta_update_chunked(q, k, v, a, b, mx.zeros((1,)), mx.zeros((1,)), None, mx.ones((1, 4), mx.bool_))
