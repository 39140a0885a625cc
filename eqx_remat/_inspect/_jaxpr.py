# pyright: reportPrivateImportUsage=false
# jax 0.12 merged `ClosedJaxpr` into `Jaxpr` (a `Jaxpr` carries its constants and
# its `.jaxpr` is itself); `jax.extend.core` keeps `ClosedJaxpr` as an alias
# (`Jaxpr as ClosedJaxpr`) that pyright does not count as exported. A line's
# `# pyright: ignore` would be unnecessary, and so an error, with jax 0.10.2.
"""One toolkit for reading, evaluating and rewriting jaxprs.

Every analysis in eqx_remat (`count_flops`, `residuals`, the exact
`save_all_but_names`) and the Pallas cost hook walk jaxprs with these helpers,
so that there is one way to tell a literal, one way to find the jaxprs an
equation holds (loop bodies, `cond` branches, calls, custom derivatives,
`shard_map`, Pallas kernels) and one evaluator.
"""

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Literal, Var
from typing_extensions import TypeIs

from .. import _jax_private


# An open or a closed jaxpr: what a jaxpr-valued parameter or a trace holds.
AnyJaxpr = Jaxpr | ClosedJaxpr

# Primitives that call one jaxpr once, and the parameter that holds it.
CALLS: Mapping[str, str] = {
    "jit": "jaxpr",
    "pjit": "jaxpr",
    "closed_call": "call_jaxpr",
    # jax 0.11's `closed_call` (jax/_src/core.py: `closed_call_p = eval_jaxpr_p`).
    "eval_jaxpr": "call_jaxpr",
    "core_call": "call_jaxpr",
    "remat2": "jaxpr",
    "checkpoint": "jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr",
    "custom_vmap_call": "call",
    "linear_call": "callee",
}

# JAX's higher-order primitives (`call_hi_primitive`, whose parameter `_prim`
# is the operation, an object with its own `params`) that call one jaxpr once,
# by the operation's class, and the parameter of the operation that holds it:
# under JAX's remat3 (`jax_remat3=True`), a `jax.checkpoint` is a `RematTraced`
# (in a backward pass too, where it recomputes what its policy did not save).
HI_CALLS: Mapping[str, str] = {"RematTraced": "jaxpr"}

# The calls that only call: evaluating the jaxpr they hold is the same as binding
# them (no checkpointing, custom derivative or batching rule is lost).
PLAIN_CALLS = frozenset({"jit", "pjit", "closed_call", "eval_jaxpr", "core_call"})


def is_literal(v: Any) -> TypeIs[Literal]:
    """Whether an equation's input (or a jaxpr's output) is a literal constant
    (whose value is `v.val`) rather than a variable."""
    return isinstance(v, Literal)


def open_jaxpr(j: AnyJaxpr) -> Jaxpr:
    """The open jaxpr of a `Jaxpr` or `ClosedJaxpr`."""
    return j.jaxpr if isinstance(j, ClosedJaxpr) else j


def jaxpr_and_consts(j: AnyJaxpr) -> tuple[Jaxpr, Sequence[Any]]:
    """`(jaxpr, consts)` of a `Jaxpr` (no constants) or `ClosedJaxpr`."""
    return (j.jaxpr, j.consts) if isinstance(j, ClosedJaxpr) else (j, ())


def _is_jaxpr(x: Any) -> bool:
    return isinstance(x, AnyJaxpr)


def sub_jaxprs(eqn: JaxprEqn) -> list[AnyJaxpr]:
    """Every jaxpr an equation holds in its parameters, as it holds it (`Jaxpr`
    or `ClosedJaxpr`): the body of a `scan`, the body and condition of a
    `while`, the branches of a `cond`, the callee of `jit`, `jax.checkpoint`
    (remat3's too, held by its operation: `hi_operation`), `custom_jvp` /
    `custom_vjp` / `custom_vmap` calls, the body of `shard_map`, the kernel of
    a `pallas_call`..."""
    out = []
    hi = hi_operation(eqn)
    params = eqn.params if hi is None else getattr(hi, "params", {})
    for value in params.values():
        for sub in value if isinstance(value, tuple | list) else (value,):
            if _is_jaxpr(sub):
                out.append(sub)
    return out


def hi_operation(eqn: JaxprEqn) -> Any:
    """The operation of a `call_hi_primitive` equation (JAX's higher-order
    primitives: remat3's checkpoint and `checkpoint_name`, ...), an object
    with `params` of its own; `None` for other equations."""
    if eqn.primitive.name != "call_hi_primitive":
        return None
    return eqn.params.get("_prim")


def called_jaxpr(eqn: JaxprEqn) -> AnyJaxpr | None:
    """The jaxpr that a call (a primitive of `CALLS`, or an operation of
    `HI_CALLS`) calls once, with the equation's inputs; `None` for other
    equations."""
    hi = hi_operation(eqn)
    if hi is not None:
        param = HI_CALLS.get(type(hi).__name__)
        return None if param is None else getattr(hi, "params", {}).get(param)
    param = CALLS.get(eqn.primitive.name)
    return None if param is None else eqn.params.get(param)


def scan_sizes(eqn: JaxprEqn) -> tuple[int, int]:
    """`(consts, carry)`: how many of a `scan` equation's inputs are constants
    and how many carries (its body reads `[*consts, *carry, *xs]` and writes
    `[*carry, *ys]`). jax < 0.11 gives them as the parameters `num_consts` and
    `num_carry`; jax 0.11 packs the inputs' structure into `ft_in`."""
    p = eqn.params
    if "num_consts" in p:
        return p["num_consts"], p["num_carry"]
    consts, carry, _ = p["ft_in"].unpack()
    return len(consts), len(carry)


def producers(jaxpr: Jaxpr) -> dict[Var, JaxprEqn]:
    """`{variable: the equation of jaxpr that computes it}`."""
    return {v: e for e in jaxpr.eqns for v in e.outvars}


def users(jaxpr: Jaxpr) -> dict[Var, list[JaxprEqn]]:
    """`{variable: the equations of jaxpr that read it}`, in order."""
    out: dict[Var, list[JaxprEqn]] = {}
    for e in jaxpr.eqns:
        for v in e.invars:
            if not is_literal(v):
                out.setdefault(v, []).append(e)
    return out


def varying(jaxpr: Jaxpr, inputs: Sequence[bool]) -> list[bool]:
    """For each output of `jaxpr`, whether it depends on one of the inputs
    marked in `inputs`, looking into the calls it makes (`jnp.where` is one);
    any other equation with such an input is taken to vary in every output."""
    out = {v for v, f in zip(jaxpr.invars, inputs) if f}
    for eqn in jaxpr.eqns:
        ins = [not is_literal(v) and v in out for v in eqn.invars]
        if not any(ins):
            continue
        sub = called_jaxpr(eqn)
        if sub is not None and len(open_jaxpr(sub).invars) == len(ins):
            outs = varying(open_jaxpr(sub), ins)
        else:
            outs = [True] * len(eqn.outvars)
        out.update(v for v, f in zip(eqn.outvars, outs) if f)
    return [not is_literal(v) and v in out for v in jaxpr.outvars]


def map_eqns(jaxpr: Jaxpr, fn: Callable[[JaxprEqn], JaxprEqn]) -> Jaxpr:
    """`jaxpr` with `fn` applied to each equation, in the jaxprs it holds too
    (inner equations first: `fn` sees an equation whose sub-jaxprs are already
    rewritten). Parts where `fn` changes nothing are returned as they are, so
    `map_eqns(jaxpr, lambda e: e) is jaxpr`."""
    eqns = [fn(_map_sub_jaxprs(e, fn)) for e in jaxpr.eqns]
    if all(new is old for new, old in zip(eqns, jaxpr.eqns)):
        return jaxpr
    return jaxpr.replace(eqns=eqns)


def _map_sub_jaxprs(eqn: JaxprEqn, fn: Callable[[JaxprEqn], JaxprEqn]) -> JaxprEqn:
    def rewrite(x: Any) -> Any:
        if isinstance(x, ClosedJaxpr):
            inner = map_eqns(x.jaxpr, fn)
            return x if inner is x.jaxpr else x.replace(jaxpr=inner)
        if isinstance(x, Jaxpr):
            return map_eqns(x, fn)
        return x

    params = {}
    for name, value in eqn.params.items():
        if isinstance(value, tuple | list) and any(map(_is_jaxpr, value)):
            new = type(value)(map(rewrite, value))
            changed = any(a is not b for a, b in zip(new, value))
            params[name] = new if changed else value
        else:
            params[name] = rewrite(value)
    if all(params[k] is v for k, v in eqn.params.items()):
        return eqn
    return eqn.replace(params=params)


def eval_jaxpr(
    jaxpr: Jaxpr,
    consts: Sequence[Any],
    args: Sequence[Any],
    *,
    inline: bool = False,
    outputs: Callable[[JaxprEqn, list], list] | None = None,
) -> list:
    """Evaluate `jaxpr` on `args` (values or tracers), binding each equation
    again at its original source location (so errors and profiles still point
    at the user's code).

    **Arguments:**

    - `jaxpr`, `consts`: the jaxpr and the values of its constants.
    - `args`: the values of its inputs.
    - `inline`: evaluate the jaxprs of plain calls (`PLAIN_CALLS`: `jax.jit`)
      in place instead of binding the call, so that what is traced sees through
      them.
    - `outputs`: `outputs(eqn, outs)` may replace the outputs of each bound
      equation (e.g. to tag them).

    **Returns:**

    The values of the jaxpr's outputs, as a list.
    """
    env: dict = {}

    def read(v):
        return v.val if is_literal(v) else env[v]

    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        sub = called_jaxpr(eqn)
        if inline and eqn.primitive.name in PLAIN_CALLS and sub is not None:
            sub_jaxpr, sub_consts = jaxpr_and_consts(sub)
            outs = eval_jaxpr(
                sub_jaxpr, sub_consts, invals, inline=True, outputs=outputs
            )
        else:
            outs = bind(eqn, invals)
            if outputs is not None:
                outs = outputs(eqn, outs)
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


def bind(eqn: JaxprEqn, invals: Sequence[Any]) -> list:
    """Bind `eqn`'s primitive to `invals` with its parameters, at its source
    location and in its context; its outputs as a list.

    A `checkpoint_name` tag is bound again with `checkpoint_name`, so it takes
    the form of the checkpoint in force where it is evaluated (JAX's remat3
    tag under `jax_remat3=True`, the tag before it otherwise), whichever form
    it was traced in: the exact `save_all_but_names` checkpoints a layer with
    remat3 off, that the engine may have traced with it on."""
    name = _user_tag(eqn)
    if name is not None:
        with _user_context(eqn):
            return [checkpoint_name(invals[0], name)]
    params = eqn.primitive.get_bind_params(eqn.params)
    invals = list(invals)
    if isinstance(params, tuple):  # older jax: (subfuns, params)
        subfuns, params = params
        invals = [*subfuns, *invals]
    ctx = getattr(getattr(eqn, "ctx", None), "manager", None)
    with _user_context(eqn), ctx or contextlib.nullcontext():
        outs = eqn.primitive.bind(*invals, **params)
    return list(outs) if eqn.primitive.multiple_results else [outs]


def _user_context(eqn: JaxprEqn):
    """Bind an equation re-evaluated from a jaxpr at its original source location."""
    return _jax_private.source_context(eqn.source_info)


def trace(fn: Callable[..., Any], *args: Any) -> tuple[ClosedJaxpr, list, Any]:
    """`(closed_jaxpr, flat_args, out_tree)` of `fn(*args)`, `args` pytrees of
    arrays: the jaxpr takes the flattened leaves of `args`, and its outputs
    unflatten with `out_tree` (a `jax.tree_util.PyTreeDef`, which jax defines as
    a variable and so cannot be named in an annotation)."""
    flat, in_tree = jax.tree.flatten(args)
    closed, out_shape = jax.make_jaxpr(
        lambda *f: fn(*jax.tree.unflatten(in_tree, f)), return_shape=True
    )(*flat)
    return closed, flat, jax.tree.structure(out_shape)


def iter_eqns(jaxpr: Jaxpr) -> Iterator[JaxprEqn]:
    """Every equation of `jaxpr` and of the jaxprs it holds, depth first."""
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in sub_jaxprs(eqn):
            yield from iter_eqns(open_jaxpr(sub))


# The tag that the exact `save_all_but_names` (eqx_remat/_policies/_exclude.py)
# gives values that must stay saved: not a tag of the user's, so
# `checkpoint_names` leaves it out and `residuals` looks through it.
KEEP_TAG = "__eqx_remat_keep__"


def is_tag(prim: Any, params: Mapping[str, Any]) -> bool:
    """Whether primitive `prim`, bound with `params`, is a `checkpoint_name` tag."""
    # `checkpoint_name(x, name)` binds the primitive "name" with a `name` parameter.
    return getattr(prim, "name", None) == "name" and "name" in params


def checkpoint_names(jaxpr: Jaxpr) -> list[str]:
    """The `checkpoint_name` tags of `jaxpr` and of the jaxprs it holds (loop
    bodies, `cond`/`switch` branches, calls, custom derivatives...), each once,
    in the order met (depth first)."""
    found: dict[str, None] = {}
    for e in iter_eqns(jaxpr):
        name = tag_name(e)
        if name is not None and name != KEEP_TAG:
            found.setdefault(name, None)
    return list(found)


def _user_tag(eqn: JaxprEqn) -> str | None:
    """The name of `eqn` if it is a `checkpoint_name(x, name)` tag in either
    form (not remat3's `CheckpointNameFwd`, which its backward pass binds),
    else `None`."""
    if is_tag(eqn.primitive, eqn.params):
        return eqn.params["name"]
    hi = hi_operation(eqn)
    if type(hi).__name__ == "CheckpointName":
        return getattr(hi, "params", {}).get("name")
    return None


def tag_name(eqn: JaxprEqn) -> str | None:
    """The name of `eqn` if it is a `checkpoint_name` tag, else `None`. Under
    JAX's remat3 (`jax_remat3=True`) a tag is a higher-order
    primitive, `call_hi_primitive`, holding a `CheckpointName` (in a backward
    pass, jax 0.12, also a `CheckpointNameFwd`) with the name in its `params`:
    that form is recognised too."""
    if is_tag(eqn.primitive, eqn.params):
        return eqn.params["name"]
    hi = hi_operation(eqn)
    if type(hi).__name__ in ("CheckpointName", "CheckpointNameFwd"):
        return getattr(hi, "params", {}).get("name")
    return None


def _nbytes(aval) -> int:
    return int(np.prod(aval.shape, dtype=np.int64)) * aval.dtype.itemsize


def on_host(aval: Any) -> bool:
    """Whether a value of abstract value `aval` lives in host memory
    (`f32<host>[...]`: an offloading policy's residual)."""
    return getattr(getattr(aval, "memory_space", None), "name", None) == "Host"


def saved_across(
    jaxpr, depths: frozenset[int] | None, *, per_trip: bool = False
) -> tuple[int, int]:
    """`(device_bytes, host_bytes)` that `jaxpr` keeps across its stacks: the
    values stacked by one scan over a stack (length in `depths`; `None`: any
    scan) and read by another, at every level of sub-jaxprs, once (the
    memory); with `per_trip`, once per trip of a loop around them (what is
    written and read: `accumulate`'s `k` micro-batches save theirs `k` times)."""

    def over_a_stack(e) -> bool:
        return e.primitive.name == "scan" and (
            depths is None or e.params["length"] in depths
        )

    device = host = 0
    scans = [e for e in jaxpr.eqns if over_a_stack(e)]
    stacked = {v: e for e in scans for v in e.outvars[scan_sizes(e)[1] :]}
    seen = set()
    for e in jaxpr.eqns:
        if over_a_stack(e):
            for v in e.invars:
                if is_literal(v) or stacked.get(v, e) is e or v in seen:
                    continue
                seen.add(v)
                if on_host(v.aval):
                    host += _nbytes(v.aval)
                else:
                    device += _nbytes(v.aval)
        trips = e.params["length"] if per_trip and e.primitive.name == "scan" else 1
        for sub in sub_jaxprs(e):
            d, h = saved_across(open_jaxpr(sub), depths, per_trip=per_trip)
            device, host = device + trips * d, host + trips * h
    return device, host
