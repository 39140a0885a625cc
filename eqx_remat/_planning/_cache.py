"""What the planner remembers between calls: one `PlanCache` (`CACHE`), which
`eqx_remat.clear_plan_cache` empties."""

import collections
from collections.abc import Callable
from typing import Any

import jax.tree_util as jtu
import numpy as np

from .._util import is_array_like


class PlanCache:
    """What [`eqx_remat.plan`][] remembers between calls: compiled programs,
    what tracing priced, the memory of compiled mixes and measured step
    times, each keyed by the function (its identity: functions need not be
    hashable), the shapes, dtypes and shardings of the arguments, and the
    target. Planning the same function for another budget compiles, traces
    and times only what is new. `eqx_remat.clear_plan_cache()` empties it
    (e.g. after the machine's load changed, to time afresh)."""

    def __init__(self, size: int = 512):
        self.size = size
        self._entries: collections.OrderedDict = collections.OrderedDict()

    def get(self, fn: Callable, key: Any, compute: Callable[[], Any]) -> Any:
        """`compute()`, or what it gave for `fn` and `key` before."""
        if key is None:
            return compute()
        hit = self._entries.get(key)
        if hit is not None and hit[0] is fn:  # holding `fn` keeps its id unique
            self._entries.move_to_end(key)
            return hit[1]
        value = compute()
        self.put(fn, key, value)
        return value

    def put(self, fn: Callable, key: Any, value: Any) -> None:
        """Remember `value` for `fn` and `key`, in place of what was there."""
        if key is not None:
            self._entries[key] = fn, value
            self._entries.move_to_end(key)
            if len(self._entries) > self.size:
                self._entries.popitem(last=False)

    def has(self, fn: Callable, key: Any) -> bool:
        hit = self._entries.get(key)
        return hit is not None and hit[0] is fn

    def clear(self) -> None:
        """Forget everything."""
        self._entries.clear()


CACHE = PlanCache()


def clear_plan_cache() -> None:
    """Empty what [`eqx_remat.plan`][] remembers between calls (compiled
    programs, prices, the memory of compiled mixes, measured step times), so
    that the next call compiles, traces and times afresh."""
    CACHE.clear()


def cache_key(fn: Callable, args: tuple, target: Any) -> Any:
    """The cache key of `fn(*args)` compiled for `target`, or `None` where the
    static arguments are not hashable."""
    leaves, treedef = jtu.tree_flatten(args)
    avals = []
    for x in leaves:
        if is_array_like(x):
            sharding = getattr(x, "sharding", None)
            avals.append(("array", np.shape(x), str(x.dtype), sharding))
        else:
            avals.append(("static", x))
    key = (id(fn), treedef, tuple(avals), target)
    try:
        hash(key)
    except TypeError:
        return None
    return key
