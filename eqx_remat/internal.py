"""Semi-public helpers, as in `equinox.internal`: used by the zoo and the
benchmarks, useful to others building on eqx_remat, but not part of its stable
API — they may change between versions without notice."""

from ._pallas import with_pallas_costs as with_pallas_costs


__all__ = ["with_pallas_costs"]
