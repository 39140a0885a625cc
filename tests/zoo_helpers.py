"""Test helpers for the zoo: a quick-compiling `filter_jit`."""

import functools

import equinox as eqx
import jax


# Compiled without LLVM's optimisations: about twice as fast on two cores, the
# same numerics to float rounding, and the same optimised HLO and memory. (Every
# process of a test run compiles so: tests/conftest.py sets them in XLA_FLAGS;
# here they hold wherever the wrapper is used.)
QUICK_COMPILE = {
    "xla_backend_optimization_level": 0,
    "xla_llvm_disable_expensive_passes": True,
}


def quick_jit(fn):
    """`eqx.filter_jit(fn)`, compiled with `QUICK_COMPILE`. Non-array arguments
    (including a model's static `checkpoint`) are static: each distinct value
    compiles once, and the cache is shared by every test that uses the wrapper."""

    @functools.partial(jax.jit, static_argnums=0, compiler_options=QUICK_COMPILE)
    def run(static, arrays):
        treedef, others = static
        it = iter(arrays)
        leaves = [next(it) if o is _ARRAY else o for o in others]
        args, kwargs = jax.tree.unflatten(treedef, leaves)
        return fn(*args, **kwargs)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        leaves, treedef = jax.tree.flatten((args, kwargs))
        arrays = [x for x in leaves if eqx.is_array(x)]
        others = tuple(_ARRAY if eqx.is_array(x) else x for x in leaves)
        return run((treedef, others), arrays)

    return wrapper


_ARRAY = object()


def build(cls, *args, key, **kwargs):
    """`cls(*args, key=key, **kwargs)`, initialised under one jit: a model of new
    shapes compiles once instead of op by op (5x faster for a tiny transformer).
    Non-array fields (`Dropout.p`, ...) stay Python values, as `eqx.filter_jit`
    keeps them."""
    statics = []

    @functools.partial(jax.jit, compiler_options=QUICK_COMPILE)
    def init(key):
        arrays, static = eqx.partition(cls(*args, key=key, **kwargs), eqx.is_array)
        statics.append(static)
        return arrays

    arrays = init(key)
    return eqx.combine(arrays, statics[0])
