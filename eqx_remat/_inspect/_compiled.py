"""One program compiled for a target, as a typed record (`Compiled`): its memory
report, or XLA's RESOURCE_EXHAUSTED kept, not raised; its FLOPs and compile
time; and, where it runs here, the executable, run on its inputs by `Program`
(what the clock times)."""

import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax

from .._util import split_args, traceable
from ._flops import count_flops
from ._memory import (
    MemoryReport,
    available_bytes,
    compiled_report,
    inspect_memory,
    needed_bytes,
)


class Compiled(NamedTuple):
    """One program compiled under `checkpoint`: its memory `report`, or `None`
    where XLA refused it (`error`: its RESOURCE_EXHAUSTED message), its
    `flops`, the seconds compiling took (`compile_s`) and the `executable`
    where it can run here (else `None`)."""

    checkpoint: Any
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


def compile_program(
    fn: Callable, args: tuple, checkpoint: Any, target: str | None, runnable: bool
) -> Compiled:
    """`fn(*args)` (under `checkpoint`, as `args` hold it) compiled for `target`
    as `memory_report` compiles it, without an offload's save-on-device twin;
    `runnable`: lowered on the arguments as given (their shardings too) for
    the device at hand, keeping the executable."""
    start = time.perf_counter()
    try:
        if runnable:
            f, _ = traceable(fn, args)
            executable = jax.jit(f).lower(split_args(args)[0]).compile()
            flops = count_flops(fn, *args)
            backend = jax.default_backend()
            report = compiled_report(executable, flops=flops, target=backend)
        else:
            report = inspect_memory(fn, args, target, None, check_offload=False)[0]
            executable = None
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        seconds = time.perf_counter() - start
        return Compiled(checkpoint, None, str(e), int(count_flops(fn, *args)), seconds)
    seconds = time.perf_counter() - start
    return Compiled(checkpoint, report, None, int(report.flops), seconds, executable)


class Program(NamedTuple):
    """One step of a compiled program on its `inputs`: `program()`."""

    record: Compiled
    inputs: Any

    def __call__(self) -> Any:
        return self.record.executable(self.inputs)
