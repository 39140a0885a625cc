import jax
import jax.numpy as jnp
import numpy as np


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


def count_primitive(jaxpr, name: str) -> int:
    """How many times primitive `name` runs, weighting scan bodies by their length.

    `cond` counts its most expensive branch.
    """
    total = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == name:
            total += 1
        mult = eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1
        subs = [
            v.jaxpr if hasattr(v, "jaxpr") else v
            for v in eqn.params.values()
            if hasattr(v, "eqns") or hasattr(v, "jaxpr")
        ]
        if eqn.primitive.name == "cond":
            branches = eqn.params["branches"]
            total += max(count_primitive(b.jaxpr, name) for b in branches)
            continue
        for sub in subs:
            total += mult * count_primitive(sub, name)
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
