"""How a policy is applied to a layer function: the one place `jax.checkpoint` is
called with a policy, checking a name policy's names against the layer's tags."""

import types
from collections.abc import Callable

import equinox as eqx
import jax

from .._inspect._jaxpr import checkpoint_names
from ._exclude import ExcludeProducers
from ._values import (
    NamePolicy,
    Offloading,
    Policy,
    check_tags,
    save_all_but_names,
    save_names,
)


_cp = jax.checkpoint_policies


def checkpointed(fn: Callable, pol: Policy, *, prevent_cse: bool = False) -> Callable:
    """`jax.checkpoint(fn, policy=pol)`, making `save_all_but_names` exact; under
    JAX's remat3, with `pol` as remat3 takes it (`for_remat3`). `prevent_cse`
    as `jax.checkpoint` takes it: needless inside a loop (the body of a scan),
    needed where layers are traced one after another (a list of layers).

    The one place a policy is applied to a layer function (the plain scan of
    `scan_layers` and `chain`, and the engine's `Layers`): a name policy whose
    names are not all tags of `fn` raises a `ValueError` when it is called (at
    trace time), see `check_tags`."""
    checked = pol  # the policy whose names are checked against the tags
    if remat3():
        pol = for_remat3(pol)
    elif isinstance(pol, save_all_but_names):
        return ExcludeProducers(fn, pol, prevent_cse=prevent_cse)
    checkpointed_fn = jax.checkpoint(fn, policy=pol, prevent_cse=prevent_cse)
    if isinstance(checked, NamePolicy):
        return _CheckedNames(fn, checkpointed_fn, checked)
    return checkpointed_fn


def remat3() -> bool:
    """Whether `jax.checkpoint` is JAX's remat3 (the `jax_remat3` flag, which
    jax 0.10.2 has off and later versions turn on): it honours only its own
    name policies (`jax.checkpoint_policies.save_only_these_names`, ...) at a
    `checkpoint_name` tag, and recomputes the tag under any other."""
    return bool(getattr(jax.config, "jax_remat3", False))


def for_remat3(pol: Policy) -> Policy:
    """`pol` as a value remat3 honours: `save_names` as JAX's own
    `save_only_these_names`, an offloading policy as the JAX policy it wraps;
    any other policy (JAX's, or a callable of your own) as it is.

    **Raises:**

    `NotImplementedError` for `save_all_but_names` (its exact rewrite tags
    values for a policy of its own, which remat3 would ignore), and for
    `offload_names` and `save_and_offload_names` where this jax's
    `save_and_offload_only_these_names` is a plain function (remat3 would
    recompute every tag instead of offloading it).
    """
    if isinstance(pol, save_names):
        return _cp.save_only_these_names(*sorted(pol.names))
    if isinstance(pol, save_all_but_names):
        raise NotImplementedError(
            f"{pol!r} is not supported under JAX's remat3 (jax_remat3=True): "
            "remat3 honours only its own name policies. Use save_names with the "
            "names to keep, or a policy name such as 'dots'."
        )
    inner = getattr(pol, "_jax_policy", pol)
    inner = inner.policy if isinstance(inner, Offloading) else inner
    if isinstance(pol, NamePolicy) and isinstance(inner, types.FunctionType):
        raise NotImplementedError(
            f"{pol!r} is not supported under JAX's remat3 (jax_remat3=True) in jax "
            f"{jax.__version__}: its save_and_offload_only_these_names is a "
            "function, which remat3 ignores at a checkpoint_name tag (it would "
            "recompute every tag instead of offloading it). Use save_names with "
            "the same names, or a newer jax."
        )
    return inner


class _CheckedNames:
    """`jax.checkpoint(fn, policy=pol)` for a name policy `pol`, whose names are
    checked against the tags of `fn` when it is called (`check_tags`).
    `fn` is traced once more for this, once per structure and types of its
    arguments (the engine calls one layer function at several places of a
    backward pass)."""

    def __init__(self, fn: Callable, checkpointed_fn: Callable, pol: NamePolicy):
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
