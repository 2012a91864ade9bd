"""A running lane's decode state, one slot per row (`LaneState`)."""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import numpy as np

from mtplx.engine.commit import HeadHistory
from mtplx.models.cache import RaggedKVCache, empty_batch_layer


class LaneState:
    """What a running lane keeps per slot on the device: the target's caches and the head's, each
    slot's last hidden state and logits (the logits' host copy too, where a sampled cycle read
    them), and the head's history (`HeadHistory`). Empty until the lane's first row is placed
    (`start`). A cycle reads and replaces the arrays; a row's placement (`put`) and the lane's
    reshapes (`move_rows`, `clear`) go through here. The rows themselves are the lane's."""

    def __init__(self):
        self.caches: Optional[list] = None
        self.mtp_caches: Optional[list] = None
        self.logits_last: Optional[mx.array] = None
        self.h_last: Optional[mx.array] = None
        self.logits_host: Optional[np.ndarray] = None
        self.history: Optional[HeadHistory] = None

    @property
    def empty(self) -> bool:
        return self.caches is None

    def start(self, adm, width: int, depth: int) -> None:
        """Empty state for `width` slots, shaped like this first row's prefill (`RowPrefill`)."""
        self.caches = [empty_batch_layer(c, width) for c in adm.cache]
        self.mtp_caches = [empty_batch_layer(c, width) for c in adm.mtp_cache or []]
        logits, hidden = adm.out
        self.logits_last = mx.zeros((width,) + logits.shape, logits.dtype)
        self.h_last = mx.zeros((width,) + hidden.shape[1:], hidden.dtype)
        self.history = HeadHistory(width, depth, hidden)

    def put(self, b: int, adm) -> None:
        """Slot b takes a prefilled row's caches and its last logits and hidden state."""
        for layer, per_row in zip(self.caches, adm.cache):
            layer.put_row(b, per_row)
        for layer, per_row in zip(self.mtp_caches, adm.mtp_cache or []):
            layer.put_row(b, per_row)
        logits, hidden = adm.out
        self.logits_last[b] = logits
        self.h_last[b] = hidden[0]
        self.logits_host = None
        self.history.clear_slot(b)

    def move_rows(self, index: list) -> None:
        """New slot i takes old slot index[i]'s state (None: an empty slot)."""
        take = [i if i is not None else 0 for i in index]
        self.caches = [c.take_rows(index) for c in self.caches]
        self.mtp_caches = [c.take_rows(index) for c in self.mtp_caches]
        sel = mx.array(take, dtype=mx.int32)
        self.logits_last, self.h_last = self.logits_last[sel], self.h_last[sel]
        self.history.take(take)

    def clear(self) -> None:
        """Nothing live to carry: the next row placed starts empty layers."""
        self.caches = self.mtp_caches = self.history = None

    def reserve(self, positions: int) -> None:
        """Room in every ragged KV layer for `positions` positions per slot."""
        for layer in self.caches + self.mtp_caches:
            if isinstance(layer, RaggedKVCache):
                layer.ensure_capacity(positions)

    def all_ragged(self) -> bool:
        """Every layer ragged KV (its commit can move on the device)."""
        return all(isinstance(c, RaggedKVCache) for c in self.caches + self.mtp_caches)
