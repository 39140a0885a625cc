"""`save_all_but_names`, made exact: the jaxpr rewrite that recomputes the excluded
values with the operations that produced them, instead of saving those."""

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from .. import _jax_private
from .._inspect._jaxpr import (
    KEEP_TAG,
    checkpoint_names,
    eval_jaxpr,
    is_literal,
    is_tag,
    producers,
    trace,
    users,
)
from ._values import check_tags, save_all_but_names


# Operations that only move, reshape or cast their input: a value computed by one
# of them from an excluded value is excluded too (recomputed from it, not saved).
_VIEWS = frozenset(
    {
        "reshape",
        "squeeze",
        "expand_dims",
        "broadcast_in_dim",
        "transpose",
        "convert_element_type",
        "reduce_precision",
        "slice",
        "split",
        "rev",
        "copy",
        "copy_p",
    }
)
# Operations whose backward pass needs none of their inputs (linear ones, and those
# whose derivative is computed from their output): an input computed only to feed
# one of them, when its output is excluded, is not saved under `"everything"`
# either, and is recomputed with it.
_UPSTREAM = _VIEWS | frozenset(
    {"add", "add_any", "sub", "neg", "concatenate", "pad", "reduce_sum"}
    | {"tanh", "exp", "logistic", "sqrt"}
)


class ExcludeProducers:
    """`jax.checkpoint(fn)` with a `save_all_but_names` policy that recomputes the
    excluded values instead of saving them.

    A JAX policy sees one operation at a time (its primitive, input shapes and
    parameters), and a `checkpoint_name` tag is an identity: refusing to save
    the tag's output saves the identical output of the operation that produced
    it. So `fn` is traced once (calls to `jax.jit`-ed functions inlined), and the
    *excluded region* is found on its jaxpr:

    - the tagged values and their producers;
    - reshapes, slices, transposes and dtype casts of them (a split `qkv`
      projection's `q`, `k`, `v`);
    - upstream, inputs of a region operation whose backward pass needs none of
      its inputs (an add, a broadcast, a reshape, a `tanh`...) when nothing
      outside the region uses them (the matmul output before a bias add).

    So the values saved instead are those the backward pass needs anyway (the
    inputs of the matmul that produced the tag), and excluding a value that is
    saved under `"everything"` saves strictly less.

    The policy recomputes every operation with the signature of a region
    operation. An operation outside the region with such a signature has its
    output tagged `KEEP_TAG`, which the policy saves, so it stays saved: the jaxpr
    is evaluated again, with those tags inserted, inside `jax.checkpoint`.
    Signatures match input shapes as suffixes, so leading axes added by
    `jax.vmap` still match.

    Under JAX's remat3 (`jax_remat3=True`) too, this checkpoint is JAX's
    previous one (traced with remat3 off): remat3 saves only the outputs of
    the operations it has a rule for (matrix products, tags) and recomputes
    every other, whatever the policy says, so "everything but" cannot be said
    to it. Its tags too: a layer traced with remat3 on (as the engine traces
    each stack's layer) has them bound again as this checkpoint's (see
    `eval_jaxpr`). The gradients and the values saved are the same as without
    remat3.
    """

    def __init__(
        self, fn: Callable, pol: save_all_but_names, *, prevent_cse: bool = False
    ):
        self.fn = fn
        self.pol = pol
        self.prevent_cse = prevent_cse

    def __call__(self, *args):
        with _jax_private.remat3_set(False):
            return self._checkpointed(*args)

    def _checkpointed(self, *args):
        closed, flat, out_tree = trace(self.fn, *args)
        check_tags(self.pol, checkpoint_names(closed.jaxpr))
        # Inline calls to jitted functions, so the region can follow values
        # through them.
        flat_closed = jax.make_jaxpr(
            lambda *f: eval_jaxpr(closed.jaxpr, closed.consts, f, inline=True)
        )(*flat)
        jaxpr, consts = flat_closed.jaxpr, flat_closed.consts
        # What the policy sees is the JVP of the layer: its primal operations,
        # and those the derivative rules add (`1 - tanh(x)**2`, `3 * x**2`...).
        # Values those add from excluded values are excluded too.
        diff = [jnp.issubdtype(jnp.result_type(x), jnp.inexact) for x in flat]

        def primal(*d):
            it = iter(d)
            f = [next(it) if m else x for m, x in zip(diff, flat)]
            return eval_jaxpr(jaxpr, consts, f)

        def inlined_jvp(d, t):
            c = jax.make_jaxpr(lambda d, t: jax.jvp(primal, d, t))(d, t)
            return eval_jaxpr(c.jaxpr, c.consts, d + t, inline=True)

        d = [x for m, x in zip(diff, flat) if m]
        jvp = jax.make_jaxpr(inlined_jvp)(d, d).jaxpr
        tangent = set(jvp.invars[len(d) :])
        for e in jvp.eqns:
            if any(not is_literal(v) and v in tangent for v in e.invars):
                tangent.update(e.outvars)
        jvp_region = _region(jvp, self.pol.names, tangent)
        producer_signatures = frozenset(
            _signature(e)
            for e in jvp.eqns
            if e.primitive.name != "name" and any(v in jvp_region for v in e.outvars)
        )
        region = _region(jaxpr, self.pol.names, set())
        keep = frozenset(
            id(e)
            for e in jaxpr.eqns
            if e.primitive.name != "name"
            and not any(v in region for v in e.outvars)
            and _matches(_signature(e), producer_signatures)
        )
        pol = _ResolvedSaveAllBut(self.pol.names, producer_signatures)

        def tag_kept(eqn, outs):
            if id(eqn) in keep:
                return [checkpoint_name(o, KEEP_TAG) for o in outs]
            return outs

        def run(*f):
            outs = eval_jaxpr(jaxpr, consts, f, outputs=tag_kept)
            return jax.tree.unflatten(out_tree, outs)

        return jax.checkpoint(run, policy=pol, prevent_cse=self.prevent_cse)(*flat)


def _region(jaxpr, names, tangent: set) -> set:
    """The variables of `jaxpr` not to save: see `ExcludeProducers`. In a JVP
    jaxpr, `tangent` holds the variables that depend on the tangents: values
    computed from excluded ones only for them (derivative coefficients) are
    excluded too."""
    producer = producers(jaxpr)
    readers = users(jaxpr)
    outputs = {v for v in jaxpr.outvars if not is_literal(v)}
    region: set = set()
    # The primal values the primal outputs depend on; in a JVP jaxpr, the other
    # primal values are derivative coefficients.
    needed = {v for v in outputs if v not in tangent}
    for e in reversed(jaxpr.eqns):
        if any(v in needed for v in e.outvars) and not any(
            v in tangent for v in e.outvars
        ):
            needed.update(v for v in e.invars if not is_literal(v))

    def excluded(v) -> bool:
        return not is_literal(v) and v in region

    for e in jaxpr.eqns:
        if e.primitive.name == "name" and e.params.get("name") in names:
            region.update(e.outvars)
            if e.invars[0] in producer:
                region.add(e.invars[0])
    changed = True
    while changed:
        changed = False
        for e in jaxpr.eqns:
            name = e.primitive.name
            if any(v in tangent for v in e.outvars):
                continue
            # Downstream: views and casts of an excluded value, and coefficients
            # of the derivative computed from one.
            if (
                (name in _VIEWS and e.invars and excluded(e.invars[0]))
                or (
                    tangent
                    and any(excluded(v) for v in e.invars)
                    and not any(v in needed for v in e.outvars)
                )
            ) and not all(v in region for v in e.outvars):
                region.update(e.outvars)
                changed = True
            # Upstream: inputs that exist only to feed a region operation whose
            # backward pass does not need them.
            if name in _UPSTREAM and any(v in region for v in e.outvars):
                for u in e.invars:
                    if (
                        not is_literal(u)
                        and u in producer
                        and u not in region
                        and u not in outputs
                        and all(
                            all(w in region for w in user.outvars)
                            for user in readers.get(u, ())
                        )
                    ):
                        region.add(u)
                        changed = True
    return region


def _signature(eqn) -> tuple:
    params = []
    for k, v in sorted(eqn.params.items()):
        try:
            hash(v)
        except TypeError:
            continue
        if hasattr(v, "eqns") or hasattr(v, "jaxpr"):
            continue
        params.append((k, v))
    shapes = tuple(tuple(getattr(v.aval, "shape", ())) for v in eqn.invars)
    return eqn.primitive.name, tuple(params), shapes


def _matches(sig: tuple, producers: frozenset) -> bool:
    name, key, shapes = sig
    for p_name, p_key, p_shapes in producers:
        if (
            name == p_name
            and key == p_key
            and len(shapes) == len(p_shapes)
            and all(
                len(a) >= len(b) and tuple(a[len(a) - len(b) :]) == b
                for a, b in zip(shapes, p_shapes)
            )
        ):
            return True
    return False


@dataclasses.dataclass(frozen=True)
class _ResolvedSaveAllBut:
    names: frozenset[str]
    producers: frozenset[tuple]

    def __call__(self, prim, *avals, **params) -> bool:
        if is_tag(prim, params):
            return params["name"] not in self.names
        if self.producers:
            return not _matches(
                _signature(_FakeEqn(prim, avals, params)), self.producers
            )
        return True


class _FakeEqn:
    def __init__(self, prim, avals, params):
        self.primitive = prim
        self.invars = [_FakeVar(a) for a in avals]
        self.params = params


class _FakeVar:
    def __init__(self, aval):
        self.aval = aval
