"""Policies: what one layer saves for the backward pass.

A policy is what `jax.checkpoint(..., policy=...)` takes: a function called on each
primitive of the checkpointed function that says whether its output is saved
(`True`), recomputed (`False`) or offloaded to another memory space.
"""

import dataclasses
import types
from collections.abc import Callable, Mapping
from typing import Any, TypeAlias

import jax
from jax.ad_checkpoint import checkpoint_name  # noqa: F401  (re-exported for users)


Policy: TypeAlias = Callable[..., Any]

_cp = jax.checkpoint_policies


def _is_name(prim: Any, params: dict) -> bool:
    # `checkpoint_name(x, name)` binds the primitive "name" with a `name` parameter.
    return getattr(prim, "name", None) == "name" and "name" in params


@dataclasses.dataclass(frozen=True)
class save_names:
    """Save only the values tagged with one of `names` (by
    `jax.ad_checkpoint.checkpoint_name`); recompute everything else.

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
    values: a tagged value is recomputed from the inputs of the operation that
    produced it. A per-operation policy alone cannot do that (the producer's output
    *is* the tagged value, and would be saved in its place), so eqx_remat's
    combinators (`scan_layers`, `chain`, the schedules and the zoo) trace each
    layer once to find the producers of the excluded values and recompute them
    too. Passed directly to `jax.checkpoint`, this policy excludes the tags but
    not their producers, and saves about as much as `"everything"`.

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
        for arg, value in (("src", src), ("dst", dst)):
            if not isinstance(value, str):
                raise ValueError(
                    f"offload_names: {arg} must be a memory-space name like "
                    f"'device' or 'pinned_host'. Got {value!r}."
                )
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
        return _offload_policy(self.names, self.src, self.dst)


_OFFLOAD_CACHE: dict = {}


def _offload_policy(names: frozenset[str], src: str, dst: str) -> Policy:
    key = (names, src, dst)
    if key not in _OFFLOAD_CACHE:
        _OFFLOAD_CACHE[key] = _cp.save_and_offload_only_these_names(
            names_which_can_be_saved=[],
            names_which_can_be_offloaded=sorted(names),
            offload_src=src,
            offload_dst=dst,
        )
    return _OFFLOAD_CACHE[key]


def _check_names(fn: str, names: tuple) -> None:
    if len(names) == 0:
        raise ValueError(f"{fn} expected at least one name. Got none.")
    for n in names:
        if not isinstance(n, str):
            raise ValueError(
                f"{fn} expected names as strings (the tags given to "
                f"`checkpoint_name`). Got {n!r} of type {type(n).__name__}."
            )


POLICIES: Mapping[str, Policy] = types.MappingProxyType(
    {
        "everything": _cp.everything_saveable,
        "nothing": _cp.nothing_saveable,
        "dots": _cp.dots_saveable,
        "dots_no_batch": _cp.dots_with_no_batch_dims_saveable,
        "offload_dots_no_batch": _cp.offload_dot_with_no_batch_dims(
            "device", "pinned_host"
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
    """`jax.checkpoint(fn, policy=pol)`, making `save_all_but_names` exact."""
    if isinstance(pol, save_all_but_names):
        return _ExcludeProducers(fn, pol)
    return jax.checkpoint(fn, policy=pol, prevent_cse=False)


class _ExcludeProducers:
    """`jax.checkpoint(fn)` with a `save_all_but_names` policy that also recomputes
    the operations producing the excluded values.

    A JAX policy sees one operation at a time — its primitive, input shapes and
    parameters — so the producers are found by tracing `fn` once and matching on
    that signature (input shapes as suffixes, so leading batch axes added by
    `jax.vmap` still match). An operation elsewhere with the same signature is
    recomputed too: more recomputation, never a different gradient.
    """

    def __init__(self, fn: Callable, pol: save_all_but_names):
        self.fn = fn
        self.pol = pol

    def __call__(self, *args):
        flat, treedef = jax.tree.flatten(args)
        closed = jax.make_jaxpr(lambda *f: self.fn(*jax.tree.unflatten(treedef, f)))(
            *flat
        )
        producers = frozenset(_producers(closed.jaxpr, self.pol.names))
        pol = _ResolvedSaveAllBut(self.pol.names, producers)
        return jax.checkpoint(self.fn, policy=pol, prevent_cse=False)(*args)


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


def _producers(jaxpr, names) -> list[tuple]:
    """Signatures of the operations whose outputs are tagged with one of `names`,
    looking inside calls (jit, custom_jvp, ...) for the innermost producer."""
    producer_of = {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars}
    out = []

    def innermost(eqn, var):
        sub = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
        if sub is not None and eqn.primitive.name != "scan":
            sub = getattr(sub, "jaxpr", sub)
            k = eqn.outvars.index(var)
            inner_var = sub.outvars[k]
            inner = {v: e for e in sub.eqns for v in e.outvars}.get(inner_var)
            if inner is not None:
                return innermost(inner, inner_var)
        return _signature(eqn)

    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "name" and eqn.params.get("name") in names:
            producer = producer_of.get(eqn.invars[0])
            if producer is not None:
                out.append(innermost(producer, eqn.invars[0]))
        for v in eqn.params.values():
            for sub in v if isinstance(v, tuple) else (v,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    out.extend(_producers(sub, names))
    return out


@dataclasses.dataclass(frozen=True)
class _ResolvedSaveAllBut:
    names: frozenset[str]
    producers: frozenset[tuple]

    def __call__(self, prim, *avals, **params) -> bool:
        if _is_name(prim, params):
            return params["name"] not in self.names
        if self.producers:
            name, key, shapes = _signature(_FakeEqn(prim, avals, params))
            for p_name, p_key, p_shapes in self.producers:
                if (
                    name == p_name
                    and key == p_key
                    and len(shapes) == len(p_shapes)
                    and all(
                        len(a) >= len(b) and tuple(a[len(a) - len(b) :]) == b
                        for a, b in zip(shapes, p_shapes)
                    )
                ):
                    return False
        return True


class _FakeEqn:
    def __init__(self, prim, avals, params):
        self.primitive = prim
        self.invars = [_FakeVar(a) for a in avals]
        self.params = params


class _FakeVar:
    def __init__(self, aval):
        self.aval = aval
