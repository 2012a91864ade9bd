"""Ray Serve deployments of mtplx: the OpenAI ingress, the MTP replica and the app builder.

`serve run serve_configs/config.yaml` imports `deployments:build_app`. Nothing here imports MLX
at import time (the replica loads it in its own process), nor Ray until the builder is asked for:
`python -m deployments.scaleout` sets up Ray's environment before Ray is imported.
"""

__all__ = ["AppArgs", "build_app"]


def __getattr__(name: str):
    if name in __all__:
        from . import app

        return getattr(app, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
