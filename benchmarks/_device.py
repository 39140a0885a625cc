"""Where a script runs (`--device auto|tpu|gpu|cpu`, `select_device`; an
explicit `JAX_PLATFORMS` wins, a named device that is not there is an `error:`
line, never a fallback), the multi-process runtime, and what the device can
tell (peak memory; peak FLOP/s from `PEAK_FLOPS`, else MFU is `null`)."""

import argparse
import glob
import importlib.util
import os
import shutil
from typing import Any

from eqx_remat.internal import HARDWARE


DEVICES = ("auto", "tpu", "gpu", "cpu")
_PLATFORM = {"tpu": "tpu", "gpu": "cuda", "cpu": "cpu"}

# Dense bf16 peak FLOP/s per chip by `device_kind`, from the library's table
# (with its sources); the CPU's entry is nominal, not a peak: left out.
PEAK_FLOPS: dict[str, float] = {
    kind: h.peak_flops for kind, h in HARDWARE.items() if kind != "cpu"
}


# The device flags' help, the same in every script (`train_lm.py`'s too).
HELP = {
    "device": "where to run: the machine's TPU, else GPU, else CPU (auto), or one of "
    "them explicitly; an explicit JAX_PLATFORMS environment variable wins",
    "distributed": "call jax.distributed.initialize() first (a multi-host slice: run "
    "the same command on every host; only process 0 prints and writes)",
    "coordinator_address": "with --distributed: process 0's HOST:PORT, the same on "
    "every process (unset: $JAX_COORDINATOR_ADDRESS, else auto-detected)",
    "num_processes": "with --distributed: how many processes (unset: "
    "$JAX_NUM_PROCESSES, else auto-detected)",
    "process_id": "with --distributed: this process, 0 to N - 1 (unset: "
    "$JAX_PROCESS_ID, else auto-detected)",
    "heartbeat_timeout": "a process silent this many seconds is taken as dead, and "
    "the run stops on every process (as JAX's)",
}


def add_device_args(parser: argparse.ArgumentParser) -> None:
    """`--device`, `--distributed` and the multi-process flags."""
    default = " (default: %(default)s)"
    parser.add_argument(
        "--device", choices=DEVICES, default="auto", help=HELP["device"] + default
    )
    off = HELP["distributed"] + " (default: off)"
    parser.add_argument("--distributed", action="store_true", help=off)
    group = parser.add_argument_group(
        "multi-process (with --distributed; auto-detected on a TPU slice, Slurm, "
        "Open MPI)"
    )
    for flag, (metavar, _, kind) in _DISTRIBUTED.items():
        name = "--" + flag.replace("_", "-")
        group.add_argument(name, metavar=metavar, type=kind, help=HELP[flag])
    group.add_argument(
        "--heartbeat-timeout",
        metavar="SECONDS",
        type=positive_int,
        help=HELP["heartbeat_timeout"] + " (default: 100)",
    )


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # a parent package is missing
        return False


def _has_tpu() -> bool:
    if not _installed("libtpu"):
        return False
    return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


def _has_gpu() -> bool:
    plugin = any(
        _installed(m)
        for m in ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_plugins.xla_cuda12")
    )
    return plugin and bool(glob.glob("/dev/nvidia[0-9]*") or shutil.which("nvidia-smi"))


def resolve_device(choice: str) -> str:
    """The JAX platform for `--device choice` ("tpu", "cuda" or "cpu"); an
    explicit `JAX_PLATFORMS` is returned as it is."""
    explicit = os.environ.get("JAX_PLATFORMS")
    if explicit:
        return explicit
    if choice == "auto":
        return "tpu" if _has_tpu() else "cuda" if _has_gpu() else "cpu"
    return _PLATFORM[choice]


def select_device(
    args: argparse.Namespace,
    parser: argparse.ArgumentParser,
    *,
    initialise: bool = True,
) -> str:
    """Point JAX at `args.device` and initialise it (with `args.distributed`,
    the multi-host runtime first; `initialise=False`: only point, for a process
    that starts one process per measurement). Call before any JAX array is
    made. Returns the platform; a device that is not there is `parser.error`."""
    import jax

    platform = resolve_device(args.device)
    jax.config.update("jax_platforms", platform)
    if not initialise:
        return platform
    if getattr(args, "distributed", False):
        initialize_distributed(args, parser, platform)
    else:
        for flag in (*_DISTRIBUTED, "heartbeat_timeout"):
            if getattr(args, flag, None) is not None:
                name = "--" + flag.replace("_", "-")
                parser.error(f"argument {name}: needs --distributed.")
    try:
        jax.devices()
    except Exception as e:  # RuntimeError, or an AssertionError inside jax
        parser.error(
            f"--device {args.device}: no {platform} device could be initialised "
            f"({(str(e) or type(e).__name__).splitlines()[0]}). Use --device auto "
            "to take what the machine has."
        )
    return platform


# jax 0.10.2 reads `JAX_COORDINATOR_ADDRESS` but not the process count or id:
# those are read here, under the same prefix.
COORDINATOR_ENV = "JAX_COORDINATOR_ADDRESS"
NUM_PROCESSES_ENV = "JAX_NUM_PROCESSES"
PROCESS_ID_ENV = "JAX_PROCESS_ID"


def address_problem(text: str) -> str | None:
    """What is wrong with a coordinator address, or `None`."""
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return f"expected HOST:PORT with a port in 1..65535. Got {text!r}."
    return None


def _address(text: str) -> str:
    if problem := address_problem(text):
        raise argparse.ArgumentTypeError(problem)
    return text.strip()


def _int_at_least(least: int, what: str):
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            n = None
        if n is None or n < least:
            raise argparse.ArgumentTypeError(f"expected {what}. Got {text!r}.")
        return n

    return parse


positive_int = _int_at_least(1, "a positive integer")
non_negative_int = _int_at_least(0, "an integer >= 0")

# The multi-process flags: metavar, the environment variable, argparse `type`.
_DISTRIBUTED = {
    "coordinator_address": ("HOST:PORT", COORDINATOR_ENV, _address),
    "num_processes": ("N", NUM_PROCESSES_ENV, positive_int),
    "process_id": ("I", PROCESS_ID_ENV, non_negative_int),
}


def distributed_settings(
    args: argparse.Namespace, parser: argparse.ArgumentParser
) -> dict[str, Any]:
    """`jax.distributed.initialize`'s keyword arguments: each multi-process
    setting from its flag, else its environment variable, else left to JAX's
    auto-detection; a loopback coordinator binds only to its address."""
    env = os.environ
    values: dict[str, Any] = {}
    named: dict[str, str] = {}  # where each value came from, for messages
    for flag, (_, var, parse) in _DISTRIBUTED.items():
        value = getattr(args, flag, None)
        named[flag] = "argument --" + flag.replace("_", "-")
        if value is None and env.get(var):
            named[flag] = f"environment variable {var}"
            try:
                value = parse(env[var])
            except argparse.ArgumentTypeError as e:
                parser.error(f"{named[flag]}: {e}")
        if value is not None:
            values[flag] = value
    n, i = values.get("num_processes"), values.get("process_id")
    if n is not None and i is not None and not i < n:
        parser.error(
            f"{named['process_id']}: expected 0 to {n - 1} "
            f"({named['num_processes']} is {n}). Got {i}."
        )
    address = values.get("coordinator_address")
    if address is not None and "JAX_COORDINATOR_BIND_ADDRESS" not in env:
        host = address.rpartition(":")[0].strip("[]")
        if host == "localhost" or host.startswith("127.") or host == "::1":
            values["coordinator_bind_address"] = address
    values["heartbeat_timeout_seconds"] = getattr(args, "heartbeat_timeout", 0) or 100
    return values


def initialize_distributed(
    args: argparse.Namespace, parser: argparse.ArgumentParser, platform: str
) -> None:
    """`jax.distributed.initialize(**distributed_settings(...))` (gloo
    collectives on the CPU); what JAX cannot settle is a `parser.error` naming
    the flags."""
    import jax

    settings = distributed_settings(args, parser)
    if platform == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(**settings)
    except (ValueError, TypeError) as e:
        missing = [
            f"--{f.replace('_', '-')}" for f in _DISTRIBUTED if f not in settings
        ]
        parser.error(
            f"--distributed: {e} This is not a machine where JAX detects its "
            f"processes: give {', '.join(missing) or 'every multi-process flag'} "
            f"(or ${COORDINATOR_ENV}, ${NUM_PROCESSES_ENV}, ${PROCESS_ID_ENV})."
        )


def is_main_process() -> bool:
    """Only process 0 of a multi-host run prints tables and writes files."""
    import jax

    return jax.process_index() == 0


def device_kind() -> str:
    import jax

    return jax.devices()[0].device_kind


def peak_flops_per_chip(kind: str | None = None) -> float | None:
    """Peak bf16 FLOP/s of a `kind` chip (default: this one's), or `None`."""
    return PEAK_FLOPS.get(device_kind() if kind is None else kind)


def peak_bytes_in_use() -> int | None:
    """The largest `peak_bytes_in_use` of the local devices since the process
    started, or `None` where the backend does not say (the CPU)."""
    import jax

    peaks = []
    for d in jax.local_devices():
        stats: Any = d.memory_stats()
        if not stats or "peak_bytes_in_use" not in stats:
            return None
        peaks.append(int(stats["peak_bytes_in_use"]))
    return max(peaks) if peaks else None


def utilisation(
    flops: int | None,
    step_s: float | None,
    *,
    kind: str | None = None,
    devices: int | None = None,
) -> float | None:
    """`flops / (step_s × peak FLOP/s of all devices)` (MFU for the model's
    FLOPs, HFU with recomputation), or `None` where a figure is unknown."""
    if flops is None or not step_s:
        return None
    peak = peak_flops_per_chip(kind)
    if peak is None:
        return None
    if devices is None:
        import jax

        devices = jax.device_count()
    return flops / (step_s * peak * devices)


_MAIN: list[bool] = []


def set_main(main: bool) -> None:
    """Whether this process prints and writes, where JAX is not initialised
    here (the measuring processes say)."""
    _MAIN[:] = [main]


def is_main() -> bool:
    return _MAIN[0] if _MAIN else is_main_process()
