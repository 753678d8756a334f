"""Phase timers for one PPO step: the trainer logs them as time/<phase>, scripts/bench_ppo.py subclasses
them to add CPU time and FLOP counts. The step functions take a timer instead of being monkeypatched."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator


class PhaseTimer:
    """Wall seconds per phase name, summed over the step. `with timer("generate"): ...`.

    Phases may be timed from two threads at once (--parallel_update): each adds under a lock."""

    def __init__(self) -> None:
        self.wall: dict[str, float] = {}
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - start)

    def add(self, name: str, seconds: float) -> None:
        with self._lock:
            self.wall[name] = self.wall.get(name, 0.0) + seconds
