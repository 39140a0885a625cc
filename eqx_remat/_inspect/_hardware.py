"""Per-chip figures of the targets the planner prices: peak FLOP/s, memory
bandwidth, memory and the host link. One table, with its sources; the
benchmarks read it too. The CPU's figures are measured, once per process.
A [`Target`][eqx_remat._inspect._targets.Target] holds the figures of what it
names."""

import functools
import os
import statistics
import time
from collections.abc import Mapping
from types import MappingProxyType
from typing import NamedTuple

import jax
import jax.numpy as jnp

from ._flops import FlopCount


class Hardware(NamedTuple):
    """What one chip of a target can do: the figures [`eqx_remat.plan`][]'s
    roofline prices a step with where it cannot time it, and the benchmarks
    compute MFU with.

    **Attributes:**

    - `kind`: the device kind (`jax.devices()[0].device_kind`), or `"cpu"`.
    - `peak_flops`: dense bf16 peak FLOP/s of one chip (the CPU: measured).
    - `memory_bytes_per_s`: bandwidth of one chip's own memory (HBM; the CPU:
      measured), read and write together.
    - `memory_bytes`: memory of one chip, or `None` where it is the host's.
    - `host_bytes_per_s`: bandwidth of one chip's link to host memory, one
      direction, or `None` where there is no separate host memory to offload to
      (the CPU).
    - `source`: where the figures come from.
    - `measured_fraction`: the fraction of the roofline's rate that published
      runs on this chip reach (a measured step takes the roofline's time over
      it), or `None` where no run was compared; `measured_source` says which.
    - `usable_bytes`: what XLA lets one program use of `memory_bytes`, where
      known (a v5e chip: 15.75 GiB of its 16 GiB, as XLA's
      `RESOURCE_EXHAUSTED` messages say); else `None` (all of it).
    - `interconnect_bytes_per_s`: what one chip can send the other chips of
      its slice (ICI on a TPU), one direction, all its links together (half
      the bidirectional figure Google publishes), or `None` where unknown.
    - `network_bytes_per_s`: what one chip can send chips of other slices
      (the data center network, DCN: its host's share), or `None`.
    """

    kind: str
    peak_flops: float
    memory_bytes_per_s: float
    memory_bytes: int | None
    host_bytes_per_s: float | None
    source: str
    measured_fraction: float | None = None
    measured_source: str | None = None
    usable_bytes: int | None = None
    interconnect_bytes_per_s: float | None = None
    network_bytes_per_s: float | None = None

    @property
    def capacity_bytes(self) -> int | None:
        """What one program may use of one chip's memory: `usable_bytes`
        where known, else `memory_bytes`."""
        return self.memory_bytes if self.usable_bytes is None else self.usable_bytes

    def estimate_note(self, collectives: bool = False) -> str:
        """How an estimate on this chip is made (with `collectives`: plus what
        the chips send each other) and how it compares with published runs:
        what every estimated time and rate is printed with."""
        how = "roofline"
        if collectives:
            how = "roofline, then the collectives at the interconnect's rate"
        if self.measured_fraction is None:
            return how
        of = "of the roofline alone" if collectives else "of it"
        return f"{how}; {self.measured_source} reach {self.measured_fraction:.2f} {of}"


_GIB = 2**30
_TPU_DOCS = (
    "cloud.google.com/tpu/docs/{} (peak compute, HBM bandwidth and capacity, "
    "bidirectional ICI bandwidth per chip)"
)
# Google publishes no host-link figure for its TPUs. Their hosts attach chips by
# PCIe; we assume PCIe Gen4 x8 per chip, 16 GB/s per direction (PCI-SIG: 16 GT/s
# per lane, 128b/130b encoding): a nominal figure, not a measurement.
_TPU_HOST = 16e9
_TPU_HOST_SOURCE = "host link not published by Google: PCIe Gen4 x8, 16 GB/s, assumed"
# NVIDIA's datasheets give PCIe bandwidth both ways: Gen5 x16 "128 GB/s" (H100,
# H200), Gen4 x16 "64 GB/s" (A100); one direction is half.
_H100 = (
    989e12,
    3.35e12,
    80 * _GIB,
    64e9,
    "NVIDIA H100 datasheet (SXM): 989 TFLOP/s bf16 dense, 3.35 TB/s HBM3, 80 GB; "
    "PCIe Gen5 128 GB/s both ways",
)
_H200 = (
    989e12,
    4.8e12,
    141 * 10**9,
    64e9,
    "NVIDIA H200 datasheet (SXM): 989 TFLOP/s bf16 dense, 4.8 TB/s HBM3e, 141 GB; "
    "PCIe Gen5 128 GB/s both ways",
)
_A100_80 = (
    312e12,
    2.039e12,
    80 * _GIB,
    32e9,
    "NVIDIA A100 datasheet: 312 TFLOP/s bf16 dense, 2,039 GB/s (80GB SXM); "
    "PCIe Gen4 64 GB/s both ways",
)
_A100_40 = (
    312e12,
    1.555e12,
    40 * _GIB,
    32e9,
    "NVIDIA A100 datasheet: 312 TFLOP/s bf16 dense, 1,555 GB/s (40GB); "
    "PCIe Gen4 64 GB/s both ways",
)


# MaxText's published MFU on v5e-256 (16B 61.10%, 32B 66.86%, 64B 59.90%, 128B
# 56.06%; google/maxtext 9bc243c, October 2023) over the roofline's for the same
# models compiled for v5e:16x16 (`benchmarks/maxtext_mfu.py`, 75.4-78.3%): 0.81,
# 0.86, 0.77, 0.72, median 0.79. One stated factor, not a fit: the roofline's
# ranking is kept (it has no term for collectives).
_V5E_MEASURED = (0.79, "MaxText's measured v5e runs")


# What XLA lets one program use of a v5e chip's 16 GiB of HBM: "exceeds
# available HBM (15.75G)" in its RESOURCE_EXHAUSTED messages (libtpu 0.0.42.1).
_V5E_USABLE = int(15.75 * _GIB)


# Interconnects, per chip, as cloud.google.com/tpu/docs/{v5e,v5p,v6e} publish
# them: bidirectional ICI 400, 1200 and 800 GB/s (one direction: half); DCN, a
# v5e host's 2 x 100 Gbps NICs for its 8 chips (3.125 GB/s a chip), a v5p's
# 50 Gbps a chip. v4's and v6e's DCN: not in their pages.
_ICI = {"v5e": 200e9, "v5p": 600e9, "v6e": 400e9}
_DCN = {"v5e": 200e9 / 8 / 8, "v5p": 50e9 / 8}


def _tpu(
    kind: str,
    flops: float,
    bandwidth: float,
    gib: int,
    doc: str,
    measured: tuple[float, str] | None = None,
    usable: int | None = None,
) -> Hardware:
    source = f"{_TPU_DOCS.format(doc)}; {_TPU_HOST_SOURCE}"
    fraction, by = (None, None) if measured is None else measured
    return Hardware(
        kind,
        flops,
        bandwidth,
        gib * _GIB,
        _TPU_HOST,
        source,
        fraction,
        by,
        usable,
        _ICI.get(doc),
        _DCN.get(doc),
    )


HARDWARE: Mapping[str, Hardware] = MappingProxyType(
    {
        h.kind: h
        for h in (
            _tpu("TPU v4", 275e12, 1228e9, 32, "v4"),
            # what a v5e reports
            _tpu("TPU v5 lite", 197e12, 819e9, 16, "v5e", _V5E_MEASURED, _V5E_USABLE),
            _tpu("TPU v5e", 197e12, 819e9, 16, "v5e", _V5E_MEASURED, _V5E_USABLE),
            _tpu("TPU v5", 459e12, 2765e9, 95, "v5p"),  # what a v5p chip reports
            _tpu("TPU v5p", 459e12, 2765e9, 95, "v5p"),
            _tpu("TPU v6 lite", 918e12, 1640e9, 32, "v6e"),  # v6e (Trillium)
            _tpu("TPU v6e", 918e12, 1640e9, 32, "v6e"),
            Hardware("NVIDIA H100 80GB HBM3", *_H100),  # H100 SXM
            Hardware("NVIDIA H100", *_H100),
            Hardware("NVIDIA H200", *_H200),
            Hardware("NVIDIA A100-SXM4-80GB", *_A100_80),
            Hardware("NVIDIA A100-SXM4-40GB", *_A100_40),
            Hardware("NVIDIA A100 80GB PCIe", *_A100_80[:1], 1.935e12, *_A100_80[2:]),
            Hardware("NVIDIA A100-PCIE-40GB", *_A100_40),
        )
    }
)
"""Per-chip figures by device kind (`jax.devices()[0].device_kind`), with their
sources. The CPU is not in it: its figures are measured
([`eqx_remat.internal.cpu_hardware`][])."""

# What an unknown device of a platform is priced as (and said to be).
_FALLBACK = {"tpu": "TPU v5 lite", "gpu": "NVIDIA A100-SXM4-80GB"}


CPU_NOMINAL = Hardware(
    "cpu",
    1e11,
    1e10,
    None,
    None,
    "nominal (100 GFLOP/s, 10 GB/s): one figure for every process of a "
    "multi-process run, where measured ones would differ between them",
)


@functools.cache
def cpu_hardware() -> Hardware:
    """This CPU's figures, measured once per process (about a second): the
    FLOP/s of a 512 x 512 float32 matrix product and the bytes per second of a
    64 MiB copy (read and write, into a new buffer, as a step's temporaries
    are): the product's best and the copy's median of 20 runs, each after a
    quarter of a second of warm-up, on the default CPU device."""
    # Why the warm-up and the copy's median: one warm-up run and the best of
    # five read 0.22 to 0.42 TFLOP/s in fresh processes on a 2-core machine
    # that reads 0.46 to 0.49 warm, and the best copy of 20 now and then
    # caught a reused buffer (11.6 GB/s where most read 8).
    cpu = jax.local_devices(backend="cpu")[0]
    n = 512
    a = jax.device_put(jnp.ones((n, n), jnp.float32), cpu)
    x = jax.device_put(jnp.ones((2**24,), jnp.float32), cpu)
    matmul = jax.jit(lambda a: a @ a).lower(a).compile()
    copy = jax.jit(lambda x: x + 1.0).lower(x).compile()

    def times(f, arg) -> list[float]:
        warm = time.perf_counter() + 0.25
        while time.perf_counter() < warm:
            jax.block_until_ready(f(arg))
        out = []
        for _ in range(20):
            start = time.perf_counter()
            jax.block_until_ready(f(arg))
            out.append(time.perf_counter() - start)
        return out

    flops = 2 * n**3 / min(times(matmul, a))
    bandwidth = 2 * x.nbytes / statistics.median(times(copy, x))
    source = (
        f"measured on this CPU ({os.cpu_count()} cores): a {n}x{n} float32 "
        "matrix product (best of 20) and a 64 MiB elementwise pass (median of "
        "20), after warm-up; host devices send each other bytes by copying "
        "them through that memory (read and written: half its rate)"
    )
    return Hardware(
        "cpu",
        flops,
        bandwidth,
        None,
        None,
        source,
        interconnect_bytes_per_s=bandwidth / 2,
    )


def device_hardware() -> tuple[Hardware, bool]:
    """The figures of the default backend's first device: measured on a CPU
    (nominal where several processes run), from `HARDWARE` by device kind
    elsewhere.

    **Returns:**

    `(hardware, known)`: `known` is `False` when the device kind is not in
    `HARDWARE` and a platform's nominal figures are used instead.
    """
    device = jax.devices()[0]
    if device.platform == "cpu":
        if jax.process_count() > 1:
            # Each process would measure other figures, and could plan
            # differently: all take the same nominal ones.
            return CPU_NOMINAL, True
        return cpu_hardware(), True
    if device.device_kind in HARDWARE:
        return HARDWARE[device.device_kind], True
    platform = "gpu" if device.platform in ("gpu", "cuda", "rocm") else device.platform
    return HARDWARE[_FALLBACK.get(platform, "gpu")], False


def collective_time(
    hw: Hardware, sent: float | int, network: float | int = 0
) -> float | None:
    """The seconds one chip takes to send `sent` bytes to the other chips of
    its slice at its interconnect's rate, then `network` bytes to chips of
    other slices at the data center network's (`None` where a rate it needs
    is unknown)."""
    rate, dcn = hw.interconnect_bytes_per_s, hw.network_bytes_per_s
    if rate is None or (network > 0 and dcn is None):
        return None
    return max(sent, 0) / rate + (network / dcn if dcn and network > 0 else 0.0)


def roofline_time(
    hw: Hardware, flops: float | int, moved: float | int, host_bytes: float | int
) -> float:
    """The roofline's seconds on one chip: `flops` (that chip's share) at its
    peak, plus the bytes it `moved` through its memory at the memory's
    bandwidth, plus `host_bytes` offloaded over its host link, out in the
    forward pass and back in the backward pass. Offloading is never free."""
    link = 0.0 if host_bytes <= 0 else 2 * host_bytes / (hw.host_bytes_per_s or 1.0)
    return max(flops, 0.0) / hw.peak_flops + moved / hw.memory_bytes_per_s + link


def bytes_moved(flops: FlopCount, saved: int) -> int:
    """The bytes a function moves through device memory, as the roofline
    counts them: what it `saved` (per trip) three times (JAX's scan zero-fills
    each stacked buffer, the forward pass writes it, the backward pass reads
    it: issue 28's profile), and its matrix products' operands and results
    (`FlopCount.dot_bytes`). Elementwise work is taken to be fused."""
    return 3 * saved + flops.dot_bytes
