"""Semi-public helpers: `eqx_remat.internal` (Equinox's convention, as
`equinox.internal`).

What is here exists for the zoo and the benchmarks, and for models of your own
that want to behave like the zoo's (validate their arguments with the same
messages). It is documented and tested, but not part of the stable API of
`eqx_remat`: a name here may change or move in a minor release.
"""

from ._inspect._clock import (
    Timing as Timing,
    concrete as concrete,
    on_one_clock as on_one_clock,
    paired_ratio as paired_ratio,
    time_interleaved as time_interleaved,
)
from ._inspect._collectives import (
    Collectives as Collectives,
    collectives as collectives,
)
from ._inspect._hardware import (
    HARDWARE as HARDWARE,
    Hardware as Hardware,
    collective_time as collective_time,
    cpu_hardware as cpu_hardware,
)
from ._inspect._memory import (
    compiled_report as compiled_report,
    needed_bytes as needed_bytes,
)
from ._inspect._offload import offload_fails as offload_fails
from ._inspect._pallas import with_pallas_costs as with_pallas_costs
from ._inspect._targets import (
    TENSOR_AXIS as TENSOR_AXIS,
    hardware as hardware,
    mesh_splits as mesh_splits,
    slice_count as slice_count,
    slice_generation as slice_generation,
    slice_shape as slice_shape,
)
from ._jax_private import pallas_interpreting as pallas_interpreting
from ._roofline import roofline_seconds as roofline_seconds
from ._schedules._checkpoint import (
    check_checkpoint as check_checkpoint,
    map_loss_chunk_sizes as map_loss_chunk_sizes,
)
from ._util import (
    format_flops as format_flops,
    is_array_like as is_array_like,
    platform_of as platform_of,
    traceable as traceable,
)
from ._validate import check_int as check_int


__all__ = [
    "TENSOR_AXIS",
    "HARDWARE",
    "Collectives",
    "Hardware",
    "Timing",
    "check_checkpoint",
    "check_int",
    "collective_time",
    "collectives",
    "compiled_report",
    "concrete",
    "cpu_hardware",
    "format_flops",
    "hardware",
    "is_array_like",
    "map_loss_chunk_sizes",
    "mesh_splits",
    "needed_bytes",
    "offload_fails",
    "on_one_clock",
    "pallas_interpreting",
    "paired_ratio",
    "platform_of",
    "roofline_seconds",
    "slice_count",
    "slice_generation",
    "slice_shape",
    "time_interleaved",
    "traceable",
    "with_pallas_costs",
]
