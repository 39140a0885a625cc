"""What a function saves for its backward pass."""

import re
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np

from .. import _jax_private
from .._util import format_bytes, traceable
from ._jaxpr import (
    KEEP_TAG,
    called_jaxpr,
    hi_operation,
    is_literal,
    open_jaxpr,
    producers,
    scan_sizes,
    tag_name,
)


class Residual(NamedTuple):
    """One value saved on the forward pass for the backward pass.

    **Attributes:**

    - `shape`: its shape. A value saved by each layer of a scan (a scanned
      stack of layers, a policy's residuals) is one array stacked over the
      layers: its shape starts with the number of layers.
    - `dtype`: its dtype.
    - `nbytes`: its size in bytes.
    - `source`: where it comes from, as JAX describes it (`"from the argument x"`,
      `"output of sin from file.py:12"`, `"named 'mlp_hidden' from ..."`), looking
      inside scans: a value stacked by a scan is described by the operation that
      computes it in one layer, followed by `"inside a scan over D layers"`.
    - `name`: its `checkpoint_name` tag (found inside scans too), or `None`.
    - `layers`: how many layers of scans it is stacked over (`D`; the product
      for nested scans), `1` for a value saved once. The value of one layer has
      shape `shape[-(len(shape) - k):]` for the `k` stacked axes; for a single
      scan, `shape[1:]`.
    """

    shape: tuple[int, ...]
    dtype: Any  # a NumPy dtype, or an extended one such as a PRNG key's
    nbytes: int
    source: str
    name: str | None
    layers: int = 1

    @property
    def layer_shape(self) -> tuple[int, ...]:
        """The shape of the value saved by one layer (`shape` without the
        stacked axes of the scans it is saved by)."""
        shape = list(self.shape)
        n = self.layers
        while n > 1 and shape and n % shape[0] == 0:
            n //= shape.pop(0)
        return tuple(shape)


def residuals(fn: Callable[..., Any], *args: Any) -> list[Residual]:
    """The values that `jax.vjp(fn, *args)` saves on the forward pass.

    Arguments may be any pytrees (Equinox modules included); their array leaves
    may be arrays or `jax.ShapeDtypeStruct`s, other leaves (Python numbers
    included) are static, as in `eqx.filter_jit` — the same arguments as
    [`eqx_remat.count_flops`][] and [`eqx_remat.memory_report`][]. Nothing is
    compiled or run: the function is traced.

    Values saved by every layer of a scan (the scanned stacks of
    [`eqx_remat.scan_layers`][] and the zoo) are one stacked array each; they are
    described from inside the scan, with their `checkpoint_name` tag and their
    number of layers.

    **Arguments:**

    - `fn`: the function to differentiate.
    - `*args`: its arguments.

    **Returns:**

    A list of [`eqx_remat.Residual`][], in JAX's order: literals, constants,
    arguments, then intermediates in the order they are computed.
    """
    f, dynamic = traceable(fn, args)
    leaves, in_tree = jax.tree.flatten(dynamic)

    def f_flat(*leaves):
        return f(jax.tree.unflatten(in_tree, leaves))

    closed, out_shape = jax.make_jaxpr(
        lambda *a: jax.vjp(f_flat, *a), return_shape=True
    )(*leaves)
    jaxpr = closed.jaxpr
    num_res = len(jax.tree.leaves(out_shape[1]))
    res_vars = jaxpr.outvars[len(jaxpr.outvars) - num_res :]
    paths = [
        "dynamic" + jax.tree_util.keystr(p)
        for p, _ in jax.tree_util.tree_flatten_with_path(dynamic)[0]
    ]
    return _describe_all(jaxpr, res_vars, paths)


def _describe_all(jaxpr, res_vars, arg_names) -> list[Residual]:
    producer = producers(jaxpr)
    # Look through reduce_precision (JAX inserts it on residuals), as JAX does.
    resolved = []
    for v in res_vars:
        while not is_literal(v) and v in producer:
            e = producer[v]
            if e.primitive.name != "reduce_precision":
                break
            v = e.invars[0]
        resolved.append(v)
    out = [
        _residual(v.aval, "from a literal", None, 1) for v in resolved if is_literal(v)
    ]
    variables = {v for v in resolved if not is_literal(v)}
    for v in jaxpr.constvars:
        if v in variables:
            out.append(_residual(v.aval, "from a constant", None, 1))
    for v, name in zip(jaxpr.invars, arg_names):
        if v in variables:
            out.append(_residual(v.aval, f"from the argument {name}", None, 1))
    for e in jaxpr.eqns:
        for v in e.outvars:
            if v in variables:
                source, name, layers = _describe(jaxpr, v, producer)
                source += _range(e, v)
                out.append(_residual(v.aval, source, name, layers))
    return out


# The name scope `eqx_remat.ranges` puts each range's operations in.
_RANGE_SCOPE = re.compile(r"ranges\[\d+\] \(layers \d+\.\.\d+: [^/]*\)")


def _range(eqn, v) -> str:
    """`", in ranges[k] (layers a..b: checkpoint)"` for a value `v` computed by
    `eqn` in a range of an [`eqx_remat.ranges`][] checkpoint (`", the output of
    ranges[k] ..."` for the carry that leaves the range), else `""`."""
    stack = str(getattr(eqn.source_info, "name_stack", ""))
    found = _RANGE_SCOPE.findall(stack)
    if not found:
        return ""
    carry = eqn.primitive.name == "scan" and (eqn.outvars.index(v) < scan_sizes(eqn)[1])
    return f", {'the output of' if carry else 'in'} {found[-1]}"


def _residual(aval, source, name, layers) -> Residual:
    dtype = aval.dtype  # not np.dtype(...): PRNG keys have extended dtypes
    shape = tuple(aval.shape)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    return Residual(shape, dtype, nbytes, source, name, layers)


def _where(eqn) -> str:
    where = _jax_private.summarize_source(eqn.source_info)
    return where or "an unknown location"


def _describe(jaxpr, v, producer) -> tuple[str, str | None, int]:
    """`(source, tag, layers)` of variable `v` of `jaxpr`, looking into scans."""
    e = producer.get(v)
    if e is None:
        return "from an input", None, 1
    prim = e.primitive.name
    if prim == "reduce_precision" and not is_literal(e.invars[0]):
        inner = e.invars[0]
        if inner in producer:
            return _describe(jaxpr, inner, producer)
    tag = tag_name(e)  # a `name` equation, or remat3's tag
    if tag is not None:
        inner = e.invars[0]
        if tag == KEEP_TAG and not is_literal(inner) and inner in producer:
            return _describe(jaxpr, inner, producer)
        return f"named '{tag}' from {_where(e)}", tag, 1
    if prim == "scan":
        k = e.outvars.index(v)
        body = open_jaxpr(e.params["jaxpr"])
        num_consts, num_carry = scan_sizes(e)
        if k >= num_carry:
            inner = body.outvars[k]
            length = e.params["length"]
            inner_producer = producers(body)
            scan = f"inside a scan over {length} layers"
            if not is_literal(inner) and inner in inner_producer:
                source, tag, layers = _describe(body, inner, inner_producer)
                return f"{source}, {scan}", tag, layers * length
            if is_literal(inner):  # a scalar the layer's vjp keeps
                value = np.asarray(inner.val).item()
                return f"the constant {value!r} of each layer, {scan}", None, length
            if inner in body.invars:
                i = body.invars.index(inner) - num_consts
                what = "the carry" if i < num_carry else "a per-layer input"
                return f"{what} (each layer's input), {scan}", None, length
    if prim == "jit":
        return (
            f"output of jitted function '{e.params['name']}' from {_where(e)}",
            None,
            1,
        )
    called = called_jaxpr(e)
    if called is not None:
        # A call that runs its body once (the `jax.checkpoint` of a name
        # policy, remat3's too, a `closed_call`): describe the value where the
        # body makes it.
        body = open_jaxpr(called)
        inner = body.outvars[e.outvars.index(v)]
        inner_producer = producers(body)
        if not is_literal(inner) and inner in inner_producer:
            return _describe(body, inner, inner_producer)
        if inner in body.invars:
            outer = e.invars[body.invars.index(inner)]
            if not is_literal(outer) and outer in producer:
                return _describe(jaxpr, outer, producer)
    hi = hi_operation(e)  # a higher-order operation of JAX's: by its name
    what = prim if hi is None else type(hi).__name__
    return f"output of {what} from {_where(e)}", None, 1


def print_residuals(fn: Callable[..., Any], *args: Any) -> None:
    """Print what `jax.vjp(fn, *args)` saves: one line per residual (shape,
    dtype, size, source) and the total. A value saved by each layer of a scan
    is printed with its per-layer shape and its number of layers, e.g.
    `float32[6,24] × 2 layers  1.1 KiB  named 'qkv_proj' from ...`.

    **Arguments:** as [`eqx_remat.residuals`][].
    """
    res = residuals(fn, *args)
    for r in res:
        if r.layers > 1:
            shape = ",".join(map(str, r.layer_shape))
            what = f"{r.dtype.name}[{shape}] × {r.layers} layers"
        else:
            what = f"{r.dtype.name}[{','.join(map(str, r.shape))}]"
        print(f"{what}  {format_bytes(r.nbytes, digits=1)}  {r.source}")
    total = sum(r.nbytes for r in res)
    print(f"{len(res)} residuals, {format_bytes(total, digits=1)} in total")
