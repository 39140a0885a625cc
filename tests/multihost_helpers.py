"""Start a multi-process JAX run on this machine: N processes on 127.0.0.1 (a free
port, the coordinator bound to loopback only), each with its own host CPU devices
and gloo collectives, each in its own session so that it and whatever it starts
can be killed; every wait has a deadline, and no process outlives the call."""

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A port that nothing listens on now, on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


DISTRIBUTED_ENV = (
    "JAX_COORDINATOR_ADDRESS",
    "JAX_COORDINATOR_BIND_ADDRESS",
    "JAX_NUM_PROCESSES",
    "JAX_PROCESS_ID",
)


def process_env(
    port: int, n: int, i: int, devices: int, *, coordinator: bool = True
) -> dict[str, str]:
    """The environment of process `i` of `n`: `devices` CPU devices, the
    repository first on the path and, with `coordinator`, the coordinator's
    address and this process's count and id (JAX's variables for the address;
    `JAX_NUM_PROCESSES` and `JAX_PROCESS_ID` for the rest, read by
    `benchmarks/_device.py` and by `tests/_multihost_check.py`)."""
    # Without the tests' persistent compilation cache: with jax 0.12.1, two
    # processes that read their programs from a warm cache hang in their first
    # step (gloo collectives on the CPU; a fresh cache, or none, runs).
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in DISTRIBUTED_ENV
        and not k.startswith("JAX_PERSISTENT_CACHE")
        and k != "JAX_COMPILATION_CACHE_DIR"
    }
    flag = f"--xla_force_host_platform_device_count={devices}"
    kept = [f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f]
    env |= {
        "XLA_FLAGS": " ".join([*kept, flag]),
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": os.pathsep.join(
            [str(ROOT), *filter(None, [env.get("PYTHONPATH")])]
        ),
    }
    if coordinator:
        env |= {
            "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
            "JAX_COORDINATOR_BIND_ADDRESS": f"127.0.0.1:{port}",
            "JAX_NUM_PROCESSES": str(n),
            "JAX_PROCESS_ID": str(i),
        }
    return env


@dataclass
class Finished:
    """What one process did: exit code (`None`: killed at the deadline), its
    output, and when it ended (seconds after the start)."""

    returncode: int | None
    stdout: str
    stderr: str
    seconds: float

    def tail(self) -> str:
        return f"rc {self.returncode}\n{self.stdout[-3000:]}\n{self.stderr[-6000:]}"


class Group:
    """N processes of one run, started with `start`; `finish` waits for all of
    them (until the deadline), kills what is left, and returns what each did."""

    def __init__(
        self,
        argv: Callable[..., Sequence[str]],
        *,
        n: int = 2,
        devices: int = 2,
        timeout: float = 300,
        cwd: Path = ROOT,
        flags: bool = False,
    ) -> None:
        """`argv(i)`: the command line of process `i` (after `python`); with
        `flags`, `argv(i, port)` and no coordinator in the environment: the
        command line says it."""
        self.port = free_port()
        self.deadline = time.monotonic() + timeout
        self.start = time.monotonic()
        self.logs = []
        self.procs: list[subprocess.Popen] = []
        for i in range(n):
            # Output to files, not pipes: a process that fills a pipe nobody reads
            # would block, and the run with it.
            out = tempfile.TemporaryFile("w+")
            err = tempfile.TemporaryFile("w+")
            self.logs.append((out, err))
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, *(argv(i, self.port) if flags else argv(i))],
                    env=process_env(self.port, n, i, devices, coordinator=not flags),
                    cwd=cwd,
                    stdout=out,
                    stderr=err,
                    stdin=subprocess.DEVNULL,
                    text=True,
                    start_new_session=True,
                )
            )
        self.ended: dict[int, float] = {}

    def stderr_so_far(self, i: int) -> str:
        err = self.logs[i][1]
        err.flush()
        with open(f"/proc/self/fd/{err.fileno()}") as f:
            return f.read()

    def wait_for(self, i: int, text: str) -> None:
        """Wait until process `i` has written `text` to stderr (or has ended, or
        the deadline), then return; fails if it has not."""
        while time.monotonic() < self.deadline:
            if text in self.stderr_so_far(i):
                return
            if self.procs[i].poll() is not None:
                break
            time.sleep(0.05)
        self.kill()
        raise AssertionError(
            f"process {i} never wrote {text!r}:\n{self.stderr_so_far(i)[-6000:]}"
        )

    def signal(self, i: int, signum: int) -> None:
        self.procs[i].send_signal(signum)

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in self.procs:
            p.wait()

    def finish(self) -> list[Finished]:
        try:
            while time.monotonic() < self.deadline:
                for i, p in enumerate(self.procs):
                    if i not in self.ended and p.poll() is not None:
                        self.ended[i] = time.monotonic() - self.start
                if len(self.ended) == len(self.procs):
                    break
                time.sleep(0.05)
        finally:
            killed = {i for i, p in enumerate(self.procs) if p.poll() is None}
            self.kill()
            # Whatever the processes started themselves (none is expected).
            for p in self.procs:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        done = []
        for i, (p, (out, err)) in enumerate(zip(self.procs, self.logs, strict=True)):
            out.seek(0), err.seek(0)
            rc = None if i in killed else p.returncode
            ended = self.ended.get(i, time.monotonic() - self.start)
            done.append(Finished(rc, out.read(), err.read(), ended))
            out.close(), err.close()
        return done


def run(argv: Callable[..., Sequence[str]], **kwargs) -> list[Finished]:
    """Start the processes and wait for all of them (see `Group`)."""
    return Group(argv, **kwargs).finish()


def assert_ok(done: Sequence[Finished]) -> None:
    for i, f in enumerate(done):
        assert f.returncode == 0, f"process {i}: {f.tail()}"
