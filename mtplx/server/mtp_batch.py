"""The seed's import path for the scheduler's public names (their home: `mtplx.scheduler.service`)."""

from mtplx.scheduler.service import (MTPBatchCancelled, MTPBatchGenerationService, MTPBatchJob,
                                     MTPBatchOwnerFinalizeError, MTPBatchServiceClosed,
                                     mtp_batch_compatibility_key)

__all__ = ["MTPBatchCancelled", "MTPBatchGenerationService", "MTPBatchJob", "MTPBatchOwnerFinalizeError",
           "MTPBatchServiceClosed", "mtp_batch_compatibility_key"]
