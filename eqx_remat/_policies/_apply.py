"""How a policy is applied to a layer function: the one place `jax.checkpoint` is
called with a policy, checking a name policy's names against the layer's tags."""

from collections.abc import Callable

import equinox as eqx
import jax

from .._inspect._jaxpr import checkpoint_names
from ._exclude import ExcludeProducers
from ._values import NamePolicy, Policy, check_tags, save_all_but_names


def checkpointed(fn: Callable, pol: Policy) -> Callable:
    """`jax.checkpoint(fn, policy=pol)`, making `save_all_but_names` exact.

    The one place a policy is applied to a layer function (the plain scan of
    `scan_layers` and `chain`, and the engine's `Layers`): a name policy whose
    names are not all tags of `fn` raises a `ValueError` when it is called (at
    trace time), see `check_tags`."""
    if isinstance(pol, save_all_but_names):
        return ExcludeProducers(fn, pol)
    checkpointed_fn = jax.checkpoint(fn, policy=pol, prevent_cse=False)
    if isinstance(pol, NamePolicy):
        return _CheckedNames(fn, checkpointed_fn, pol)
    return checkpointed_fn


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
