import contextlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqx_remat._inspect._jaxpr import iter_eqns, open_jaxpr, sub_jaxprs


ROOT = Path(__file__).resolve().parents[1]


def run_script(
    script: str, *args: str, rc: int = 0, env: dict | None = None, timeout: int = 900
) -> subprocess.CompletedProcess:
    """`benchmarks/<script>` with `args`, run from the repository's root on the
    CPU (or with `env`), its exit code checked against `rc` (the output's tail
    said where it differs)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"} if env is None else env
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )
    assert proc.returncode == rc, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc


needs_libtpu = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason="needs libtpu (the `tpu` extra: pip install 'eqx-remat[tpu]') to "
    "compile for TPU v5e",
)


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


__all__ = ["temp_bytes", "count_primitive", "jnp"]


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


def check_close(actual, expected, *, rtol=1e-5, atol=1e-6):
    """Two pytrees of arrays: the same shapes and dtypes, values within
    `rtol`/`atol` leaf by leaf."""
    leaves = zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True)
    for a, b in leaves:
        assert a.dtype == b.dtype and a.shape == b.shape, (a, b)
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)


@contextlib.contextmanager
def jax_remat3(on: bool):
    """JAX's `jax_remat3` flag set to `on` inside the block, restored after."""
    before = jax.config.jax_remat3
    jax.config.update("jax_remat3", on)
    try:
        yield
    finally:
        jax.config.update("jax_remat3", before)
