"""Preemption and Ctrl-C: SIGTERM (SLURM, Kubernetes, torchrun's shutdown), SIGUSR1 (SLURM's --signal)
and SIGINT ask the run to stop after the current step; the loop then saves a resume file and exits 0
with a line saying how to continue.

One request often arrives twice: SLURM signals every process of the job step, torchrun among them,
and torchrun forwards the same signal to its workers; a Ctrl-C reaches every process of the terminal's
group, torchrun included, which forwards it again. So a repeat is absorbed, and only a Ctrl-C given
again after GRACE_S seconds stops at once (KeyboardInterrupt; the atomic saves lose nothing). Repeated
SIGTERM/SIGUSR1 never interrupt a step: a scheduler that will not wait sends SIGKILL."""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
GRACE_S = 1.0  # a repeat within this many seconds of the first signal is the same request delivered twice
# What signal.signal installs and returns: a function, SIG_DFL / SIG_IGN, or None (a handler set outside Python).
Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


class StopRequest:
    def __init__(self, grace_s: float = GRACE_S) -> None:
        self.signal: str | None = None  # name of the first signal received
        self.grace_s = grace_s
        self._first_at = 0.0
        self._previous: dict[int, Handler] = {}

    def install(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():  # signal.signal works only there
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        now = time.monotonic()
        if self.signal is None:
            self.signal, self._first_at = name, now
            print(f"\n{name}: finishing this step, then saving and stopping (Ctrl-C again to stop at once)",
                  file=sys.stderr, flush=True)
            return
        if now - self._first_at < self.grace_s:
            return  # the same request, delivered again by the scheduler or the launcher
        if signum == signal.SIGINT:
            raise KeyboardInterrupt(f"second signal ({name}): stopping at once")
        print(f"{name}: already stopping after this step (Ctrl-C to stop at once)", file=sys.stderr, flush=True)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
