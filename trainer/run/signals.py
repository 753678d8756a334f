"""Preemption and Ctrl-C: SIGTERM (SLURM, Kubernetes), SIGUSR1 (SLURM's --signal) and SIGINT ask the
run to stop after the current step; the loop then saves a resume file and exits 0 with a line saying
how to continue. A second signal stops at once (KeyboardInterrupt; the atomic saves lose nothing)."""

from __future__ import annotations

import signal
import sys
import threading

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class StopRequest:
    def __init__(self) -> None:
        self.signal: str | None = None  # name of the first signal received
        self._previous: dict[int, object] = {}

    def install(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():  # signal.signal works only there
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.signal is not None:
            raise KeyboardInterrupt(f"second signal ({name}): stopping at once")
        self.signal = name
        print(f"\n{name}: finishing this step, then saving and stopping (send it again to stop at once)",
              file=sys.stderr, flush=True)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
