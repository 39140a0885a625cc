"""The checkpointed scan behind every depth schedule.

`remat_scan(step, consts, stacked, carry, plan)` computes

    for i in range(D): carry = step(consts, stacked[i], carry)

with a plain `lax.scan` on the forward pass, saving only its inputs, and a
`jax.custom_vjp` backward pass that follows a `Plan`: split the stack into
`splits[0]` segments, run forward storing each segment's input carry, then
differentiate the segments last to first, recursing into `splits[1]`, ..., down to
segments of `leaf` layers that are differentiated with `jax.vjp`.

Three properties matter, and are why this is a custom_vjp rather than nested
`lax.scan`s left to autodiff:

- The parameter gradients are written, layer by layer, into one buffer threaded
  through the loops. Autodiff of nested scans allocates a full gradient buffer per
  nesting level (O(params · log D) for bisection).
- The stored carries live in one buffer of `plan.slots` entries, indexed
  dynamically: a segment's first child reuses the segment's own slot, so bisection
  stores `ceil(log2 D) + 1` carries, not two per level.
- Each nesting level is one traced loop, so the program has O(len(splits))
  equations whatever the depth. Depths that the plan does not divide exactly are
  padded, and padded layers are skipped with `lax.cond`.

Under `jax.vmap` (the innermost transformation) the custom_vjp would be batched
with per-example parameter gradients, materialising `batch × params`. A
`custom_vmap` rule instead calls the engine once with a batched `step`, so the
gradient of each layer's parameters is summed over the batch inside that layer's
backward pass.
"""

import math
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jax import lax
from jax._src import core as _jax_core
from jax._src.interpreters import batching as _jax_batching

from ._policies import checkpointed
from ._schedules import Plan


def _index(tree, i):
    return jtu.tree_map(lambda x: lax.dynamic_index_in_dim(x, i, keepdims=False), tree)


def _set(tree, value, i):
    return jtu.tree_map(
        lambda x, v: lax.dynamic_update_index_in_dim(x, v, i, axis=0), tree, value
    )


def _is_diff(x) -> bool:
    return eqx.is_inexact_array(x)


def _innermost_is_vmap() -> bool:
    # The trace that a primitive bound now would be processed by. Private API,
    # pinned by the jax version range in pyproject.toml.
    return isinstance(_jax_core.trace_ctx.trace, _jax_batching.BatchTrace)


def remat_scan(
    step: Callable[[Any, Any, Any], Any],
    consts: Any,
    stacked: Any,
    carry: Any,
    plan: Any,
):
    """Apply `step(consts, stacked[i], carry)` for `i < plan.depth`, checkpointed
    by `plan`. `stacked` has a leading axis of length `plan.depth`.

    `plan` is a `Plan`, or a plan with its own backward pass: an object with a
    `custom_vjp(step)` method (binomial's `RevolvePlan`)."""
    carry = jtu.tree_map(jnp.asarray, carry)  # Python scalars have no shape
    if _innermost_is_vmap():
        return _vmapped(step, plan)(consts, stacked, carry)
    return _custom_vjp(step, plan)(consts, stacked, carry)


def _vmapped(step, plan):
    def fn(consts, stacked, carry):
        return _custom_vjp(step, plan)(consts, stacked, carry)

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
        c_axes = jtu.tree_map(lambda b: 0 if b else None, consts_b)
        s_axes = jtu.tree_map(lambda b: 0 if b else None, stacked_b)

        def batched_step(c, s, x):
            return jax.vmap(step, in_axes=(c_axes, s_axes, 0))(c, s, x)

        out = remat_scan(batched_step, consts, stacked, carry, plan)
        return out, jtu.tree_map(lambda _: True, out)

    return fn


def _custom_vjp(step, plan: Any):
    if not isinstance(plan, Plan):
        # A schedule with its own backward pass (binomial's RevolvePlan).
        return plan.custom_vjp(step)
    depth = plan.depth
    masked = plan.padded > depth

    def run_layer(consts, stacked, carry, i, layer_fn):
        s_i = _index(stacked, jnp.minimum(i, depth - 1))
        if not masked:
            return layer_fn(consts, s_i, carry)
        return lax.cond(i < depth, lambda: layer_fn(consts, s_i, carry), lambda: carry)

    def run_forward(consts, stacked, carry, start, length):
        def body(c, t):
            return run_layer(consts, stacked, c, start + t, step), None

        return lax.scan(body, carry, jnp.arange(length))[0]

    @jax.custom_vjp
    def fn(consts, stacked, carry):
        body = lambda c, s: (step(consts, s, c), None)
        return lax.scan(body, carry, stacked, length=depth)[0]

    def fn_fwd(consts, stacked, carry):
        return fn(consts, stacked, carry), (consts, stacked, carry)

    def fn_bwd(res, ct):
        consts, stacked, carry0 = res
        consts_d, consts_nd = eqx.partition(consts, _is_diff)
        stacked_d, stacked_nd = eqx.partition(stacked, _is_diff)
        carry_d_ct = eqx.filter(ct, _is_diff)

        # Differentiate `plan.leaf` layers starting at `start`, from `carry`.
        layer_fn = step
        if plan.policy is not None:
            layer_fn = checkpointed(step, plan.policy)

        def leaf(start, carry, ct, gs, gc):
            idx = start + jnp.arange(plan.leaf)
            clipped = jnp.minimum(idx, depth - 1)
            seg_d = jtu.tree_map(lambda x: x[clipped], stacked_d)
            seg_nd = jtu.tree_map(lambda x: x[clipped], stacked_nd)
            carry_d, carry_nd = eqx.partition(carry, _is_diff)

            def segment(c_d, s_d, x_d):
                c = eqx.combine(c_d, consts_nd)
                s = eqx.combine(s_d, seg_nd)
                x = eqx.combine(x_d, carry_nd)

                def body(x, t):
                    s_t = _index(s, t)
                    if not masked:
                        return layer_fn(c, s_t, x), None
                    return lax.cond(
                        idx[t] < depth, lambda: layer_fn(c, s_t, x), lambda: x
                    ), None

                out = lax.scan(body, x, jnp.arange(plan.leaf))[0]
                return eqx.filter(out, _is_diff)

            _, vjp = jax.vjp(segment, consts_d, seg_d, carry_d)
            g_c, g_s, g_x = vjp(ct)
            # Padded positions (idx >= depth) are out of bounds and dropped.
            gs = jtu.tree_map(lambda buf, g: buf.at[idx].set(g, mode="drop"), gs, g_s)
            gc = jtu.tree_map(lambda a, b: a + b, gc, g_c)
            return g_x, gs, gc

        def level(lvl, start, slot, ct, slots, gs, gc):
            if lvl == len(plan.splits):
                ct, gs, gc = leaf(start, _index(slots, slot), ct, gs, gc)
                return ct, slots, gs, gc
            n = plan.splits[lvl]
            child = plan.padded // math.prod(plan.splits[: lvl + 1])
            base = 1 + sum(c - 1 for c in plan.splits[:lvl])

            def fwd_body(state, j):
                x, slots = state
                x = run_forward(consts, stacked, x, start + j * child, child)
                return (x, _set(slots, x, base + j)), None

            x0 = _index(slots, slot)
            (_, slots), _ = lax.scan(fwd_body, (x0, slots), jnp.arange(n - 1))

            def bwd_body(state, j):
                ct, slots, gs, gc = state
                child_slot = jnp.where(j == 0, slot, base + j - 1)
                state = level(lvl + 1, start + j * child, child_slot, ct, slots, gs, gc)
                return state, None

            state, _ = lax.scan(
                bwd_body, (ct, slots, gs, gc), jnp.arange(n), reverse=True
            )
            return state

        slots = jtu.tree_map(
            lambda x: jnp.zeros((plan.slots, *x.shape), x.dtype).at[0].set(x), carry0
        )
        gs = jtu.tree_map(jnp.zeros_like, stacked_d)
        gc = jtu.tree_map(jnp.zeros_like, consts_d)
        ct_x, _, gs, gc = level(0, 0, 0, carry_d_ct, slots, gs, gc)
        return (
            eqx.combine(gc, _nones(consts_nd)),
            eqx.combine(gs, _nones(stacked_nd)),
            eqx.combine(ct_x, _nones(eqx.filter(carry0, _is_diff, inverse=True))),
        )

    fn.defvjp(fn_fwd, fn_bwd)
    return fn


def _nones(tree):
    return jtu.tree_map(lambda _: None, tree)
