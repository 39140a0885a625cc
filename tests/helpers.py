import jax
import jax.numpy as jnp
import numpy as np

from eqx_remat._jaxpr import iter_eqns, open_jaxpr, sub_jaxprs


def tree_allclose(x, y, *, rtol=1e-5, atol=1e-6) -> bool:
    """Whether two pytrees have the same structure and allclose array leaves."""
    if jax.tree.structure(x) != jax.tree.structure(y):
        return False
    for a, b in zip(jax.tree.leaves(x), jax.tree.leaves(y)):
        a, b = np.asarray(a), np.asarray(b)
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        if not np.allclose(a, b, rtol=rtol, atol=atol):
            return False
    return True


def temp_bytes(fn, *args) -> int:
    """Compiled temp memory of `jax.jit(fn)(*args)`."""
    compiled = jax.jit(fn).lower(*args).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def count_primitive(jaxpr, name: str, *, weighted: bool = True) -> int:
    """How many times primitive `name` runs, weighting scan bodies by their length
    (`cond` counts its most expensive branch); with `weighted=False`, how many
    times it occurs in the program text (every branch, loop bodies once)."""
    if not weighted:
        return sum(e.primitive.name == name for e in iter_eqns(jaxpr))
    total = 0
    for eqn in jaxpr.eqns:
        total += eqn.primitive.name == name
        subs = [count_primitive(open_jaxpr(s), name) for s in sub_jaxprs(eqn)]
        if eqn.primitive.name == "cond":
            total += max(subs)
        else:
            mult = eqn.params["length"] if eqn.primitive.name == "scan" else 1
            total += mult * sum(subs)
    return total


__all__ = ["tree_allclose", "temp_bytes", "count_primitive", "jnp"]


def raises_bad_input(match: str, *, param: str):
    """`pytest.raises` for invalid arguments: eqx_remat's own `ValueError` matching
    `match`, or — where pytest's jaxtyping hook checks the annotation first — a
    type-check error naming the parameter `param`."""
    import pytest
    from jaxtyping import TypeCheckError

    return pytest.raises(
        (ValueError, TypeCheckError),
        match=f"(?s){match}|typechecking parameter '{param}'",
    )
