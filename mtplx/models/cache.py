"""A ragged batched KV cache: one shared buffer, per-row logical lengths.

mlx-lm's `BatchKVCache` left-pads rows and trims all rows alike; speculative cohorts need each
row to keep 0, 1 or 2 of the positions a verify wrote. Here every row writes its new positions at
its own offset (so RoPE positions are per row and no padding token is ever attended to), and
`commit_rows` moves each row's offset back over the positions it rejected. Those slots become
dead: the causal mask never reaches past a row's offset, and the next write overwrites them.

Protocol (what mlx-lm's attention layers call): `offset` (an int32 array [B], read as the RoPE
position), `update_and_fetch(keys, values)`, `make_mask(N, ...)`.

Cache protocol the decode paths rely on, for any layer type (attention here; recurrent caches
implement the same four in their own module):
  solo:    `trim(n)` drops the last n positions written by the latest forward;
  lane:    `empty_rows(width)`, `put_row(b, per_row)` (a newly prefilled row joins a running lane),
           `take_rows(index)` (the lane widens or narrows, rows keep their state), and
           `advance(delta)`: each row moves by `keep - written` after a verify (`commit_rows`);
  prefix:  `snapshot_layer` / `restore_layer` below.
"""

from __future__ import annotations

from typing import Optional, Sequence

import mlx.core as mx
import numpy as np

STEP = 256


class RaggedKVCache:
    def __init__(self, keys: mx.array, values: mx.array, lengths: Sequence[int]):
        self.keys, self.values = keys, values          # [B, H, capacity, D]
        self.lengths = np.asarray(lengths, dtype=np.int64).copy()  # per row: host truth, an upper bound while a device commit is unsettled
        self.offset = mx.array(self.lengths, dtype=mx.int32)
        self.full_span = False    # traced: attend over the whole buffer, keep no host state
        self.reserved = 0         # capacity asked for before the buffer exists

    @classmethod
    def traced(cls, keys: mx.array, values: mx.array, offset: mx.array,
               span: Optional[int] = None) -> "RaggedKVCache":
        """A pure-array view for `mx.compile`: shapes fixed by the buffer's capacity, no host
        bookkeeping inside the graph (the caller advances `lengths`). Attention reads the first
        `span` positions (the whole buffer when None). The caller guarantees capacity for the
        positions written and a span that covers every row's length after the write."""
        c = cls.__new__(cls)
        c.keys, c.values, c.offset, c.lengths, c.full_span = keys, values, offset, None, True
        c.reserved, c.span = 0, span
        return c

    def _span(self, T: int) -> int:
        if self.full_span:
            return self.span or self.keys.shape[2]
        return int(self.lengths.max()) + T

    @property
    def batch_size(self) -> int:
        return len(self.lengths)

    # ---- the running lane's row protocol
    @classmethod
    def empty_rows(cls, width: int) -> "RaggedKVCache":
        return cls(None, None, [0] * width)

    def put_row(self, b: int, kv) -> None:
        """Row b becomes the per-row mlx-lm KVCache `kv` (its positions, its length); the row's old
        slots past that length are dead (the mask never reaches them)."""
        n = int(kv.offset) if kv.keys is not None else 0
        if n:
            k, v = kv.keys[..., :n, :], kv.values[..., :n, :]
            W = len(self.lengths)
            self.ensure_capacity(n + 2, like=(mx.broadcast_to(k[:, :, :1], (W,) + k.shape[1:2] + (1,) + k.shape[3:]),
                                              mx.broadcast_to(v[:, :, :1], (W,) + v.shape[1:2] + (1,) + v.shape[3:])))
            # A slice update (in place when MLX can donate the buffer, not a copy of every row);
            # arrays taken from the buffer before keep their old contents.
            self.keys[b:b + 1, :, :n, :] = k
            self.values[b:b + 1, :, :n, :] = v
        self.lengths = self.lengths.copy()
        self.lengths[b] = n
        self.offset = mx.array(self.lengths, dtype=mx.int32)

    def take_rows(self, index: Sequence[Optional[int]]) -> "RaggedKVCache":
        """A cache whose row i is this cache's row index[i] (None: an empty row)."""
        lengths = [int(self.lengths[i]) if i is not None else 0 for i in index]
        if self.keys is None:
            c = RaggedKVCache(None, None, lengths)
            c.reserved = self.reserved
            return c
        rows = mx.array([i if i is not None else 0 for i in index], dtype=mx.int32)
        return RaggedKVCache(self.keys[rows], self.values[rows], lengths)

    def ensure_capacity(self, needed: int, like: Optional[tuple] = None) -> None:
        """Capacity for `needed` positions per row, in steps of STEP. Before the first write (no
        buffer yet, `like` None) the request is remembered and honoured at allocation."""
        if self.keys is None:        # every row started empty: allocate from the first write
            self.reserved = max(self.reserved, needed)
            if like is None:
                return
            k, v = like
            B, H, _, Dk = k.shape
            cap = -(-self.reserved // STEP) * STEP
            self.keys = mx.zeros((B, H, cap, Dk), k.dtype)
            self.values = mx.zeros((B, H, cap, v.shape[3]), v.dtype)
            return
        cap = self.keys.shape[2]
        if needed <= cap:
            return
        grow = -(-(needed - cap) // STEP) * STEP
        B, H, _, Dk = self.keys.shape
        self.keys = mx.concatenate([self.keys, mx.zeros((B, H, grow, Dk), self.keys.dtype)], axis=2)
        self.values = mx.concatenate(
            [self.values, mx.zeros((B, H, grow, self.values.shape[3]), self.values.dtype)], axis=2)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        B, H, T, _ = keys.shape
        span = self._span(T)
        if not self.full_span:
            self.ensure_capacity(span, like=(keys, values))
        pos = self.offset[:, None] + mx.arange(T, dtype=mx.int32)[None]          # [B, T]
        self.keys = mx.put_along_axis(
            self.keys, mx.broadcast_to(pos[:, None, :, None], keys.shape), keys, axis=2)
        self.values = mx.put_along_axis(
            self.values, mx.broadcast_to(pos[:, None, :, None], values.shape), values, axis=2)
        self.offset = self.offset + T
        if not self.full_span:
            self.lengths = self.lengths + T
        return self.keys[..., :span, :], self.values[..., :span, :]

    def make_mask(self, N: int, return_array: bool = False, window_size=None) -> mx.array:
        """[B, 1, N, S]: query i of row b (at position q = offset_b + i) sees keys j <= q, and
        with a `window_size` W (a sliding-window layer) only j > q - W: the W keys mlx-lm's
        `RotatingKVCache` and window mask give that query. Per row and per position, so rows
        of any lengths, a verify's speculative positions and a row moved back over rejected
        drafts each see exactly their own window."""
        span = self._span(N)
        q_pos = (self.offset[:, None] + mx.arange(N, dtype=mx.int32)[None])[:, :, None]      # [B, N, 1]
        k_pos = mx.arange(span, dtype=mx.int32)[None, None, :]
        mask = k_pos <= q_pos
        if window_size is not None:
            mask = mask & (k_pos > q_pos - window_size)
        return mask[:, None]

    def advance(self, delta, offset: Optional[mx.array] = None) -> None:
        """Move each row's offset by delta (negative to drop the positions just written). A host
        delta moves the host lengths too; a device one (an `mx.array`) only the device offsets,
        the host lengths staying an upper bound until `settle_rows`. `offset`: the resulting
        device offsets, when a sibling layer sharing this one's already built them."""
        if not isinstance(delta, mx.array):
            self.lengths = self.lengths + np.asarray(delta, dtype=np.int64)
        if offset is None:
            offset = self.offset + (delta if isinstance(delta, mx.array) else mx.array(delta, dtype=mx.int32))
        self.offset = offset

    # ---- the compiled-cycle protocol (`mtplx.engine.forwards.CycleForwards`): a cache enters an
    # `mx.compile`d forward as plain arrays, runs there as a traced view, and takes back its outputs
    def graph_inputs(self) -> list:
        return [self.keys, self.values]

    @classmethod
    def graph_view(cls, arrays: Sequence[mx.array], offset: mx.array, span: Optional[int] = None) -> "RaggedKVCache":
        return cls.traced(arrays[0], arrays[1], offset, span)

    def graph_outputs(self) -> list:
        return [self.keys, self.values]

    def absorb_graph(self, outputs, T: int, offset: mx.array) -> None:
        """Take this cache's outputs from the iterator; `offset` is the cohort's moved offset."""
        self.keys, self.values = next(outputs), next(outputs)
        self.lengths, self.offset = self.lengths + T, offset

    @property
    def state(self):
        return self.keys, self.values, self.offset

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes


# A sliding layer reads its window band rather than the whole span only when the span is at least
# this many times the band: below, the band's gather costs about what it saves (BENCHMARKS.md,
# "Measurements behind the engine's constants").
BAND_MIN_RATIO = 1.5


def window_band(cache, keys: mx.array, values: mx.array, mask: mx.array, offset, window: int):
    """The keys, values and mask a sliding-window layer's queries can see, out of a full cache's
    span (`keys`, `values`, `mask` as the layer got them): per row, the W + T - 1 positions from
    max(0, offset - W + 1), `offset` being the row's length before this forward's T positions.
    Every position left out is masked for every query of that row (a window never reaches below
    it), so attention over the band equals attention over the span, reading W + T - 1 keys a row
    instead of the whole context. A ragged lane cache takes each row's own band from its buffer
    (rows of that buffer, one gather) with the band's window mask; one row (mlx-lm's `KVCache`,
    an int offset) slices. Unchanged (None) when the span is not long enough to pay for it."""
    T, S = mask.shape[-2], keys.shape[2]
    band = window + T - 1
    if S < BAND_MIN_RATIO * band:
        return None
    if not isinstance(offset, mx.array):
        lo = max(0, int(offset) - window + 1)
        return keys[..., lo:, :], values[..., lo:, :], mask[..., lo:]
    B, H, cap, _ = cache.keys.shape
    start = mx.maximum(offset.astype(mx.int32) - (window - 1), 0)
    pos = start[:, None] + mx.arange(band, dtype=mx.int32)[None]                  # [B, band]
    # band end = max(band, offset_b + T) <= S <= capacity: every position is a slot of row b
    rows = pos[:, None, :] + (mx.arange(B * H, dtype=mx.int32) * cap).reshape(B, H, 1)
    rows = rows.reshape(-1)

    def take(buf):      # rows of the flat buffer: a row gather, ~5x cheaper than take_along_axis here
        return mx.take(buf.reshape(B * H * cap, -1), rows, axis=0).reshape(B, H, band, -1)

    q_pos = (offset.astype(mx.int32)[:, None] + mx.arange(T, dtype=mx.int32)[None])[:, :, None]   # [B, T, 1]
    k_pos = pos[:, None, :]
    band_mask = (k_pos <= q_pos) & (k_pos > q_pos - window)
    return take(cache.keys), take(cache.values), band_mask[:, None]


def empty_batch_layer(per_row, width: int):
    """A lane layer of `width` empty rows, of the batched type that matches this per-row cache."""
    if hasattr(type(per_row), "empty_rows"):
        return type(per_row).empty_rows(width)
    return RaggedKVCache.empty_rows(width)


def snapshot_layer(cache, m: int):
    """An immutable copy of a per-row cache at prompt boundary m (its latest write)."""
    if hasattr(cache, "snapshot"):
        return cache.snapshot(m)
    kv = (mx.array(cache.keys[..., :m, :]), mx.array(cache.values[..., :m, :]))
    mx.eval(kv)
    return kv


def restore_layer(snap):
    """A fresh per-row cache holding a snapshot (the snapshot itself stays untouched)."""
    if hasattr(snap, "restore"):
        return snap.restore()
    from mlx_lm.models.cache import KVCache

    c = KVCache()
    c.update_and_fetch(*snap)
    return c


def snapshot_nbytes(snap) -> int:
    return snap.nbytes if hasattr(snap, "nbytes") else sum(a.nbytes for a in snap)


def commit_rows(caches: Sequence[RaggedKVCache], written: int, keep) -> None:
    """After a forward that wrote `written` positions per row, keep `keep[b]` of them. `keep` on
    the device (an `mx.array`: a cycle launched before the host read the last one's verify)
    moves the rows' device offsets now and leaves their host lengths as they are, an upper bound
    that `settle_rows` corrects once the host reads `keep` (ragged KV layers only)."""
    on_device = isinstance(keep, mx.array)
    if on_device:
        delta = (keep - written).astype(mx.int32)
    else:
        delta = np.asarray(keep, dtype=np.int64) - written
        if not delta.any():
            return
    moved: dict = {}          # a cohort's attention layers share one offset array: moved once
    grouped: dict = {}        # other layer types that commit all their layers at once
    for c in caches:
        if isinstance(c, RaggedKVCache):
            shared = id(c.offset)
            c.advance(delta, moved.get(shared))
            moved[shared] = c.offset
        elif on_device:
            raise TypeError(f"a {type(c).__name__} layer cannot commit on the device")
        elif hasattr(type(c), "advance_all"):
            grouped.setdefault(type(c), []).append(c)
        else:
            c.advance(delta)
    for kind, group in grouped.items():
        kind.advance_all(group, delta)


def settle_rows(caches: Sequence[RaggedKVCache], written: int, keep: np.ndarray) -> None:
    """The host lengths of a commit made on the device (`commit_rows` with `keep` on the device),
    now that the host has read `keep`."""
    delta = np.asarray(keep, dtype=np.int64) - written
    for c in caches:
        c.lengths = c.lengths + delta
