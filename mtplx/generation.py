"""The seed's import path for single-request decoding (its home: `mtplx.engine.decode`)."""

from mtplx.engine.decode import GenerationResult, generate_ar, generate_mtpk
from mtplx.engine.prefill import CapacityError

__all__ = ["CapacityError", "GenerationResult", "generate_ar", "generate_mtpk"]
