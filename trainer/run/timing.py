"""Phase timers for one PPO step: the trainer logs them as time/<phase>, benchmarks/bench_ppo.py subclasses
them to add CPU time and FLOP counts. The step functions take a timer instead of being monkeypatched."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterable, Iterator

import torch

SYNCED = frozenset({"step", "generate", "score", "update", "eval"})


class PhaseTimer:
    """Wall seconds per phase name, summed over the step. `with timer("generate"): ...`.

    Phases may be timed from two threads at once (--parallel_update): each adds under a lock.

    `cuda_devices`: the GPUs the step computes on. CUDA kernels run after Python has queued them, so
    without a synchronisation a phase's time would be its launch time and the next phase would pay for
    its kernels; each of the step's main phases (SYNCED) therefore starts and ends with every one of
    these GPUs idle. Sub-phases inside them (per micro-batch forwards, reward components) do not sync:
    a host wait there would idle the GPU on the hot path."""

    def __init__(self, cuda_devices: Iterable[torch.device] = ()) -> None:
        self.wall: dict[str, float] = {}
        self._lock = threading.Lock()
        self._cuda = [d for d in cuda_devices if d.type == "cuda"]

    def _sync(self) -> None:
        for d in self._cuda:
            torch.cuda.synchronize(d)

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        sync = name in SYNCED
        if sync:
            self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            if sync:
                self._sync()
            self.add(name, time.perf_counter() - start)

    def add(self, name: str, seconds: float) -> None:
        with self._lock:
            self.wall[name] = self.wall.get(name, 0.0) + seconds
