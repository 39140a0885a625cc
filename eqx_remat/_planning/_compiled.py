"""Compiling a checkpoint for the planner (the bench's `compile`): one typed
record per program (`Compiled`), XLA's RESOURCE_EXHAUSTED kept, not raised."""

import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax

from .._inspect._flops import count_flops
from .._inspect._memory import (
    MemoryReport,
    available_bytes,
    compiled_report,
    inspect_memory,
    needed_bytes,
)
from .._schedules._checkpoint import Planned, set_checkpoint
from .._util import split_args, traceable


class Compiled(NamedTuple):
    """One program the planner compiled under `checkpoint`: its memory
    `report`, or `None` where XLA refused it (`error`: its RESOURCE_EXHAUSTED
    message), its `flops`, the seconds compiling took (`compile_s`) and the
    `executable` where it can run here (else `None`)."""

    checkpoint: Planned
    report: MemoryReport | None
    error: str | None
    flops: int
    compile_s: float
    executable: Any = None

    @property
    def memory_bytes(self) -> int | None:
        """Compiled memory, or what XLA said it needed (`None` if nothing)."""
        if self.report is not None:
            return self.report.total_bytes
        return needed_bytes(self.error or "")

    @property
    def available_bytes(self) -> int | None:
        """What XLA's error says one device holds (`None` if nothing)."""
        return available_bytes(self.error or "")

    @property
    def host_bytes(self) -> int:
        return 0 if self.report is None else self.report.host_temp_bytes


def compile_checkpoint(
    fn: Callable, args: tuple, c: Planned, target: str | None, *, runnable: bool
) -> Compiled:
    """Compile `fn(*args)` with every checkpoint field of `args` set to `c`, for
    `target`; `runnable`: keep the executable (the device at hand)."""
    args = set_checkpoint(args, c)
    start = time.perf_counter()
    try:
        report, executable = _compile(fn, args, target, runnable)
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        seconds = time.perf_counter() - start
        return Compiled(c, None, str(e), int(count_flops(fn, *args)), seconds)
    seconds = time.perf_counter() - start
    return Compiled(c, report, None, int(report.flops), seconds, executable)


def _compile(
    fn: Callable, args: tuple, target: str | None, runnable: bool
) -> tuple[MemoryReport, Any]:
    """`(report, executable)`: `memory_report`'s compile, keeping the
    executable where it can run here."""
    if not runnable:
        # Without its save-on-device twin: whether an offload pays is the
        # pricer's question (`Bench.unpaid_offload`, which takes this compile).
        return inspect_memory(fn, args, target, None, check_offload=False)[0], None
    # Lowered on the arguments as given (their shardings included), as
    # `memory_report` lowers them.
    f, _ = traceable(fn, args)
    executable = jax.jit(f).lower(split_args(args)[0]).compile()
    flops = count_flops(fn, *args)
    report = compiled_report(executable, flops=flops, target=jax.default_backend())
    return report, executable


class Program(NamedTuple):
    """One step of a compiled checkpoint on the planner's inputs: `program()`."""

    record: Compiled
    inputs: Any

    def __call__(self) -> Any:
        return self.record.executable(self.inputs)
