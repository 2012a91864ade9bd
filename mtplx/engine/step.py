"""One lane step's per-row record: what its decisions read (primaries, targets, drafts, the
proposal) and what they leave (each row's kept positions, the drafts kept)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import numpy as np

from mtplx.engine.acceptor import DeviceVerdicts, Targets
from mtplx.engine.row import LaneRow, logprob_entry


@dataclass
class Step:
    """One step's per-row inputs and outputs, for the decisions that follow its verify."""
    active: np.ndarray                 # rows live in this step
    has_pending: np.ndarray            # rows whose primary was emitted last step
    greedy: bool                       # every live row greedy: targets are argmax ids, read on the device
    x0: mx.array                       # each row's primary token [W]
    x0_host: Optional[np.ndarray] = None
    drafting: Optional[np.ndarray] = None
    depth: int = 0                     # the verify's drafts a row (the lane's depth)
    row_depth: Optional[np.ndarray] = None   # drafts each row chained (<= depth; sampled rows: their own)
    targets: Optional[Targets] = None
    verdicts: Optional[DeviceVerdicts] = None     # sampled rows' chains judged on the device
    lp_host: Optional[np.ndarray] = None     # verify logits on the host, for log-probability entries
    d_host: Optional[np.ndarray] = None      # drafts [W, depth]
    proposal: object = None
    keep: Optional[np.ndarray] = None
    # sampled constrained rows: row b -> what its grammar allows at each verify position [0..its
    # depth] (after its primary and the drafts before that position, which its grammar speculates)
    allowed: Optional[dict] = None
    drafted: int = 0                   # rows that drafted, drafts they kept (the StepPolicy's acceptance)
    accepted: int = 0
    # a step launched before the host read the last one's verify (`ahead.commit_on_device`)
    ahead: bool = False
    # this step's commit made on the device when the next step launched ahead: each row's keep [W]
    device_keep: Optional[mx.array] = None

    def entry(self, row: LaneRow, b: int, j: int, token: int) -> Optional[tuple]:
        """Row b's log-probability entry for `token` at verify position j (None: not asked for)."""
        k = row.req.logprobs
        return None if k is None else logprob_entry(self.lp_host[b, j], token, k)

