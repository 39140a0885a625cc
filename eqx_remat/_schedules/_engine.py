"""The engine behind every depth schedule.

`remat_scan(step, consts, stacked, carry, depth, schedule)` computes

    for i in range(depth): carry = step(consts, stacked[i], carry)

as a `jax.custom_vjp` whose forward and backward passes are the schedule's
(`Schedule.forward` and `Schedule.backward`). The schedule only says *which*
layers to run and reverse, and when; what it runs them with is a `Layers`: the
operations on the stack that this module implements once, for every schedule:

- `Layers.step` / `Layers.run`: apply one layer, or a range of them with a
  `lax.scan`, reading each layer's parameters by indexing the stack (never
  copying a segment of it).
- `Layers.reverse`: the backward step of one layer (`jax.vjp` at its input, under
  the schedule's inner policy). Its parameter gradient is written straight into
  the one gradient buffer, at the layer's index.
- `Layers.reverse_segment`: one forward pass over a segment that saves each
  layer's residuals (what the inner policy keeps), then the backward steps of
  the segment, last to first. A layer's parameters are never among the saved
  residuals: they are read from the stack again. Residuals that depend on
  neither the layer nor its input (an attention mask) are kept once for the
  segment, not per layer, as JAX's scan hoists them out of its loop.
- `Layers.save_segment` / `Layers.apply_segment`: the two halves of
  `reverse_segment` on their own, for a schedule that saves a segment's
  residuals on the forward pass (`eqx_remat.ranges`'s per-layer ranges).
- `Layers.view`: some consecutive layers as a stack of their own, with their own
  inner policy, reading the same stack and writing the same gradient buffer.
- `Layers.carries`, `Layers.load`, `Layers.store`: a buffer of stored carries.

So parameter memory stays at that of a plain scan: one gradient buffer for the
stack (the output), plus one layer's parameters and gradient at a time.

Under `jax.vmap` (the innermost transformation) the custom_vjp would be batched
with per-example parameter gradients, materialising `batch × params`. A
`custom_vmap` rule instead runs the engine once with a batched `step`, so the
gradient of each layer's parameters is summed over the batch inside that layer's
backward step. That `step` is batched with the `axis_name` and `spmd_axis_name`
of the user's `jax.vmap`.
"""

import abc
import dataclasses
import functools
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.core
import jax.numpy as jnp
import jax.tree_util as jtu
from jax import lax
from jax.extend.core import Jaxpr

from .. import _jax_private
from .._inspect._jaxpr import checkpoint_names, eval_jaxpr, varying
from .._inspect._offload import on_device
from .._policies._apply import checkpointed
from .._policies._named import to_jax_policy
from .._policies._values import NamePolicy, check_tags


_warned_no_vmap_rule = False


def _innermost_is_vmap() -> bool:
    global _warned_no_vmap_rule
    if not _jax_private.sees_traces():  # pragma: no cover - jax version
        if not _warned_no_vmap_rule:
            _warned_no_vmap_rule = True
            warnings.warn(
                "eqx_remat: this jax version hides which trace is innermost "
                f"(jax {jax.__version__}; eqx_remat is tested with jax 0.10.2). "
                "Schedules under jax.vmap still give correct gradients, but "
                "per-example parameter gradients are materialised.",
                stacklevel=3,
            )
        return False
    return _jax_private.innermost_is_vmap()


def _vmap_names() -> dict[str, Any]:
    """The `axis_name` and `spmd_axis_name` of the innermost `jax.vmap`, as
    keyword arguments of `jax.vmap`, so that the `custom_vmap` rule batches
    with them: collectives over the axis name still work, and values stay split
    over the mesh axes of `spmd_axis_name` (a `shard_map`'s specs keep them)."""
    return _jax_private.vmap_axis_names()


def _is_diff(x: Any) -> bool:
    return eqx.is_inexact_array(x)


def stays_a_loop(length: int, unroll: int | bool) -> bool:
    """Whether `lax.scan(..., length=length, unroll=unroll)` runs every iteration
    inside an XLA while loop of two trips or more: it runs `length // unroll`
    trips of `unroll` iterations and unrolls the remainder, and XLA removes a
    loop of one trip."""
    if isinstance(unroll, bool):
        unroll = length if unroll else 1
    return length >= 2 * unroll >= 2 and length % unroll == 0


# Layer indices are never negative: without the wrap-around of negative
# indices, XLA sees the index as it is computed and fuses each read and write
# of a layer's slice with it, as in JAX's own scan.
def _index(tree: Any, i: Any) -> Any:
    return jtu.tree_map(
        lambda x: lax.dynamic_index_in_dim(
            x, i, keepdims=False, allow_negative_indices=False
        ),
        tree,
    )


def _set(tree: Any, value: Any, i: Any) -> Any:
    return jtu.tree_map(
        lambda x, v: lax.dynamic_update_index_in_dim(
            x, v, i, axis=0, allow_negative_indices=False
        ),
        tree,
        value,
    )


def _nones(tree: Any) -> Any:
    return jtu.tree_map(lambda _: None, tree)


def _sharded_as(z: jax.Array, t: Any) -> jax.Array:
    """`z`, resharded to the sharding of the type `t` where that sharding is over
    Explicit mesh axes and `z`'s is not. jax 0.12 makes new arrays (zeros,
    `zeros_like`, `full_like`) without the Explicit sharding of the value they
    are like when no mesh is set, as in a `custom_vjp`'s backward pass (jax
    0.10.2 kept it); `dynamic_update_slice` then refuses to write a sharded
    carry into the buffer."""
    want = getattr(t, "sharding", None)
    mesh = getattr(want, "mesh", None)
    if jax.sharding.AxisType.Explicit not in getattr(mesh, "axis_types", ()):
        return z
    return z if jax.typeof(z).sharding == want else jax.sharding.reshard(z, want)


def _zeros_like(x: Any) -> jax.Array:
    """Zeros shaped, typed and sharded like `x`."""
    return _sharded_as(jnp.zeros_like(x), jax.typeof(x))


def _zeros_of_type(t: Any) -> jax.Array:
    """Zeros of the abstract value `t` with all that its type carries (shape,
    dtype, weak type, sharding, memory space): what a `lax.cond` branch that
    skips a layer returns in place of values the other branch computes."""
    if jnp.issubdtype(t.dtype, jax.dtypes.extended):
        # A PRNG key kept as a residual: zeros_like_aval gives its tangent type.
        z = jnp.zeros(t.shape, t.dtype)
    else:
        z = _sharded_as(_jax_private.zeros_like_aval(t), t)
    space = getattr(t, "memory_space", None)
    if space is not None and space != jax.memory.Space.Device:
        z = jax.device_put(z, space)  # e.g. a residual offloaded to host memory
    return z


def _is_arange(start: Any, length: int, depth: int) -> bool:
    """Whether layers `start, ..., start + length - 1` all exist, knowing
    only what is static."""
    return isinstance(start, int) and 0 <= start and start + length <= depth


@dataclasses.dataclass(frozen=True, eq=False)
class _Layout:
    """How to rebuild a layer's pullback from the residuals that
    `Layers.save_segment` keeps: the pullback's tree structure, and where each
    of its leaves comes from (`kinds`: `("invariant", k)`, the `k`th parameter
    or constant of the layer, read again; `("constant", value)`; `("kept", k)`,
    the `k`th kept residual). `fixed`: which kept residuals depend on no input of
    the layer (computed once for the segment, not stacked). A static value,
    compared by identity."""

    tree: Any
    kinds: tuple[tuple[str, Any], ...]
    fixed: tuple[bool, ...] = ()


@jtu.register_pytree_node_class
class _Saved:
    """What `Layers.save_segment` returns: the stacked residuals and those
    computed once for the segment (the pytree's children), and their `_Layout`
    (static)."""

    def __init__(self, arrays: list, fixed: list, layout: _Layout):
        self.arrays = arrays
        self.fixed = fixed
        self.layout = layout

    def tree_flatten(self):
        return (self.arrays, self.fixed), self.layout

    @classmethod
    def tree_unflatten(cls, layout, children):
        arrays, fixed = children
        return cls(arrays, fixed, layout)


@dataclasses.dataclass(frozen=True, eq=False)
class Layers:
    """The stack of layers that a [`eqx_remat.Schedule`][] checkpoints, and the
    operations a schedule may use on it.

    A schedule never calls the layers itself: it asks a `Layers` to run them
    forward (`step`, `run`), to reverse them (`reverse`, `reverse_segment`, or
    its halves `save_segment` and `apply_segment`) and to store carries
    (`carries`, `store`, `load`); `view` gives some of the layers as a stack of
    their own. Layer indices and `start`s
    may be traced integers (e.g. a `lax.scan`'s counter); lengths are Python
    ints.

    The backward state `cts` that `reverse` and `reverse_segment` take and
    return (and that [`eqx_remat.Schedule.backward`][] threads through) is
    opaque: the cotangent of the running carry and the gradient buffers. Pass it
    through loops as a pytree.

    A `Layers` is a frozen value, built by the engine: a schedule never
    changes one, and `view` returns a new one.

    **Attributes:**

    - `depth`: the number of layers, `D`.
    """

    # The layer function, `step(consts, layer_params, carry)`.
    _step: Callable[[Any, Any, Any], Any]
    # What every layer reads (closed-over parameters), and the stacked layers.
    _consts: Any
    _stacked: Any
    depth: int
    # The inner policy (normalised to a JAX policy, or `None`).
    _policy: Any
    _unroll: int | bool
    # Where this stack starts in `_stacked` (a `view`'s first layer).
    _offset: int = 0

    def __post_init__(self):
        object.__setattr__(self, "_policy", to_jax_policy(self._policy))

    @functools.cached_property
    def _layer_fn(self) -> Callable[[Any, Any, Any], Any]:
        """`_step` under the inner policy."""
        if self._policy is None:
            return self._step
        return checkpointed(self._step, on_device(self._policy))

    @functools.cached_property
    def _consts_split(self) -> tuple[Any, Any]:
        """`_consts` as its differentiable leaves and the others."""
        return eqx.partition(self._consts, _is_diff)

    @functools.cached_property
    def _stacked_split(self) -> tuple[Any, Any]:
        """`_stacked` as its differentiable leaves and the others."""
        return eqx.partition(self._stacked, _is_diff)

    def view(self, start: int, depth: int, policy: Any) -> "Layers":
        """The layers `start, ..., start + depth - 1` of this stack as a stack of
        their own, with its own inner `policy`: its layer `i` is this stack's
        layer `start + i`, read by index from the same stack (nothing is
        copied), and its parameter gradients go into the same gradient buffer.
        What [`eqx_remat.ranges`][] gives each range's checkpoint.

        **Arguments:**

        - `start`: the first layer, a Python int >= 0.
        - `depth`: how many layers, a Python int >= 1, with `start + depth`
          at most this stack's `depth`.
        - `policy`: what each layer of the view saves in its backward step (a
          policy or its name, or `None`).
        """
        if not _is_arange(start, depth, self.depth) or depth < 1:
            raise ValueError(
                f"Layers.view expected layers within 0..{self.depth - 1}. Got "
                f"start={start!r}, depth={depth!r}."
            )
        return dataclasses.replace(
            self, depth=depth, _offset=self._offset + start, _policy=policy
        )

    def _pads(self, start: Any, length: int, pad: bool) -> bool:
        """Whether layers `start, ..., start + length - 1` must be run with a
        check that each exists: `pad` was asked (see `run`) and what is static
        does not show that they all do."""
        return pad and not _is_arange(start, length, self.depth)

    def _at(self, i: Any) -> Any:
        """The index in the full stack of this stack's layer `i`."""
        return i if self._offset == 0 else self._offset + i

    # --- forward ------------------------------------------------------------

    def step(self, i: Any, carry: Any) -> Any:
        """The output of layer `i` (a Python or traced int) for input `carry`."""
        return self._step(self._consts, _index(self._stacked, self._at(i)), carry)

    def run(self, carry: Any, start: Any, length: int, *, pad: bool = False) -> Any:
        """Run `carry` through layers `start, ..., start + length - 1` with one
        `lax.scan`.

        **Arguments:**

        - `carry`: the input of layer `start`.
        - `start`: the first layer (a Python or traced int).
        - `length`: how many layers, a Python int >= 0.
        - `pad`: `True` when the range may run past the last layer (a schedule
          that pads the stack to a uniform split): layers `>= depth` are then
          skipped with a `lax.cond`.

        **Returns:**

        The output of layer `start + length - 1`.
        """
        pad = self._pads(start, length, pad)

        def body(x, t):
            i = start + t
            if not pad:
                return self.step(i, x), None
            return lax.cond(i < self.depth, self.step, lambda _, x: x, i, x), None

        if length == 0:
            return carry
        return lax.scan(
            body, carry, jnp.arange(length, dtype=jnp.int32), unroll=self._unroll
        )[0]

    # --- backward -----------------------------------------------------------

    def _vjp(self, i: Any, carry: Any):
        """`jax.vjp` of layer `i` at `carry`, under the inner policy: its output,
        its pullback, and the leaves of its parameters."""
        s_d, s_nd = self._params(i)
        x_d, x_nd = eqx.partition(carry, _is_diff)

        def layer(c_d, s_d, x_d):
            c = eqx.combine(c_d, self._consts_split[1])
            out = self._layer_fn(c, eqx.combine(s_d, s_nd), eqx.combine(x_d, x_nd))
            return eqx.partition(out, _is_diff)

        out_d, vjp, out_nd = jax.vjp(
            layer, self._consts_split[0], s_d, x_d, has_aux=True
        )
        invariant = jtu.tree_leaves((self._consts, s_d, s_nd))
        return eqx.combine(out_d, out_nd), vjp, invariant

    def _params(self, i: Any) -> tuple[Any, Any]:
        """Layer `i`'s differentiable and other parameters, read from the stack."""
        i = self._at(i)
        return _index(self._stacked_split[0], i), _index(self._stacked_split[1], i)

    def _apply(self, i: Any, vjp: Callable, cts: Any) -> Any:
        ct, gs, gc = cts
        g_c, g_s, g_x = vjp(ct)
        gs = _set(gs, g_s, self._at(i))  # each layer is reversed exactly once
        gc = jtu.tree_map(lambda a, b: a + b, gc, g_c)
        return g_x, gs, gc

    def reverse(self, i: Any, carry: Any, cts: Any, *, pad: bool = False) -> Any:
        """The backward step of layer `i`: `jax.vjp` of the layer at its input
        `carry` (saving what the schedule's inner policy saves), applied to the
        cotangent in `cts`; the layer's parameter gradient goes into the
        gradient buffer. Returns the new `cts`. Each layer must be reversed
        exactly once, last to first. `pad`: as in `run` (layers `>= depth` are
        skipped)."""

        def real(cts):
            _, vjp, _ = self._vjp(i, carry)
            return self._apply(i, vjp, cts)

        if self._pads(i, 1, pad):
            return lax.cond(i < self.depth, real, lambda cts: cts, cts)
        return real(cts)

    def reverse_segment(
        self, start: Any, length: int, carry: Any, cts: Any, *, pad: bool = False
    ) -> Any:
        """Reverse layers `start, ..., start + length - 1` from the segment's
        input `carry`: one forward pass that saves every layer's residuals (what
        the inner policy keeps; not the layers' parameters, which are read from
        the stack again), then the backward steps, last to first. Memory: the
        segment's residuals. Returns the new `cts`. `pad`: as in `run`.

        The two halves are `save_segment` and `apply_segment`."""
        if length == 1:
            return self.reverse(start, carry, cts, pad=pad)
        _, saved = self.save_segment(start, length, carry, pad=pad)
        return self.apply_segment(start, length, saved, cts, pad=pad)

    def save_segment(
        self, start: Any, length: int, carry: Any, *, pad: bool = False
    ) -> tuple[Any, Any]:
        """The forward half of `reverse_segment`: run layers `start, ...,
        start + length - 1` from `carry` with one `lax.scan`, saving each
        layer's residuals under the inner policy (not its parameters, which
        are read from the stack again; and once, outside the loop, those that
        depend on neither the layer nor its input). `pad`: as in `run`.

        **Returns:**

        `(output, saved)`: the output of the last layer, and the residuals for
        `apply_segment` (a pytree of arrays, stacked over the `length` layers
        but for those kept once).
        """
        pad = self._pads(start, length, pad)
        # One layer traced outside the loop gives the layout (static) and says
        # which kept residuals depend on neither the layer's index nor its
        # input (an attention mask made from the sequence length, say): those
        # are the same for every layer, computed once, outside the loop, as
        # JAX's scan hoists them, not stacked.
        i0 = jnp.asarray(start, dtype=jnp.int32)
        one, _, (_, layout) = eqx.filter_make_jaxpr(
            lambda i, x: self._pullback(i, x)[1:]
        )(i0, carry)
        flat = [x for x in jtu.tree_leaves((i0, carry)) if eqx.is_array(x)]
        once = [not v for v in varying(one.jaxpr, [True] * len(flat))]
        layout = dataclasses.replace(layout, fixed=tuple(once))
        fixed = []
        if any(once):
            only, used = _jax_private.dce_jaxpr(one.jaxpr, once, True)
            args = [a for a, u in zip(flat, used) if u]
            fixed = eval_jaxpr(only, one.consts, args)

        def forward(i, x):
            out, residuals, _ = self._pullback(i, x)
            return out, [r for r, f in zip(residuals, once) if not f]

        def fwd_body(x, t):
            i = start + t
            if not pad:
                return forward(i, x)
            types = jax.make_jaxpr(lambda i, x: forward(i, x)[1])(i, x).out_avals

            def skip(i, x):
                return x, [_zeros_of_type(t) for t in types]

            return lax.cond(i < self.depth, forward, skip, i, x)

        ts = jnp.arange(length, dtype=jnp.int32)
        out, saved = lax.scan(fwd_body, carry, ts, unroll=self._unroll)
        return out, _Saved(saved, fixed, layout)

    def _pullback(self, i: Any, x: Any) -> tuple[Any, list, _Layout]:
        """Layer `i` at `x`: its output, the residuals its pullback keeps, and
        the `_Layout` that rebuilds the pullback from them (`fixed` not yet
        known). Residuals that are parameters or constants are loop-invariant
        (or a slice of the stack): they are left out of the kept residuals and
        read again on the way back."""
        out, vjp, invariant = self._vjp(i, x)
        leaves, tree = jtu.tree_flatten(vjp)
        kinds, residuals = [], []
        for leaf in leaves:
            k = next((k for k, v in enumerate(invariant) if v is leaf), None)
            if k is not None:
                kinds.append(("invariant", k))
            elif not isinstance(leaf, jax.core.Tracer):
                kinds.append(("constant", leaf))
            else:
                kinds.append(("kept", len(residuals)))
                residuals.append(leaf)
        return out, residuals, _Layout(tree, tuple(kinds))

    def apply_segment(
        self, start: Any, length: int, saved: Any, cts: Any, *, pad: bool = False
    ) -> Any:
        """The backward half of `reverse_segment`: the backward steps of layers
        `start + length - 1, ..., start`, from what `save_segment` returned as
        `saved` for the same layers. Returns the new `cts`. `pad`: as in
        `run`."""
        pad = self._pads(start, length, pad)
        layout, fixed, saved = saved.layout, saved.fixed, saved.arrays

        def backward(i, saved, cts):
            invariant = jtu.tree_leaves((self._consts, *self._params(i)))
            stacked, once = iter(saved), iter(fixed)
            kept = [next(once) if f else next(stacked) for f in layout.fixed]
            leaves = []
            for kind, k in layout.kinds:
                if kind == "invariant":
                    leaves.append(invariant[k])
                elif kind == "constant":
                    leaves.append(k)
                else:
                    leaves.append(kept[k])
            vjp = jtu.tree_unflatten(layout.tree, leaves)
            return self._apply(i, vjp, cts)

        if self._policy is not None and not stays_a_loop(length, self._unroll):
            return self._apply_in_loop(start, length, saved, cts, backward, pad)

        def bwd_body(cts, t_saved):
            t, saved = t_saved
            i = start + t
            if not pad:
                return backward(i, saved, cts), None
            return lax.cond(
                i < self.depth, backward, lambda i, s, cts: cts, i, saved, cts
            ), None

        ts = jnp.arange(length, dtype=jnp.int32)
        cts, _ = lax.scan(bwd_body, cts, (ts, saved), reverse=True, unroll=self._unroll)
        return cts

    def _apply_in_loop(self, start, length, saved, cts, backward, pad):
        """`apply_segment` under a policy where its `lax.scan` would not stay
        a loop (one layer, or unrolled): out of a loop, XLA runs the policy's
        recomputation, which needs no cotangent, as early as the forward pass
        and keeps all it computes until the backward step, as if nothing were
        recomputed (optimization barriers do not stop it on the CPU). So the
        backward steps run in a loop of at least two trips (one index more,
        skipped, for a single layer), never unrolled."""
        trips = max(length, 2)

        def body(cts, t):
            i = start + t
            s = _index(saved, jnp.minimum(t, length - 1))
            if not pad and trips == length:
                return backward(i, s, cts), None
            real = (t < length) & (i < self.depth) if pad else t < length
            return lax.cond(real, backward, lambda i, s, cts: cts, i, s, cts), None

        ts = jnp.arange(trips, dtype=jnp.int32)
        return lax.scan(body, cts, ts, reverse=True)[0]

    # --- the gradient state -------------------------------------------------

    def _initial_cts(self, ct: Any) -> Any:
        """The backward state before the last layer is reversed: the cotangent
        `ct` of the stack's output, and zero gradient buffers."""
        return (
            eqx.filter(ct, _is_diff),
            jtu.tree_map(_zeros_like, self._stacked_split[0]),
            jtu.tree_map(_zeros_like, self._consts_split[0]),
        )

    def _gradients(self, cts: Any, ct: Any) -> tuple[Any, Any, Any]:
        """`(consts, stacked, carry)` cotangents, shaped like the stack's
        arguments (`None` for what is not differentiable), from the backward
        state `cts` after the first layer has been reversed; `ct` is the
        cotangent the backward pass started from."""
        ct_x, gs, gc = cts
        return (
            eqx.combine(gc, _nones(self._consts_split[1])),
            eqx.combine(gs, _nones(self._stacked_split[1])),
            eqx.combine(ct_x, _nones(eqx.filter(ct, _is_diff, inverse=True))),
        )

    # --- stored carries -----------------------------------------------------

    @staticmethod
    def carries(n: int, like: Any) -> Any:
        """A buffer of `n` carries shaped like `like`, all zeros."""
        # Broadcast from `zeros_like`, so that under a mesh with Explicit axes
        # the buffer is sharded like the carry (along a new leading axis).
        return jtu.tree_map(
            lambda x: jnp.broadcast_to(_zeros_like(x), (n, *jnp.shape(x))), like
        )

    @staticmethod
    def store(buffer: Any, k: Any, carry: Any) -> Any:
        """`buffer` with `carry` in slot `k` (updated in place by XLA)."""
        return _set(buffer, carry, k)

    @staticmethod
    def load(buffer: Any, k: Any) -> Any:
        """The carry in slot `k` of `buffer`."""
        return _index(buffer, k)


class Schedule(abc.ABC):
    """How a stack of `D` layers is checkpointed across depth: the base class of
    [`eqx_remat.every`][], [`eqx_remat.nested`][], [`eqx_remat.recursive`][] and
    [`eqx_remat.binomial`][], and of any schedule you write (see the tutorial
    *Writing your own schedule*).

    A schedule is a frozen, hashable value (a frozen dataclass): it can be the
    static `checkpoint` field of an Equinox module, and rebuilding an equal
    schedule does not recompile.

    It says how the stack is differentiated, in three methods. `forward` runs
    the stack and keeps what `backward` needs; `backward` re-runs layers from
    what was kept and reverses every layer once, last to first; `evaluations`
    counts the layer evaluations this takes. Both passes work through a
    [`eqx_remat.Layers`][], which owns everything that is the same for every
    schedule: reading a layer's parameters by indexing the stack (never copying
    a segment of it), the backward step of a layer under the inner `policy`,
    writing each layer's parameter gradient straight into one gradient buffer,
    and `jax.vmap` without per-example parameter gradients.

    Schedules are reverse-mode: `jax.grad`, `jax.grad` of `jax.grad` and
    forward-over-reverse (`jax.jvp` of `jax.grad`, `jax.hessian`) work; forward
    mode through the stack itself (`jax.jvp`, `jax.jacfwd` of the checkpointed
    function) raises JAX's *"can't apply forward-mode autodiff (jvp) to a
    custom_vjp function"*. Use a policy, or `None`, for forward mode.

    **Attributes:**

    - `policy`: what each layer saves inside its own backward step (a policy or
      its name, see [`eqx_remat.policy`][]); `None` saves everything.
    """

    policy: Any

    @abc.abstractmethod
    def forward(self, layers: Layers, carry: Any) -> tuple[Any, Any]:
        """The forward pass: run all `layers.depth` layers from `carry`.

        **Arguments:**

        - `layers`: the stack, a [`eqx_remat.Layers`][].
        - `carry`: the input of the first layer.

        **Returns:**

        `(output, saved)`: the output of the last layer, and what `backward`
        needs (any pytree of arrays, e.g. `carry` itself, or a buffer of stored
        carries). Everything in `saved` stays in memory until the backward
        pass.
        """

    @abc.abstractmethod
    def backward(self, layers: Layers, saved: Any, cts: Any) -> Any:
        """The backward pass: reverse every layer exactly once, last to first,
        with `layers.reverse` (or `layers.reverse_segment`), re-running layers
        from what `saved` holds with `layers.run`.

        **Arguments:**

        - `layers`: the stack, a [`eqx_remat.Layers`][].
        - `saved`: what `forward` returned as `saved`.
        - `cts`: the backward state (opaque: cotangent and gradient buffers),
          to pass to `layers.reverse` and thread through loops.

        **Returns:**

        The backward state after the first layer has been reversed.
        """

    def unrolled(self, layers: Sequence[Callable[[Any], Any]], carry: Any) -> Any:
        """The same checkpoint for a Python list of layers that are not
        stacked: `layers` are `carry -> carry` functions that close over their
        parameters, run in order from `carry`; returns the last one's output.

        Implemented with nested `jax.checkpoint`s over segments of the list,
        so that no layer is copied into a stack (see
        [`eqx_remat.scan_layers`][]). The traced program holds every layer,
        and its layer evaluations are JAX's for nested checkpoints, which
        may be more than `evaluations(depth)`.
        A schedule of your own need not implement it: a list is then stacked
        and scanned, with a warning that says what that costs."""
        raise NotImplementedError

    def check_depth(self, depth: int) -> None:
        """Raise a `ValueError` when this schedule cannot checkpoint a stack of
        `depth` layers. Called by the engine when it traces the stack (forward
        pass included). Every depth >= 1 is fine unless a schedule says
        otherwise ([`eqx_remat.ranges`][] needs its counts to add up to
        `depth`)."""
        del depth

    def policies(self) -> tuple[Any, ...]:
        """Every inner policy this schedule applies to layers: `(self.policy,)`
        unless a schedule says otherwise ([`eqx_remat.ranges`][] gives each
        part's). The engine checks the names of the name policies among them
        against the layer's `checkpoint_name` tags when it traces the stack,
        forward pass included, so a typo fails at the same point as a policy
        given directly."""
        return (self.policy,)

    def kept(self, depth: int) -> tuple[int, int] | None:
        """What this schedule holds at once for a stack of `depth` layers, as
        `(carries, layers)`: the most layer inputs it stores at once, and the
        most layers whose residuals (what the inner `policy` saves) it holds at
        once in the backward pass. `None` where a schedule does not say (the
        default). [`eqx_remat.plan`][] uses it to skip compiling a schedule
        that cannot fit a budget."""
        del depth
        return None

    @abc.abstractmethod
    def evaluations(self, depth: int) -> int:
        """The number of layer evaluations for a stack of `depth` layers: calls
        of a layer's forward computation outside that layer's own backward step,
        the forward pass included (so at least `depth`). The backward step of a
        layer (its `jax.vjp` and pullback) is counted apart: every schedule does
        exactly one per layer. A layer reversed from residuals saved by an
        inner policy recomputes inside its backward step what the policy did
        not save: that recompute counts as one more evaluation.
        [`eqx_remat.count_flops`][] of a gradient counts exactly these
        evaluations (for a policy that recomputes the whole layer; less for one
        that saves part of it)."""


def remat_scan(
    step: Callable[[Any, Any, Any], Any],
    consts: Any,
    stacked: Any,
    carry: Any,
    depth: int,
    schedule: Schedule,
    unroll: int | bool = 1,
) -> Any:
    """Apply `step(consts, stacked[i], carry)` for `i < depth`, checkpointed by
    `schedule`. Every array in `stacked` has a leading axis of length `depth`.
    `step` may close over arrays (tracers included): they are made constants."""
    schedule.check_depth(depth)
    carry = jtu.tree_map(jnp.asarray, carry)  # Python scalars have no shape
    consts = _arrays(consts)
    step, consts, jaxpr = _closure_converted(step, consts, stacked, carry)
    _check_inner_names(jaxpr, schedule)
    if _innermost_is_vmap():
        vmapped = _vmapped(step, depth, schedule, unroll, _vmap_names())
        return vmapped(consts, stacked, carry)
    return _custom_vjp(step, depth, schedule, unroll)(consts, stacked, carry)


def _arrays(tree: Any) -> Any:
    """Every array leaf of `tree` as a JAX array: a Python float traced by
    `jax.grad` would otherwise reach the backward pass as a float, which
    `_is_diff` does not differentiate."""
    return jtu.tree_map(lambda x: jnp.asarray(x) if eqx.is_array(x) else x, tree)


def _closure_converted(step, consts, stacked, carry):
    """`(step', (consts, hoisted), jaxpr)`: `step` traced once, on the first
    layer, to `jaxpr`, and `step'` computing it with every array `step`
    closes over in `hoisted` (tracers of `jax.grad` or `jax.vmap` included,
    of any dtype): a custom_vjp must not close over a tracer, and what it is
    passed is differentiated and batched as a parameter is. (Unlike
    `eqx.filter_closure_convert`'s, calls are not checked against the example:
    outside `jax.jit`, a sharding may differ between the two.)"""
    layer = jax.eval_shape(lambda s: _index(s, 0), stacked)  # shapes: no slicing
    closed, out, out_static = eqx.filter_make_jaxpr(step)(consts, layer, carry)
    treedef = jtu.tree_structure(out)

    def converted(cs, s, c):
        consts, hoisted = cs
        args = jtu.tree_leaves(eqx.filter((consts, s, c), eqx.is_array))
        flat = eval_jaxpr(closed.jaxpr, hoisted, args)
        return eqx.combine(jtu.tree_unflatten(treedef, flat), out_static)

    return converted, (consts, _arrays(list(closed.consts))), closed.jaxpr


def _check_inner_names(jaxpr: Jaxpr, schedule: Schedule) -> None:
    """Check the names of the schedule's inner name policies against the tags
    of one layer's `jaxpr` (`check_tags`), on the forward pass: otherwise they
    are checked only where they are applied, in the backward pass, and a typo
    would go unnoticed by a function that is not differentiated."""
    pols = [to_jax_policy(p) for p in schedule.policies()]
    pols = [p for p in pols if isinstance(p, NamePolicy)]
    if not pols:
        return
    tags = checkpoint_names(jaxpr)
    for pol in pols:
        check_tags(pol, tags)


def _vmapped(step, depth, schedule, unroll, names: dict[str, Any]):
    def fn(consts, stacked, carry):
        return _custom_vjp(step, depth, schedule, unroll)(consts, stacked, carry)

    fn = jax.custom_batching.custom_vmap(fn)

    @fn.def_vmap
    def rule(axis_size, in_batched, consts, stacked, carry):
        consts_b, stacked_b, carry_b = in_batched
        # The depth axis must stay leading: move the batch axis behind it.
        stacked = jtu.tree_map(
            lambda x, b: jnp.moveaxis(x, 0, 1) if b else x, stacked, stacked_b
        )
        carry = jtu.tree_map(
            lambda x, b: x if b else jnp.broadcast_to(x, (axis_size, *x.shape)),
            carry,
            carry_b,
        )

        def batched_step(c, s, x):
            # Unbatched values are closed over rather than passed with
            # `in_axes=None`: under a mesh with Explicit axes, vmap refuses
            # unmapped arguments sharded along the axis it maps over (FSDP).
            c_b, c_u = _split_by(c, consts_b)
            s_b, s_u = _split_by(s, stacked_b)

            def one(c_b, s_b, x):
                return step(eqx.combine(c_b, c_u), eqx.combine(s_b, s_u), x)

            return jax.vmap(one, **names)(c_b, s_b, x)

        out = remat_scan(batched_step, consts, stacked, carry, depth, schedule, unroll)
        return out, jtu.tree_map(lambda _: True, out)

    return fn


def _split_by(tree: Any, batched: Any) -> tuple[Any, Any]:
    """`tree` split into its batched and unbatched leaves (`None` elsewhere)."""
    b = jtu.tree_map(lambda x, f: x if f else None, tree, batched)
    u = jtu.tree_map(lambda x, f: None if f else x, tree, batched)
    return b, u


def _custom_vjp(step, depth: int, schedule: Schedule, unroll):
    def layers(consts, stacked, policy=None):
        return Layers(step, consts, stacked, depth, policy, unroll)

    @jax.custom_vjp
    def fn(consts, stacked, carry):
        return layers(consts, stacked).run(carry, 0, depth)

    def fn_fwd(consts, stacked, carry):
        # Not `fn(...)`: a custom_vjp function called here could not be
        # differentiated forward (jax.jvp of jax.grad).
        out, saved = schedule.forward(layers(consts, stacked), carry)
        return out, (consts, stacked, saved)

    def fn_bwd(res, ct):
        consts, stacked, saved = res
        stack = layers(consts, stacked, schedule.policy)
        cts = schedule.backward(stack, saved, stack._initial_cts(ct))
        return stack._gradients(cts, ct)

    fn.defvjp(fn_fwd, fn_bwd)
    return fn
