"""Preemption: SIGTERM and Ctrl-C stop the run after the current step, saved.

With several processes (`--distributed`), SIGTERM to any one of them (a slice's
preemption reaches every host; here one is enough) is caught by JAX's preemption
notifier, which tells every process; they agree on a step to stop after
(`multihost_utils.reached_preemption_sync_point`), save it together and exit 0."""

import os
import signal
from typing import Any

import jax
from jax.experimental import multihost_utils


class StopRequest:
    """SIGTERM / SIGINT: the first asks the loop to finish its step, save and exit
    0; the handler then gives the signal back to the operating system, so a second
    one ends the process at once (even inside a compile), without saving."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.previous: dict[int, Any] = {}

    def install(self) -> None:
        signals = [signal.SIGINT]
        if jax.process_count() == 1:
            # On a multi-host slice, SIGTERM (preemption) reaches JAX's preemption
            # notifier, and the hosts agree on a step (`reached_preemption_sync_point`).
            signals.append(signal.SIGTERM)
        for s in signals:
            self.previous[s] = signal.signal(s, self._handle)

    def uninstall(self) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)
        self.previous.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        for s in self.previous:
            signal.signal(s, signal.SIG_DFL)
        if jax.process_count() > 1:
            # Ctrl-C on one process of several: handed to JAX's preemption
            # notifier as a SIGTERM, so that every process stops after one step.
            os.kill(os.getpid(), signal.SIGTERM)
            return
        self.signum = signum

    @property
    def name(self) -> str:
        """What stopped the run, for its closing line."""
        return signal.Signals(self.signum).name if self.signum else "preemption"

    def requested(self, step: int) -> bool:
        if self.signum is not None or jax.process_count() == 1:
            return self.signum is not None
        return multihost_utils.reached_preemption_sync_point(step)
