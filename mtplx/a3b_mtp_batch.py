"""The seed's import path for the lane driver's public names (their home: `mtplx.engine`)."""

from mtplx.engine.cohort import generate_a3b_mtp_batch
from mtplx.engine.install import LaneSelfCheckError, install_a3b_mtp_batch_lane
from mtplx.engine.installed import InstalledA3BMTPBatchLane
from mtplx.engine.lane import RunningLane
from mtplx.engine.row import (A3BMTPBatchCapacityError, A3BMTPBatchRequest, A3BMTPBatchResult,
                              A3BMTPBatchStreamResult, RowEvent)

__all__ = ["A3BMTPBatchCapacityError", "A3BMTPBatchRequest", "A3BMTPBatchResult", "A3BMTPBatchStreamResult", "InstalledA3BMTPBatchLane", "LaneSelfCheckError", "RowEvent", "RunningLane", "generate_a3b_mtp_batch", "install_a3b_mtp_batch_lane"]
