"""Cost estimates for Pallas kernels that come without one."""

import functools
from collections.abc import Callable, Mapping
from typing import Any

from jax.extend.core import JaxprEqn
from jaxtyping import PyTree

from ._jaxpr import eval_jaxpr, iter_eqns, map_eqns, trace


def with_pallas_costs(
    fn: Callable[..., Any], costs: Mapping[str, Any]
) -> Callable[..., Any]:
    """`fn`, with a cost estimate on each Pallas kernel it calls that has none.

    [`eqx_remat.count_flops`][] counts a `pallas_call` by its `cost_estimate`
    (a `jax.experimental.pallas.CostEstimate`, which XLA's cost analysis reads
    too); a kernel without one counts zero and is listed in
    `FlopCount.unknown`. Pass `cost_estimate=` to the `pallas_call`s you write.
    This is for kernels written by others that do not — the two backward
    kernels of `jax.experimental.pallas.ops.tpu.flash_attention`, for one —
    giving them estimates from outside, without changing their code:

    ```python
    from jax.experimental import pallas as pl

    def bwd(vjp, g):  # in a custom_vjp around a kernel
        return with_pallas_costs(
            vjp, {"_flash_attention_dq_kernel": pl.CostEstimate(
                flops=..., transcendentals=..., bytes_accessed=...)}
        )(g)
    ```

    `fn` is traced when the returned function is called, the estimates set on
    the kernels of its jaxpr (inside `jax.jit`, loops, `shard_map`, custom
    derivatives ... too), and the jaxpr evaluated: the result is that of `fn`,
    computed by the same operations. Kernels that already have an estimate keep
    it.

    **Arguments:**

    - `fn`: a function of arrays (pytrees of arrays) that calls Pallas kernels.
    - `costs`: a mapping from a kernel's name to its
      `jax.experimental.pallas.CostEstimate`. A kernel is named as Pallas names
      it in its messages: the `name` passed to `pallas_call`, else the name of
      its kernel function (through `functools.partial`).

    **Returns:**

    A function with the signature and outputs of `fn`.

    **Raises:**

    `TypeError` if `costs` is not a mapping from names (`str`) to
    `CostEstimate`s; `ValueError`, when the returned function is traced, if a
    name in `costs` names none of the kernels `fn` calls (the message lists
    those it calls).
    """
    costs = _check_costs(costs)

    @functools.wraps(fn)
    def with_costs(*args: PyTree) -> PyTree:
        closed, flat, out_tree = trace(fn, *args)
        called = {
            _kernel_name(e)
            for e in iter_eqns(closed.jaxpr)
            if e.primitive.name == "pallas_call"
        }
        missing = sorted(set(costs) - called)
        if missing:
            raise ValueError(
                f"with_pallas_costs: costs names the kernels {missing}, which "
                f"{_name(fn)} does not call. It calls the kernels "
                f"{sorted(n for n in called if n is not None)}."
            )

        def add_cost(eqn: JaxprEqn) -> JaxprEqn:
            if eqn.primitive.name != "pallas_call":
                return eqn
            name = _kernel_name(eqn)
            cost = None if name is None else costs.get(name)
            if cost is None or eqn.params.get("cost_estimate") is not None:
                return eqn
            return eqn.replace(params={**eqn.params, "cost_estimate": cost})

        jaxpr = map_eqns(closed.jaxpr, add_cost)
        outs = eval_jaxpr(jaxpr, closed.consts, flat)
        return out_tree.unflatten(outs)

    return with_costs


def _check_costs(costs: Any) -> dict[str, Any]:
    from jax.experimental import pallas as pl

    if not isinstance(costs, Mapping) or not all(
        isinstance(k, str) and isinstance(v, pl.CostEstimate) for k, v in costs.items()
    ):
        raise TypeError(
            "with_pallas_costs expected costs as a mapping from kernel names "
            f"(str) to jax.experimental.pallas.CostEstimate. Got {costs!r}."
        )
    return dict(costs)


def _kernel_name(eqn: JaxprEqn) -> str | None:
    """The name Pallas gives a `pallas_call`: its `name`, else its kernel
    function's."""
    if eqn.params.get("name"):
        return eqn.params["name"]
    info = getattr(eqn.params.get("jaxpr"), "debug_info", None)
    return getattr(info, "func_name", None)


def _name(fn: Any) -> str:
    return getattr(fn, "__name__", None) or repr(fn)
