"""Benchmarks (`mtplx bench ...`): the lane in process, the served app against `mlx_lm.server`
under load, the soak. The library never imports this package: `mtplx bench` runs it as a program
(`python -m benchmarks`)."""

import mtplx  # noqa: F401,E402  (loads an optimized BLAS before any benchmark module imports mlx.core)
