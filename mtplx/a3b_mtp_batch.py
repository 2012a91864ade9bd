"""The seed's import path for the lane driver's public names (their home: `mtplx.engine`)."""

from mtplx.engine.lane import (A3BMTPBatchCapacityError, A3BMTPBatchRequest, A3BMTPBatchResult,  # noqa: F401
                               A3BMTPBatchStreamResult, InstalledA3BMTPBatchLane, LaneSelfCheckError,
                               RunningLane, generate_a3b_mtp_batch, install_a3b_mtp_batch_lane)
