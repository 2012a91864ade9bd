"""Gated DeltaNet (GDN) state with capture-commit rollback.

A GDN layer's state (a short conv window and a [Hv, Dv, Dk] recurrent matrix per row) cannot be
trimmed like KV: position t's state is a function of every earlier position. Speculative decoding
therefore records, during a short multi-token forward (a verify over [x0, d1..dK]), the state after
EACH position; committing then installs the state at the last kept position:

  solo    `trim(n)`        drop the last n positions of the latest forward (state at T-1-n)
  cohort  `advance(delta)` per row, delta = keep - written; keep 0 restores the pre-forward state
                           (no snapshot copy before the verify, no re-forward after a reject)

The capture forward is ours (`capture_forward`), built from the mlx-lm layer's own pieces: its
projections (`fix_query_key_value_ordering` for Qwen3-Next), `conv1d`, `normalize_qk` and one
`gated_delta_update` step per position (the Metal kernel on Apple GPUs, the ops step on CPU: the
state stays float32 between steps, so splitting a forward into steps changes no bit). It runs for
forwards of at most `CAPTURE_MAX_T` positions on a `RecurrentCache`; longer forwards (prefill
chunks) keep mlx-lm's fast path and leave nothing to roll back. `install_capture(layers)` swaps the
GDN modules' class for a capturing subclass at load time; the weights are untouched.

Batching needs no mask: lane rows are prefilled alone (never padded), then `put_row` places each
row's state in its row of the batched state.
"""

from __future__ import annotations

from typing import Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import ArraysCache
from mlx_lm.models.gated_delta import gated_delta_update, normalize_qk

CAPTURE_MAX_T = 4          # verify of depth 3 writes 4 positions; prefill chunks are longer


class RecurrentCache(ArraysCache):
    """cache[0]: conv window [B, K-1, C]; cache[1]: recurrent state [B, Hv, Dv, Dk] (float32)."""

    def __init__(self):
        super().__init__(size=2)
        # The latest capture forward: its conv input [B, K-1+T, C] (the window after j kept
        # positions is rows j..j+K-2) and the recurrent states [pre, after 1, ..., after T].
        self._conv_input: Optional[mx.array] = None
        self._states: Optional[list] = None
        self._width: Optional[int] = None          # rows of a lane layer (`empty_rows`)

    # ---- the capture record
    def record(self, conv_input: mx.array, states: list) -> None:
        self._conv_input, self._states = conv_input, states

    def clear_capture(self) -> None:
        self._conv_input = self._states = None

    @property
    def captured_positions(self) -> int:
        return 0 if self._states is None else len(self._states) - 1

    def rollback(self, kept) -> None:
        """Install, per row, the state after `kept[b]` positions of the latest capture forward
        (0 = the state before it). Consumes the capture."""
        _rollback([self], kept)

    # ---- the engine's cache protocol
    def advance(self, delta) -> None:
        """A scalar is mlx-lm's GDN forward counting its own positions (the state already moved;
        any older capture is stale). An array is a commit: per row, keep `written + delta[b]`
        positions of the latest capture forward (`mtplx.models.cache.commit_rows`)."""
        if np.ndim(delta) == 0:
            self.clear_capture()
            return
        delta = np.asarray(delta, dtype=np.int64)
        if (delta >= 0).all():
            self.clear_capture()
            return
        self.rollback(self.captured_positions + np.minimum(delta, 0))

    @classmethod
    def advance_all(cls, caches: Sequence["RecurrentCache"], delta) -> None:
        """`advance(delta)` for all of a cohort's GDN layers at once: a mixed commit selects every
        layer's rows in one compiled call (one dispatch per cycle, not one per layer)."""
        if np.ndim(delta) == 0 or (np.asarray(delta) >= 0).all():
            for c in caches:
                c.advance(delta)
        elif caches:
            _rollback(caches, caches[0].captured_positions + np.minimum(np.asarray(delta, dtype=np.int64), 0))

    def trim(self, n: int) -> int:
        """Solo rollback: drop the last n positions of the latest capture forward."""
        n = int(n)
        if n <= 0:
            self.clear_capture()
            return 0
        self.rollback(self.captured_positions - n)
        return n

    # ---- the compiled-cycle protocol (see `RaggedKVCache.graph_inputs`): the verify graph takes
    # the conv window and state, and gives back the capture (conv input, state after each position)
    def graph_inputs(self) -> list:
        return [self.cache[0], self.cache[1]]

    @classmethod
    def graph_view(cls, arrays: Sequence[mx.array], offset=None, span=None) -> "RecurrentCache":
        c = cls()
        c[0], c[1] = arrays
        return c

    def graph_outputs(self) -> list:
        if self._states is None:
            raise RuntimeError("a compiled GDN forward must be a capture forward "
                               f"(at most {CAPTURE_MAX_T} positions)")
        return [self._conv_input, *self._states[1:]]

    def absorb_graph(self, outputs, T: int, offset=None) -> None:
        conv_input = next(outputs)
        states = [self.cache[1]] + [next(outputs) for _ in range(T)]
        self.record(conv_input, states)
        self.cache[0], self.cache[1] = conv_input[:, T:], states[-1]

    def is_trimmable(self) -> bool:
        return self._states is not None

    def make_mask(self, N: int, **_kwargs):
        return None          # rows are never padded, and `lengths`/`left_padding` stay None

    # ---- the running lane's row protocol (see `RaggedKVCache.put_row`)
    @classmethod
    def empty_rows(cls, width: int) -> "RecurrentCache":
        out = cls()
        out._width = width
        return out

    def put_row(self, b: int, row: "RecurrentCache") -> None:
        for e in range(2):
            if row[e] is None:
                continue
            if self[e] is None:
                self[e] = mx.zeros((self._width,) + row[e].shape[1:], row[e].dtype)
            self[e][b:b + 1] = row[e]      # a slice update, as `RaggedKVCache.put_row`

    def take_rows(self, index: Sequence[Optional[int]]) -> "RecurrentCache":
        out = type(self).empty_rows(len(index))
        rows = mx.array([i if i is not None else 0 for i in index], dtype=mx.int32)
        for e in range(2):
            if self[e] is not None:
                out[e] = self[e][rows]
        return out

    def snapshot(self, m: int) -> "RecurrentSnapshot":
        """The state now (taken right after the prefill chunk ending at boundary m)."""
        conv, state = self.cache[0], self.cache[1]
        mx.eval([a for a in (conv, state) if a is not None])
        return RecurrentSnapshot(conv, state, m)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.cache if c is not None)


def _select_rows_impl(kept: mx.array, slot: mx.array, k1: int, conv_input: mx.array, *states: mx.array):
    """Per row b: the conv window after kept[b] captured positions, and the recurrent state
    states[slot[b]] (the caller passes only the states some row keeps)."""
    pos = kept[:, None] + mx.arange(k1, dtype=mx.int32)[None]
    conv = mx.take_along_axis(conv_input, pos[..., None], axis=1)
    state = states[-1]
    for j in range(len(states) - 2, -1, -1):
        state = mx.where((slot == j).reshape(-1, *([1] * (state.ndim - 1))), states[j], state)
    return conv, state


def _checked_keeps(caches: Sequence[RecurrentCache], kept) -> np.ndarray:
    """`kept` as one count per row, checked against what the caches captured."""
    if any(c._states is None for c in caches):
        raise RuntimeError("GDN state cannot be rolled back: the latest forward captured no "
                           f"per-position states (more than {CAPTURE_MAX_T} positions, or none)")
    T = caches[0].captured_positions
    B = caches[0]._states[0].shape[0]
    kept = np.asarray(kept, dtype=np.int64).reshape(-1)
    if kept.size == 1 and B > 1:
        kept = np.full(B, int(kept[0]))
    if kept.size != B or kept.min() < 0 or kept.max() > T or any(c.captured_positions != T for c in caches):
        raise ValueError(f"cannot keep {kept.tolist()} of {T} captured positions for {B} rows")
    return kept


def _rollback(caches: Sequence[RecurrentCache], kept) -> None:
    """Install in each cache, per row b, the state after kept[b] positions of its latest capture
    forward (0 = the state before it), and consume the captures."""
    kept = _checked_keeps(caches, kept)
    T = caches[0].captured_positions
    k1 = caches[0]._conv_input.shape[1] - T
    if (kept == kept[0]).all():
        j = int(kept[0])
        for c in caches:
            c.cache[0], c.cache[1] = mx.contiguous(c._conv_input[:, j:j + k1, :]), c._states[j]
    else:
        # Only the states some row keeps are read (all rows active: two of the three at T=2).
        used = sorted(set(kept.tolist()))
        slot = np.searchsorted(used, kept).astype(np.int32)
        arrays = [a for c in caches for a in (c._conv_input, *[c._states[j] for j in used])]
        out = _select_rows_all(len(used), k1, mx.array(kept.astype(np.int32)), mx.array(slot), *arrays)
        for i, c in enumerate(caches):
            c.cache[0], c.cache[1] = out[2 * i], out[2 * i + 1]
    for c in caches:
        c.clear_capture()


def _select_rows_all(n_used: int, k1: int, kept: mx.array, slot: mx.array, *arrays: mx.array):
    """`_select_rows_impl` for every layer in one compiled graph (one fused elementwise pass per
    layer); arrays are, per layer, its conv input and its `n_used` kept states."""
    key = (k1, n_used, len(arrays))
    fn = _SELECT_COMPILED.get(key)
    if fn is None:
        per = 1 + n_used

        def select_all(kept, slot, *arrays):
            out = []
            for i in range(0, len(arrays), per):
                out.extend(_select_rows_impl(kept, slot, k1, arrays[i], *arrays[i + 1:i + per]))
            return out

        fn = _SELECT_COMPILED[key] = mx.compile(select_all)
    return fn(kept, slot, *arrays)


_SELECT_COMPILED: dict = {}


class RecurrentSnapshot:
    """An immutable GDN state at a prompt boundary (mlx arrays are never written in place: caches
    only rebind them, so holding references is a copy)."""

    def __init__(self, conv: Optional[mx.array], state: Optional[mx.array], boundary: int):
        self.conv, self.state, self.boundary = conv, state, boundary

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.conv, self.state) if a is not None)

    def restore(self) -> RecurrentCache:
        c = RecurrentCache()
        c[0], c[1] = self.conv, self.state
        return c


# ------------------------------------------------------------------ the capture forward

def _project(layer, inputs: mx.array):
    """(mixed qkv [B, S, conv_dim], z [B, S, Hv, Dv], b [B, S, Hv], a [B, S, Hv]) from the layer's
    own projections: Qwen3.5's separate ones, or Qwen3-Next's fused ones."""
    B, S, _ = inputs.shape
    if hasattr(layer, "in_proj_qkvz"):
        q, k, v, z, b, a = layer.fix_query_key_value_ordering(layer.in_proj_qkvz(inputs), layer.in_proj_ba(inputs))
        qkv = mx.concatenate([q.reshape(B, S, -1), k.reshape(B, S, -1), v.reshape(B, S, -1)], axis=-1)
        return qkv, z, b, a
    qkv = layer.in_proj_qkv(inputs)
    z = layer.in_proj_z(inputs).reshape(B, S, layer.num_v_heads, layer.head_v_dim)
    return qkv, z, layer.in_proj_b(inputs), layer.in_proj_a(inputs)


def capture_forward(layer, inputs: mx.array, cache: RecurrentCache) -> mx.array:
    """The GDN layer's forward that also records the state after each position in `cache`."""
    B, S, _ = inputs.shape
    qkv, z, b, a = _project(layer, inputs)
    k1 = layer.conv_kernel_size - 1
    conv_state = cache[0] if cache[0] is not None else mx.zeros((B, k1, layer.conv_dim), dtype=inputs.dtype)
    conv_input = mx.concatenate([conv_state, qkv], axis=1)
    cache[0] = mx.contiguous(conv_input[:, -k1:, :])
    conv_out = nn.silu(layer.conv1d(conv_input))
    q, k, v = [
        t.reshape(B, S, h, d)
        for t, h, d in zip(mx.split(conv_out, [layer.key_dim, 2 * layer.key_dim], -1),
                           [layer.num_k_heads, layer.num_k_heads, layer.num_v_heads],
                           [layer.head_k_dim, layer.head_k_dim, layer.head_v_dim])
    ]
    q, k = normalize_qk(q, k, inv_scale=layer.head_k_dim ** -0.5, eps=1e-6)
    state = cache[1]
    if state is None:
        state = mx.zeros((B, layer.num_v_heads, layer.head_v_dim, layer.head_k_dim), dtype=mx.float32)
    states, ys = [state], []
    for t in range(S):
        s = slice(t, t + 1)
        y, state = gated_delta_update(q[:, s], k[:, s], v[:, s], a[:, s], b[:, s], layer.A_log, layer.dt_bias,
                                      state, None, use_kernel=not layer.training)
        ys.append(y)
        states.append(state)
    cache[1] = state
    cache.record(conv_input, states)
    out = ys[0] if S == 1 else mx.concatenate(ys, axis=1)
    out = layer.norm(out, z)
    return layer.out_proj(out.reshape(B, S, -1))


_CAPTURE_CLASSES: dict = {}


def _capture_class(base: type) -> type:
    if getattr(base, "_mtplx_capture", False):
        return base
    if base not in _CAPTURE_CLASSES:
        def __call__(self, inputs, mask=None, cache=None):
            if (isinstance(cache, RecurrentCache) and mask is None and inputs.shape[1] <= CAPTURE_MAX_T
                    and getattr(self, "sharding_group", None) is None):
                return capture_forward(self, inputs, cache)
            return base.__call__(self, inputs, mask, cache)

        _CAPTURE_CLASSES[base] = type(f"Capturing{base.__name__}", (base,),
                                      {"__call__": __call__, "_mtplx_capture": True,
                                       "__doc__": f"{base.__name__} with per-position state capture."})
    return _CAPTURE_CLASSES[base]


def install_capture(layers) -> int:
    """Give every GDN (`linear_attn`) module of these decoder layers the capturing forward.
    Idempotent; returns the number of GDN layers."""
    n = 0
    for layer in layers:
        if getattr(layer, "is_linear", False):
            gdn = layer.linear_attn
            gdn.__class__ = _capture_class(type(gdn))
            n += 1
    return n
