"""Compiled memory of a function, on the local backend or TPU v5e ahead of time."""

import contextlib
import functools
import os
import re
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .._util import format_bytes, split_args, traceable
from ._collectives import collectives
from ._flops import count_flops
from ._offload import (
    OffloadWarning,
    offload_fails,
    offloads,
    policy_name,
    saving_on_device,
)
from ._targets import Target, slice_count


class ReplicatedArgumentsWarning(UserWarning):
    """Warned by [`eqx_remat.memory_report`][] and [`eqx_remat.plan`][] when a
    function is compiled for a target with several chips and none of its
    arguments has a sharding: every argument, the batch included, is then
    replicated on every chip, and the per-chip figures are those of the whole
    batch on each chip. To replicate on purpose, silence it:
    `warnings.simplefilter("ignore", eqx_remat.ReplicatedArgumentsWarning)`."""


class MemoryReport(NamedTuple):
    """What a compiled function needs in memory, and its FLOPs.

    For a target with several chips, the byte counts are per chip (XLA compiles
    one SPMD program per chip); `flops` is for the whole program.

    **Attributes:**

    - `temp_bytes`: device memory for temporaries (activations, residuals saved
      for the backward pass, workspace): `memory_analysis().temp_size_in_bytes`.
    - `argument_bytes`: device memory of the arguments.
    - `output_bytes`: device memory of the outputs.
    - `host_temp_bytes`: host memory for temporaries — what offloading policies
      move off the device. `0` where the backend has no separate host memory
      space (the CPU).
    - `flops`: [`eqx_remat.count_flops`][] of the function (loop trip counts and
      recomputation included): a [`eqx_remat.FlopCount`][], an `int` that also
      says what it could not count (`dynamic_loops`, `unknown`).
    - `target`: what it was compiled for: the default backend's platform
      (`"cpu"`, `"gpu"`, ...) or a TPU topology such as `"v5e:2x2"`.
    - `collective_bytes`: the bytes each chip sends other chips in one step,
      in the all-gathers, reduce-scatters, all-reduces, all-to-alls and
      collective permutes that XLA's partitioner added, each once per trip of
      the loops around it (`0` on one device); by kind:
      [`eqx_remat.internal.collectives`][]. Of several slices
      (`"Nxv5e:AxB"`), those within a slice.
    - `network_bytes`: of several slices, the bytes each chip sends chips of
      other slices in one step, over the data center network (`0` for one
      slice).
    """

    temp_bytes: int
    argument_bytes: int
    output_bytes: int
    host_temp_bytes: int
    flops: int
    target: str
    collective_bytes: int = 0
    network_bytes: int = 0

    def __str__(self) -> str:
        return (
            f"temp {_mib(self.temp_bytes)}, args {_mib(self.argument_bytes)}, "
            f"out {_mib(self.output_bytes)}, host temp {_mib(self.host_temp_bytes)}, "
            f"{self.flops / 1e9:.3f} GFLOPs [{self.target}]"
        )

    @property
    def total_bytes(self) -> int:
        """Device memory in all: `temp_bytes + argument_bytes + output_bytes` (what
        must fit in one device; host memory not included)."""
        return self.temp_bytes + self.argument_bytes + self.output_bytes

    def to_dict(self) -> dict[str, int | str]:
        """The report as a JSON-serialisable `dict` (plain `int`s and `str`)."""
        return {
            k: (v if isinstance(v, str) else int(v)) for k, v in self._asdict().items()
        }


def _mib(n: int) -> str:
    return format_bytes(n, unit="MiB", digits=1)


def memory_report(
    fn: Callable[..., Any],
    *args: Any,
    target: str | None = None,
    compiler_options: Mapping[str, Any] | None = None,
) -> MemoryReport:
    """Compile `fn(*args)` ahead of time and report its memory and FLOPs.

    Compiles `jax.jit(fn).lower(*args).compile()` and reads its
    `memory_analysis()`: deterministic numbers, the same on every run, with
    nothing executed. Arguments may be `jax.ShapeDtypeStruct`s, so a model far
    larger than this machine's memory can be measured without allocating it.

    `target="v5e"` compiles for a TPU v5e slice with libtpu, without a TPU (the
    way MaxText's `train_compile.py` does; v6e and v5p alike), and reports
    per-chip memory:

    - By default every argument is replicated on every chip. To shard one, pass
      it as a `jax.ShapeDtypeStruct` whose `sharding` is a `NamedSharding` on
      [`eqx_remat.v5e_mesh`][]`(target)` — a mesh with one axis, `"data"`, over
      all chips. For example, a batch split across the chips:
      `jax.ShapeDtypeStruct((8, 2048, 1024), jnp.bfloat16,
      sharding=NamedSharding(eqx_remat.v5e_mesh(), PartitionSpec("data")))`
      (or `zoo.shard_batch(batch, eqx_remat.v5e_mesh())`). On a slice of
      several chips where no argument has a sharding, a
      [`eqx_remat.ReplicatedArgumentsWarning`][] says that everything,
      the batch included, is replicated on every chip.
    - `fn` is traced on that mesh (as under `jax.set_mesh`), so code that asks
      what it is traced for sees the TPU: a zoo model with
      `attention="flash"` (a Pallas TPU kernel) compiles for the target, also
      when no argument carries a sharding.
    - XLA keeps intermediates in the chip's on-chip VMEM when they fit, and
      `temp_bytes` counts only HBM. A small program can therefore report
      `temp_bytes == 0`. To count every intermediate in HBM — to compare
      policies on shapes too small to leave VMEM — pass
      `compiler_options={"xla_vf_vmem_memory_space_assignment": False}` (a
      libtpu flag, found in libtpu 0.0.42; not a stable interface).
    - On a machine with libtpu installed and no TPU, importing `eqx_remat`
      tells libtpu so (`TPU_ACCELERATOR_TYPE`, `TPU_WORKER_HOSTNAMES` and
      `TPU_SKIP_MDS_QUERY`, where unset), so that JAX's first use of a backend,
      which loads libtpu, prints none of its "could not determine TPU
      accelerator type" start-up errors (import `eqx_remat` before JAX runs
      anything for this to apply).
    - Offloading policies ([`eqx_remat.offload_names`][],
      `"offload_dots_no_batch"`) show up as `host_temp_bytes`. On the CPU there
      is one memory: offloaded values stay where they are, `host_temp_bytes` is
      `0` and `temp_bytes` is that of saving the same values, so offloading
      can only be measured on a TPU (or GPU) target.
    - An offload that does not pay is said: where the traced program puts
      values in host memory, `fn` is traced and compiled once more as its
      save-on-device twin (each offloading policy of eqx_remat's checkpoints —
      `scan_layers`, `chain`, the schedules, `ranges`, the zoo's models,
      whether in the arguments or in `fn` itself — applied as one that saves on
      the device what it offloads: `offload_names(n)` as `save_names(n)`,
      `"offload_dots_no_batch"` as `"dots_no_batch"`). Where the offloading
      program moves no bytes to the host, or keeps at least as many
      `temp_bytes` as its twin, an [`eqx_remat.OffloadWarning`][] names the
      policy and both figures (so on the CPU, always). Programs that do not
      offload are compiled once, as before. An offload of your own
      (`jax.checkpoint` with an offloading policy, `jax.device_put` to host
      memory) has no twin: it is warned about only where it moves no bytes.

    **Arguments:**

    - `fn`: the function, e.g. a training step or `jax.grad(loss)`.
    - `*args`: its arguments, any pytrees (Equinox modules included). Array
      leaves may be arrays or `jax.ShapeDtypeStruct`s; other leaves (Python
      numbers included) are static, as in `eqx.filter_jit`. Non-array leaves of
      the output are dropped.
    - `target`: `None` for the default backend (or its platform name, `"cpu"`,
      `"gpu"` or `"tpu"`, as [`eqx_remat.MemoryReport`][]`.target` names it), `"v5e"`
      for a TPU v5e 2x2 slice (4 chips), `"v5e:AxB"` for another slice shape
      TPU v5e comes in (1x1, 2x2, 2x4, 4x4, 4x8, 8x8, 8x16 or 16x16),
      `"v6e:AxB"` for TPU v6e (the same shapes), `"v5p:AxBxC"` for TPU v5p
      (2x2x1, 2x2x2, 2x2x4, 2x4x4, or sides that are multiples of 4: `"v5p:4x4x4"`
      is a v5p-128, 64 chips), or `"Nx"` before any of them for `N` such slices
      joined by the data center network (multislice, e.g. `"2xv5e:16x16"`:
      `network_bytes` says what crosses it).
    - `compiler_options`: XLA options passed to `.compile(...)`.

    **Returns:**

    A [`eqx_remat.MemoryReport`][].

    **Raises:**

    `ValueError` for an unknown target, listing the valid ones, or a platform
    name other than the default backend's; `ImportError`
    naming the `tpu` extra (`pip install 'eqx-remat[tpu]'`) when `target` is a
    TPU and libtpu is not installed; XLA's `JaxRuntimeError`
    (`RESOURCE_EXHAUSTED: ... the total memory required for HLO temporaries
    (18.02G) exceeds available HBM (15.75G)`) when the program does not fit in
    one chip — XLA refuses to compile it, so there is no report to return.
    """
    report, unpaid = inspect_memory(fn, args, target, compiler_options)
    if unpaid is not None:
        what, why = unpaid
        warnings.warn(
            f"memory_report(target={target!r}): offloading with {what} does not "
            f"pay on {report.target}: {why}. Save those values on the device "
            "instead (save_names with the same names; 'dots_no_batch' for "
            "'offload_dots_no_batch'). To offload anyway, silence "
            "eqx_remat.OffloadWarning.",
            OffloadWarning,
            stacklevel=user_stacklevel(),
        )
    return report


def inspect_memory(
    fn: Callable[..., Any],
    args: tuple,
    target: str | None,
    compiler_options: Mapping[str, Any] | None,
    *,
    check_offload: bool = True,
) -> tuple[MemoryReport, tuple[str, str] | None]:
    """`memory_report(fn, *args, ...)`'s report, and, where it offloads and
    that does not pay, `(what, why)`: the offloading policies, and why it does
    not pay (`offload_fails`). `None` where it pays or does not offload, or
    where not `check_offload` (then an offloading program is compiled once,
    not beside its twin)."""
    on = Target.of(target, "memory_report")
    if on.mesh is not None:
        warn_replicated("memory_report", on.label, on.mesh, split_args(args)[0])
    on = on.placed(split_args(args)[0])
    dynamic, traced = _placed(fn, args, on)
    options = dict(compiler_options or {})
    compiled = _compile(traced, options, target)
    with on.traced():
        flops = count_flops(fn, *args)
    report = compiled_report(compiled, flops=flops, target=on.label)
    if not (check_offload and offloads(traced.jaxpr)):
        return report, None
    return report, _unpaid(report, fn, args, dynamic, on.mesh, options, target)


def unpaid_offload(
    report: MemoryReport, fn: Callable, args: tuple, target: str | None
) -> tuple[str, str] | None:
    """`inspect_memory`'s offload check of `fn(*args)` compiled for `target`,
    given its compiled `report`: `(what, why)` where it offloads and that does
    not pay; the program itself is not compiled again."""
    on = Target.of(target, "memory_report").placed(split_args(args)[0])
    dynamic, traced = _placed(fn, args, on)
    if not offloads(traced.jaxpr):
        return None
    return _unpaid(report, fn, args, dynamic, on.mesh, {}, target)


def _placed(fn: Callable, args: tuple, on: Target) -> tuple[Any, Any]:
    """`(dynamic, traced)`: `args`' arrays, placed on `on`'s mesh where it has
    one, and `fn(*args)` traced on them (`_trace`)."""
    dynamic, _ = split_args(args)
    if on.mesh is not None:
        dynamic = jax.tree.map(functools.partial(_place, on.mesh, on.label), dynamic)
    return dynamic, _trace(fn, args, dynamic, on.mesh)


def _trace(fn: Callable, args: tuple, dynamic: Any, mesh: Mesh | None) -> Any:
    """`fn(*args)` traced (a `jax.stages.Traced`), on `mesh` where there is one."""
    f, _ = traceable(fn, args)
    with contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh):
        return jax.jit(f).trace(dynamic)


def _compile(traced: Any, options: dict, target: str | None) -> jax.stages.Compiled:
    try:
        return traced.lower().compile(options)
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" in str(e):
            e.add_note(
                f"memory_report(target={target!r}): the program does not fit in "
                "the memory of one device of the target; XLA's message above says "
                "how much it needs. Nothing else can be reported for it."
            )
        raise


def _unpaid(
    report: MemoryReport,
    fn: Callable,
    args: tuple,
    dynamic: Any,
    mesh: Mesh | None,
    options: dict,
    target: str | None,
) -> tuple[str, str] | None:
    """`(what, why)` for `report`, the report of a program that offloads: the
    offloading policies and why they do not pay, or `None` where it pays
    against its save-on-device twin
    (`offload_fails`). The twin is `fn` traced with eqx_remat applying each
    offloading policy as one that saves what it offloads (XLA refusing it as
    too large: it pays); where that leaves an
    offload in the program (a `jax.checkpoint` or `device_put` of the
    caller's own), there is no twin to compare with, and only a program that
    moves no bytes to the host is warned about."""
    with saving_on_device() as seen:
        twin = _trace(fn, args, dynamic, mesh)
    if seen and not offloads(twin.jaxpr):
        try:
            compiled = _compile(twin, options, target)
        except jax.errors.JaxRuntimeError as e:
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            return None  # saved on the device it does not fit: offloading pays
        saving = compiled_report(compiled, flops=report.flops, target=report.target)
        why = offload_fails(report, saving)
        what = ", ".join(map(policy_name, seen))
    elif report.host_temp_bytes <= 0:
        why = (
            "it moves no bytes to the host (it keeps "
            f"{format_bytes(report.temp_bytes)} of device memory for temporaries)"
        )
        what = "the offloading of this program (not an eqx_remat checkpoint's)"
    else:
        return None
    return None if why is None else (what, why)


def compiled_report(
    compiled: jax.stages.Compiled, *, flops: int, target: str
) -> MemoryReport:
    """The [`eqx_remat.MemoryReport`][] of a program already compiled (a
    `jax.stages.Compiled`), read from its `memory_analysis()`, with `flops` and
    `target` as given: for callers that compile to run the program too (the
    benchmarks), so that it is compiled once."""
    m = compiled.memory_analysis()
    if m is None:
        raise ValueError(
            "compiled_report expected a program whose memory_analysis() gives "
            f"its sizes. Got one compiled for {jax.default_backend()}, whose "
            "memory_analysis() is None."
        )
    sent = collectives(compiled.as_text() or "", slice_count(target))
    return MemoryReport(
        temp_bytes=int(m.temp_size_in_bytes),
        argument_bytes=int(m.argument_size_in_bytes),
        output_bytes=int(m.output_size_in_bytes),
        host_temp_bytes=int(getattr(m, "host_temp_size_in_bytes", 0)),
        flops=flops,
        target=target,
        collective_bytes=sent.total,
        network_bytes=sent.network_total,
    )


def warn_replicated(
    fn: str, target: str, mesh: Mesh, dynamic: Any, *, stacklevel: int | None = None
) -> None:
    """Warn (`ReplicatedArgumentsWarning`) when `mesh` has several chips and no
    array leaf of `dynamic` is a `ShapeDtypeStruct` with a sharding: everything
    is replicated on every chip. One message for `memory_report` and `plan`.

    The warning points at the user's line: the first caller outside `eqx_remat`
    (`stacklevel=None`, the default), however deep the library's own calls are;
    an explicit `stacklevel` counts from the caller of this function, as
    `warnings.warn`'s does. Call it once per user call, and silence it around
    the library's own calls of `memory_report` (as `plan` does)."""
    leaves = jax.tree.leaves(dynamic)
    if mesh.size == 1 or any(
        isinstance(x, jax.ShapeDtypeStruct) and x.sharding is not None for x in leaves
    ):
        return
    nbytes = sum(int(np.prod(np.shape(x))) * x.dtype.itemsize for x in leaves)
    warnings.warn(
        f"{fn}(target={target!r}): no argument has a sharding, so every argument "
        f"({format_bytes(nbytes)} in all, the batch included) is replicated on "
        f"each of the {mesh.size} chips, and the figures are per chip for the "
        "whole batch. To split the batch over the chips, give it a sharding on "
        f"the target's mesh: `batch = zoo.shard_batch(batch, "
        f"eqx_remat.v5e_mesh({target!r}))`, or `jax.ShapeDtypeStruct(shape, "
        "dtype, sharding=NamedSharding(eqx_remat.v5e_mesh("
        f"{target!r}), PartitionSpec('data')))`. To replicate on purpose, "
        "silence eqx_remat.ReplicatedArgumentsWarning.",
        ReplicatedArgumentsWarning,
        stacklevel=user_stacklevel() if stacklevel is None else stacklevel + 1,
    )


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


# What XLA says it needed, in its RESOURCE_EXHAUSTED messages: "the total memory
# required for HLO temporaries (16.00G) exceeds available HBM (15.75G)", "Used
# 17.5G of 15.75G hbm".
_NEEDED = (
    re.compile(r"required for [^(]*\((\d+(?:\.\d+)?)([KMGT]?)i?B?\)"),
    re.compile(r"Used (\d+(?:\.\d+)?)([KMGT]?)i?B? of"),
)
# And what it says one device has.
_AVAILABLE = (
    re.compile(r"exceeds available [A-Za-z]* ?\((\d+(?:\.\d+)?)([KMGT]?)i?B?\)"),
    re.compile(r"Used \S+ of (\d+(?:\.\d+)?)([KMGT]?)i?B?"),
)
_XLA_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _xla_bytes(message: str, patterns: Sequence[re.Pattern]) -> int | None:
    for pattern in patterns:
        match = pattern.search(message)
        if match is not None:
            return int(float(match.group(1)) * _XLA_UNITS[match.group(2)])
    return None


def needed_bytes(message: str) -> int | None:
    """The bytes XLA says a program needed, from its RESOURCE_EXHAUSTED `message`
    (the error `memory_report` raises when a program does not fit in one
    device), or `None` where the message gives no figure."""
    return _xla_bytes(message, _NEEDED)


def available_bytes(message: str) -> int | None:
    """What XLA's RESOURCE_EXHAUSTED `message` says one device holds, or `None`."""
    return _xla_bytes(message, _AVAILABLE)


def user_stacklevel() -> int:
    """The `stacklevel` for a `warnings.warn` made by this function's caller that
    points at the first frame outside `eqx_remat`: the user's line, not `sys:1`
    (where too large a fixed level lands) nor the library's own."""
    frame = sys._getframe(1)  # the caller, which calls `warnings.warn`
    level = 1
    while frame.f_back is not None and os.path.dirname(
        os.path.abspath(frame.f_code.co_filename)
    ).startswith(_PACKAGE_DIR):
        frame = frame.f_back
        level += 1
    return level


def _place(mesh: Mesh, name: str, x: Any) -> jax.ShapeDtypeStruct:
    """An argument as a `ShapeDtypeStruct` on `mesh`: its own sharding if it is a
    `ShapeDtypeStruct` sharded on `mesh`'s devices, else replicated."""
    sharding = (
        getattr(x, "sharding", None) if isinstance(x, jax.ShapeDtypeStruct) else None
    )
    if sharding is None:
        sharding = NamedSharding(mesh, PartitionSpec())
    elif set(sharding.device_set) != set(mesh.devices.flat):
        raise ValueError(
            f"memory_report(target={name!r}) expected ShapeDtypeStruct shardings "
            f"on eqx_remat.v5e_mesh({name!r}). Got {sharding}."
        )
    return jax.ShapeDtypeStruct(
        np.shape(x),
        x.dtype,
        sharding=sharding,
        weak_type=getattr(x, "weak_type", False),
    )
