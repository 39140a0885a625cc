"""Binomial (revolve) checkpointing: the offline schedule and its backward pass.

The revolve schedule for `(depth, slots)` is computed once, in Python, as a table
of *actions*. Each action reads a stored carry from a slot, advances it through
`n` layers, and then either stores the result in a slot or reverses the next layer
(`jax.vjp` of that one layer, applied to the running cotangent). The backward pass
executes the table as one `lax.scan` over its rows; advancing by a dynamic `n` is a
binary decomposition `n = Σ 2^k` into static `lax.scan`s of `2^k` layers, each
behind a `lax.cond`. So the traced program holds the layer `O(log D)` times, never
`D` times, every layer evaluation the schedule asks for is run exactly once, and
everything stays reverse-differentiable (`jax.grad` of `jax.grad` works).
"""

import contextlib
import dataclasses
import functools
from collections.abc import Iterator
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax import lax
from jax._src import config as _jax_config

from ._engine import _index, _is_diff, _nones, _set
from ._policies import Policy, checkpointed, policy as _normalise_policy
from ._schedules import Schedule, _check_int, _check_policy


@dataclasses.dataclass(frozen=True)
class binomial(Schedule):
    """Binomial checkpointing (Griewank–Walther *revolve*): the fewest possible
    layer evaluations for a stack of `D` layers when at most `slots` carries may
    be stored at once.

    The schedule is computed offline from `(D, slots)`. The forward pass stores the
    first carries the schedule needs (at most `slots`, the stack's input included)
    while it computes the output; the backward pass re-runs layers from stored
    carries, storing new ones in freed slots, and differentiates one layer at a time
    — the last layer first. With `r` evaluations per layer, `slots` carries reverse
    up to `C(slots + r, slots)` layers.

    **Cost model.** One *layer evaluation* is one call of a layer's forward
    computation outside that layer's own backward step. The backward step of a
    layer (`jax.vjp` at its stored or recomputed input, then the pullback) is
    counted apart: every schedule, and no checkpointing at all, does exactly one per
    layer. The forward pass is included (it evaluates all `D` layers). Then
    `binomial(s)` on `D` layers does `F(D, s) + 1` layer evaluations, where

    - `F(1, s) = 0` (a lone layer is reversed straight from its stored input),
    - `F(l, 1) = l (l - 1) / 2` (one slot: re-run from the input for every layer),
    - `F(l, s) = min over 0 < j < l of j + F(l - j, s - 1) + F(j, s)` (advance `j`
      layers and store that carry, reverse the last `l - j` with one slot fewer,
      then the first `j` with the slot freed again),

    in closed form `F(l, s) = r l - C(s + r, s + 1)` with `r` the smallest integer
    such that `C(s + r, s) >= l`. The `+ 1` is the last layer, evaluated once by the
    forward pass to produce the output and once more in its backward step. No
    schedule that keeps at most `s` carries stored does fewer evaluations.
    `slots >= D` stores every layer's input: `D` evaluations, the cost of plain
    per-layer rematerialisation. Memory: at most `slots` stored carries plus one
    working carry (the one being advanced), and one parameter-gradient buffer.

    The traced program holds the layer `O(log D)` times (never `D` times), so it
    compiles in about the same time at any depth. Advances of a dynamic number
    of layers sit behind `lax.cond`s, which [`eqx_remat.count_flops`][] counts as
    if they all ran (an upper bound); [`eqx_remat.plan`][] counts `binomial`
    exactly. `jax.grad` of `jax.grad` works,
    but the second-order pass is not checkpointed (it keeps every re-run carry);
    prefer `jax.jvp` of `jax.grad` for Hessian-vector products.

    ??? cite "Algorithm 799: revolve"
        ```bibtex
        @article{griewank2000revolve,
            title={Algorithm 799: revolve: an implementation of checkpointing for
                   the reverse or adjoint mode of computational differentiation},
            author={Griewank, Andreas and Walther, Andrea},
            journal={ACM Transactions on Mathematical Software},
            volume={26}, number={1}, pages={19--45},
            year={2000}
        }
        ```

    **Arguments:**

    - `slots`: the number of carries that may be stored at once, the stack's input
      included; an int >= 1.
    - `policy`: what each layer saves inside its own backward step (a policy or its
      name). Layers are reversed one at a time, so this only changes the memory of
      one layer's `vjp`; `None` saves everything inside it.
    """

    slots: int
    policy: Any = None

    def __post_init__(self):
        _check_int("binomial", "slots", self.slots, 1)
        _check_policy("binomial", self.policy)

    def _plan(self, depth: int) -> "RevolvePlan":
        return RevolvePlan(
            depth, min(self.slots, depth), _normalise_policy(self.policy)
        )


@dataclasses.dataclass(frozen=True)
class RevolvePlan:
    """A binomial schedule for `depth` layers with `slots` stored carries."""

    depth: int
    slots: int
    policy: Policy | None

    def custom_vjp(self, step):
        """The checkpointed scan of `step` (see `_engine.remat_scan`)."""
        return _revolve_vjp(step, self)

    def evaluations(self) -> int:
        """Layer evaluations, forward pass included (the docstring's cost model)."""
        return optimal_evaluations(self.depth, self.slots)


# ---------------------------------------------------------------------------
# The offline schedule
# ---------------------------------------------------------------------------


def _betas(s: int, upto: int) -> np.ndarray:
    """`C(s + r, s)` for `r = 0, 1, ...` until it reaches `upto`."""
    out = [1]
    r = 0
    while out[-1] < upto:
        r += 1
        out.append(out[-1] * (s + r) // r)
    return np.asarray(out, dtype=np.int64)


def _cost(lengths: np.ndarray, s: int) -> np.ndarray:
    """`F(l, s)` of the docstring for an array of `l >= 1`, in closed form."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if s == 1:
        return lengths * (lengths - 1) // 2
    betas = _betas(s, int(lengths.max(initial=1)))
    r = np.searchsorted(betas, lengths, side="left")
    # C(s + r, s + 1) = C(s, r - 1) (s + r) / (s + 1), zero for r = 0.
    rr = np.arange(len(betas), dtype=np.int64)
    below = np.concatenate([[0], betas[:-1] * (s + rr[1:]) // (s + 1)])
    return r * lengths - below[r]


def optimal_evaluations(depth: int, slots: int) -> int:
    """The fewest layer evaluations, forward pass included, that reverse `depth`
    layers with at most `slots` stored carries: `F(depth, slots) + 1`."""
    slots = min(slots, depth)
    return int(_cost(np.asarray([depth]), slots)[0]) + 1


def _split(length: int, s: int) -> int:
    """The optimal number of layers to advance before storing a carry."""
    j = np.arange(1, length, dtype=np.int64)
    total = j + _cost(length - j, s - 1) + _cost(j, s)
    return int(j[np.argmin(total)])


@functools.lru_cache(maxsize=64)
def _schedule(depth: int, slots: int) -> tuple[np.ndarray, np.ndarray]:
    """The revolve schedule as `(store_at, actions)`.

    `store_at[i]` is the slot where the forward pass stores the input of layer
    `i`; slot `slots` is the working slot (a scratch slot for layers whose input is
    not stored). `actions[t] = (src, pos, n, dst, reverse)`: advance the carry in
    slot `src` through layers `pos, ..., pos + n - 1`, then store it in `dst`
    (`reverse == 0`) or reverse layer `pos + n` from it (`reverse == 1`).
    """
    work = slots
    actions: list[tuple[int, int, int, int, int]] = []
    # Explicit stack (depth-first, right part first): Python recursion would be
    # as deep as the stack of layers.
    todo = [(0, depth, slots, 0)]
    while todo:
        pos, length, s, src = todo.pop()
        if length == 1 or s == 1:
            for n in range(length - 1, -1, -1):
                actions.append((src, pos, n, work, 1))
            continue
        j = _split(length, s)
        dst = slots - s + 1
        actions.append((src, pos, j, dst, 0))
        todo.append((pos, j, s, src))
        todo.append((pos + j, length - j, s - 1, dst))

    # The leading stores advance from the input along one path: the forward pass
    # does them while it computes the output, and also keeps the input of the
    # last layer (in the working slot) for the first reversal.
    store_at = np.full(depth, work, dtype=np.int32)
    store_at[0] = 0
    first = 0
    while actions[first][4] == 0:
        _, pos, n, dst, _ = actions[first]
        store_at[pos + n] = dst
        first += 1
    src, pos, n, dst, _ = actions[first]
    if n > 0:
        actions[first] = (work, depth - 1, 0, work, 1)
    rest = np.asarray(actions[first:], dtype=np.int32).reshape(-1, 5)
    store_at.setflags(write=False)
    rest.setflags(write=False)
    return store_at, rest


# ---------------------------------------------------------------------------
# The backward pass
# ---------------------------------------------------------------------------

# `count_flops` weights a `lax.cond` as its most expensive branch, so it counts the
# backward pass below as if every skipped advance ran. While counting, the
# backward pass is traced as a *twin* instead: straight scans with the same layer
# evaluations and trip counts, which a jaxpr walker weights exactly (it is never
# compiled). The switch is a JAX config state in the trace context, so JAX's
# tracing caches keep the twin and the real program apart. Private API, pinned by
# the jax version range in pyproject.toml.
_flop_twin = _jax_config.bool_state(
    "eqx_remat_binomial_flop_twin",
    False,
    help="Trace binomial backward passes as FLOP-counting twins (never compiled).",
    include_in_trace_context=True,
)


@contextlib.contextmanager
def exact_flops() -> Iterator[None]:
    """Inside this context, `binomial` backward passes are traced as straight-line
    twins whose jaxpr `count_flops` counts exactly. Only for counting: the twin
    computes wrong values."""
    with _flop_twin(True):
        yield


def _revolve_vjp(step, plan: RevolvePlan):
    depth = plan.depth
    store_at, actions = _schedule(depth, plan.slots)
    # At least one bit: a carry read from the buffer then always comes out of a
    # `lax.cond`, and XLA updates the buffer in place. (Read straight from the
    # buffer and written back to it, the carry made XLA copy the whole buffer
    # on every action.)
    nbits = max(1, int(actions[:, 2].max()).bit_length())
    layer_fn = step if plan.policy is None else checkpointed(step, plan.policy)

    def advance(consts, stacked, x, pos, n):
        """Layers `pos, ..., pos + n - 1` for a traced `0 <= n < 2**nbits`."""
        for k in reversed(range(nbits)):
            size = 2**k
            take = (n >> k) & 1

            def run(x, start, size=size):
                def body(x, t):
                    return step(consts, _index(stacked, start + t), x), None

                return lax.scan(body, x, jnp.arange(size))[0]

            x = lax.cond(take == 1, run, lambda x, _: x, x, pos)
            pos = pos + take * size
        return x

    @jax.custom_vjp
    def fn(consts, stacked, carry):
        body = lambda c, s: (step(consts, s, c), None)
        return lax.scan(body, carry, stacked, length=depth)[0]

    def fn_fwd(consts, stacked, carry):
        buf = jtu.tree_map(
            lambda x: jnp.broadcast_to(x, (plan.slots + 1, *jnp.shape(x))), carry
        )

        def body(state, s_k):
            x, buf = state
            s, k = s_k
            buf = _set(buf, x, k)
            return (step(consts, s, x), buf), None

        (out, buf), _ = lax.scan(body, (carry, buf), (stacked, jnp.asarray(store_at)))
        return out, (consts, stacked, buf)

    def fn_bwd(res, ct):
        consts, stacked, buf = res
        consts_d, consts_nd = eqx.partition(consts, _is_diff)
        stacked_d, stacked_nd = eqx.partition(stacked, _is_diff)
        ct = eqx.filter(ct, _is_diff)

        def reverse(i, x, ct):
            s_nd = _index(stacked_nd, i)
            x_d, x_nd = eqx.partition(x, _is_diff)

            def layer(c_d, s_d, x_d):
                c = eqx.combine(c_d, consts_nd)
                s = eqx.combine(s_d, s_nd)
                out = layer_fn(c, s, eqx.combine(x_d, x_nd))
                return eqx.filter(out, _is_diff)

            _, vjp = jax.vjp(layer, consts_d, _index(stacked_d, i), x_d)
            g_c, g_s, g_x = vjp(ct)
            return g_x, g_s, g_c

        def skip(i, x, ct):
            zeros = jtu.tree_map(jnp.zeros_like, _index(stacked_d, i))
            return ct, zeros, jtu.tree_map(jnp.zeros_like, consts_d)

        def body(state, action):
            buf, ct, gs, gc = state
            src, pos, n, dst, rev = (
                action[0],
                action[1],
                action[2],
                action[3],
                action[4],
            )
            x = advance(consts, stacked, _index(buf, src), pos, n)
            buf = _set(buf, x, dst)
            i = jnp.minimum(pos + n, depth - 1)
            ct, g_s, g_c = lax.cond(rev == 1, reverse, skip, i, x, ct)
            gs = jtu.tree_map(
                lambda b, g: lax.dynamic_update_index_in_dim(
                    b, lax.dynamic_index_in_dim(b, i, keepdims=False) + g, i, axis=0
                ),
                gs,
                g_s,
            )
            gc = jtu.tree_map(lambda a, b: a + b, gc, g_c)
            return (buf, ct, gs, gc), None

        def twin(buf, ct, gs, gc):
            """The same layer evaluations, trip counts and bookkeeping as `body`
            over `actions`, as straight scans: all advances, then the stores'
            bookkeeping, then the reversals. For `count_flops` only."""

            def accumulate(gs, gc, i, g_s, g_c):
                gs = jtu.tree_map(lambda b, g: b.at[i].add(g), gs, g_s)
                return gs, jtu.tree_map(lambda a, b: a + b, gc, g_c)

            def advance_body(x, t):
                return step(consts, _index(stacked, lax.rem(t, depth)), x), None

            advances = jnp.arange(int(actions[:, 2].sum()), dtype=jnp.int32)
            x = lax.scan(advance_body, _index(buf, 0), advances)[0]

            def store_body(state, i):
                _, g_s, g_c = skip(i, x, ct)
                return accumulate(*state, i, g_s, g_c), None

            stores = jnp.zeros(len(actions) - depth, jnp.int32)
            (gs, gc), _ = lax.scan(store_body, (gs, gc), stores)

            def reverse_body(state, i):
                ct, gs, gc = state
                ct, g_s, g_c = reverse(i, x, ct)
                return (ct, *accumulate(gs, gc, i, g_s, g_c)), None

            layers = jnp.arange(depth, dtype=jnp.int32)
            (ct, gs, gc), _ = lax.scan(reverse_body, (ct, gs, gc), layers)
            return ct, gs, gc

        gs = jtu.tree_map(jnp.zeros_like, stacked_d)
        gc = jtu.tree_map(jnp.zeros_like, consts_d)
        if _flop_twin.value:
            ct_x, gs, gc = twin(buf, ct, gs, gc)
        else:
            init = (buf, ct, gs, gc)
            (_, ct_x, gs, gc), _ = lax.scan(body, init, jnp.asarray(actions))
        carry_nd = eqx.filter(_index(buf, 0), _is_diff, inverse=True)
        return (
            eqx.combine(gc, _nones(consts_nd)),
            eqx.combine(gs, _nones(stacked_nd)),
            eqx.combine(ct_x, _nones(carry_nd)),
        )

    fn.defvjp(fn_fwd, fn_bwd)
    return fn
