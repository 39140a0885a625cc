"""Layer ranges: different checkpoints for consecutive layers of one stack.

`ranges((n1, c1), (n2, c2), ...)` is one more [`eqx_remat.Schedule`][]: the
engine's `custom_vjp`, its `custom_vmap` rule and its one parameter-gradient
buffer are shared by every range. Each range works on a view of the same
[`eqx_remat.Layers`][] (`Layers.view`: an offset into the stack and the range's
own inner policy), so a layer is always read from the full stack by index: no
range copies or slices its part of the stack (the transpose of a slice would
materialise a full-size gradient per range).

- A range checkpointed by a schedule runs that schedule's `forward` and
  `backward` on its view.
- A range checkpointed by `None` or a policy is reversed per layer: the forward
  pass runs it saving each layer's residuals under the policy
  (`Layers.save_segment`), the backward pass applies them
  (`Layers.apply_segment`).

The forward pass runs the ranges first to last, keeping what each one saves; the
backward pass reverses them last to first.
"""

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import jax

from .._validate import check_int
from ._checkpoint import SCHEDULES_IN_RANGES, Checkpoint, check_checkpoint
from ._engine import Layers, Schedule
from ._unrolled import Layer, run_unrolled


@dataclasses.dataclass(frozen=True, init=False, repr=False)
class ranges(Schedule):
    """Different checkpoints for consecutive ranges of layers of one stack: the
    first `n1` layers use `c1`, the next `n2` use `c2`, and so on.

    ```python
    import eqx_remat

    # 24 layers: the first 4 save everything (no checkpointing), the next 16
    # save their matmuls, the last 4 are checkpointed by bisection.
    ck = eqx_remat.ranges((4, None), (16, "dots"), (4, eqx_remat.recursive()))
    print(ck, ck.depth)
    ```

    ```text
    ranges((4, None), (16, 'dots'), (4, recursive(policy=None))) 24
    ```

    A `ranges(...)` is a checkpoint like any other: pass it as the `checkpoint`
    of a zoo model, [`eqx_remat.scan_layers`][] or [`eqx_remat.chain`][], to
    [`eqx_remat.set_checkpoint`][] or among [`eqx_remat.plan`][]'s candidates.
    It is a frozen, hashable value compared by value (rebuilding an equal one
    does not recompile), checked when it is built. The counts must add up to
    the depth of the stack it checkpoints: otherwise tracing raises a
    `ValueError` naming both numbers.

    Gradients are those without checkpointing. Every layer is read from the
    stack by index (no range copies its part of the stack) and its parameter
    gradient is written into the one gradient buffer of the stack, so parameter
    memory stays that of a plain scan, as for every schedule. Memory and FLOPs
    are those of the ranges, each as if it were a stack of its own: a range
    checkpointed by `None` or a policy keeps what that policy keeps for each of
    its layers, a range checkpointed by a schedule keeps what the schedule
    keeps. What a range saves is alive until the backward pass reaches it (the
    last range is reversed first). [`eqx_remat.residuals`][] names the range
    each residual belongs to, and [`eqx_remat.count_flops`][] counts the sum
    of the ranges.

    **Arguments:**

    - `*parts`: `(count, checkpoint)` pairs, first layers first: `count` an
      int >= 1, `checkpoint` `None`, a policy or its name (a JAX policy, a name
      policy such as [`eqx_remat.save_names`][] or
      [`eqx_remat.save_and_offload_names`][]) or a schedule
      ([`eqx_remat.every`][], [`eqx_remat.nested`][],
      [`eqx_remat.recursive`][], [`eqx_remat.binomial`][]); not another
      `ranges`. At least one pair.

    **Attributes:**

    - `parts`: the pairs, a tuple of `(int, checkpoint)`.
    - `depth`: the number of layers, the sum of the counts.
    - `policy`: always `None` (each range has its own).

    **Raises:**

    `ValueError` naming the bad pair: not a `(count, checkpoint)` pair, a count
    that is not an int >= 1, an invalid checkpoint.
    """

    parts: tuple[tuple[int, Checkpoint], ...]

    def __init__(self, *parts: Any):  # checked below, naming the bad pair
        if len(parts) == 0:
            raise ValueError(
                "ranges expected at least one (count, checkpoint) pair. Got none."
            )
        checked = []
        for k, part in enumerate(parts):
            if not isinstance(part, tuple | list) or len(part) != 2:
                raise ValueError(
                    "ranges expected (count, checkpoint) pairs, e.g. "
                    f"ranges((4, None), (12, 'dots')). Got {part!r} at position {k}."
                )
            n, c = part
            n = check_int("ranges", f"the count of pair {k}", n, 1)
            if isinstance(c, ranges):
                raise ValueError(
                    f"ranges expected a checkpoint that is not itself a ranges(...) "
                    f"in pair {k}: list its pairs instead. Got {c!r}."
                )
            check_checkpoint(
                c,
                name=f"ranges: pair {k} ({n}, {c!r}):",
                schedules=SCHEDULES_IN_RANGES,
            )
            checked.append((n, c))
        object.__setattr__(self, "parts", tuple(checked))

    def __repr__(self) -> str:
        return f"ranges({', '.join(repr(p) for p in self.parts)})"

    @property
    def depth(self) -> int:
        return sum(n for n, _ in self.parts)

    @property
    def policy(self) -> None:
        return None

    def policies(self) -> tuple[Any, ...]:
        """Each part's policy: a policy part's own, a schedule part's
        `policies()`."""
        return tuple(
            p
            for _, c in self.parts
            for p in (c.policies() if isinstance(c, Schedule) else (c,))
        )

    def _ranges(self) -> Iterator[tuple[int, int, int, Checkpoint]]:
        """`(k, start, count, checkpoint)` for each range."""
        start = 0
        for k, (n, c) in enumerate(self.parts):
            yield k, start, n, c
            start += n

    def _view(self, layers: Layers, start: int, n: int, c: Checkpoint) -> Layers:
        inner = c.policy if isinstance(c, Schedule) else c
        return layers.view(start, n, inner)

    def _scope(self, k: int, start: int, n: int, c: Checkpoint):
        """A name scope that says which range an operation belongs to (what
        `residuals` prints as the source of a range's residuals)."""
        return jax.named_scope(f"ranges[{k}] (layers {start}..{start + n - 1}: {c!r})")

    def check_depth(self, depth: int) -> None:
        if self.depth != depth:
            counts = " + ".join(str(n) for n, _ in self.parts)
            raise ValueError(
                f"ranges expected counts that add up to the depth of the stack, "
                f"{depth} layers. Got {counts} = {self.depth} layers: {self!r}."
            )

    def unrolled(self, layers: Sequence[Layer], carry: Any) -> Any:
        start = 0
        for n, c in self.parts:
            carry = run_unrolled(layers[start : start + n], carry, c)
            start += n
        return carry

    def forward(self, layers: Layers, carry: Any) -> tuple[Any, Any]:
        self.check_depth(layers.depth)
        saved = []
        for k, start, n, c in self._ranges():
            view = self._view(layers, start, n, c)
            with self._scope(k, start, n, c):
                if isinstance(c, Schedule):
                    carry, s = c.forward(view, carry)
                else:  # None or a policy: per layer
                    carry, s = view.save_segment(0, n, carry)
            saved.append(s)
        return carry, tuple(saved)

    def backward(self, layers: Layers, saved: Any, cts: Any) -> Any:
        self.check_depth(layers.depth)
        for (k, start, n, c), s in reversed(list(zip(self._ranges(), saved))):
            view = self._view(layers, start, n, c)
            with self._scope(k, start, n, c):
                if isinstance(c, Schedule):
                    cts = c.backward(view, s, cts)
                else:
                    cts = view.apply_segment(0, n, s, cts)
        return cts

    def evaluations(self, depth: int) -> int:
        """The sum over the ranges: a range checkpointed by a schedule counts
        that schedule's `evaluations(count)`; one checkpointed by `None`
        evaluates each of its layers once (the forward pass), and one
        checkpointed by a policy twice (the forward pass, and the policy's
        recompute inside the layer's backward step, as a schedule's inner
        policy counts)."""
        self.check_depth(depth)
        return sum(
            c.evaluations(n) if isinstance(c, Schedule) else n * (1 + (c is not None))
            for n, c in self.parts
        )
