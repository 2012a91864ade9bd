"""The KV memory budget: rows join lanes only while every lane's decode state (target and MTP
head KV, recurrent state) fits `budget_bytes`. A lane holds width x its longest row's
prompt + max_tokens of KV, whatever its other rows need: buffers are sized once per admission so
compiled graphs never retrace."""

from __future__ import annotations

from typing import Iterable, Optional


def row_state_bytes(model) -> tuple:
    """(bytes per KV position, fixed bytes) of one row's decode state, target and MTP head
    together, read off a two-token prefill: KV layers grow per position, recurrent (GDN) layers
    hold a fixed state per row."""
    from mtplx.engine.prefill import prefill

    cache, mtp_cache = model.make_cache(), model.make_mtp_cache()
    prefill(model, [0, 0], cache, mtp_cache)
    per_position = per_row = 0
    for layer in list(cache) + list(mtp_cache or []):
        keys = getattr(layer, "keys", None)
        if keys is not None:
            per_position += (keys.nbytes + layer.values.nbytes) // keys.shape[2]
        else:
            per_row += sum(a.nbytes for a in (layer.state or []) if a is not None)
    return per_position, per_row


def row_need(job) -> int:
    """KV positions one row may hold: what its lane reserves for it (`row_positions`)."""
    from mtplx.engine.installed import row_positions

    return row_positions(len(job.prompt_ids), job.max_tokens)


class KVBudget:
    """Decode-state accounting for one model. `budget_bytes=None`: no limit. One row's cost is
    measured at the first admission (a prefill on the owner thread)."""

    def __init__(self, model, budget_bytes: Optional[int]):
        self.model = model
        self.budget_bytes = None if budget_bytes is None or model is None else int(budget_bytes)
        self.row_bytes: Optional[tuple] = None        # (bytes per KV position, fixed bytes per row)

    def lane_bytes(self, needs: list, widths: list) -> int:
        """A lane's decode state for rows of these needs: the narrowest of `widths` that holds
        them, every row's KV buffer as long as the longest (rounded to the buffer's growth step)."""
        from mtplx.models.cache import STEP

        if not needs or self.row_bytes is None:
            return 0
        widths = sorted(widths) or [1]
        width = next((w for w in widths if w >= len(needs)), widths[-1])
        per_position, per_row = self.row_bytes
        return width * (-(-max(needs) // STEP) * STEP * per_position + per_row)

    def held_bytes(self, lanes: Iterable[list], widths: list) -> int:
        """Every lane's decode state, each lane given as its rows' needs."""
        return sum(self.lane_bytes(needs, widths) for needs in lanes)

    def too_big(self, need: int, widths: list) -> Optional[str]:
        """Why a row of this need can never fit, even alone (None when it can)."""
        if self.budget_bytes is None:
            return None
        if self.row_bytes is None:
            self.row_bytes = row_state_bytes(self.model)
        alone = self.lane_bytes([need], widths)
        if alone <= self.budget_bytes:
            return None
        return (f"needs {alone / 2**30:.2f} GiB of decode state, more than the server's budget of "
                f"{self.budget_bytes / 2**30:.2f} GiB: lower max_tokens or shorten the prompt")

    def room(self, held: int) -> Optional[int]:
        """Bytes left beside `held` (None: no limit)."""
        return None if self.budget_bytes is None else self.budget_bytes - held
