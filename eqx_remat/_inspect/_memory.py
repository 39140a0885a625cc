"""Compiled memory of a function, on the local backend or TPU v5e ahead of time."""

import contextlib
import functools
import glob
import importlib.util
import os
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .._util import format_bytes, split_args, traceable
from ._flops import count_flops
from ._targets import PLATFORMS, V5E_SLICES, VALID_TARGETS, v5e_shape


_TPU_EXTRA_HINT = (
    "Compiling for TPU v5e ahead of time needs libtpu (no TPU needed). Install "
    "it with `pip install 'eqx-remat[tpu]'`."
)


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
    """

    temp_bytes: int
    argument_bytes: int
    output_bytes: int
    host_temp_bytes: int
    flops: int
    target: str

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
    way MaxText's `train_compile.py` does), and reports per-chip memory:

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

    **Arguments:**

    - `fn`: the function, e.g. a training step or `jax.grad(loss)`.
    - `*args`: its arguments, any pytrees (Equinox modules included). Array
      leaves may be arrays or `jax.ShapeDtypeStruct`s; other leaves (Python
      numbers included) are static, as in `eqx.filter_jit`. Non-array leaves of
      the output are dropped.
    - `target`: `None` for the default backend (or its platform name, `"cpu"`,
      `"gpu"` or `"tpu"`, as [`eqx_remat.MemoryReport`][]`.target` names it), `"v5e"`
      for a TPU v5e 2x2 slice (4 chips), or `"v5e:AxB"` for another slice shape
      TPU v5e comes in (1x1, 2x2, 2x4, 4x4, 4x8, 8x8, 8x16 or 16x16).
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
    dynamic, _ = split_args(args)
    target = at_hand("memory_report", target)
    mesh = None
    if target is None:
        name = jax.default_backend()
    else:
        name, mesh = _v5e(target)
        warn_replicated("memory_report", name, mesh, dynamic)
        dynamic = jax.tree.map(functools.partial(_place, mesh, name), dynamic)

    f, _ = traceable(fn, args)
    with _on_mesh(mesh):
        lowered = jax.jit(f).lower(dynamic)
    try:
        compiled = lowered.compile(dict(compiler_options or {}))
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" in str(e):
            e.add_note(
                f"memory_report(target={target!r}): the program does not fit in "
                "the memory of one device of the target; XLA's message above says "
                "how much it needs. Nothing else can be reported for it."
            )
        raise
    with _on_mesh(mesh, abstract=True):
        flops = count_flops(fn, *args)
    return compiled_report(compiled, flops=flops, target=name)


def at_hand(fn: str, target: Any) -> Any:
    """`target`, or `None` for the platform name of the default backend; the
    name of another platform is a `ValueError` that names this one."""
    if target not in PLATFORMS:
        return target
    if target != jax.default_backend():
        raise ValueError(
            f"{fn}(target={target!r}): a platform name must be the default "
            f"backend, here {jax.default_backend()!r}. Use None for it, or "
            '"v5e" / "v5e:AxB" to compile for TPU v5e without a TPU.'
        )
    return None


def traced_for(target: Any) -> contextlib.AbstractContextManager:
    """A context in which functions are traced (not compiled) for `target`, as
    `memory_report(..., target=target)` traces them: on a v5e target's abstract
    mesh, so that code asking what it is traced for (zoo's flash attention)
    sees the TPU. Nothing for `None` or a platform name."""
    if target is None or target in PLATFORMS:
        return contextlib.nullcontext()
    return _on_mesh(_v5e(target)[1], abstract=True)


def _on_mesh(
    mesh: Mesh | None, *, abstract: bool = False
) -> contextlib.AbstractContextManager:
    """`jax.set_mesh(mesh)`, or nothing for `None`: a target's function is traced
    on the target's mesh, so that code asking what it is traced for
    (`jax.sharding.get_abstract_mesh()`: zoo's flash attention, which needs a
    TPU) sees the target's chips, also when no argument carries a sharding.

    `abstract=True`: only the abstract mesh, for tracing without compiling
    (`count_flops`, which computes small integer values eagerly, on the default
    backend: the target's chips cannot run anything)."""
    if mesh is None:
        return contextlib.nullcontext()
    if abstract:
        return jax.sharding.use_abstract_mesh(mesh.abstract_mesh)
    return jax.set_mesh(mesh)


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
    return MemoryReport(
        temp_bytes=int(m.temp_size_in_bytes),
        argument_bytes=int(m.argument_size_in_bytes),
        output_bytes=int(m.output_size_in_bytes),
        host_temp_bytes=int(getattr(m, "host_temp_size_in_bytes", 0)),
        flops=flops,
        target=target,
    )


def v5e_mesh(target: str = "v5e") -> Mesh:
    """The device mesh that `memory_report(..., target=target)` compiles for.

    One axis, `"data"`, over all the chips of the slice. Use it to give
    `jax.ShapeDtypeStruct` arguments a sharding, e.g.
    `NamedSharding(v5e_mesh(), PartitionSpec("data"))` to split a batch across
    the chips. The mesh is built once per target (its devices are TPU v5e chips
    of a topology description: nothing can run on them, only compile).

    **Arguments:**

    - `target`: `"v5e"` (2x2, 4 chips) or `"v5e:AxB"`.

    **Returns:**

    A `jax.sharding.Mesh` with axis names `("data",)`.
    """
    return _v5e(target)[1]


def _v5e(target: Any) -> tuple[str, Mesh]:
    shape = v5e_shape(target)
    if shape is None:
        raise ValueError(
            f"Unknown target {target!r}. It needs to be one of {VALID_TARGETS}."
        )
    a, b = shape
    if shape not in V5E_SLICES:
        slices = ", ".join(f"{a}x{b}" for a, b in V5E_SLICES)
        raise ValueError(
            f"Unknown target {target!r}: TPU v5e comes in slices of {slices}. "
            f"It needs to be one of {VALID_TARGETS}."
        )
    if not _installed("libtpu"):
        raise ImportError(
            f"memory_report(target={target!r}): libtpu is not installed. "
            + _TPU_EXTRA_HINT
        )
    return f"v5e:{a}x{b}", _mesh(a, b)


@functools.lru_cache(maxsize=16)
def _mesh(a: int, b: int) -> Mesh:
    from jax.experimental import topologies

    # A v5e host holds up to 8 chips (v5litepod-1/4/8 are single hosts); larger
    # slices are made of 2x2 hosts.
    per_host = [a, b, 1] if a * b <= 8 else [2, 2, 1]
    with _libtpu_environment(a * b):
        try:
            topo = topologies.get_topology_desc(
                platform="tpu",
                topology_name=f"v5e:{a}x{b}",
                chip_config_name="default",
                chips_per_host_bounds=per_host,
                num_slices=1,
                wrap=[False, False, False],
            )
        except Exception as e:  # libtpu's errors are JaxRuntimeErrors
            if "INVALID_ARGUMENT" not in str(e):
                raise
            raise ValueError(
                f"libtpu could not describe a TPU v5e {a}x{b} slice: {e}. Targets "
                f"need to be one of {VALID_TARGETS}, for a slice shape that TPU "
                "v5e comes in."
            ) from e
    n = len(topo.devices)
    return topologies.make_mesh(topo, (n,), ("data",))


def _has_tpu() -> bool:
    """Whether this machine has TPU chips (a TPU VM exposes them as `/dev/accel*`
    or `/dev/vfio/*`: the test the benchmarks' `--device auto` makes)."""
    return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


def _describe_no_slice() -> None:
    """On a machine with libtpu installed (the `tpu` extra, for compiling for
    v5e ahead of time) and no TPU, JAX's first use of a backend loads libtpu to
    look for chips. Asked nothing about the slice it runs on, libtpu looks for
    it, finds none and prints errors on stderr ("could not determine TPU
    accelerator type", "unexpected worker hostname", a source location trace)
    that look like a crash, though JAX then settles on the CPU as it should.
    Tell it, the way `_libtpu_environment` does: a value the user has set is
    kept, and a machine with TPU chips is left alone. Nothing else changes: the
    backend JAX picks, and what libtpu compiles for a target, are the same."""
    if _installed("libtpu") and not _has_tpu():
        for k, v in _SLICE_DEFAULTS.items():
            os.environ.setdefault(k, v)


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # a parent package is missing
        return False


# What libtpu asks a machine's metadata server when it loads, said instead (the
# chip count is filled in per target by `_libtpu_environment`).
_SLICE_DEFAULTS = {
    "TPU_ACCELERATOR_TYPE": "v5litepod-4",
    "TPU_WORKER_HOSTNAMES": "localhost",
    "TPU_SKIP_MDS_QUERY": "1",
}


@contextlib.contextmanager
def _libtpu_environment(chips: int) -> Iterator[None]:
    """The environment variables libtpu reads when it loads (in
    `get_topology_desc`), set while it loads and restored afterwards: compiling
    for the topology later needs none of them.

    - `TPU_ACCELERATOR_TYPE`, `TPU_WORKER_HOSTNAMES`, `TPU_SKIP_MDS_QUERY`
      describe a slice without querying a TPU VM's metadata server; a value the
      user has set is kept.
    - `ALLOW_MULTIPLE_LIBTPU_LOAD`: libtpu takes a machine-wide lock
      (/tmp/libtpu_lockfile) when it loads, so that two processes cannot drive
      one TPU. Compiling drives nothing, and two processes compiling at once
      (pytest-xdist workers, parallel benchmarks) must not fail: allow several
      loads, for this load only.
    """
    defaults = {**_SLICE_DEFAULTS, "TPU_ACCELERATOR_TYPE": f"v5litepod-{chips}"}
    values = {k: v for k, v in defaults.items() if k not in os.environ}
    values["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"
    previous = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in previous.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


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
        stacklevel=_user_stacklevel() if stacklevel is None else stacklevel + 1,
    )


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def _user_stacklevel() -> int:
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


_describe_no_slice()
