"""The benchmark scripts (`python benchmarks/run.py` or `python -m benchmarks.run`)
and what they share. Not part of the `eqx_remat` API: they use `eqx_remat` and
`zoo` through their public names only."""
