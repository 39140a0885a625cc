"""How a policy is applied to a layer function: the one place `jax.checkpoint` is
called with a policy, checking a name policy's names against the layer's tags."""

import functools
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from .. import _jax_private
from .._inspect._jaxpr import checkpoint_names
from ._exclude import ExcludeProducers
from ._second_order import guarded
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
    trace time), see `check_tags`. Under remat3, an offloading policy's
    backward pass differentiated in reverse mode again raises a clear
    `NotImplementedError` (see `guarded`), as JAX's previous checkpoint makes
    `Offloading` raise."""
    if isinstance(pol, save_all_but_names):
        # Under remat3 too: see `ExcludeProducers`.
        return ExcludeProducers(fn, pol, prevent_cse=prevent_cse)
    checked = pol  # the policy whose names are checked against the tags
    if remat3():
        pol = for_remat3(pol)
        if pol is _cp.everything_saveable:  # saves what no checkpoint saves
            return fn
    checkpointed_fn = jax.checkpoint(fn, policy=pol, prevent_cse=prevent_cse)
    if isinstance(pol, Offloading) and remat3():
        # remat3 does not ask the policy on the backward pass: see `guarded`.
        checkpointed_fn = guarded(checkpointed_fn, checked)
    if isinstance(checked, NamePolicy):
        return _CheckedNames(fn, checkpointed_fn, checked)
    return checkpointed_fn


def remat3() -> bool:
    """Whether `jax.checkpoint` is JAX's remat3 (the `jax_remat3` flag, off by
    default in jax 0.10.2 to 0.12.1, and by JAX's docs on its way to becoming
    the default)."""
    return bool(getattr(jax.config, "jax_remat3", False))


def for_remat3(pol: Policy) -> Policy:
    """`pol` as a value JAX's remat3 honours, for `jax.checkpoint` under
    `jax_remat3=True`.

    - `save_names` as JAX's own `save_only_these_names`, one value per set of
      names (rebuilding an equal policy gives the same value, so nothing is
      compiled again);
    - where this jax's remat3 asks any policy at each operation it can save
      (matrix products and `checkpoint_name` tags; jax 0.12 does): any other
      policy as it is, `offload_names` and `save_and_offload_names` as their
      JAX policy (also one value per policy);
    - where it honours only JAX's own policy values, by their type (jax
      0.10.2): those (`save_only_these_names`, `'dots'`, `'dots_no_batch'`,
      `'nothing'`) and `'everything'`, which `checkpointed` then applies as no
      checkpoint at all (what jax 0.12's remat3 does).

    (`save_all_but_names` never comes here: `checkpointed` applies it with
    `ExcludeProducers`.)

    **Raises:**

    `NotImplementedError`, at trace time, naming the policy and the jax
    version, for a policy this jax's remat3 would silently not honour (jax
    0.10.2: an offloading policy, or a callable of your own, which its remat3
    would take for `'nothing'`).
    """
    if isinstance(pol, save_names):
        return _save_only_these_names(tuple(sorted(pol.names)))
    if _remat3_asks_policies():
        return getattr(pol, "_jax_policy", pol)
    if pol is _cp.everything_saveable or _jax_policy_value(pol):
        return pol
    raise NotImplementedError(
        f"{pol!r} is not supported under JAX's remat3 (jax_remat3=True) in jax "
        f"{jax.__version__}: this jax's remat3 honours only JAX's own policy "
        "values (save_only_these_names, 'dots', 'dots_no_batch', 'nothing', "
        "'everything'), and would recompute what this policy saves or "
        "offloads. Use one of those (eqx_remat.save_names for names), turn "
        "jax_remat3 off, or use jax >= 0.12, whose remat3 honours any policy."
    )


@functools.lru_cache(maxsize=256)
def _save_only_these_names(names: tuple[str, ...]) -> Policy:
    """JAX's `save_only_these_names(*names)`, one value per `names` (while
    among the 256 most recently used): jax 0.12 makes it a new function at
    each call, which would compare unequal to the last and so compile again."""
    return _cp.save_only_these_names(*names)


def _jax_policy_value(pol: Policy) -> bool:
    """Whether `pol` is one of the policy values jax 0.10.2's remat3 honours
    by their type (at a tag: `save_only_these_names`,
    `save_any_names_but_these`; at a matrix product: `dots_saveable` and
    `dots_with_no_batch_dims_saveable`), or `nothing_saveable`."""
    cls = type(pol)
    return pol is _cp.nothing_saveable or (
        cls.__module__ == "jax._src.ad_checkpoint"
        and cls.__name__
        in ("SaveOnlyTheseNames", "SaveAnyNamesButThese", "DotsSaveable")
    )


@functools.cache
def _remat3_asks_policies() -> bool:
    """Whether this jax's remat3 calls a policy callable at a `checkpoint_name`
    tag (jax 0.12 does, and at every operation it can save; jax 0.10.2's looks
    only at the type of JAX's own policy values), found once by tracing the
    gradient of one tagged operation under remat3 with a policy that notes
    its calls."""
    calls = []

    def probe(prim, *_, **params):
        calls.append(prim)
        return False

    f = jax.checkpoint(lambda x: checkpoint_name(jnp.sin(x), "probe"), policy=probe)
    with _jax_private.remat3_set(True):
        jax.make_jaxpr(jax.grad(f))(1.0)
    return bool(calls)


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
