"""Targets: what `memory_report`, `plan` and the benchmarks compile for. The one
parser of their names (`None`: the default backend, a platform name, or TPU
slices: `"v5e"`, `"v5e:AxB"`, `"v6e:AxB"`, `"v5p:AxBxC"`, `"Nxv5e:AxB"`), and
`Target`, the value a name is normalised to once: its name, its mesh and its
chips' figures."""

import contextlib
import dataclasses
import functools
import glob
import importlib.util
import math
import os
import re
from collections.abc import Iterator
from typing import Any, NamedTuple, SupportsIndex

import jax
from jax.sharding import Mesh

from .._validate import check_int
from ._hardware import HARDWARE, Hardware, device_hardware


PLATFORMS = ("cpu", "gpu", "tpu")

MESH_AXES = ("data", "fsdp")
"""The axes of a mesh that splits the chips between data parallelism and FSDP."""

TENSOR_AXIS = "tensor"
"""The mesh axis of tensor parallelism: `zoo.shard` splits the layers' heads
and hidden units over it, and each chip does its share of every example."""

VALID_TARGETS = (
    'None (the default backend), its platform name ("cpu", "gpu" or "tpu", as '
    'reports name it), "v5e" (TPU v5e 2x2, 4 chips), "v5e:AxB" (e.g. "v5e:2x4", '
    '"v5e:4x4"), "v6e:AxB" (TPU v6e, the same shapes), "v5p:AxBxC" (TPU v5p, e.g. '
    '"v5p:4x4x4", 64 chips), or "Nx" before any of them (N such slices joined by '
    'the data center network, e.g. "2xv5e:16x16")'
)

# The slice shapes TPU v5e and v6e come in (Cloud TPU's "TPU v5e" and "TPU v6e"
# pages: "supports the following 2D slice shapes", with no custom topologies):
# libtpu describes others too (a 2x3 slice), which no one can run on.
V5E_SLICES = ((1, 1), (2, 2), (2, 4), (4, 4), (4, 8), (8, 8), (8, 16), (16, 16))
# TPU v5p's (its Cloud TPU page): 2x2x1 to 2x4x4, then any 3D shape whose sides
# are multiples of 4 (4x4x4 is a v5p-128: v5p names count TensorCores, 2 a chip).
_V5P_SMALL = ((2, 2, 1), (2, 2, 2), (2, 2, 4), (2, 4, 4))


class Generation(NamedTuple):
    """A TPU generation a target can name: its chip's `kind` (as a device
    reports it, the key of its figures in `HARDWARE`), its slice shape's
    `dims`, the shape of a bare name, the accelerator type a slice of `n`
    chips is (`TPU_ACCELERATOR_TYPE`, what libtpu asks of a TPU VM), and the
    most chips one host holds (larger slices are made of 2x2 hosts)."""

    kind: str
    dims: int
    default: tuple[int, ...]
    accelerator: str
    host_chips: int

    def comes_in(self, shape: tuple[int, ...]) -> bool:
        """Whether the generation comes in slices of `shape`."""
        if len(shape) != self.dims:
            return False
        if self.dims == 2:
            return shape in V5E_SLICES
        return shape in _V5P_SMALL or all(d % 4 == 0 and d > 0 for d in shape)

    def shapes(self) -> str:
        """The slice shapes it comes in, in words (`comes_in`)."""
        if self.dims == 2:
            return ", ".join("x".join(map(str, s)) for s in V5E_SLICES)
        small = ", ".join("x".join(map(str, s)) for s in _V5P_SMALL)
        return f"{small} or AxBxC with every side a multiple of 4"


GENERATIONS = {
    # A v5e or v6e host holds up to 8 chips (v5litepod-1/4/8 are single
    # hosts), a v5p host 4.
    "v5e": Generation("TPU v5 lite", 2, (2, 2), "v5litepod-{n}", 8),
    "v6e": Generation("TPU v6 lite", 2, (2, 2), "v6e-{n}", 8),
    "v5p": Generation("TPU v5", 3, (2, 2, 1), "v5p-{cores}", 4),
}

_TPU = re.compile(r"(?:(\d+)x)?(v5e|v6e|v5p)(?::(\d+(?:x\d+)*))?")


def slice_shape(target: Any) -> tuple[int, ...] | None:
    """The slice shape that a TPU target names: `(2, 2)` for `"v5e"`, `(A, B)`
    for `"v5e:AxB"` or `"v6e:AxB"`, `(A, B, C)` for `"v5p:AxBxC"` (not checked
    to be a slice the TPU comes in); `None` for any other value.

    ```python
    import eqx_remat

    shape = eqx_remat.internal.slice_shape
    print(shape("v5e:2x4"), shape("v5p:4x4x4"), shape("cpu"))
    ```

    ```text
    (2, 4) (4, 4, 4) None
    ```
    """
    parts = _tpu_parts(target)
    return None if parts is None else parts[2]


def slice_generation(target: Any) -> str | None:
    """The TPU generation a target names (`"v5e"`, `"v6e"` or `"v5p"`), or
    `None` for any other value."""
    parts = _tpu_parts(target)
    return None if parts is None else parts[1]


def slice_count(target: Any) -> int:
    """How many slices a TPU target names: `N` for `"Nxv5e:AxB"` (or any
    generation's), else 1 (any other value too)."""
    parts = _tpu_parts(target)
    return 1 if parts is None else parts[0]


def _tpu_parts(target: Any) -> tuple[int, str, tuple[int, ...]] | None:
    """`(N, generation, shape)` of `"NxGEN:AxB[xC]"` (`N` 1 and the shape the
    generation's default where left out), or `None` for any value that is
    not a TPU target's name: the one parser."""
    match = _TPU.fullmatch(target) if isinstance(target, str) else None
    if match is None:
        return None
    n, gen, shape = match.groups()
    dims = GENERATIONS[gen].default if shape is None else shape.split("x")
    return int(n or 1), gen, tuple(map(int, dims))


def _name(n: int, gen: str, shape: tuple[int, ...]) -> str:
    """The canonical name of `n` slices of `shape` (`"v5e:2x2"`, `"2xv5p:4x4x4"`)."""
    one = f"{gen}:{'x'.join(map(str, shape))}"
    return one if n == 1 else f"{n}x{one}"


TPU_EXTRA_HINT = (
    "Compiling for TPU ahead of time needs libtpu (no TPU needed). Install "
    "it with `pip install 'eqx-remat[tpu]'`."
)


def at_hand(fn: str, target: Any) -> Any:
    """`target`, or `None` for the platform name of the default backend; the
    name of another platform is a `ValueError` that names this one."""
    if target not in PLATFORMS:
        return target
    if target != jax.default_backend():
        raise ValueError(
            f"{fn}(target={target!r}): a platform name must be the default "
            f"backend, here {jax.default_backend()!r}. Use None for it, or "
            '"v5e" / "v5e:AxB" (or "v6e:AxB", "v5p:AxBxC") to compile for a TPU '
            "slice without a TPU."
        )
    return None


def v5e_mesh(
    target: str = "v5e",
    *,
    fsdp: SupportsIndex | None = None,
    tensor: SupportsIndex | None = None,
) -> Mesh:
    """The device mesh that `memory_report(..., target=target)` compiles for.

    By default one axis, `"data"`, over all the chips of the slice. Use it to
    give `jax.ShapeDtypeStruct` arguments a sharding, e.g.
    `NamedSharding(v5e_mesh(), PartitionSpec("data"))` to split a batch across
    the chips. With `fsdp`, two axes, `("data", "fsdp")`, of `chips / fsdp` and
    `fsdp` chips, the split of the slice that MaxText's `ici_data_parallelism`
    and `ici_fsdp_parallelism` set: the parameters split over `"fsdp"`
    (`zoo.shard(model, mesh, fsdp=True, axis="fsdp")`), the batch over both
    (`zoo.shard_batch(batch, mesh, axis=("data", "fsdp"))`). The devices are
    the TPU chips of a topology description (v5e, or the v6e or v5p a target
    names: the name predates them): nothing can run on them, only compile;
    each mesh is built once.

    With `tensor` too, three axes, `("data", "fsdp", "tensor")`: MaxText's
    `ici_tensor_parallelism`, the axis `zoo.shard` splits the layers' heads
    and hidden units over (tensor parallelism).

    Of several slices (`"Nxv5e:AxB"`, any generation's), the `"data"` axis
    spans them, slice after slice, as MaxText's `dcn_data_parallelism` joins
    slices: FSDP stays within a slice, and what crosses the data center
    network is the data parallelism's (the gradients' all-reduce).

    **Arguments:**

    - `target`: `"v5e"` (2x2, 4 chips), `"v5e:AxB"`, `"v6e:AxB"`,
      `"v5p:AxBxC"`, or `"Nx"` before one of them.
    - `fsdp`: `None` (the default) for one axis; else an int `>= 1` that
      divides a slice's chips: the size of the `"fsdp"` axis. (Keyword only.)
    - `tensor`: `None` (the default) for no tensor axis; else an int `>= 1`
      that divides a slice's chips over `fsdp` (1 where `fsdp` is `None`): the
      size of the `"tensor"` axis. (Keyword only.)

    **Returns:**

    A `jax.sharding.Mesh` with axis names `("data",)`, `("data", "fsdp")`
    with `fsdp`, or `("data", "fsdp", "tensor")` with `tensor`.

    **Raises:**

    `ValueError` for an unknown target, or an `fsdp` (times `tensor`) that is
    not an int `>= 1` dividing a slice's chips.
    """
    name, mesh = tpu_target(target)
    if fsdp is None and tensor is None:
        return mesh
    parts = _tpu_parts(name)
    assert parts is not None  # `name` is canonical
    slices, gen, dims = parts
    n = math.prod(dims)
    fsdp = 1 if fsdp is None else check_int("v5e_mesh", "fsdp", fsdp, 1)
    shape: tuple[int, ...] = (fsdp,)
    if tensor is not None:
        shape += (check_int("v5e_mesh", "tensor", tensor, 1),)
    if n % math.prod(shape):
        each = " of each slice" if slices > 1 else ""
        got = ", ".join(f"{k}={v}" for k, v in zip(("fsdp", "tensor"), shape))
        raise ValueError(
            f"v5e_mesh expected {' x '.join(('fsdp', 'tensor')[: len(shape)])} to "
            f"divide the {n} chips{each} of {name} (one of {divisors(n)[::-1]}). "
            f"Got {got}."
        )
    return slice_mesh(gen, dims, (slices * n // math.prod(shape), *shape), slices)


def divisors(n: int) -> list[int]:
    """The divisors of `n`, largest first: the FSDP degrees of `n` chips."""
    return [k for k in range(n, 0, -1) if n % k == 0]


def tpu_target(target: Any) -> tuple[str, Mesh]:
    """`(name, mesh)` of a TPU target: its canonical name (`"v5e:2x2"`) and the
    mesh it compiles for; a `ValueError` for another value or a slice shape
    the TPU does not come in, an `ImportError` without libtpu."""
    parts = _tpu_parts(target)
    if parts is None:
        raise ValueError(
            f"Unknown target {target!r}. It needs to be one of {VALID_TARGETS}."
        )
    n, gen, shape = parts
    g = GENERATIONS[gen]
    if not g.comes_in(shape):
        sizes = "x".join("ABC"[: g.dims])
        raise ValueError(
            f"Unknown target {target!r}: TPU {gen} comes in slices of "
            f"{g.shapes()} ({gen}:{sizes}). It needs to be one of {VALID_TARGETS}."
        )
    if n < 1:
        raise ValueError(
            f"Unknown target {target!r}: N slices of Nx{gen} need N >= 1. "
            f"It needs to be one of {VALID_TARGETS}."
        )
    if not installed("libtpu"):
        raise ImportError(
            f"memory_report(target={target!r}): libtpu is not installed. "
            + TPU_EXTRA_HINT
        )
    return _name(n, gen, shape), slice_mesh(gen, shape, None, n)


@functools.lru_cache(maxsize=16)
def slice_mesh(
    gen: str,
    dims: tuple[int, ...],
    shape: tuple[int, ...] | None = None,
    slices: int = 1,
) -> Mesh:
    """The mesh of `slices` slices of TPU `gen` of shape `dims`: one axis,
    `"data"`, or, of `shape` `(data, fsdp)` or `(data, fsdp, tensor)`, two or
    three, laid out on each slice's chips by JAX's `create_device_mesh` (as
    `topologies.make_mesh` does), splitting a physical axis where an axis of
    `shape` is no product of them (`fsdp=128` of `16x16`: 16 = 2 x 8, as
    MaxText's `allow_split_physical_axes`), the slices one after another along
    `"data"` (`create_hybrid_device_mesh`)."""
    from jax.experimental import mesh_utils

    devices = list(_topology(gen, dims, slices).devices)
    axes = (*MESH_AXES, TENSOR_AXIS)[: len(shape)] if shape is not None else ("data",)
    shape = shape if shape is not None else (len(devices),)
    # Within a slice: the data axis a slice's share of it.
    each, across = (shape[0] // slices, *shape[1:]), (slices, *[1] * (len(shape) - 1))

    def grid(split: bool) -> Any:
        if slices == 1:
            return mesh_utils.create_device_mesh(
                shape, devices, allow_split_physical_axes=split
            )
        return mesh_utils.create_hybrid_device_mesh(
            each, across, devices, allow_split_physical_axes=split
        )

    try:
        return Mesh(grid(False), axes)
    except NotImplementedError:  # no product of the physical axes: split one
        return Mesh(grid(True), axes)


@functools.lru_cache(maxsize=16)
def _topology(gen: str, dims: tuple[int, ...], slices: int = 1) -> Any:
    from jax.experimental import topologies

    shape = (*dims, 1)[:3]
    chips = math.prod(dims)
    per_host = list(shape) if chips <= GENERATIONS[gen].host_chips else [2, 2, 1]
    name = _name(1, gen, dims)
    with libtpu_environment(gen, chips):
        try:
            topo = topologies.get_topology_desc(
                platform="tpu",
                topology_name=name,
                chip_config_name="default",
                chips_per_host_bounds=per_host,
                num_slices=slices,
                wrap=[False, False, False],
            )
        except Exception as e:  # libtpu's errors are JaxRuntimeErrors
            if "INVALID_ARGUMENT" not in str(e):
                raise
            raise ValueError(
                f"libtpu could not describe a TPU {name} slice: {e}. Targets "
                f"need to be one of {VALID_TARGETS}, for a slice shape that the "
                "TPU comes in."
            ) from e
    return topo


def has_tpu() -> bool:
    """Whether this machine has TPU chips (a TPU VM exposes them as `/dev/accel*`
    or `/dev/vfio/*`: the test the benchmarks' `--device auto` makes)."""
    return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


def describe_no_slice() -> None:
    """On a machine with libtpu installed (the `tpu` extra, for compiling for
    TPU ahead of time) and no TPU, JAX's first use of a backend loads libtpu to
    look for chips. Asked nothing about the slice it runs on, libtpu looks for
    it, finds none and prints errors on stderr ("could not determine TPU
    accelerator type", "unexpected worker hostname", a source location trace)
    that look like a crash, though JAX then settles on the CPU as it should.
    Tell it, the way `libtpu_environment` does: a value the user has set is
    kept, and a machine with TPU chips is left alone. Nothing else changes: the
    backend JAX picks, and what libtpu compiles for a target, are the same."""
    if installed("libtpu") and not has_tpu():
        for k, v in SLICE_DEFAULTS.items():
            os.environ.setdefault(k, v)


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # a parent package is missing
        return False


# What libtpu asks a machine's metadata server when it loads, said instead (the
# chip count is filled in per target by `libtpu_environment`).
SLICE_DEFAULTS = {
    "TPU_ACCELERATOR_TYPE": "v5litepod-4",
    "TPU_WORKER_HOSTNAMES": "localhost",
    "TPU_SKIP_MDS_QUERY": "1",
}


@contextlib.contextmanager
def libtpu_environment(gen: str, chips: int) -> Iterator[None]:
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
    kind = GENERATIONS[gen].accelerator.format(n=chips, cores=2 * chips)
    defaults = {**SLICE_DEFAULTS, "TPU_ACCELERATOR_TYPE": kind}
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


@dataclasses.dataclass(frozen=True)
class Target:
    """What a function is compiled for, normalised once at the top of
    [`eqx_remat.memory_report`][] and [`eqx_remat.plan`][]
    (`Target.of(target)`).

    - `name`: `None` for the device at hand (the default backend), else a TPU
      slice, or several, by its canonical name (`"v5e:2x4"`, `"2xv5e:16x16"`,
      `"v5p:4x4x4"`).
    - `mesh`: the slice's mesh (one axis, `"data"`), `None` for the device at
      hand.
    - `figures`: the chips' [`eqx_remat.internal.Hardware`][] where given (a
      what-if); `None` to look them up (`hardware`).
    """

    name: str | None
    mesh: Mesh | None = None
    figures: Hardware | None = None

    @staticmethod
    def of(target: Any, fn: str = "memory_report") -> "Target":
        """`target` (`None`, a platform name, `"v5e"`, `"v5e:AxB"`, ...) as a
        `Target`; errors name `fn`, the function it was given to."""
        target = at_hand(fn, target)
        if target is None:
            return Target(None)
        return Target(*tpu_target(target))

    @property
    def label(self) -> str:
        """The name, or the default backend's platform name."""
        return jax.default_backend() if self.name is None else self.name

    @property
    def chips(self) -> int:
        """The slice's chips; of the device at hand, its devices."""
        return jax.device_count() if self.mesh is None else self.mesh.size

    def placed(self, dynamic: Any) -> "Target":
        """This target on the mesh `dynamic`'s arrays are placed on, where it
        is another mesh of the same chips (`v5e_mesh(name, fsdp=k)`): code
        that asks which mesh it is traced on (zoo's flash attention) sees
        theirs."""
        if self.mesh is None:
            return self
        chips = set(self.mesh.devices.flat)
        for x in jax.tree.leaves(dynamic):
            mesh = getattr(getattr(x, "sharding", None), "mesh", None)
            if isinstance(mesh, Mesh) and set(mesh.devices.flat) == chips:
                return dataclasses.replace(self, mesh=mesh)
        return self

    def meshes(self) -> list[Mesh]:
        """`mesh_splits` of this target."""
        n = self.chips
        if self.name is not None:  # FSDP within a slice
            per = n // slice_count(self.name)
            return [v5e_mesh(self.name, fsdp=k) for k in divisors(per)]
        auto = (jax.sharding.AxisType.Auto,) * 2
        return [
            jax.make_mesh((n // k, k), MESH_AXES, axis_types=auto) for k in divisors(n)
        ]

    def hardware(self) -> tuple[Hardware, bool]:
        """`(figures of one chip, known)`: a TPU target's from the table; the
        device at hand's measured (a CPU) or by its kind (`known` is `False`
        where its kind is not in the table and a platform's are used)."""
        if self.figures is not None:
            return self.figures, True
        parts = _tpu_parts(self.name)
        if parts is not None:
            return HARDWARE[GENERATIONS[parts[1]].kind], True
        return device_hardware()

    def traced(self) -> contextlib.AbstractContextManager:
        """A context in which functions are traced (not compiled) for this
        target: on a TPU target's abstract mesh, so that code asking what it
        is traced for (zoo's flash attention) sees the TPU."""
        if self.mesh is None:
            return contextlib.nullcontext()
        return jax.sharding.use_abstract_mesh(self.mesh.abstract_mesh)


def mesh_splits(target: str | None = None) -> list[Mesh]:
    """Every split of `target`'s chips between data parallelism and FSDP, as
    [`eqx_remat.plan`][]`(..., shard=...)` plans them: meshes of axes
    `("data", "fsdp")`, FSDP over every chip first, data parallelism last (of
    several slices, `"Nxv5e:AxB"` or another generation's: FSDP over every
    chip of a slice first, the data axis spanning the slices).

    **Arguments:**

    - `target`: `None` for the device at hand (its devices: a CPU's host
      devices, `XLA_FLAGS=--xla_force_host_platform_device_count=8`), or
      a TPU target, `"v5e"` / `"v5e:AxB"` / `"v6e:AxB"` / `"v5p:AxBxC"` /
      `"Nxv5e:AxB"` ([`eqx_remat.v5e_mesh`][]`(target, fsdp=k)`).

    ```python
    import eqx_remat

    for mesh in eqx_remat.internal.mesh_splits("v5e"):
        print(dict(mesh.shape))
    ```

    ```text
    {'data': 1, 'fsdp': 4}
    {'data': 2, 'fsdp': 2}
    {'data': 4, 'fsdp': 1}
    ```
    """
    return Target.of(target, "mesh_splits").meshes()


def hardware(target: str | None) -> tuple[Hardware, bool]:
    """The figures for a [`eqx_remat.memory_report`][] target: `None` (the
    default backend's first device), its platform name, or a TPU target
    (`"v5e[:AxB]"`, `"v6e:AxB"`, `"v5p:AxBxC"`).

    **Returns:**

    `(hardware, known)`: `known` is `False` when the device kind is not in
    `HARDWARE` and a platform's nominal figures are used instead.
    """
    return Target.of(target, "hardware").hardware()


describe_no_slice()


def share_per_chip(args: tuple, chips: int) -> float:
    """The part of the activations one chip holds: `1 / k` when an argument
    (the batch) is split `k` ways along its first axis, else 1 (everything
    replicated); and, on a mesh with a tensor axis (`TENSOR_AXIS`) the batch
    is not split over, that much less again (each example's layers split
    over it)."""
    ways = 1
    for x in jax.tree.leaves(args):
        sharding = getattr(x, "sharding", None)
        spec = getattr(sharding, "spec", None)
        if not isinstance(x, jax.ShapeDtypeStruct) or sharding is None or not spec:
            continue
        first = spec[0]
        axes = (first,) if isinstance(first, str) else tuple(first or ())
        shape = dict(sharding.mesh.shape)
        k = math.prod(shape[a] for a in axes)
        if TENSOR_AXIS not in axes:
            k *= shape.get(TENSOR_AXIS, 1)
        ways = max(ways, k)
    return 1.0 / min(ways, max(chips, 1))
