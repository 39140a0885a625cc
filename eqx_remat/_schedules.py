"""Schedules: how a stack of D layers is checkpointed across depth."""

import dataclasses
import math
from collections.abc import Callable
from typing import Any, TypeAlias

from ._policies import Policy, policy as _normalise_policy


class Schedule:
    """Base class of the depth schedules ([`eqx_remat.every`][],
    [`eqx_remat.nested`][], [`eqx_remat.recursive`][], [`eqx_remat.binomial`][]).

    A schedule is a frozen, hashable value: it can be the static `checkpoint` field
    of an Equinox module, and rebuilding an equal schedule does not recompile.

    Every schedule runs the forward pass as one `lax.scan` that saves its inputs
    (and, for `binomial`, the first carries of its offline schedule), and a
    backward pass that re-runs the stack from a few stored carries, writing the
    parameter gradients into a single buffer. Backward passes
    of this kind are reverse-mode only: `jax.jvp`, `jax.jacfwd` and `jax.hessian`
    through a schedule raise an error (use a policy, or `None`, for forward mode).
    Reverse-over-reverse (`jax.grad` of `jax.grad`) works.
    """

    policy: Any

    def _plan(self, depth: int) -> "Plan":
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class Plan:
    """A uniform checkpointing plan for `depth` layers (padded to `padded`).

    The stack is split into `splits[0]` segments, each split into `splits[1]`
    segments, and so on; a segment of `leaf` layers is differentiated directly,
    saving the residuals that `policy` keeps (everything when `policy` is None).
    """

    depth: int
    splits: tuple[int, ...]
    leaf: int
    policy: Policy | None

    @property
    def padded(self) -> int:
        return math.prod(self.splits) * self.leaf

    @property
    def slots(self) -> int:
        """The number of carries stored at once on the backward pass."""
        return 1 + sum(c - 1 for c in self.splits)


def _check_int(fn: str, arg: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(
            f"{fn}: {arg} must be an int >= {minimum}. "
            f"Got {value!r} of type {type(value).__name__}."
        )
    if value < minimum:
        raise ValueError(f"{fn}: {arg} must be an int >= {minimum}. Got {value}.")


def _check_policy(fn: str, value: Any) -> None:
    try:
        _normalise_policy(value)
    except ValueError as e:
        raise ValueError(f"{fn}: invalid policy. {e}") from None


def _ceil_root(n: int, k: int) -> int:
    """The smallest integer b with b**k >= n."""
    b = max(1, round(n ** (1 / k)))
    while b**k < n:
        b += 1
    while b > 1 and (b - 1) ** k >= n:
        b -= 1
    return b


@dataclasses.dataclass(frozen=True)
class every(Schedule):
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
        _check_int("every", "k", self.k, 1)
        _check_policy("every", self.policy)

    def _plan(self, depth: int) -> Plan:
        k = min(self.k, depth)
        c = -(-depth // k)
        splits = (c,) if c > 1 else ()
        return Plan(depth, splits, k, _normalise_policy(self.policy))


@dataclasses.dataclass(frozen=True)
class nested(Schedule):
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
        _check_int("nested", "levels", self.levels, 1)
        _check_policy("nested", self.policy)

    def _plan(self, depth: int) -> Plan:
        b = _ceil_root(depth, self.levels)
        splits = []
        remaining = depth
        for _ in range(self.levels - 1):
            if remaining <= 1 or b <= 1:
                break
            splits.append(b)
            remaining = -(-remaining // b)
        return Plan(depth, tuple(splits), remaining, _normalise_policy(self.policy))


@dataclasses.dataclass(frozen=True)
class recursive(Schedule):
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

    def _plan(self, depth: int) -> Plan:
        levels = max(0, math.ceil(math.log2(depth))) if depth > 1 else 0
        return Plan(depth, (2,) * levels, 1, None)


Checkpoint: TypeAlias = None | str | Callable[..., Any] | Schedule
"""The type of every `checkpoint` field: `None` (no checkpointing), a policy name,
a JAX policy callable, or a [`eqx_remat.Schedule`][]."""
