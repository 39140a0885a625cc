"""Policies: what one layer saves for the backward pass.

A policy is what `jax.checkpoint(..., policy=...)` takes: a function called on each
primitive of the checkpointed function that says whether its output is saved
(`True`), recomputed (`False`) or offloaded to another memory space.
"""

import dataclasses
import functools
import types
from collections.abc import Callable, Mapping
from typing import Any, TypeAlias

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from .._inspect._jaxpr import eval_jaxpr, is_literal, iter_eqns, producers, trace, users


Policy: TypeAlias = Callable[..., Any]

_cp = jax.checkpoint_policies


def _is_name(prim: Any, params: dict) -> bool:
    # `checkpoint_name(x, name)` binds the primitive "name" with a `name` parameter.
    return getattr(prim, "name", None) == "name" and "name" in params


@dataclasses.dataclass(frozen=True)
class save_names:
    """Save only the values tagged with one of `names` (by
    `jax.ad_checkpoint.checkpoint_name`); recompute everything else.

    As the `checkpoint` of eqx_remat's combinators and the zoo (directly or
    as a schedule's inner policy), each name must tag a value in at least one
    layer: a name that tags nothing raises a `ValueError` at trace time,
    listing the tags there.

    Compares and hashes by value, so rebuilding the same policy does not trigger
    recompilation.

    **Arguments:**

    - `*names`: the `checkpoint_name` tags to save.
    """

    names: frozenset[str]

    def __init__(self, *names):
        _check_names("save_names", names)
        object.__setattr__(self, "names", frozenset(names))

    def __repr__(self) -> str:
        return f"save_names({', '.join(map(repr, sorted(self.names)))})"

    def __call__(self, prim, *_, **params) -> bool:
        return _is_name(prim, params) and params["name"] in self.names


@dataclasses.dataclass(frozen=True)
class save_all_but_names:
    """Save everything the backward pass needs except the values tagged with one of
    `names`, which are recomputed.

    Unlike `jax.checkpoint_policies.save_anything_except_these_names` in jax 0.10.2
    (which ignores its names and saves everything), this really excludes the named
    values. A tag is an identity, and a JAX policy sees one operation at a time,
    so refusing to save the tag alone would save the identical output of the
    operation that produced it. eqx_remat's combinators (`scan_layers`, `chain`,
    the schedules and the zoo) therefore trace each layer once and recompute, with
    each excluded value:

    - the operations that produced it, back to values the backward pass needs
      anyway (for `qkv_proj = h @ W + b`: the bias add and the matmul, from `h`
      and `W`);
    - its reshapes, slices, transposes and dtype casts (the `q`, `k`, `v` split
      from a fused projection);
    - the derivative coefficients computed from it (`3 x²` in a GELU's
      derivative).

    So excluding a value that is saved under `"everything"` saves strictly less,
    and excluding one that is not (a layer's input, which a checkpointed layer
    always keeps; an output only added to the residual stream) changes nothing.
    Values inside nested control flow (a `lax.scan` within the layer) are not
    followed. Passed directly to `jax.checkpoint`, outside the combinators, this
    policy excludes the tags but not their producers, and saves about as much
    as `"everything"`.

    As the `checkpoint` of eqx_remat's combinators and the zoo (directly or
    as a schedule's inner policy), each name must tag a value in at least one
    layer: a name that tags nothing raises a `ValueError` at trace time,
    listing the tags there.

    Compares and hashes by value.

    **Arguments:**

    - `*names`: the `checkpoint_name` tags not to save.
    """

    names: frozenset[str]

    def __init__(self, *names):
        _check_names("save_all_but_names", names)
        object.__setattr__(self, "names", frozenset(names))

    def __repr__(self) -> str:
        return f"save_all_but_names({', '.join(map(repr, sorted(self.names)))})"

    def __call__(self, prim, *_, **params) -> bool:
        if _is_name(prim, params):
            return params["name"] not in self.names
        return True


@dataclasses.dataclass(frozen=True)
class offload_names:
    """Offload the values tagged with one of `names` from memory space `src` to
    `dst` (on the forward pass) and back (on the backward pass); recompute
    everything else.

    Offloading needs a backend with a host memory space (TPU, GPU); on the CPU the
    values stay where they are.

    Reverse-over-reverse differentiation (`jax.grad` of `jax.grad`,
    `jax.hessian`) through an offloading policy raises a `NotImplementedError`
    at trace time: JAX cannot differentiate the reload of an offloaded value in
    the backward pass. Forward-over-reverse (`jax.jvp` of `jax.grad`) works.

    As the `checkpoint` of eqx_remat's combinators and the zoo (directly or
    as a schedule's inner policy), each name must tag a value in at least one
    layer: a name that tags nothing raises a `ValueError` at trace time,
    listing the tags there.

    Compares and hashes by value.

    **Arguments:**

    - `*names`: the `checkpoint_name` tags to offload.
    - `src`: the memory space the values are computed in. Default `"device"`.
    - `dst`: where they are kept until the backward pass. Default `"pinned_host"`.
    """

    names: frozenset[str]
    src: str
    dst: str

    def __init__(self, *names, src="device", dst="pinned_host"):
        _check_names("offload_names", names)
        _check_spaces("offload_names", src, dst)
        object.__setattr__(self, "names", frozenset(names))
        object.__setattr__(self, "src", src)
        object.__setattr__(self, "dst", dst)

    def __repr__(self) -> str:
        names = ", ".join(map(repr, sorted(self.names)))
        return f"offload_names({names}, src={self.src!r}, dst={self.dst!r})"

    def __call__(self, prim, *args, **params):
        return self._jax_policy(prim, *args, **params)

    @property
    def _jax_policy(self) -> Policy:
        return _offload_policy(frozenset(), self.names, self.src, self.dst)


@dataclasses.dataclass(frozen=True)
class save_and_offload_names:
    """Per `checkpoint_name` tag, one of three decisions: save the values
    tagged with one of `save` (kept in device memory), offload those tagged with
    one of `offload` (moved from memory space `src` to `dst` on the forward pass
    and back on the backward pass), recompute everything else.

    JAX's `jax.checkpoint_policies.save_and_offload_only_these_names` as one
    value: it compares and hashes by value (rebuilding an equal one does not
    recompile), its names are checked when it is built, and, like
    [`eqx_remat.offload_names`][], differentiating its backward pass again
    (grad of grad) raises a clear `NotImplementedError` when something is
    offloaded. With `offload=()` it saves what [`eqx_remat.save_names`][]
    saves; with `save=()`, it is [`eqx_remat.offload_names`][].

    ```python
    import eqx_remat

    # zoo.Transformer: keep the projections, move the MLP's hidden
    # activations to host memory, recompute the rest.
    pol = eqx_remat.save_and_offload_names(
        save=("qkv_proj", "out_proj"), offload=("mlp_hidden",)
    )
    same = eqx_remat.save_and_offload_names(
        offload="mlp_hidden", save=("out_proj", "qkv_proj")
    )
    print(pol == same, hash(pol) == hash(same), sorted(pol.names))
    ```

    ```text
    True True ['mlp_hidden', 'out_proj', 'qkv_proj']
    ```

    Offloading needs a backend with a host memory space (TPU, GPU); on the CPU
    the offloaded values stay where they are.

    **Arguments:**

    - `save`: the tags to save, a tuple of names (or one name as a string).
    - `offload`: the tags to offload, likewise. No name may be in both, and at
      least one name must be given.
    - `src`: the memory space the offloaded values are computed in. Default
      `"device"`.
    - `dst`: where they are kept until the backward pass. Default
      `"pinned_host"`.
    """

    save: frozenset[str]
    offload: frozenset[str]
    src: str
    dst: str

    def __init__(self, save=(), offload=(), *, src="device", dst="pinned_host"):
        fn = "save_and_offload_names"
        save, offload = (
            _name_tuple(fn, "save", save),
            _name_tuple(fn, "offload", offload),
        )
        _check_names(fn, save + offload)
        both = sorted(set(save) & set(offload))
        if both:
            raise ValueError(
                f"{fn} expected each name in save or in offload, not both. Got "
                f"{', '.join(map(repr, both))} in both."
            )
        _check_spaces(fn, src, dst)
        object.__setattr__(self, "save", frozenset(save))
        object.__setattr__(self, "offload", frozenset(offload))
        object.__setattr__(self, "src", src)
        object.__setattr__(self, "dst", dst)

    @property
    def names(self) -> frozenset[str]:
        """Every name it decides for (saved or offloaded)."""
        return self.save | self.offload

    def __repr__(self) -> str:
        save = tuple(sorted(self.save))
        offload = tuple(sorted(self.offload))
        return (
            f"save_and_offload_names(save={save!r}, offload={offload!r}, "
            f"src={self.src!r}, dst={self.dst!r})"
        )

    def __call__(self, prim, *args, **params):
        return self._jax_policy(prim, *args, **params)

    @property
    def _jax_policy(self) -> Policy:
        return _offload_policy(self.save, self.offload, self.src, self.dst)


def _name_tuple(fn: str, arg: str, names: Any) -> tuple:
    """`names` (a string, or an iterable of them) as a tuple."""
    if isinstance(names, str):
        return (names,)
    try:
        return tuple(names)
    except TypeError:
        raise ValueError(
            f"{fn}: {arg} expected a tuple of names (the tags given to "
            f"`checkpoint_name`). Got {names!r}."
        ) from None


@functools.lru_cache(maxsize=256)
def _offload_policy(
    save: frozenset[str], offload: frozenset[str], src: str, dst: str
) -> Policy:
    """The JAX policy of `save_and_offload_names(save=save, offload=offload,
    src=src, dst=dst)` (and of `offload_names`, which saves nothing): one object
    per value (while it is among the 256 most recently used), so that rebuilding
    the same policy does not retrigger compilation."""
    return _Offloading(
        _cp.save_and_offload_only_these_names(
            names_which_can_be_saved=sorted(save),
            names_which_can_be_offloaded=sorted(offload),
            offload_src=src,
            offload_dst=dst,
        ),
        repr((sorted(save), sorted(offload), src, dst)),
    )


_SECOND_ORDER_OFFLOAD = (
    "Differentiating the backward pass of an offloading policy "
    "(offload_names, save_and_offload_names, 'offload_dots_no_batch') — grad of "
    "grad, jax.hessian — is "
    "not supported: JAX's offloading reloads the saved values from host memory "
    "in the backward pass, and differentiating that reload fails in jax "
    "(<= 0.10.2: 'Expected cotangent type float32[...] but got "
    "float32<host>[...]'). Use the matching saving policy for higher-order "
    "derivatives (save_names with the same names — for save_and_offload_names, "
    "its save and offload names together — or 'dots_no_batch'); "
    "forward-over-reverse (jax.jvp of jax.grad) works."
)


class _Offloading:
    """A JAX offloading policy that raises a clear error, at trace time, when the
    backward pass it produced is itself differentiated.

    JAX calls a policy on the operations of the function it checkpoints; when the
    backward pass is differentiated again, the policy is called once more, on the
    backward pass's operations — which include the reload of an offloaded value
    from host memory. That reload is what JAX cannot transpose, so seeing an
    input in host memory is the signal.
    """

    def __init__(self, policy: Policy, key: str):
        self.policy = policy
        self.key = key

    def __call__(self, prim, *avals, **params):
        for a in avals:
            space = getattr(a, "memory_space", None)
            if getattr(space, "name", None) == "Host":
                raise NotImplementedError(_SECOND_ORDER_OFFLOAD)
        return self.policy(prim, *avals, **params)

    def __repr__(self) -> str:
        return f"_Offloading({self.key})"


def _check_spaces(fn: str, src: Any, dst: Any) -> None:
    for arg, value in (("src", src), ("dst", dst)):
        if not isinstance(value, str):
            raise ValueError(
                f"{fn}: {arg} must be a memory-space name like "
                f"'device' or 'pinned_host'. Got {value!r}."
            )


def _check_names(fn: str, names: tuple) -> None:
    if len(names) == 0:
        raise ValueError(f"{fn} expected at least one name. Got none.")
    for n in names:
        if not isinstance(n, str):
            raise ValueError(
                f"{fn} expected names as strings (the tags given to "
                f"`checkpoint_name`). Got {n!r} of type {type(n).__name__}."
            )
        if n == "":
            raise ValueError(f"{fn} expected non-empty names. Got ''.")


POLICIES: Mapping[str, Policy] = types.MappingProxyType(
    {
        "everything": _cp.everything_saveable,
        "nothing": _cp.nothing_saveable,
        "dots": _cp.dots_saveable,
        "dots_no_batch": _cp.dots_with_no_batch_dims_saveable,
        "offload_dots_no_batch": _Offloading(
            _cp.offload_dot_with_no_batch_dims("device", "pinned_host"),
            "dots_no_batch, device -> pinned_host",
        ),
    }
)
"""The named policies: a read-only mapping from a short name to a JAX policy.

| name | saves |
|---|---|
| `"everything"` | every intermediate (checkpointing only the layer boundary) |
| `"nothing"` | nothing but the layer's inputs |
| `"dots"` | the outputs of matrix multiplies |
| `"dots_no_batch"` | matrix multiplies without batch dimensions |
| `"offload_dots_no_batch"` | the same, offloaded to pinned host memory |

Offloading policies support first-order reverse mode and forward-over-reverse;
differentiating their backward pass again (grad of grad) raises a
`NotImplementedError` at trace time (see [`eqx_remat.offload_names`][]).
"""


def policy(spec: Any) -> Policy | None:
    """Normalise a policy specification into a JAX policy.

    **Arguments:**

    - `spec`: `None`, a name from [`eqx_remat.POLICIES`][], or a JAX policy callable
      (e.g. `jax.checkpoint_policies.dots_saveable`, or [`eqx_remat.save_names`][]).

    **Returns:**

    `None` for `None`, else a callable policy for `jax.checkpoint`.

    **Raises:**

    `ValueError` for an unknown name, listing the valid ones.
    """
    return _to_jax_policy(spec)


def _to_jax_policy(spec: Any) -> Policy | None:
    """What [`eqx_remat.policy`][] returns for `spec`, for the modules that take a
    policy (the engine, the checkpoint value): the public function is not
    imported under another name."""
    if spec is None:
        return None
    if isinstance(spec, str):
        try:
            return POLICIES[spec]
        except KeyError:
            raise ValueError(
                f"Unknown policy {spec!r}. It needs to be one of "
                f"{sorted(POLICIES)}, or a JAX policy callable."
            ) from None
    if callable(spec) and not isinstance(spec, type):
        return spec
    raise ValueError(
        "policy expected None, a policy name (one of "
        f"{sorted(POLICIES)}) or a JAX policy callable. Got {spec!r}."
    )


def checkpointed(fn: Callable, pol: Policy) -> Callable:
    """`jax.checkpoint(fn, policy=pol)`, making `save_all_but_names` exact.

    The one place a policy is applied to a layer function (the plain scan of
    `scan_layers` and `chain`, and the engine's `Layers`): a name policy whose
    names are not all tags of `fn` raises a `ValueError` when it is called (at
    trace time), see `check_tags`."""
    if isinstance(pol, save_all_but_names):
        return _ExcludeProducers(fn, pol)
    checkpointed_fn = jax.checkpoint(fn, policy=pol, prevent_cse=False)
    if _is_name_policy(pol):
        return _CheckedNames(fn, checkpointed_fn, pol)
    return checkpointed_fn


def _is_name_policy(pol: Any) -> bool:
    """Whether `pol` is one of eqx_remat's name policies (`save_names`,
    `save_all_but_names`, `offload_names`, and any other policy value of this
    module that decides by its `names`), whose names are checked against the
    tags of what it checkpoints. JAX's own policies are not checked."""
    return type(pol).__module__ == __name__ and isinstance(
        getattr(pol, "names", None), frozenset
    )


def checkpoint_names(jaxpr) -> set[str]:
    """The `checkpoint_name` tags of `jaxpr` and of the jaxprs it holds (loop
    bodies, `cond`/`switch` branches, calls, custom derivatives...)."""
    return {
        e.params["name"] for e in iter_eqns(jaxpr) if _is_name(e.primitive, e.params)
    } - {_KEEP}


def check_tags(pol: Any, tags: set[str]) -> None:
    """Raise a `ValueError` when a name of the name policy `pol` is not among
    `tags`, the `checkpoint_name` tags of the function it checkpoints: such a
    name does nothing (a typo, or a tag never attached), and the policy would
    silently save, offload or recompute other than asked. The message names
    the names that tag nothing and lists the tags that exist, sorted."""
    missing = sorted(pol.names - tags)
    if not missing:
        return
    there = (
        f"The tags there are {sorted(tags)}."
        if tags
        else "That function has no checkpoint_name tags."
    )
    raise ValueError(
        f"{pol!r} expected names that tag values of the function it checkpoints "
        "(with jax.ad_checkpoint.checkpoint_name); a name that tags nothing "
        f"would silently do nothing. Got {', '.join(map(repr, missing))}, which "
        f"{'tags' if len(missing) == 1 else 'tag'} nothing. {there}"
    )


class _CheckedNames:
    """`jax.checkpoint(fn, policy=pol)` for a name policy `pol`, whose names are
    checked against the tags of `fn` when it is called (`check_tags`). `fn` is
    traced once more for this, once per structure and types of its arguments
    (the engine calls one layer function at several places of a backward
    pass)."""

    def __init__(self, fn: Callable, checkpointed_fn: Callable, pol: Any):
        self.fn = fn
        self.checkpointed_fn = checkpointed_fn
        self.pol = pol
        self.checked: set = set()

    def __call__(self, *args):
        dynamic, static = eqx.partition(args, eqx.is_array)
        leaves, treedef = jax.tree.flatten(dynamic)
        key = (treedef, tuple(jax.typeof(x) for x in leaves))
        if key not in self.checked:
            jaxpr = jax.make_jaxpr(lambda d: self.fn(*eqx.combine(d, static)))(dynamic)
            check_tags(self.pol, checkpoint_names(jaxpr.jaxpr))
            self.checked.add(key)
        return self.checkpointed_fn(*args)


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
# The tag given to values that must stay saved although an excluded value's
# producer has the same signature (see `_ExcludeProducers`).
_KEEP = "__eqx_remat_keep__"


class _ExcludeProducers:
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
    output tagged `_KEEP`, which the policy saves, so it stays saved: the jaxpr
    is evaluated again, with those tags inserted, inside `jax.checkpoint`.
    Signatures match input shapes as suffixes, so leading axes added by
    `jax.vmap` still match.
    """

    def __init__(self, fn: Callable, pol: save_all_but_names):
        self.fn = fn
        self.pol = pol

    def __call__(self, *args):
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
                return [checkpoint_name(o, _KEEP) for o in outs]
            return outs

        def run(*f):
            outs = eval_jaxpr(jaxpr, consts, f, outputs=tag_kept)
            return jax.tree.unflatten(out_tree, outs)

        return jax.checkpoint(run, policy=pol, prevent_cse=False)(*flat)


def _region(jaxpr, names, tangent: set) -> set:
    """The variables of `jaxpr` not to save: see `_ExcludeProducers`. In a JVP
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
        if _is_name(prim, params):
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
