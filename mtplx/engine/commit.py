"""The commit of a step: each row keeps 0..T of the positions its verify wrote into the target's
caches (ragged, per row), and the MTP head's history follows: the head's KV holds one entry
(target hidden, token) per kept position, written in the next cycle's head forward or, after AR
steps, owed and written in one forward (`HeadHistory`)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mtplx.models.cache import commit_rows

HISTORY_FLUSH_AT = 16        # AR steps of owed MTP history a lane holds before writing it into the head's KV


def commit_positions(caches, H, L, keep, T: int) -> tuple:
    """Keep `keep[b]` of the T verify positions of row b (0: the row's state does not move; `keep`
    on the host, or on the device: `commit_rows`) and return each row's last kept hidden
    [W, 1, Hd] and logits [W, V] (a row that kept none: its first position's, never read)."""
    commit_rows(caches, T, keep)
    last = mx.maximum(keep - 1, 0) if isinstance(keep, mx.array) else mx.array(np.maximum(keep - 1, 0))
    sel = last.astype(mx.int32)[:, None, None]
    return mx.take_along_axis(H, sel, axis=1), mx.take_along_axis(L, sel, axis=1)[:, 0]


class HeadHistory:
    """The head-history entries a lane's rows owe. An MTP cycle's head forward writes, for each
    row, the entries of the drafts it accepted last cycle (`hidden` [W, D, Hd] and `tokens`
    [W, D]: the last verify's hiddens and drafts; a row's `owed` count says how many) before its
    draft entry. An AR step runs no head forward: its entries, and those a row owed from its last
    MTP cycle, become owed columns (hidden [W, 1, Hd], token [W], owner mask [W]) that `write`
    puts into the head's KV in one [W, n] forward."""

    def __init__(self, width: int, depth: int, like: mx.array):
        self.hidden = mx.zeros((width, depth) + like.shape[2:], like.dtype)
        self.tokens = mx.zeros((width, depth), mx.uint32)
        self.columns: list = []

    @property
    def due(self) -> bool:
        return len(self.columns) >= HISTORY_FLUSH_AT

    def owe(self, hidden: mx.array, tokens: mx.array, owners: np.ndarray) -> None:
        self.columns.append((hidden, tokens, owners))

    def owe_rows(self, rows) -> np.ndarray:
        """Move the entries rows owe from the last MTP cycle (their accepted drafts) to owed
        columns; rows then owe none. Returns which rows may draft (their entries are kept)."""
        may_draft = np.array([r is not None and r.req.speculative for r in rows])
        owed = np.array([r.owed if r is not None else 0 for r in rows]) * may_draft
        for j in range(int(owed.max(initial=0))):      # oldest first
            self.owe(self.hidden[:, j:j + 1], self.tokens[:, j], owed > j)
        for row in rows:
            if row is not None:
                row.owed = 0
        return may_draft

    def write(self, model, mtp_caches) -> None:
        """One head forward over [W, n] (no logits), each row's own columns left-aligned in order,
        then each row keeps its own count: the head's history is then exactly what consecutive MTP
        cycles would have written."""
        cols, self.columns = self.columns, []
        if not cols or not mtp_caches:
            return
        owner = np.stack([c[2] for c in cols], axis=1)                  # [W, n]
        counts = owner.sum(axis=1)
        if not counts.any():
            return
        n = len(cols)
        own = np.argsort(~owner, axis=1, kind="stable")              # each row's own columns first, in order
        last = np.take_along_axis(own, np.maximum(counts - 1, 0)[:, None], axis=1)
        idx = np.where(np.arange(n)[None, :] < counts[:, None], own, last).astype(np.int32)
        h = mx.take_along_axis(mx.concatenate([c[0] for c in cols], axis=1), mx.array(idx)[:, :, None], axis=1)
        t = mx.take_along_axis(mx.stack([c[1] for c in cols], axis=1), mx.array(idx), axis=1)
        model.draft_hidden(h, t, mtp_caches)     # lazy: only the layer's keys and values are used
        commit_rows(mtp_caches, n, counts)

    def record(self, H: mx.array, drafts: mx.array) -> None:
        """A cycle's verify hiddens and drafts [W, n] (n <= depth): the entries its rows' accepted
        drafts owe."""
        self.hidden = H[:, :self.hidden.shape[1]]
        n = drafts.shape[1]
        self.tokens = drafts if n == self.tokens.shape[1] else mx.concatenate([drafts, self.tokens[:, n:]], axis=1)

    def redepth(self, depth: int) -> None:
        """The lane moves to chains of `depth` drafts (rows have settled what they owed: `owe_rows`)."""
        width = self.tokens.shape[0]
        self.hidden = mx.zeros((width, depth) + self.hidden.shape[2:], self.hidden.dtype)
        self.tokens = mx.zeros((width, depth), mx.uint32)

    def clear_slot(self, b: int) -> None:
        """A new row takes slot b: what the slot owed was its previous row's."""
        self.tokens[b] = 0
        for _h, _t, owners in self.columns:
            owners[b] = False

    def take(self, index: list) -> None:
        """Rows move to new slots (`index[i]`: the old slot of new slot i; owed columns are
        written before any move)."""
        index = mx.array(index, dtype=mx.int32)
        self.hidden, self.tokens = self.hidden[index], self.tokens[index]
