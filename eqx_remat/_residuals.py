"""What a function saves for its backward pass."""

import re
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import numpy as np

# Public `jax.ad_checkpoint` exports only the printing variant.
from jax._src.ad_checkpoint import saved_residuals as _saved_residuals


class Residual(NamedTuple):
    """One value saved on the forward pass for the backward pass.

    **Attributes:**

    - `shape`: its shape.
    - `dtype`: its dtype.
    - `nbytes`: its size in bytes.
    - `source`: where it comes from, as JAX describes it (`"from the argument x"`,
      `"output of sin from file.py:12"`, `"named 'mlp_hidden' from ..."`).
    - `name`: its `checkpoint_name` tag, or `None`.
    """

    shape: tuple[int, ...]
    dtype: Any  # a NumPy dtype, or an extended one such as a PRNG key's
    nbytes: int
    source: str
    name: str | None


_NAMED = re.compile(r"^named '([^']*)'")


def residuals(fn: Callable[..., Any], *args: Any) -> list[Residual]:
    """The values that `jax.vjp(fn, *args)` saves on the forward pass.

    Arguments may be any pytrees (Equinox modules included); their non-array parts
    are treated as static. Nothing is compiled or run: the function is traced.

    **Arguments:**

    - `fn`: the function to differentiate.
    - `*args`: its arguments (arrays or `jax.ShapeDtypeStruct`s as leaves).

    **Returns:**

    A list of [`eqx_remat.Residual`][], in JAX's order: literals, constants,
    arguments, then intermediates in the order they are computed.
    """
    dynamic, static = eqx.partition(args, eqx.is_array)

    def f(dynamic):
        return fn(*eqx.combine(dynamic, static))

    dynamic = jax.tree.map(
        lambda x: (
            jax.ShapeDtypeStruct(x.shape, x.dtype)
            if isinstance(x, jax.ShapeDtypeStruct)
            else x
        ),
        dynamic,
    )
    out = []
    for aval, source in _saved_residuals(f, dynamic):
        dtype = aval.dtype  # not np.dtype(...): PRNG keys have extended dtypes
        shape = tuple(aval.shape)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        match = _NAMED.match(source)
        out.append(Residual(shape, dtype, nbytes, source, match and match.group(1)))
    return out


def print_residuals(fn: Callable[..., Any], *args: Any) -> None:
    """Print what `jax.vjp(fn, *args)` saves: one line per residual (shape, dtype,
    size, source) and the total.

    **Arguments:** as [`eqx_remat.residuals`][].
    """
    res = residuals(fn, *args)
    for r in res:
        shape = ",".join(map(str, r.shape))
        print(f"{r.dtype.name}[{shape}]  {_fmt_bytes(r.nbytes)}  {r.source}")
    total = sum(r.nbytes for r in res)
    print(f"{len(res)} residuals, {_fmt_bytes(total)} in total")


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError
