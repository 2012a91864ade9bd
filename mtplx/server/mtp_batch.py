"""The seed's import path for the scheduler's public names (their home: `mtplx.scheduler`)."""

from mtplx.scheduler.service import (MTPBatchCancelled, MTPBatchGenerationService, MTPBatchJob,  # noqa: F401
                                     MTPBatchOwnerFinalizeError, MTPBatchServiceClosed,
                                     mtp_batch_compatibility_key)
