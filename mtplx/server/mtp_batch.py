"""The seed's import path for the scheduler's public names (their homes: `mtplx.scheduler.service`,
`mtplx.scheduler.job`, `mtplx.api.rows`)."""

from mtplx.api.rows import mtp_batch_compatibility_key
from mtplx.scheduler.job import MTPBatchCancelled, MTPBatchJob, MTPBatchOwnerFinalizeError, MTPBatchServiceClosed
from mtplx.scheduler.service import MTPBatchGenerationService

__all__ = ["MTPBatchCancelled", "MTPBatchGenerationService", "MTPBatchJob", "MTPBatchOwnerFinalizeError",
           "MTPBatchServiceClosed", "mtp_batch_compatibility_key"]
