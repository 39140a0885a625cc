"""Whether an offload pays: the save-on-device twin of an offloading checkpoint,
and the one rule that compares the compiled figures of the two.

An offloading policy moves what it offloads to host memory on the forward pass
and back on the backward pass, so that the device keeps less. Whether it does
is the compiler's decision: with jax 0.12.1 and libtpu 0.0.52 an offloading
policy kept more v5e device memory than the policy that saves the same values
on the device. `memory_report` and `plan` compare the two compiled programs
and say so (`OffloadWarning`), by this rule.
"""

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

from .._util import format_bytes
from ._jaxpr import AnyJaxpr, iter_eqns, on_host, open_jaxpr


class OffloadWarning(UserWarning):
    """Warned by [`eqx_remat.memory_report`][] when a compiled program of an
    offloading checkpoint ([`eqx_remat.offload_names`][],
    `"offload_dots_no_batch"`, [`eqx_remat.save_and_offload_names`][] with
    names to offload, or a schedule or `ranges` holding one) does not pay: it
    moves no bytes to the host, or it keeps at least as much device memory as
    the same checkpoint saving those values on the device. The message names
    the policy and both figures. Whether offloading pays is the compiler's
    decision (it does on the CPU never, there being one memory); where it does
    not, the saving policy keeps as little and spends nothing on the host
    link. [`eqx_remat.plan`][] drops such an option, with a note."""


def offload_fails(offloading: Any, saving: Any) -> str | None:
    """Why the compiled program `offloading` (a [`eqx_remat.MemoryReport`][]
    of an offloading checkpoint) does not pay against `saving` (the report of
    the same checkpoint saving the offloaded values on the device), or `None`
    where it pays: it moves bytes to the host and keeps less device memory for
    temporaries than `saving`. The one rule, for `memory_report` and `plan`."""
    device = (
        f"{format_bytes(offloading.temp_bytes)} of device memory for temporaries "
        f"against {format_bytes(saving.temp_bytes)} when saving on the device"
    )
    if offloading.host_temp_bytes <= 0:
        return f"it moves no bytes to the host ({device})"
    if offloading.temp_bytes >= saving.temp_bytes:
        return (
            f"it moves {format_bytes(offloading.host_temp_bytes)} to the host and "
            f"keeps {device}"
        )
    return None


# The policies that offloaded in a twin traced under `saving_on_device`, or
# `None` outside it.
_SEEN: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "eqx_remat_saving_on_device", default=None
)


@contextlib.contextmanager
def saving_on_device() -> Iterator[list]:
    """While on, eqx_remat applies every policy as its save-on-device twin
    (`on_device`); yields the list of the policies that offloaded something,
    filled as the function is traced."""
    seen: list = []
    token = _SEEN.set(seen)
    try:
        yield seen
    finally:
        _SEEN.reset(token)


def on_device(pol: Any) -> Any:
    """`pol` as eqx_remat's combinators apply it: `pol` itself, except under
    `saving_on_device`, where it is its twin that saves on the device what
    `pol` offloads (and decides as `pol` for everything else)."""
    seen = _SEEN.get()
    if seen is None or pol is None or not _may_offload(pol):
        return pol
    return _SavedOnDevice(pol, seen)


def _may_offload(pol: Any) -> bool:
    # eqx_remat's saving name policies (`save_names`, `save_all_but_names`:
    # `names`, and no memory space to offload to) are applied in ways of their
    # own (the exact `save_all_but_names`) and never offload: left as they are.
    return not (hasattr(pol, "names") and not hasattr(pol, "dst"))


class _SavedOnDevice:
    """A policy that saves what `policy` offloads; records `policy` in `seen`
    the first time it does."""

    def __init__(self, policy: Any, seen: list):
        self.policy = policy
        self.seen = seen

    def __call__(self, prim, *avals, **params):
        decision = self.policy(prim, *avals, **params)
        # JAX's `Offloadable(src, dst)`: the one decision that moves a value.
        if hasattr(decision, "src") and hasattr(decision, "dst"):
            if not any(p is self.policy for p in self.seen):
                self.seen.append(self.policy)
            return True
        return decision

    def __repr__(self) -> str:
        return f"saved on the device: {self.policy!r}"


def policy_name(pol: Any) -> str:
    """A policy as messages name it: its repr (`offload_names('h', ...)`;
    `"offload_dots_no_batch"` is `Offloading(dots_no_batch, device ->
    pinned_host)`)."""
    return repr(pol)


def offloads(jaxpr: AnyJaxpr) -> bool:
    """Whether a traced program puts a value in host memory (an offloading
    policy's residuals, `f32<host>[...]`), at any depth of its loops and
    calls."""
    return any(
        on_host(v.aval) for eqn in iter_eqns(open_jaxpr(jaxpr)) for v in eqn.outvars
    )
