"""Per-chip figures of the targets the planner prices: peak FLOP/s and the host
link. One table, with its sources; the benchmarks read it too."""

import re
from collections.abc import Mapping
from types import MappingProxyType
from typing import NamedTuple

import jax


class Hardware(NamedTuple):
    """What one chip of a target can do: the figures [`eqx_remat.plan`][] prices
    recomputation and offloading with, and the benchmarks compute MFU with.

    **Attributes:**

    - `kind`: the device kind (`jax.devices()[0].device_kind`), or `"cpu"`.
    - `peak_flops`: dense bf16 peak FLOP/s of one chip.
    - `host_bytes_per_s`: bandwidth of one chip's link to host memory, one
      direction, or `None` where there is no separate host memory to offload to
      (the CPU).
    - `source`: where the figures come from.
    """

    kind: str
    peak_flops: float
    host_bytes_per_s: float | None
    source: str


_TPU_DOCS = "cloud.google.com/tpu/docs/{} ('Peak compute per chip (bf16)')"
# Google publishes no host-link figure for its TPUs. Their hosts attach chips by
# PCIe; we assume PCIe Gen4 x8 per chip, 16 GB/s per direction (PCI-SIG: 16 GT/s
# per lane, 128b/130b encoding): a nominal figure, not a measurement.
_TPU_HOST = 16e9
_TPU_HOST_SOURCE = "host link not published by Google: PCIe Gen4 x8, 16 GB/s, assumed"
# NVIDIA's datasheets give PCIe bandwidth both ways: Gen5 x16 "128 GB/s" (H100),
# Gen4 x16 "64 GB/s" (A100); one direction is half.
_H100 = (
    989e12,
    64e9,
    "NVIDIA H100 datasheet: 989 TFLOP/s bf16 dense (SXM); PCIe Gen5 128 GB/s both ways",
)
_A100 = (
    312e12,
    32e9,
    "NVIDIA A100 datasheet: 312 TFLOP/s bf16 dense; PCIe Gen4 64 GB/s both ways",
)


def _tpu(kind: str, flops: float, doc: str) -> Hardware:
    source = f"{_TPU_DOCS.format(doc)}; {_TPU_HOST_SOURCE}"
    return Hardware(kind, flops, _TPU_HOST, source)


HARDWARE: Mapping[str, Hardware] = MappingProxyType(
    {
        h.kind: h
        for h in (
            _tpu("TPU v4", 275e12, "v4"),
            _tpu("TPU v5 lite", 197e12, "v5e"),  # what a v5e chip reports
            _tpu("TPU v5e", 197e12, "v5e"),
            _tpu("TPU v5", 459e12, "v5p"),  # what a v5p chip reports
            _tpu("TPU v5p", 459e12, "v5p"),
            _tpu("TPU v6 lite", 918e12, "v6e"),  # v6e (Trillium)
            _tpu("TPU v6e", 918e12, "v6e"),
            Hardware("NVIDIA H100 80GB HBM3", *_H100),  # H100 SXM
            Hardware("NVIDIA H100", *_H100),
            # Same compute as H100 SXM; the same PCIe Gen5 host link.
            Hardware("NVIDIA H200", 989e12, 64e9, "NVIDIA H200 datasheet"),
            Hardware("NVIDIA A100-SXM4-80GB", *_A100),
            Hardware("NVIDIA A100-SXM4-40GB", *_A100),
            Hardware("NVIDIA A100 80GB PCIe", *_A100),
            Hardware("NVIDIA A100-PCIE-40GB", *_A100),
            # Not a peak: a nominal figure for a few server cores running XLA's
            # CPU backend, so that CPU plans weigh recomputation at all. No host
            # link: the CPU has one memory.
            Hardware("cpu", 1e11, None, "nominal: 100 GFLOP/s (a few CPU cores)"),
        )
    }
)
"""Per-chip figures by device kind (`jax.devices()[0].device_kind`; `"cpu"` for
the CPU), with their sources."""

# What an unknown device of a platform is priced as (and said to be).
_FALLBACK = {"tpu": "TPU v5 lite", "gpu": "NVIDIA A100-SXM4-80GB", "cpu": "cpu"}
_V5E = re.compile(r"v5e(:\d+x\d+)?")


def hardware(target: str | None) -> tuple[Hardware, bool]:
    """The figures for a [`eqx_remat.memory_report`][] target: `None` (the
    default backend's first device), a platform name, or `"v5e[:AxB]"`.

    **Returns:**

    `(hardware, known)`: `known` is `False` when the device kind is not in
    `HARDWARE` and a platform's nominal figures are used instead.
    """
    if isinstance(target, str) and _V5E.fullmatch(target):
        return HARDWARE["TPU v5 lite"], True
    device = jax.devices()[0]
    kind = "cpu" if device.platform == "cpu" else device.device_kind
    if kind in HARDWARE:
        return HARDWARE[kind], True
    platform = "gpu" if device.platform in ("gpu", "cuda", "rocm") else device.platform
    return HARDWARE[_FALLBACK.get(platform, "cpu")], False
