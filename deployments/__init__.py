"""Ray Serve deployments of mtplx: the OpenAI ingress, the MTP replica and the app builder.

`serve run serve_configs/config.yaml` imports `deployments:build_app`. Nothing here imports MLX
at import time (the replica loads it in its own process).
"""

from .app import AppArgs, build_app

__all__ = ["AppArgs", "build_app"]
