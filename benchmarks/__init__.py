"""Benchmarks (`mtplx bench ...`): the lane in process, the served app against `mlx_lm.server`
under load, the soak. The library never imports this package; the CLI reaches it lazily."""
