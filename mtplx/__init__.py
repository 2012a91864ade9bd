"""mtplx: batched multi-token-prediction speculative decoding for MLX models."""

from .runtime import load_fast_blas as _load_fast_blas

_load_fast_blas()  # must run before mlx.core is imported anywhere

from .runtime import runtime_info  # noqa: E402

__version__ = "0.1.0"


def load_model(path=None, **kwargs):
    """Load an HF-layout checkpoint directory, or a model `mtplx models add` installed, by name
    (None -> the shipped default model). See mtplx.models.loader and mtplx.models.registry."""
    from .models.loader import load_model as _load
    from .models.registry import check_installed

    return _load(None if path is None else check_installed(path), **kwargs)


__all__ = ["load_model", "runtime_info", "__version__"]
