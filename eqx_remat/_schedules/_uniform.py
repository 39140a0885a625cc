"""The uniform-split schedules (`every`, `nested`, `recursive`): implementations of
the engine's `Schedule`, how a stack of D layers is checkpointed across depth."""

import abc
import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
from jax import lax

from .._policies._named import to_jax_policy
from .._validate import check_int
from ._engine import Layers, Schedule
from ._unrolled import Layer, each, segment


def _ceil_root(n: int, k: int) -> int:
    """The smallest integer b with b**k >= n."""
    b = max(1, round(n ** (1 / k)))
    while b**k < n:
        b += 1
    while b > 1 and (b - 1) ** k >= n:
        b -= 1
    return b


class _UniformSplit(Schedule):
    """The uniform split, behind `every`, `nested` and `recursive`: the stack is
    split into `splits[0]` equal segments, each into `splits[1]`, and so on, down
    to segments of `leaf` layers. The forward pass saves only its input. The
    backward pass of a segment runs its children forward, storing each child's
    input carry, then reverses the children last to first — recursively; a leaf
    segment is reversed with `Layers.reverse_segment` (one forward pass saving
    the inner policy's residuals). Depths that the split does not divide are
    padded, and the padded layers are skipped.

    Stored carries live in one buffer of `1 + Σ (splits[l] - 1)` slots: a
    segment's first child reuses the segment's own slot, so bisection stores
    `ceil(log2 D) + 1` carries. Each level is one traced loop."""

    @abc.abstractmethod
    def _split(self, depth: int) -> tuple[tuple[int, ...], int]:
        """`(splits, leaf)` for a stack of `depth` layers."""

    def forward(self, layers: Layers, carry: Any) -> tuple[Any, Any]:
        return layers.run(carry, 0, layers.depth), carry

    def backward(self, layers: Layers, saved: Any, cts: Any) -> Any:
        splits, leaf = self._split(layers.depth)
        padded = math.prod(splits) * leaf
        pad = padded > layers.depth
        slots = layers.carries(1 + sum(n - 1 for n in splits), saved)
        slots = layers.store(slots, 0, saved)

        def level(lvl, start, slot, cts, slots):
            if lvl == len(splits):
                x = layers.load(slots, slot)
                return layers.reverse_segment(start, leaf, x, cts, pad=pad), slots
            n = splits[lvl]
            child = padded // math.prod(splits[: lvl + 1])
            base = 1 + sum(c - 1 for c in splits[:lvl])

            def fwd_body(state, j):
                x, slots = state
                x = layers.run(x, start + j * child, child, pad=pad)
                return (x, layers.store(slots, base + j, x)), None

            x0 = layers.load(slots, slot)
            (_, slots), _ = lax.scan(
                fwd_body, (x0, slots), jnp.arange(n - 1, dtype=jnp.int32)
            )

            def bwd_body(state, j):
                child_slot = jnp.where(j == 0, slot, base + j - 1)
                return level(lvl + 1, start + j * child, child_slot, *state), None

            state, _ = lax.scan(
                bwd_body, (cts, slots), jnp.arange(n, dtype=jnp.int32), reverse=True
            )
            return state

        return level(0, 0, 0, cts, slots)[0]

    def unrolled(self, layers: Sequence[Layer], carry: Any) -> Any:
        depth = len(layers)
        splits, leaf = self._split(depth)
        # The layers a segment holds at each level (the last ones may hold
        # fewer, or none: the list is not padded).
        sizes = [math.prod(splits[lvl:]) * leaf for lvl in range(len(splits) + 1)]
        policy = to_jax_policy(self.policy)

        def run(lvl: int, start: int, x: Any) -> Any:
            if lvl == len(splits):
                return each(layers[start : start + leaf], x, policy)
            for j in range(splits[lvl]):
                child = start + j * sizes[lvl + 1]
                if child < depth:
                    x = segment(functools.partial(run, lvl + 1, child))(x)
            return x

        return segment(functools.partial(run, 0, 0))(carry)

    def kept(self, depth: int) -> tuple[int, int]:
        """The carry buffer's slots, and one leaf segment's layers."""
        splits, leaf = self._split(depth)
        return 1 + sum(n - 1 for n in splits), leaf

    def evaluations(self, depth: int) -> int:
        """The forward pass, the re-runs that store each child segment's input,
        and, with an inner policy on segments of more than one layer, the
        policy's recompute of each layer inside its backward step (`depth`
        more)."""
        splits, leaf = self._split(depth)
        padded = math.prod(splits) * leaf
        total = depth

        def level(lvl, start):
            nonlocal total
            if lvl == len(splits) or start >= depth:
                return
            child = padded // math.prod(splits[: lvl + 1])
            for j in range(splits[lvl]):
                if j < splits[lvl] - 1:  # run forward to store the next input
                    total += max(0, min(child, depth - start - j * child))
                level(lvl + 1, start + j * child)

        level(0, 0)
        if self.policy is not None and leaf > 1:
            # A segment is run forward saving what the policy keeps, then each
            # of its layers is reversed from that: the policy's recompute of
            # the layer's forward inside its backward step is one more.
            total += depth
        return total


@dataclasses.dataclass(frozen=True)
class every(_UniformSplit):
    """Checkpoint every `k`-th carry (checkpoint-sequential, Chen et al. 2016).

    The forward pass keeps one carry per segment of `k` layers; the backward pass
    re-runs one segment at a time, keeping that segment's residuals. Memory:
    `ceil(D/k)` carries plus one segment's residuals; one extra forward pass.
    `every(round(sqrt(D)))` is the classic √D schedule. A remainder (`D % k != 0`)
    is handled; `k >= D` re-runs the whole stack as one segment.

    ??? cite "Training Deep Nets with Sublinear Memory Cost"
        ```bibtex
        @article{chen2016training,
            title={Training Deep Nets with Sublinear Memory Cost},
            author={Chen, Tianqi and Xu, Bing and Zhang, Chiyuan and Guestrin, Carlos},
            journal={arXiv:1604.06174},
            year={2016}
        }
        ```

    **Arguments:**

    - `k`: the segment length, an int >= 1.
    - `policy`: what each layer inside a re-run segment saves (a policy or its name);
      `None` saves everything inside the segment. With a policy, a segment stores
      its layer inputs plus what the policy saves, at the cost of one more forward.
    """

    k: int
    policy: Any = None

    def __post_init__(self):
        object.__setattr__(self, "k", check_int("every", "k", self.k, 1))
        to_jax_policy(self.policy, fn="every")

    def _split(self, depth: int) -> tuple[tuple[int, ...], int]:
        k = min(self.k, depth)
        c = -(-depth // k)
        return ((c,) if c > 1 else ()), k


@dataclasses.dataclass(frozen=True)
class nested(_UniformSplit):
    """Nested checkpointing over `levels` levels: the stack is split into about
    `D^(1/levels)` segments, each of those into as many, and so on.

    Memory: `O(levels · D^(1/levels))` carries; `levels` extra forward passes at
    most. `nested(2)` is the √D schedule (Chen et al. 2016); `nested(1)` re-runs the
    whole stack once from its input (plain remat of the whole stack).

    ??? cite "Training Deep Nets with Sublinear Memory Cost"
        ```bibtex
        @article{chen2016training,
            title={Training Deep Nets with Sublinear Memory Cost},
            author={Chen, Tianqi and Xu, Bing and Zhang, Chiyuan and Guestrin, Carlos},
            journal={arXiv:1604.06174},
            year={2016}
        }
        ```

    **Arguments:**

    - `levels`: the number of nesting levels, an int >= 1.
    - `policy`: what each layer of the innermost re-run segment saves; `None` saves
      everything inside it.
    """

    levels: int
    policy: Any = None

    def __post_init__(self):
        levels = check_int("nested", "levels", self.levels, 1)
        object.__setattr__(self, "levels", levels)
        to_jax_policy(self.policy, fn="nested")

    def _split(self, depth: int) -> tuple[tuple[int, ...], int]:
        b = _ceil_root(depth, self.levels)
        splits = []
        remaining = depth
        for _ in range(self.levels - 1):
            if remaining <= 1 or b <= 1:
                break
            splits.append(b)
            remaining = -(-remaining // b)
        return tuple(splits), remaining


@dataclasses.dataclass(frozen=True)
class recursive(_UniformSplit):
    """Recursive (bisection) checkpointing: `O(log₂ D)` stored carries and
    `O(D log₂ D)` layer evaluations.

    The backward pass of a segment runs its first half forward to store the
    midpoint, differentiates the second half, then the first — recursively, down to
    single layers. `ceil(log₂ D) + 1` carries are stored at once. Any `D >= 1`.

    Each layer is differentiated immediately after it is recomputed, so there is no
    inner policy: passing one raises a `ValueError`.

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
    """

    policy: Any = None

    def __post_init__(self):
        if self.policy is not None:
            raise ValueError(
                "recursive() takes no policy: each layer is recomputed right before "
                "its backward pass, so an inner policy would change nothing. "
                f"Got policy={self.policy!r}."
            )

    def _split(self, depth: int) -> tuple[tuple[int, ...], int]:
        levels = max(0, math.ceil(math.log2(depth))) if depth > 1 else 0
        return (2,) * levels, 1
