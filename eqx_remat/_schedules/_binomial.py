"""Binomial (revolve) checkpointing: the offline schedule and its backward pass.

The revolve schedule for `(depth, slots)` is computed once, in Python, as a table
of *actions*. Each action reads a stored carry from a slot, advances it through
`n` layers, and then either stores the result in a slot or reverses the next layer
(`jax.vjp` of that one layer, applied to the running cotangent). The backward pass
executes the table as one `lax.scan` over its rows; advancing by a dynamic `n` is a
binary decomposition `n = Σ 2^k` into static `lax.scan`s of `2^k` layers, each
behind a `lax.cond` whose predicate is a column of the table. So the traced
program holds the layer `O(log D)` times, never `D` times, every layer evaluation
the schedule asks for is run exactly once, everything stays
reverse-differentiable (`jax.grad` of `jax.grad` works), and
[`eqx_remat.count_flops`][], which follows `lax.cond`s decided by constant
tables, counts exactly the evaluations the table runs.
"""

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax

from .._policies._named import to_jax_policy
from .._validate import check_int
from ._engine import Layers, Schedule
from ._unrolled import Layer, each, segment


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

    `binomial(s)` on `D` layers does `evaluations(D)` layer evaluations, the
    fewest of any schedule that keeps at most `s` carries stored; `slots >= D`
    stores every layer's input (`D` evaluations, plain per-layer
    rematerialisation). Memory: at most `slots` stored carries plus one working
    carry (the one being advanced), and one parameter-gradient buffer. The cost
    model, its recurrence and closed form: [the binomial cost
    model][the-binomial-cost-model].

    The traced program holds the layer `O(log D)` times (never `D` times), so it
    compiles in about the same time at any depth, and
    [`eqx_remat.count_flops`][] counts exactly the evaluations above
    (`evaluations(D)`). `jax.grad` of `jax.grad` works, but the second-order
    pass is not checkpointed (it keeps every re-run carry); prefer `jax.jvp` of
    `jax.grad` for Hessian-vector products.

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
        object.__setattr__(self, "slots", check_int("binomial", "slots", self.slots, 1))
        to_jax_policy(self.policy, fn="binomial")

    def forward(self, layers: Layers, carry: Any) -> tuple[Any, Any]:
        depth = layers.depth
        slots = min(self.slots, depth)
        store_at, _ = _schedule(depth, slots)
        # Slot `slots` is the working slot: the input of the last layer, which
        # the first reversal starts from, and scratch for unstored inputs.
        buf = layers.carries(slots + 1, carry)

        def body(state, i_k):
            x, buf = state
            i, k = i_k
            return (layers.step(i, x), layers.store(buf, k, x)), None

        xs = (jnp.arange(depth, dtype=jnp.int32), jnp.asarray(store_at))
        (out, buf), _ = lax.scan(body, (carry, buf), xs)
        return out, buf

    def backward(self, layers: Layers, saved: Any, cts: Any) -> Any:
        depth = layers.depth
        _, actions = _schedule(depth, min(self.slots, depth))
        # Whether each action reverses, and the bits of its advance: a table
        # apart from the actions, so that every `lax.cond` below is decided by
        # a constant of it (and `count_flops` counts each distinct row once).
        nbits = max(1, int(actions[:, 2].max()).bit_length())
        bits = (actions[:, 2:3] >> np.arange(nbits)[::-1]) & 1
        flags = np.concatenate([actions[:, 4:5], bits], axis=1).astype(np.int32)

        def advance(x, pos, flags):
            """Layers `pos, ..., pos + n - 1`, `n` given by its bits."""
            for b, k in enumerate(reversed(range(nbits))):
                size, take = 2**k, flags[1 + b]
                run = lambda x, pos, size=size: layers.run(x, pos, size)
                x = lax.cond(take == 1, run, lambda x, pos: x, x, pos)
                pos = pos + take * size
            return x

        def body(state, row_flags):
            (buf, cts), (row, flags) = state, row_flags
            src, pos, n, dst = (row[k] for k in range(4))
            rev = flags[0]
            x = advance(layers.load(buf, src), pos, flags)
            buf = layers.store(buf, dst, x)
            i = jnp.minimum(pos + n, depth - 1)
            reverse = lambda cts: layers.reverse(i, x, cts)
            cts = lax.cond(rev == 1, reverse, lambda cts: cts, cts)
            return (buf, cts), None

        xs = (jnp.asarray(actions[:, :4]), jnp.asarray(flags))
        (_, cts), _ = lax.scan(body, (saved, cts), xs)
        return cts

    def unrolled(self, layers: Sequence[Layer], carry: Any) -> Any:
        """Revolve's splits as nested segments: `n` layers with `s` slots
        advance `j` layers (`_best_split`) in a segment that keeps its input,
        then reverse the other `n - j` in a segment of their own, with one slot
        fewer; with one slot, all but the last layer are one segment, run
        again from its input for each layer reversed."""
        policy = to_jax_policy(self.policy)

        def run(start: int, n: int, s: int, x: Any) -> Any:
            if n == 1:
                return each(layers[start : start + 1], x, policy)
            j = n - 1 if s == 1 else _best_split(n, s)
            x = segment(functools.partial(run, start, j, s))(x)
            if s == 1:
                return each(layers[start + j : start + n], x, policy)
            return segment(functools.partial(run, start + j, n - j, s - 1))(x)

        depth = len(layers)
        return run(0, depth, min(self.slots, depth), carry)

    def kept(self, depth: int) -> tuple[int, int]:
        """The stored carries and the working one; one layer reversed at a time."""
        return min(self.slots, depth) + 1, 1

    def evaluations(self, depth: int) -> int:
        """`F(depth, slots) + 1`, the fewest possible (see above)."""
        return optimal_evaluations(depth, self.slots)


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


def _best_split(length: int, s: int) -> int:
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
        j = _best_split(length, s)
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
