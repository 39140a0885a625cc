"""Gradient-checkpointing policies, depth schedules and scan combinators for JAX."""

import importlib.metadata as _metadata

from . import internal as internal
from ._accumulate import accumulate as accumulate
from ._combinators import (
    StackedListWarning as StackedListWarning,
    chain as chain,
    scan_layers as scan_layers,
    stack as stack,
)
from ._inspect._flops import FlopCount as FlopCount, count_flops as count_flops
from ._inspect._memory import (
    MemoryReport as MemoryReport,
    ReplicatedArgumentsWarning as ReplicatedArgumentsWarning,
    memory_report as memory_report,
)
from ._inspect._offload import OffloadWarning as OffloadWarning
from ._inspect._residuals import (
    Residual as Residual,
    print_residuals as print_residuals,
    residuals as residuals,
)
from ._inspect._targets import v5e_mesh as v5e_mesh
from ._planning._api import plan as plan
from ._planning._cache import clear_plan_cache as clear_plan_cache
from ._planning._prices import DEFAULT_CANDIDATES as DEFAULT_CANDIDATES
from ._planning._report import (
    BatchOption as BatchOption,
    FrontierPoint as FrontierPoint,
    PlanEntry as PlanEntry,
    PlanResult as PlanResult,
)
from ._policies._named import POLICIES as POLICIES, policy as policy
from ._policies._values import (
    offload_names as offload_names,
    save_all_but_names as save_all_but_names,
    save_and_offload_names as save_and_offload_names,
    save_names as save_names,
)
from ._schedules._binomial import binomial as binomial
from ._schedules._checkpoint import (
    Checkpoint as Checkpoint,
    PerStack as PerStack,
    set_checkpoint as set_checkpoint,
)
from ._schedules._engine import Layers as Layers, Schedule as Schedule
from ._schedules._ranges import ranges as ranges
from ._schedules._spec import (
    checkpoint_label as checkpoint_label,
    parse_checkpoint as parse_checkpoint,
)
from ._schedules._uniform import (
    every as every,
    nested as nested,
    recursive as recursive,
)
from ._stacked import Stacked as Stacked
from ._util import format_bytes as format_bytes, parse_bytes as parse_bytes


__version__ = _metadata.version("eqx-remat")

__all__ = [
    "BatchOption",
    "Checkpoint",
    "DEFAULT_CANDIDATES",
    "FlopCount",
    "FrontierPoint",
    "Layers",
    "MemoryReport",
    "OffloadWarning",
    "POLICIES",
    "PerStack",
    "PlanEntry",
    "PlanResult",
    "ReplicatedArgumentsWarning",
    "Residual",
    "Schedule",
    "Stacked",
    "StackedListWarning",
    "accumulate",
    "binomial",
    "chain",
    "checkpoint_label",
    "clear_plan_cache",
    "count_flops",
    "every",
    "memory_report",
    "nested",
    "format_bytes",
    "offload_names",
    "parse_bytes",
    "parse_checkpoint",
    "plan",
    "policy",
    "print_residuals",
    "ranges",
    "recursive",
    "residuals",
    "save_all_but_names",
    "save_and_offload_names",
    "save_names",
    "scan_layers",
    "set_checkpoint",
    "stack",
    "v5e_mesh",
]
